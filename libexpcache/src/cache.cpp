#include "cache.hpp"

#include <cstdarg>
#include <cstdio>

#include "config.hpp"
#include "errors.hpp"

namespace expcache {

// ---------------------------------------------------------------------------
// Lifetime

Cache::Cache(const expcache_config_t& config, std::unique_ptr<Backend> backend)
    : backend_(std::move(backend)), arena_(*backend_), config_(config), log_level_(config.log_level) {
    layers_.resize(config.num_layers);
    classes_.resize(config.max_classes);
    batches_.reserve(EXPCACHE_MAX_BATCHES);
}

expcache_status_t Cache::create(const expcache_config_t& config, std::unique_ptr<Cache>* out) {
    expcache_config_t cfg;
    expcache_status_t s = resolve_config(config, &cfg);
    if (s != EXPCACHE_OK) return s;
    const StagingConfig staging{cfg.copy_threads, cfg.staging_bytes, cfg.staging_chunk_bytes};
    std::unique_ptr<Backend> backend;
    if (cfg.backend == EXPCACHE_BACKEND_HOST) {
        backend = make_host_backend(cfg.device_capacity_bytes, staging);
    } else {
        s = make_cuda_backend(cfg.device, staging, &backend);
        if (s != EXPCACHE_OK) {
            if (cfg.backend == EXPCACHE_BACKEND_CUDA) return s;
            backend = make_host_backend(cfg.device_capacity_bytes, staging);
            clear_last_error();
        }
    }
    out->reset(new Cache(cfg, std::move(backend)));
    return EXPCACHE_OK;
}

// Work enqueued by earlier calls may still read the slots and staging: the device
// finishes it before any of the memory is freed.
Cache::~Cache() {
    backend_->enter();
    prefetcher_.reset();  // its thread may be sending into the slots
    backend_->sync_device();
    backend_->reclaim();
    arena_.free_all();
    backend_->leave();
}

// ---------------------------------------------------------------------------
// Logging and the checks every call makes

void Cache::log(uint32_t level, const char* fmt, ...) {
    if (level > log_level_) return;
    va_list ap;
    va_start(ap, fmt);
    std::string msg = vformat(fmt, ap);
    va_end(ap);
    if (log_fn_) log_fn_(log_user_, level, msg.c_str());
    else std::fprintf(stderr, "expcache: %s\n", msg.c_str());
}

expcache_status_t Cache::set_log_callback(expcache_log_fn fn, void* user) {
    CallScope scope(*this);
    log_fn_ = fn;
    log_user_ = user;
    return EXPCACHE_OK;
}

expcache_status_t Cache::retain_memory(const void* ptr, std::shared_ptr<KeptMemory>* out) {
    CallScope scope(*this);
    if (!arena_.retain(ptr, out))
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "%p is not inside device memory this cache holds", ptr);
    return EXPCACHE_OK;
}

expcache_status_t Cache::set_dropped_callback(expcache_memory_dropped_fn fn, void* user) {
    CallScope scope(*this);
    dropped_fn_ = fn;
    dropped_user_ = user;
    return EXPCACHE_OK;
}

expcache_status_t Cache::set_log_level(uint32_t level) {
    CallScope scope(*this);
    if (level > EXPCACHE_LOG_DEBUG) return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "log level must be 0..3, got %u", level);
    log_level_ = level;
    return EXPCACHE_OK;
}

expcache_status_t Cache::check(expcache_status_t s) {
    if (s == EXPCACHE_ERR_POISONED) poisoned_ = true;
    return s;
}

expcache_status_t Cache::usable() const {
    if (poisoned_)
        return fail(EXPCACHE_ERR_POISONED,
                    "an earlier sticky CUDA error poisoned this cache; destroy it (see the first error)");
    return EXPCACHE_OK;
}

expcache_status_t Cache::validate_layer(uint32_t layer) const {
    if (layer >= layers_.size())
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "layer %u out of range (num_layers %zu)", layer, layers_.size());
    if (!layers_[layer].registered)
        return fail(EXPCACHE_ERR_INVALID_STATE,
                    "layer %u is not registered (a dense layer, or expcache_layer_register was not called for it)",
                    layer);
    return EXPCACHE_OK;
}

// ---------------------------------------------------------------------------
// Layout

expcache_status_t Cache::register_layer(uint32_t layer, const expcache_layer_desc_t& d) {
    CallScope scope(*this);
    if (layer >= layers_.size())
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "layer %u out of range (num_layers %zu)", layer, layers_.size());
    if (layers_[layer].registered) return fail(EXPCACHE_ERR_INVALID_STATE, "layer %u is already registered", layer);
    if (d.num_experts == 0 || d.num_experts > EXPCACHE_MAX_EXPERTS_LIMIT)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "num_experts must be 1..%u, got %u", EXPCACHE_MAX_EXPERTS_LIMIT,
                    d.num_experts);
    if (d.source_kind > EXPCACHE_SOURCE_FILE)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "unknown source_kind %u (0 pageable, 1 pinned, 2 file)",
                    d.source_kind);
    const bool from_file = d.source_kind == EXPCACHE_SOURCE_FILE;
    if (from_file && d.file >= files_.size())
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "file %u was not opened with expcache_file_open (%zu open)", d.file,
                    files_.size());
    if (!from_file && d.file != 0) return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "file must be 0 unless source_kind is file");
    const uint64_t bytes[kParts] = {d.gate_bytes, d.up_bytes, d.down_bytes};
    const uint64_t stride[kParts] = {d.gate_stride, d.up_stride, d.down_stride};
    const void* base[kParts] = {d.gate_base, d.up_base, d.down_base};
    static const char* names[kParts] = {"gate", "up", "down"};
    for (int p = 0; p < kParts; ++p) {
        if (bytes[p] == 0 || bytes[p] > EXPCACHE_MAX_PART_BYTES_LIMIT)
            return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "%s_bytes must be 1..2^40, got %llu", names[p],
                        (unsigned long long)bytes[p]);
        if (stride[p] < bytes[p])
            return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "%s_stride %llu is smaller than %s_bytes %llu", names[p],
                        (unsigned long long)stride[p], names[p], (unsigned long long)bytes[p]);
        if (!base[p] && !from_file) return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "%s_base is NULL", names[p]);
        unsigned __int128 end = (unsigned __int128)reinterpret_cast<uintptr_t>(base[p]) +
                                (unsigned __int128)stride[p] * (d.num_experts - 1) + bytes[p];
        if (from_file && end > files_[d.file]->size())
            return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "%s part of the last expert ends at byte %llu, past the end of %s "
                        "(%llu bytes)", names[p], (unsigned long long)end, files_[d.file]->path().c_str(),
                        (unsigned long long)files_[d.file]->size());
        if (end > (unsigned __int128)UINTPTR_MAX)
            return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "%s part of the last expert would end past the address space",
                        names[p]);
    }
    LayerState& l = layers_[layer];
    l.registered = true;
    l.pinned = d.source_kind == EXPCACHE_SOURCE_PINNED;
    l.file = from_file ? files_[d.file].get() : nullptr;
    l.num_experts = d.num_experts;
    for (int p = 0; p < kParts; ++p) {
        l.bytes[p] = bytes[p];
        l.stride[p] = stride[p];
        l.base[p] = static_cast<const unsigned char*>(base[p]);
    }
    l.key_base = next_key_;
    next_key_ += d.num_experts;
    // Layer positions for the policy clock: rank among the registered layers.
    int32_t rank = 0;
    for (LayerState& other : layers_)
        if (other.registered) other.rank = rank++;
    clock_.positions = rank;
    l.seen.assign(d.num_experts, 0);
    l.seen_pos.assign(d.num_experts, 0);
    l.slot_of.assign(d.num_experts, -1);
    // Budget shares depend on the whole layout: recompute caps lazily.
    for (ClassState& cls : classes_) cls.cap_valid = false;
    return EXPCACHE_OK;
}

expcache_status_t Cache::open_file(const char* path, uint32_t* out_file) {
    CallScope scope(*this);
    if (files_.size() >= 1024) return fail(EXPCACHE_ERR_INVALID_STATE, "1024 files are open already");
    std::unique_ptr<SourceFile> f(new SourceFile());
    const bool direct = config_.file_reads == EXPCACHE_FILE_READS_DIRECT;
    expcache_status_t s = f->open(path, direct);
    if (s != EXPCACHE_OK) return s;
    log(EXPCACHE_LOG_NOTICE, "source file %s: %llu bytes, %s reads", path, (unsigned long long)f->size(),
        f->direct() ? "O_DIRECT" : direct ? "buffered (O_DIRECT refused)" : "buffered");
    files_.push_back(std::move(f));
    *out_file = static_cast<uint32_t>(files_.size() - 1);
    return EXPCACHE_OK;
}

// ---------------------------------------------------------------------------
// Control

expcache_status_t Cache::release_all() {
    CallScope scope(*this);
    expcache_status_t s = usable();
    if (s == EXPCACHE_OK) s = check(backend_->sync_device());
    if (s != EXPCACHE_OK) return s;
    backend_->reclaim();
    arena_.free_now(compact_.ptr);
    arena_.free_now(overflow_.ptr);
    compact_ = overflow_ = OwnedBuffer{};
    return release_unheld(EXPCACHE_PATH_CONTROL);
}

expcache_status_t Cache::synchronize(void* stream) {
    CallScope scope(*this);
    expcache_status_t s = usable();
    if (s == EXPCACHE_OK) s = check(backend_->sync_stream(stream));
    return s;
}

}  // namespace expcache
