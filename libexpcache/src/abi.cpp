// The C ABI: validate the handle and the pointers, call the core, and turn
// anything thrown into a status, exactly once, here. Handles are checked
// against a registry of live caches, so a destroyed or foreign handle gets
// INVALID_ARGUMENT instead of a crash.
#include <pthread.h>

#include <atomic>
#include <mutex>
#include <new>
#include <unordered_set>

#include "cache.hpp"
#include "config.hpp"
#include "errors.hpp"
#include "expcache_testing.h"

namespace {

// fork(): how many times this process's ancestry forked since the library was loaded, as seen
// by this process (a child adds one). A handle made under another count is the parent's.
std::atomic<uint64_t> g_forks{0};

}  // namespace

struct expcache_t {
    std::unique_ptr<expcache::Cache> impl;
    uint64_t forks = g_forks.load();
};

struct expcache_memory_ref_t {
    std::shared_ptr<expcache::KeptMemory> kept;
    uint64_t forks = g_forks.load();
};

namespace {

using expcache::fail;

std::mutex g_registry_mu;
std::unordered_set<const expcache_t*>& registry() {
    static auto* r = new std::unordered_set<const expcache_t*>();  // never destroyed: usable during exit
    return *r;
}

// The registry's lock is taken across fork(), so a child never inherits it held by a thread
// that does not exist there.
void fork_prepare() {
    g_registry_mu.lock();
}
void fork_parent() {
    g_registry_mu.unlock();
}
void fork_child() {
    g_forks.fetch_add(1);
    g_registry_mu.unlock();
}
const int g_atfork = pthread_atfork(fork_prepare, fork_parent, fork_child);

bool forked_since(uint64_t forks) {
    return forks != g_forks.load(std::memory_order_relaxed);
}

bool is_live(const expcache_t* c) {
    std::lock_guard<std::mutex> lock(g_registry_mu);
    return registry().count(c) != 0;
}

expcache_status_t check_handle(const expcache_t* c) {
    if (!c) return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "cache is NULL");
    if (!is_live(c))
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "cache %p is not a live cache (destroyed?)", (const void*)c);
    if (forked_since(c->forks))
        return fail(EXPCACHE_ERR_INVALID_STATE,
                    "cache %p was created before this process forked: a cache cannot be used in a forked child "
                    "(its threads, locks and CUDA state stayed in the parent); create a new cache in the child",
                    (const void*)c);
    return EXPCACHE_OK;
}

template <typename T>
expcache_status_t check_struct(const T* p, const char* name) {
    if (!p) return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "%s is NULL", name);
    if (p->struct_size != sizeof(T))
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "%s->struct_size is %u, expected %zu (header/library mismatch?)",
                    name, p->struct_size, sizeof(T));
    return EXPCACHE_OK;
}

// Runs f, maps exceptions, and prefixes any failure with the function name.
template <typename F>
expcache_status_t guarded(const char* function, F&& f) {
    expcache::DeferredLog deferred;  // lines reach the callback after the call, its locks released
    expcache_status_t s;
    try {
        s = f();
    } catch (const std::bad_alloc&) {
        s = fail(EXPCACHE_ERR_OUT_OF_HOST_MEMORY, "host memory exhausted");
    } catch (const std::exception& e) {
        s = fail(EXPCACHE_ERR_INTERNAL, "unexpected exception: %s", e.what());
    } catch (...) {
        s = fail(EXPCACHE_ERR_INTERNAL, "unexpected exception");
    }
    if (s != EXPCACHE_OK) expcache::prefix_last_error(function);
    return s;
}

#define EXPCACHE_REQUIRE(cond, ...)                                           \
    do {                                                                      \
        if (!(cond)) return fail(EXPCACHE_ERR_INVALID_ARGUMENT, __VA_ARGS__); \
    } while (0)

#define EXPCACHE_TRY(expr)                \
    do {                                  \
        expcache_status_t s_ = (expr);    \
        if (s_ != EXPCACHE_OK) return s_; \
    } while (0)

}  // namespace

extern "C" {

uint32_t expcache_version(void) {
    return EXPCACHE_VERSION_MAJOR * 10000 + EXPCACHE_VERSION_MINOR * 100 + EXPCACHE_VERSION_PATCH;
}

const char* expcache_policy_name(uint32_t policy) {
    return expcache::policy_name(policy);
}

expcache_status_t expcache_config_init(expcache_config_t* config) {
    return guarded(__func__, [&] {
        EXPCACHE_REQUIRE(config, "config is NULL");
        expcache::config_defaults(config);
        return EXPCACHE_OK;
    });
}

expcache_status_t expcache_layer_desc_init(expcache_layer_desc_t* desc) {
    return guarded(__func__, [&] {
        EXPCACHE_REQUIRE(desc, "desc is NULL");
        *desc = expcache_layer_desc_t{};
        desc->struct_size = sizeof *desc;
        return EXPCACHE_OK;
    });
}

expcache_status_t expcache_create(const expcache_config_t* config, expcache_t** out_cache) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_struct(config, "config"));
        EXPCACHE_REQUIRE(out_cache, "out_cache is NULL");
        std::unique_ptr<expcache::Cache> impl;
        EXPCACHE_TRY(expcache::Cache::create(*config, &impl));
        expcache_t* c = new expcache_t{std::move(impl)};
        {
            std::lock_guard<std::mutex> lock(g_registry_mu);
            registry().insert(c);
        }
        *out_cache = c;
        return EXPCACHE_OK;
    });
}

void expcache_destroy(expcache_t* cache) {
    if (!cache) return;
    expcache::DeferredLog deferred;
    {
        std::lock_guard<std::mutex> lock(g_registry_mu);
        if (registry().erase(cache) == 0) return;  // unknown or already destroyed: ignore
    }
    if (forked_since(cache->forks)) {
        (void)cache->impl.release();  // the parent's threads, locks and device state: leaked, untouched
        delete cache;
        return;
    }
    try {
        delete cache;
    } catch (...) {
    }
}

expcache_status_t expcache_backend_get(const expcache_t* cache, uint32_t* out_backend) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(out_backend, "out_backend is NULL");
        *out_backend = cache->impl->backend_kind();
        return EXPCACHE_OK;
    });
}

expcache_status_t expcache_layer_register(expcache_t* cache, uint32_t layer, const expcache_layer_desc_t* desc) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_TRY(check_struct(desc, "desc"));
        return cache->impl->register_layer(layer, *desc);
    });
}

expcache_status_t expcache_file_open(expcache_t* cache, const char* path, uint32_t* out_file) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(path && path[0], "path is NULL or empty");
        EXPCACHE_REQUIRE(out_file, "out_file is NULL");
        return cache->impl->open_file(path, out_file);
    });
}

expcache_status_t expcache_select_async(expcache_t* cache, uint32_t layer, const uint32_t* ids, uint32_t k,
                                        void* stream, expcache_expert_ptrs_t* out_ptrs) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(ids, "ids is NULL");
        EXPCACHE_REQUIRE(out_ptrs, "out_ptrs is NULL");
        return cache->impl->select(layer, ids, k, stream, out_ptrs);
    });
}

expcache_status_t expcache_select_split_async(expcache_t* cache, uint32_t layer, const uint32_t* ids, uint32_t k,
                                              void* stream, expcache_expert_ptrs_t* out_ptrs, uint8_t* out_resident,
                                              void** out_ready) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(ids, "ids is NULL");
        EXPCACHE_REQUIRE(out_ptrs, "out_ptrs is NULL");
        EXPCACHE_REQUIRE(out_resident, "out_resident is NULL");
        EXPCACHE_REQUIRE(out_ready, "out_ready is NULL");
        return cache->impl->select_split(layer, ids, k, stream, out_ptrs, out_resident, out_ready);
    });
}

expcache_status_t expcache_ready_wait_async(expcache_t* cache, void* ready, void* stream) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        return cache->impl->wait_ready(ready, stream);
    });
}

expcache_status_t expcache_prefetch_async(expcache_t* cache, uint32_t layer, const uint32_t* ids, uint32_t n,
                                          void* stream, uint32_t* out_queued) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(ids, "ids is NULL");
        return cache->impl->prefetch(layer, ids, n, stream, out_queued);
    });
}

expcache_status_t expcache_prefetch_wait(expcache_t* cache) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        return cache->impl->prefetch_wait();
    });
}

expcache_status_t expcache_hint(expcache_t* cache, uint32_t layer, const uint32_t* ids, uint32_t n) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(ids, "ids is NULL");
        return cache->impl->hint(layer, ids, n);
    });
}

expcache_status_t expcache_compact_load_async(expcache_t* cache, uint32_t layer, const uint32_t* ids, uint32_t n,
                                              void* stream, expcache_compact_t* out) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(ids, "ids is NULL");
        EXPCACHE_TRY(check_struct(out, "out"));
        return cache->impl->load_compact(layer, ids, n, stream, out);
    });
}

expcache_status_t expcache_batch_prepare_async(expcache_t* cache, uint32_t layer, const uint32_t* ids, uint64_t n,
                                               void* stream, uint32_t* out_ids, expcache_expert_ptrs_t* out_ptrs,
                                               uint32_t* out_count, uint64_t* out_batch) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(ids, "ids is NULL");
        EXPCACHE_REQUIRE(out_ids && out_ptrs && out_count && out_batch,
                         "out_ids, out_ptrs, out_count and out_batch must not be NULL");
        return cache->impl->batch_prepare(layer, ids, n, stream, out_ids, out_ptrs, out_count, out_batch);
    });
}

expcache_status_t expcache_batch_finish(expcache_t* cache, uint64_t batch, void* stream) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        return cache->impl->batch_finish(batch, stream);
    });
}

expcache_status_t expcache_release_all(expcache_t* cache) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        return cache->impl->release_all();
    });
}

expcache_status_t expcache_select_device_async(expcache_t* cache, uint32_t layer, const void* ids, uint32_t id_bits,
                                               uint32_t n, uint32_t k, int32_t* out_slots, void* stream) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(ids, "ids is NULL");
        EXPCACHE_REQUIRE(out_slots, "out_slots is NULL");
        return cache->impl->select_device(layer, ids, id_bits, n, k, out_slots, stream);
    });
}

expcache_status_t expcache_class_bank_get(expcache_t* cache, uint32_t class_index, expcache_bank_t* out) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_TRY(check_struct(out, "out"));
        return cache->impl->bank(class_index, out);
    });
}

expcache_status_t expcache_synchronize(expcache_t* cache, void* stream) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        return cache->impl->synchronize(stream);
    });
}

expcache_status_t expcache_class_count_get(const expcache_t* cache, uint32_t* out_count) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(out_count, "out_count is NULL");
        return cache->impl->class_count(out_count);
    });
}

expcache_status_t expcache_class_info_get(const expcache_t* cache, uint32_t class_index, expcache_class_info_t* out) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_TRY(check_struct(out, "out"));
        return cache->impl->class_info(class_index, out);
    });
}

expcache_status_t expcache_layer_bind_class(expcache_t* cache, uint32_t layer, uint32_t* out_class) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(out_class, "out_class is NULL");
        return cache->impl->layer_class(layer, out_class);
    });
}

expcache_status_t expcache_stats_get(const expcache_t* cache, uint32_t class_index, uint32_t path,
                                     expcache_stats_t* out) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_TRY(check_struct(out, "out"));
        return cache->impl->get_stats(class_index, path, out);
    });
}

expcache_status_t expcache_staging_stats_get(const expcache_t* cache, expcache_staging_stats_t* out) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_TRY(check_struct(out, "out"));
        return cache->impl->get_staging_stats(out);
    });
}

expcache_status_t expcache_prefetch_stats_get(const expcache_t* cache, expcache_prefetch_stats_t* out) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_TRY(check_struct(out, "out"));
        return cache->impl->get_prefetch_stats(out);
    });
}

expcache_status_t expcache_stats_reset(expcache_t* cache) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        return cache->impl->reset_stats();
    });
}

expcache_status_t expcache_log_set_callback(expcache_t* cache, expcache_log_fn fn, void* user) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        return cache->impl->set_log_callback(fn, user);
    });
}

expcache_status_t expcache_memory_retain(expcache_t* cache, const void* ptr, expcache_memory_ref_t** out_ref) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(out_ref, "out_ref is NULL");
        std::unique_ptr<expcache_memory_ref_t> ref(new expcache_memory_ref_t());
        EXPCACHE_TRY(cache->impl->retain_memory(ptr, &ref->kept));
        *out_ref = ref.release();
        return EXPCACHE_OK;
    });
}

void expcache_memory_release(expcache_memory_ref_t* ref) {
    if (!ref || forked_since(ref->forks)) return;  // in a forked child: the parent's memory, left alone
    try {
        delete ref;
    } catch (...) {
    }
}

expcache_status_t expcache_memory_set_dropped_callback(expcache_t* cache, expcache_memory_dropped_fn fn, void* user) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        return cache->impl->set_dropped_callback(fn, user);
    });
}

expcache_status_t expcache_log_set_level(expcache_t* cache, uint32_t level) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        return cache->impl->set_log_level(level);
    });
}

// ---------------------------------------------------------------------------
// expcache_testing.h: hooks for tests, benchmarks and bindings

expcache_status_t expcache_testing_read_resident(expcache_t* cache, uint32_t layer, uint32_t expert, void* dst,
                                                 uint64_t dst_bytes, uint32_t* out_resident) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(dst, "dst is NULL");
        EXPCACHE_REQUIRE(out_resident, "out_resident is NULL");
        return cache->impl->read_resident(layer, expert, dst, dst_bytes, out_resident);
    });
}

expcache_status_t expcache_testing_read_device(expcache_t* cache, const void* src, void* dst, uint64_t n) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(src && dst, "src and dst must not be NULL");
        EXPCACHE_REQUIRE(n > 0, "n must be > 0");
        return cache->impl->read_device(src, dst, n);
    });
}

expcache_status_t expcache_testing_checksum(expcache_t* cache, uint32_t layer, const expcache_expert_ptrs_t* ptrs,
                                            uint32_t n, void* stream, uint64_t* out_sums) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(ptrs, "ptrs is NULL");
        EXPCACHE_REQUIRE(out_sums, "out_sums is NULL");
        return cache->impl->checksum(layer, ptrs, n, stream, out_sums);
    });
}

expcache_status_t expcache_testing_checksum_async(expcache_t* cache, uint32_t layer, const expcache_expert_ptrs_t* ptrs,
                                                  uint32_t n, void* stream, uint32_t first) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(ptrs, "ptrs is NULL");
        return cache->impl->checksum_async(layer, ptrs, n, stream, first);
    });
}

expcache_status_t expcache_testing_bank_checksum_async(expcache_t* cache, uint32_t layer, const int32_t* slots,
                                                       uint32_t n, void* stream, uint32_t first) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(slots, "slots is NULL");
        return cache->impl->bank_checksum_async(layer, slots, n, stream, first);
    });
}

expcache_status_t expcache_testing_checksum_results(expcache_t* cache, uint32_t first, uint32_t n, uint64_t* out) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(out, "out is NULL");
        return cache->impl->checksum_results(first, n, out);
    });
}

expcache_status_t expcache_testing_inject_alloc_failures(expcache_t* cache, uint64_t skip, uint64_t count) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        return cache->impl->inject_alloc_failures(skip, count);
    });
}

expcache_status_t expcache_testing_inject_copy_failures(expcache_t* cache, uint64_t skip, uint64_t count) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        return cache->impl->inject_copy_failures(skip, count);
    });
}

expcache_status_t expcache_testing_inject_staging_failures(expcache_t* cache, uint64_t skip, uint64_t count) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        return cache->impl->inject_staging_failures(skip, count);
    });
}

expcache_status_t expcache_testing_prefetch_pause(expcache_t* cache, uint32_t paused) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(paused <= 1, "paused must be 0 or 1, got %u", paused);
        return cache->impl->prefetch_pause(paused != 0);
    });
}

expcache_status_t expcache_testing_spin_async(expcache_t* cache, void* stream, uint64_t ns) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(ns <= 1000000000ull, "ns must be at most 1e9 (1 s), got %llu", (unsigned long long)ns);
        return cache->impl->spin(stream, ns);
    });
}

expcache_status_t expcache_testing_device_bytes_in_use(const expcache_t* cache, uint64_t* out_bytes) {
    return guarded(__func__, [&] {
        EXPCACHE_TRY(check_handle(cache));
        EXPCACHE_REQUIRE(out_bytes, "out_bytes is NULL");
        return cache->impl->device_bytes_in_use(out_bytes);
    });
}

uint32_t expcache_testing_struct_size(uint32_t which) {
    switch (which) {
        case EXPCACHE_STRUCT_CONFIG:
            return sizeof(expcache_config_t);
        case EXPCACHE_STRUCT_LAYER_DESC:
            return sizeof(expcache_layer_desc_t);
        case EXPCACHE_STRUCT_EXPERT_PTRS:
            return sizeof(expcache_expert_ptrs_t);
        case EXPCACHE_STRUCT_COMPACT:
            return sizeof(expcache_compact_t);
        case EXPCACHE_STRUCT_CLASS_INFO:
            return sizeof(expcache_class_info_t);
        case EXPCACHE_STRUCT_STATS:
            return sizeof(expcache_stats_t);
        case EXPCACHE_STRUCT_STAGING_STATS:
            return sizeof(expcache_staging_stats_t);
        case EXPCACHE_STRUCT_PREFETCH_STATS:
            return sizeof(expcache_prefetch_stats_t);
        case EXPCACHE_STRUCT_BANK:
            return sizeof(expcache_bank_t);
        default:
            return 0;
    }
}
static_assert(EXPCACHE_STRUCT_COUNT == 9, "expcache_testing_struct_size covers every EXPCACHE_STRUCT_*");

}  // extern "C"
