#include "cache.hpp"

#include <cstdarg>
#include <cstdio>

#include "config.hpp"
#include "errors.hpp"

namespace expcache {

// ---------------------------------------------------------------------------
// Lifetime

Cache::Cache(const expcache_config_t& config, std::unique_ptr<InstrumentedBackend> backend,
             std::unique_ptr<LookupKernels> lookup_kernels)
    : backend_(std::move(backend)),
      arena_(*backend_),
      config_(config),
      log_(config.log_level),
      pool_(backend_->link(), config.host_budget_bytes, config.policy),
      layers_(config.num_layers, config.lookup == EXPCACHE_LOOKUP_DEVICE),
      classes_(config_, *backend_, arena_, layers_, log_, health_),
      lookup_(config_, *backend_, arena_, layers_, classes_, log_, health_, std::move(lookup_kernels)),
      streams_(*backend_, health_, classes_),
      prefetch_({config_, *backend_, layers_, classes_, streams_, clock_, log_, health_}) {
    batches_.open.reserve(EXPCACHE_MAX_BATCHES);
    lookup_.use_pool(&pool_);
}

expcache_status_t Cache::create(const expcache_config_t& config, std::unique_ptr<Cache>* out) {
    expcache_config_t cfg;
    StagingTuning tuning;
    EnvironmentLines lines;
    expcache_status_t s = resolve_config(config, &cfg, &tuning, &lines);
    if (s != EXPCACHE_OK) return s;
    const StagingConfig staging{cfg.copy_threads, cfg.staging_bytes, cfg.staging_chunk_bytes, tuning};
    std::unique_ptr<StagingBackend> backend;
    std::unique_ptr<TestKernels> kernels;
    std::unique_ptr<LookupKernels> lookup;
    if (cfg.backend != EXPCACHE_BACKEND_HOST) {
        s = make_cuda_backend(cfg.device, staging, &backend);
        if (s == EXPCACHE_OK) {
            kernels = make_cuda_kernels(cfg.device);
            lookup = make_cuda_lookup_kernels(cfg.device);
        } else if (cfg.backend == EXPCACHE_BACKEND_CUDA) {
            return s;
        } else {
            clear_last_error();
        }
    }
    if (!backend) {
        backend = make_host_backend(cfg.device_capacity_bytes, staging);
        kernels = make_host_kernels();
        lookup = make_host_lookup_kernels();
    }
    std::unique_ptr<InstrumentedBackend> instrumented(new InstrumentedBackend(std::move(backend), std::move(kernels)));
    std::unique_ptr<Cache> cache(new Cache(cfg, std::move(instrumented), std::move(lookup)));
    log_environment_once(cache->log_, lines);
    cache->backend_->enter();
    s = cache->pool_.allocate();
    cache->backend_->leave();
    if (s != EXPCACHE_OK) return s;
    if (cache->pool_.enabled())
        cache->log_(EXPCACHE_LOG_NOTICE,
                    "host pool: %s of pinned host memory between pageable or file sources and "
                    "the device cache",
                    human_bytes(cfg.host_budget_bytes).c_str());
    if (cfg.budget_bytes == EXPCACHE_BUDGET_FREE_MEMORY) {
        cache->free_memory_budget_ = true;
        if ((s = cache->measure_budget(&cache->config_)) != EXPCACHE_OK) return s;
    }
    *out = std::move(cache);
    return EXPCACHE_OK;
}

// Work enqueued by earlier calls may still read the slots and staging: the device
// finishes it before any of the memory is freed.
Cache::~Cache() {
    backend_->enter();
    lookup_.report_pending();
    prefetch_.stop();  // its thread may be sending into the slots
    backend_->sync_device();
    backend_->reclaim();
    arena_.free_all();
    backend_->leave();
}

// ---------------------------------------------------------------------------
// Logging and the checks every call makes

expcache_status_t Cache::set_log_callback(expcache_log_fn fn, void* user) {
    CallScope scope(*this);
    log_.set_callback(fn, user);
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
    arena_.set_dropped_callback(fn, user);
    return EXPCACHE_OK;
}

// The class table never calls out: what it is about to free is vacated first (nothing goes out
// into the banks after this, the device has finished every kernel that may read them).
// On a device-lookup cache a class's device state is made when it is bound, and a release
// clears it there (the one copy of its residency).
expcache_status_t Cache::bind_class(uint32_t layer, uint32_t path, int32_t* out_cls) {
    const int32_t had = classes_.bound(layers_[layer]);
    expcache_status_t s = prefetch_.bind_class(layer, path, out_cls);
    if (s != EXPCACHE_OK || (had >= 0 && lookup_.ready(had))) return s;  // every call's: nothing new
    return lookup_.prepare(*out_cls);
}

expcache_status_t Cache::release_unheld(uint32_t path) {
    const std::vector<int32_t> released = classes_.unheld();
    expcache_status_t s = prefetch_.vacate(released);
    if (s == EXPCACHE_OK) s = classes_.release_unheld(path);
    for (size_t i = 0; i < released.size() && s == EXPCACHE_OK; ++i) s = lookup_.clear(released[i]);
    return s;
}

expcache_status_t Cache::set_log_level(uint32_t level) {
    CallScope scope(*this);
    if (level > EXPCACHE_LOG_DEBUG) return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "log level must be 0..3, got %u", level);
    log_.set_level(level);
    return EXPCACHE_OK;
}

// ---------------------------------------------------------------------------
// Layout

expcache_status_t Cache::register_layer(uint32_t layer, const expcache_layer_desc_t& d) {
    return register_layers(1, &layer, &d);
}

expcache_status_t Cache::register_layers(uint32_t n, const uint32_t* layers, const expcache_layer_desc_t* descs) {
    CallScope scope(*this);
    // Every descriptor checked before any is recorded: all or nothing.
    for (uint32_t i = 0; i < n; ++i)
        for (uint32_t j = 0; j < i; ++j)
            if (layers[j] == layers[i])
                return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "layer %u is listed twice (at %u and %u)", layers[i], j, i);
    for (uint32_t i = 0; i < n; ++i) {
        expcache_status_t s = layers_.check(layers[i], descs[i]);
        if (s == EXPCACHE_OK) s = device_table_fits(layers[i], descs[i].num_experts);
        if (s != EXPCACHE_OK) return n > 1 ? fail(s, "descs[%u]: %s", i, std::string(last_error()).c_str()) : s;
    }
    for (uint32_t i = 0; i < n; ++i) {
        layers_.record(layers[i], descs[i]);
        note_pool_layer(layers[i]);
    }
    clock_.policy.positions = layers_.registered();
    classes_.invalidate_caps();  // budget shares depend on the whole layout
    const size_t needed = layers_.size_classes();
    if (needed > config_.max_classes && !classes_warned_) {
        classes_warned_ = true;
        log_(EXPCACHE_LOG_WARNING,
             "the layers registered so far have %zu expert size classes and max_classes is %u: every layer of "
             "a class beyond %u will release a whole class and rebind it (no hits across them); set "
             "max_classes to %zu (at most %d)",
             needed, config_.max_classes, config_.max_classes, needed, EXPCACHE_MAX_CLASSES_LIMIT);
    }
    return EXPCACHE_OK;
}

// A device-lookup cache's table is sized from the layout when its first class is bound: after
// that, only a layer registered before, unregistered and registered again within its earlier
// experts, has keys in it.
expcache_status_t Cache::device_table_fits(uint32_t layer, uint32_t num_experts) const {
    if (!lookup_.frozen() || layers_.keeps_keys(layer, num_experts)) return EXPCACHE_OK;
    const uint32_t had = layers_[layer].key_span;
    if (had > 0)
        return fail(EXPCACHE_ERR_INVALID_STATE,
                    "layer %u is registered again with %u experts on a device-lookup cache whose device table was "
                    "sized, when its first class was bound, for the %u it had then: register it with at most %u",
                    layer, num_experts, had, had);
    return fail(EXPCACHE_ERR_INVALID_STATE,
                "layer %u registered after a class was bound on a device-lookup cache: its banks and device "
                "table are sized from the whole layout, so register every layer first",
                layer);
}

expcache_status_t Cache::unregister_layer(uint32_t layer) {
    CallScope scope(*this);
    expcache_status_t s = health_.usable();
    if (s == EXPCACHE_OK) s = layers_.validate(layer);
    if (s != EXPCACHE_OK) return s;
    for (const BatchState& batch : batches_.open)
        if (batch.layer == layer)
            return fail(EXPCACHE_ERR_INVALID_STATE,
                        "layer %u has an unfinished prefill batch (%llu) holding its experts: finish it "
                        "(expcache_batch_finish) first",
                        layer, (unsigned long long)batch.id);
    // Nothing may still read the layer's slots or source: its queued prefetches are cancelled (as a
    // serving call cancels them) and the device finishes every kernel and copy enqueued so far.
    if ((s = prefetch_.quiesce()) != EXPCACHE_OK) return s;
    LayerState& l = layers_[layer];
    const int32_t c = classes_.bound(l);
    uint64_t left = 0;
    if (c >= 0 && !lookup_.enabled()) {
        for (const int32_t slot : l.slot_of) {
            if (slot < 0) continue;
            ++left;
            if (classes_[c].slots()[slot].prefetch() != kPrefetchNone) prefetch_.dropped_unused(layer);
        }
    }
    if ((s = lookup_.forget_layer(layer, c)) != EXPCACHE_OK) return s;
    classes_.forget_layer(layer);
    layers_.unregister(layer);
    pool_.forget_layer(layer);
    clock_.policy.positions = layers_.registered();
    classes_.invalidate_caps();  // budget shares depend on the whole layout
    if (c >= 0)
        log_(EXPCACHE_LOG_NOTICE, "layer %u unregistered: its experts left class %d %s%s", layer, c,
             classes_.name(classes_[c]).c_str(),
             lookup_.enabled() ? "" : format(" (%llu were resident)", (unsigned long long)left).c_str());
    else
        log_(EXPCACHE_LOG_NOTICE, "layer %u unregistered (it was never bound to a class)", layer);
    return EXPCACHE_OK;
}

expcache_status_t Cache::open_file(const char* path, int fd, uint32_t* out_file) {
    CallScope scope(*this);
    std::string note;
    expcache_status_t s =
        layers_.open_file(path, fd, config_.file_reads == EXPCACHE_FILE_READS_DIRECT, out_file, &note);
    if (s == EXPCACHE_OK) log_(EXPCACHE_LOG_NOTICE, "%s", note.c_str());
    return s;
}

// ---------------------------------------------------------------------------
// Control

expcache_status_t Cache::release_all() {
    CallScope scope(*this);
    expcache_status_t s = health_.usable();
    if (s == EXPCACHE_OK) s = health_.check(backend_->sync_device());
    if (s != EXPCACHE_OK) return s;
    backend_->reclaim();
    arena_.free_now(staging_.compact.ptr);
    staging_ = StagingBuffers{};
    return release_unheld(EXPCACHE_PATH_CONTROL);
}

expcache_status_t Cache::synchronize(void* stream) {
    CallScope scope(*this);
    expcache_status_t s = health_.usable();
    if (s == EXPCACHE_OK) s = health_.check(backend_->sync_stream(stream));
    return s;
}

// ---------------------------------------------------------------------------
// Prefetch and hints (prefetch_coordinator.hpp): the calls' checks, under the lock

// A device select copies its misses itself, in the graph; a prefetch thread filling slots
// behind the device's back would break the one residency both sides keep.
expcache_status_t Cache::refuse_on_device_lookup(const char* what) const {
    if (!lookup_.enabled()) return EXPCACHE_OK;
    return fail(EXPCACHE_ERR_UNSUPPORTED,
                "%s is not available on a device-lookup cache: select_device copies its misses itself (inside a "
                "captured graph too); use it, or a cache made with lookup host",
                what);
}

expcache_status_t Cache::prefetch(uint32_t layer, const uint32_t* ids, uint32_t n, void* stream, uint32_t* out_queued) {
    CallScope scope(*this);
    expcache_status_t s = validate_request(layer, ids, n, EXPCACHE_MAX_SELECT, "n");
    if (s == EXPCACHE_OK) s = refuse_on_device_lookup("prefetch");
    return s == EXPCACHE_OK ? prefetch_.prefetch(layer, ids, n, stream, out_queued) : s;
}

expcache_status_t Cache::hint(uint32_t layer, const uint32_t* ids, uint32_t n) {
    CallScope scope(*this);
    expcache_status_t s = validate_request(layer, ids, n, EXPCACHE_MAX_SELECT, "n");
    if (s == EXPCACHE_OK) s = refuse_on_device_lookup("hint");
    return s == EXPCACHE_OK ? prefetch_.hint(layer, ids, n) : s;
}

expcache_status_t Cache::get_prefetch_stats(expcache_prefetch_stats_t* out) const {
    CallScope scope(*this);
    prefetch_.stats(out);
    return EXPCACHE_OK;
}

expcache_status_t Cache::prefetch_wait() {
    CallScope scope(*this);
    expcache_status_t s = health_.usable();
    return s == EXPCACHE_OK ? prefetch_.wait() : s;
}

expcache_status_t Cache::prefetch_pause(bool paused) {
    CallScope scope(*this);
    prefetch_.pause(paused);
    return EXPCACHE_OK;
}

}  // namespace expcache
