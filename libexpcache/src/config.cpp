#include "config.hpp"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <strings.h>

#include "cores.hpp"
#include "errors.hpp"
#include "policy/policy.hpp"

namespace expcache {

namespace {

constexpr double kGiB = double(uint64_t(1) << 30);

// Threads that stage pageable and file misses: the usable cores less four (left to the engine), at
// least 2 and at most 12. On the 16-core host of an H200, 12 decoded fastest of 8, 12 and 15
// (docs/transfers.md); more only add to the memory traffic.
uint32_t default_copy_threads() {
    const unsigned cores = usable_cores();  // 0: unknown
    if (cores < 6) return 2;
    return cores - 4 < 12 ? cores - 4 : 12;
}

// An on/off environment value: 1 for 1/true/yes/on, 0 for 0/false/no/off (any case), -1 otherwise.
int parse_switch(const char* text) {
    static const char* const kOn[] = {"1", "true", "yes", "on"};
    static const char* const kOff[] = {"0", "false", "no", "off"};
    for (const char* w : kOn)
        if (strcasecmp(text, w) == 0) return 1;
    for (const char* w : kOff)
        if (strcasecmp(text, w) == 0) return 0;
    return -1;
}

expcache_status_t check_fields(const expcache_config_t& cfg) {
    if (cfg.num_layers == 0 || cfg.num_layers > EXPCACHE_MAX_LAYERS_LIMIT)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "num_layers must be 1..%u, got %u", EXPCACHE_MAX_LAYERS_LIMIT,
                    cfg.num_layers);
    if (cfg.max_classes == 0 || cfg.max_classes > EXPCACHE_MAX_CLASSES_LIMIT)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "max_classes must be 1..%u, got %u",
                    EXPCACHE_MAX_CLASSES_LIMIT, cfg.max_classes);
    if (cfg.backend > EXPCACHE_BACKEND_CUDA)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "unknown backend %u (0 auto, 1 host, 2 cuda)", cfg.backend);
    if (cfg.log_level > EXPCACHE_LOG_DEBUG)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "log_level must be 0..3, got %u", cfg.log_level);
    if (cfg.budget_experts == 0 && cfg.budget_bytes == 0)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "set budget_experts or budget_bytes (both are 0)");
    if (cfg.device_capacity_bytes == 0)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "device_capacity_bytes must be > 0");
    if (cfg.slab_bytes == 0) return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "slab_bytes must be > 0");
    if (cfg.copy_threads > 64) return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "copy_threads must be 0..64, got %u", cfg.copy_threads);
    if (!policy_name(cfg.policy))
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "unknown policy %u (%s)", cfg.policy, policy_list().c_str());
    if (cfg.staging_bytes < (uint64_t(1) << 20) || cfg.staging_bytes > (uint64_t(16) << 30))
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "staging_bytes must be 1 MiB..16 GiB, got %llu",
                    (unsigned long long)cfg.staging_bytes);
    if (cfg.staging_chunk_bytes < (uint64_t(64) << 10) || cfg.staging_chunk_bytes > (uint64_t(64) << 20) ||
        cfg.staging_chunk_bytes % 4096 != 0)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT,
                    "staging_chunk_bytes must be a multiple of 4096 in 64 KiB..64 MiB, got %llu",
                    (unsigned long long)cfg.staging_chunk_bytes);
    if (cfg.prefetch_max_per_layer > EXPCACHE_MAX_SELECT)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "prefetch_max_per_layer must be 0..%d, got %u", EXPCACHE_MAX_SELECT,
                    cfg.prefetch_max_per_layer);
    if (cfg.prefetch_piece_bytes < 4096 || cfg.prefetch_piece_bytes > (uint64_t(64) << 20) ||
        cfg.prefetch_piece_bytes % 4096 != 0)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT,
                    "prefetch_piece_bytes must be a multiple of 4096 in 4 KiB..64 MiB, got %llu",
                    (unsigned long long)cfg.prefetch_piece_bytes);
    if (cfg.file_reads > EXPCACHE_FILE_READS_DIRECT)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "unknown file_reads %u (0 buffered, 1 direct)", cfg.file_reads);
    return EXPCACHE_OK;
}

// The variables override the fields (an operator's knob over what the engine passed), so they are
// read after the fields passed their checks and are themselves refused when malformed.
expcache_status_t apply_environment(expcache_config_t* cfg) {
    if (const char* env = std::getenv("EXPCACHE_RESERVE_GB")) {
        char* end = nullptr;
        double gb = std::strtod(env, &end);
        if (end == env || *end != '\0' || !std::isfinite(gb) || gb < 0 || gb > 1e6)
            return fail(EXPCACHE_ERR_INVALID_ARGUMENT,
                        "EXPCACHE_RESERVE_GB=\"%s\" is not a number of GiB between 0 and 1e6", env);
        cfg->reserve_bytes = static_cast<uint64_t>(gb * kGiB);
    }
    if (const char* env = std::getenv("EXPCACHE_VERBOSE")) {
        int on = parse_switch(env);
        if (on < 0)
            return fail(EXPCACHE_ERR_INVALID_ARGUMENT,
                        "EXPCACHE_VERBOSE=\"%s\" is not one of 1, true, yes, on (verbose) or 0, false, no, off", env);
        if (on) cfg->log_level = EXPCACHE_LOG_DEBUG;
    }
    return EXPCACHE_OK;
}

}  // namespace

void config_defaults(expcache_config_t* config) {
    *config = expcache_config_t{};
    config->struct_size = sizeof *config;
    config->backend = EXPCACHE_BACKEND_AUTO;
    config->device = 0;
    config->max_classes = 4;
    config->log_level = EXPCACHE_LOG_NOTICE;
    config->reserve_bytes = uint64_t(1) << 30;
    config->device_capacity_bytes = uint64_t(64) << 30;
    config->slab_bytes = uint64_t(512) << 20;
    config->copy_threads = default_copy_threads();
    config->staging_bytes = uint64_t(64) << 20;
    config->staging_chunk_bytes = uint64_t(512) << 10;
    config->file_reads = EXPCACHE_FILE_READS_BUFFERED;
    config->prefetch_max_per_layer = 8;
    // About 80 us of an H200's PCIe 5 link, as two transfers: a right prefetch covers the window before
    // its select; a demand miss into another slot shares the link with at most this (docs/engine.md).
    config->prefetch_piece_bytes = uint64_t(4) << 20;
    // More hits than LRU at every budget measured, for ~0.2 us more per call (docs/policy.md).
    config->policy = EXPCACHE_POLICY_OPPCLASS;
}

expcache_status_t resolve_config(const expcache_config_t& config, expcache_config_t* out) {
    expcache_config_t cfg = config;
    expcache_status_t s = check_fields(cfg);
    if (s == EXPCACHE_OK) s = apply_environment(&cfg);
    if (s != EXPCACHE_OK) return s;
    *out = cfg;
    return EXPCACHE_OK;
}

}  // namespace expcache
