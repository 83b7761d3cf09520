// The C ABI's handles: the registry of live caches (what check_handle() asks), fork() as the
// registry sees it, creating and destroying a cache, and references that keep a cache's memory
// alive past it (expcache_memory_*).
#include <pthread.h>

#include <atomic>
#include <mutex>
#include <unordered_set>

#include "abi_checks.hpp"

using expcache::abi::check_handle;
using expcache::abi::check_struct;
using expcache::abi::forked_since;
using expcache::abi::guarded;

namespace {

// The count behind fork_count(): a child adds one (fork_child).
std::atomic<uint64_t> g_forks{0};

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

bool is_live(const expcache_t* c) {
    std::lock_guard<std::mutex> lock(g_registry_mu);
    return registry().count(c) != 0;
}

}  // namespace

namespace expcache {
namespace abi {

uint64_t fork_count() {
    return g_forks.load();
}

bool forked_since(uint64_t forks) {
    return forks != g_forks.load(std::memory_order_relaxed);
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

}  // namespace abi
}  // namespace expcache

extern "C" {

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

}  // extern "C"
