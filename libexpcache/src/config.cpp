#include "config.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <set>
#include <strings.h>

#include "backend/staging_tuning.hpp"
#include "cores.hpp"
#include "errors.hpp"
#include "log.hpp"
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

// A whole number 0..max in decimal digits, nothing else (no sign, space, suffix or base): *out.
bool parse_count(const char* text, uint64_t max, uint64_t* out) {
    if (*text == '\0') return false;
    uint64_t value = 0;
    for (const char* p = text; *p != '\0'; ++p) {
        if (*p < '0' || *p > '9') return false;
        const uint64_t digit = uint64_t(*p - '0');
        if (digit > max || value > (max - digit) / 10) return false;  // past max, or past 2^64
        value = value * 10 + digit;
    }
    *out = value;
    return true;
}

// Variable `name`, when set, into *value: `what` (a noun for the message) 0..max.
expcache_status_t read_count(const char* name, uint64_t max, const char* what, uint64_t* value) {
    const char* env = std::getenv(name);
    if (env && !parse_count(env, max, value))
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "%s=\"%s\" is not %s between 0 and %llu", name, env, what,
                    (unsigned long long)max);
    return EXPCACHE_OK;
}

// Variable `name`, when set, into *index: the position of its value among `words` (any case);
// `accepted` lists them for the message.
template <size_t N>
expcache_status_t read_word(const char* name, const char* const (&words)[N], const char* accepted, size_t* index) {
    const char* env = std::getenv(name);
    if (!env) return EXPCACHE_OK;
    for (size_t i = 0; i < N; ++i)
        if (strcasecmp(env, words[i]) == 0) {
            *index = i;
            return EXPCACHE_OK;
        }
    return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "%s=\"%s\" is not one of %s", name, env, accepted);
}

// Variable `name`, when set, into *on: an on/off word (parse_switch); `meaning_on` and
// `meaning_off` say what each does, for the message.
expcache_status_t read_switch(const char* name, const char* meaning_on, const char* meaning_off, bool* on) {
    const char* env = std::getenv(name);
    if (!env) return EXPCACHE_OK;
    const int value = parse_switch(env);
    if (value < 0)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT,
                    "%s=\"%s\" is not one of 1, true, yes, on (%s) or 0, false, no, off (%s)", name, env, meaning_on,
                    meaning_off);
    *on = value == 1;
    return EXPCACHE_OK;
}

// A variable that did not parse (status s, its message the reason): ignored, with a warning; the
// value it would have set keeps the one before.
void ignore_if_bad(expcache_status_t s, EnvironmentLines* lines) {
    if (s == EXPCACHE_OK) return;
    lines->emplace_back(EXPCACHE_LOG_WARNING, std::string(last_error()) + "; ignored");
    clear_last_error();
}

// The staging ring's EXPCACHE_STAGING_* variables over StagingTuning's defaults (what each one
// sets, and why these ranges: backend/staging_tuning.hpp); each malformed one ignored.
void read_staging_environment(StagingTuning* out, EnvironmentLines* lines) {
    static const char* const kCopies[] = {"wide", "sse2"};
    static const char* const kHints[] = {"t0", "t2", "nta"};
    static const int kLocality[] = {3, 1, 0};  // kHints' as __builtin_prefetch has them
    StagingTuning t;
    uint64_t ahead = t.prefetch.ahead;
    size_t copy = t.wide_stores ? 0 : 1, hint = SIZE_MAX;
    ignore_if_bad(read_count("EXPCACHE_STAGING_NT_MAX", UINT64_MAX, "a number of bytes", &t.nt_max_bytes), lines);
    ignore_if_bad(
        read_switch("EXPCACHE_STAGING_FILE_BOUNCE", "through a bounce buffer", "into the chunk", &t.file_bounce),
        lines);
    ignore_if_bad(read_count("EXPCACHE_STAGING_COALESCE", UINT64_MAX, "a number of bytes", &t.coalesce_bytes), lines);
    ignore_if_bad(read_count("EXPCACHE_STAGING_MIN_PIECES", t.kMaxMinPieces, "a whole number", &t.min_pieces), lines);
    ignore_if_bad(read_count("EXPCACHE_STAGING_SHORT", t.kMaxShortPieces, "a whole number", &t.short_pieces), lines);
    ignore_if_bad(read_word("EXPCACHE_STAGING_COPY", kCopies,
                            "wide (64-byte stores where the CPU has AVX-512) or sse2 (16-byte stores)", &copy),
                  lines);
    ignore_if_bad(read_count("EXPCACHE_STAGING_PREFETCH", t.kMaxPrefetchBytes, "a number of bytes", &ahead), lines);
    ignore_if_bad(
        read_word("EXPCACHE_STAGING_PREFETCH_HINT", kHints, "t0 (into L1), t2 (into L2) or nta (non-temporal)", &hint),
        lines);
    if (const char* env = std::getenv("EXPCACHE_STAGING_TRACE")) {
        if (*env == '\0')
            ignore_if_bad(fail(EXPCACHE_ERR_INVALID_ARGUMENT,
                               "EXPCACHE_STAGING_TRACE=\"\" is not a file path (unset it for no trace)"),
                          lines);
        else
            t.trace_path = env;
    }
    ignore_if_bad(read_count("EXPCACHE_STAGING_TRACE_PIECES", t.kMaxTracePieces, "a whole number", &t.trace_pieces),
                  lines);
    t.wide_stores = copy == 0;
    t.prefetch.ahead = static_cast<size_t>(ahead);
    if (hint != SIZE_MAX) t.prefetch.locality = kLocality[hint];
    *out = t;
}

expcache_status_t check_fields(const expcache_config_t& cfg) {
    if (cfg.num_layers == 0 || cfg.num_layers > EXPCACHE_MAX_LAYERS_LIMIT)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "num_layers must be 1..%u, got %u", EXPCACHE_MAX_LAYERS_LIMIT,
                    cfg.num_layers);
    if (cfg.max_classes == 0 || cfg.max_classes > EXPCACHE_MAX_CLASSES_LIMIT)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "max_classes must be 1..%u, got %u", EXPCACHE_MAX_CLASSES_LIMIT,
                    cfg.max_classes);
    if (cfg.backend > EXPCACHE_BACKEND_CUDA)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "unknown backend %u (0 auto, 1 host, 2 cuda)", cfg.backend);
    if (cfg.log_level > EXPCACHE_LOG_DEBUG)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "log_level must be 0..3, got %u", cfg.log_level);
    if (cfg.budget_experts == 0 && cfg.budget_bytes == 0)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "set budget_experts or budget_bytes (both are 0)");
    if (cfg.device_capacity_bytes == 0) return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "device_capacity_bytes must be > 0");
    if (cfg.slab_bytes == 0) return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "slab_bytes must be > 0");
    if (cfg.reserved != 0) return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "reserved must be 0, got %u", cfg.reserved);
    if (cfg.reserved2 != 0) return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "reserved2 must be 0, got %u", cfg.reserved2);
    if (cfg.bank_arrangement > EXPCACHE_BANK_PARTS)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "unknown bank_arrangement %u (0 slots, 1 parts)",
                    cfg.bank_arrangement);
    if (cfg.host_budget_bytes > EXPCACHE_MAX_HOST_BUDGET_BYTES)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "host_budget_bytes must be 0 (no pool)..%llu (2^48), got %llu",
                    (unsigned long long)EXPCACHE_MAX_HOST_BUDGET_BYTES, (unsigned long long)cfg.host_budget_bytes);
    if (cfg.copy_threads > 64)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "copy_threads must be 0..64, got %u", cfg.copy_threads);
    if (!policy_name(cfg.policy))
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "unknown policy %u (%s)", cfg.policy, policy_list().c_str());
    if (cfg.lookup > EXPCACHE_LOOKUP_DEVICE)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "unknown lookup %u (0 host, 1 device)", cfg.lookup);
    if (cfg.partition > EXPCACHE_PARTITION_LAYER)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "unknown partition %u (0 global, 1 layer)", cfg.partition);
    if (cfg.lookup == EXPCACHE_LOOKUP_DEVICE && cfg.partition != EXPCACHE_PARTITION_GLOBAL)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT,
                    "lookup device keeps one order per class on the device: set partition to global");
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
    if (cfg.environment > EXPCACHE_ENVIRONMENT_IGNORE)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "unknown environment %u (0 read, 1 ignore)", cfg.environment);
    return EXPCACHE_OK;
}

// The variables override the fields (an operator's knob over what the engine passed), read after
// the fields passed their checks: a malformed one is ignored with a warning, and one that replaces
// a value the caller set (other than the default) says so.
void apply_environment(expcache_config_t* cfg, EnvironmentLines* lines) {
    expcache_config_t defaults;
    config_defaults(&defaults);
    if (const char* env = std::getenv("EXPCACHE_RESERVE_GB")) {
        char* end = nullptr;
        double gb = std::strtod(env, &end);
        if (end == env || *end != '\0' || !std::isfinite(gb) || gb < 0 || gb > 1e6) {
            ignore_if_bad(fail(EXPCACHE_ERR_INVALID_ARGUMENT,
                               "EXPCACHE_RESERVE_GB=\"%s\" is not a number of GiB between 0 and 1e6", env),
                          lines);
        } else {
            const uint64_t bytes = static_cast<uint64_t>(gb * kGiB);
            if (cfg->reserve_bytes != defaults.reserve_bytes && cfg->reserve_bytes != bytes)
                lines->emplace_back(EXPCACHE_LOG_NOTICE,
                                    format("EXPCACHE_RESERVE_GB=%s overrides the reserve_bytes the caller set (%llu "
                                           "B): the cache keeps %llu B free (set config.environment to "
                                           "EXPCACHE_ENVIRONMENT_IGNORE to read no variable)",
                                           env, (unsigned long long)cfg->reserve_bytes, (unsigned long long)bytes));
            cfg->reserve_bytes = bytes;
        }
    }
    if (const char* env = std::getenv("EXPCACHE_VERBOSE")) {
        int on = parse_switch(env);
        if (on < 0) {
            ignore_if_bad(
                fail(EXPCACHE_ERR_INVALID_ARGUMENT,
                     "EXPCACHE_VERBOSE=\"%s\" is not one of 1, true, yes, on (verbose) or 0, false, no, off", env),
                lines);
        } else if (on) {
            if (cfg->log_level != defaults.log_level && cfg->log_level != EXPCACHE_LOG_DEBUG)
                lines->emplace_back(EXPCACHE_LOG_NOTICE,
                                    format("EXPCACHE_VERBOSE=%s overrides the log_level the caller set (%u): every "
                                           "line is logged (set config.environment to EXPCACHE_ENVIRONMENT_IGNORE to "
                                           "read no variable)",
                                           env, cfg->log_level));
            cfg->log_level = EXPCACHE_LOG_DEBUG;
        }
    }
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
    // Never more than 0.5 points under LRU on any trace measured, most of OppClassLRU's gain where
    // it has one (docs/policy.md).
    config->policy = EXPCACHE_POLICY_DUEL;
    config->partition = EXPCACHE_PARTITION_GLOBAL;
    config->bank_arrangement = EXPCACHE_BANK_SLOTS;
}

expcache_status_t resolve_config(const expcache_config_t& config, expcache_config_t* out, StagingTuning* staging,
                                 EnvironmentLines* lines) {
    expcache_config_t cfg = config;
    StagingTuning tuning;
    expcache_status_t s = check_fields(cfg);
    if (s != EXPCACHE_OK) return s;
    if (cfg.environment == EXPCACHE_ENVIRONMENT_READ) {
        apply_environment(&cfg, lines);
        read_staging_environment(&tuning, lines);
    }
    *out = cfg;
    *staging = tuning;
    return EXPCACHE_OK;
}

void log_environment_once(const Log& log, const EnvironmentLines& lines) {
    static std::mutex mu;
    static std::set<std::string> logged;  // this process's, for its whole life
    for (const auto& line : lines) {
        {
            std::lock_guard<std::mutex> lock(mu);
            if (!logged.insert(line.second).second) continue;
        }
        log(line.first, "%s", line.second.c_str());
    }
}

}  // namespace expcache
