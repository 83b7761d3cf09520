// What every exported function of the C ABI (abi_*.cpp) shares: the types behind the opaque
// handles, and the checks it runs before calling the core. Each function validates the handle
// and the pointers, calls the core, and turns anything thrown into a status, exactly once,
// through guarded(). Handles are checked against a registry of live caches (abi_handles.cpp),
// so a destroyed or foreign handle gets INVALID_ARGUMENT instead of a crash.
#pragma once

#include <stdint.h>

#include <memory>
#include <new>

#include "cache.hpp"
#include "errors.hpp"

namespace expcache {
namespace abi {

// fork(): how many times this process's ancestry forked since the library was loaded, as seen
// by this process (a child adds one). A handle made under another count is the parent's.
uint64_t fork_count();
bool forked_since(uint64_t forks);

}  // namespace abi
}  // namespace expcache

struct expcache_t {
    std::unique_ptr<expcache::Cache> impl;
    uint64_t forks = expcache::abi::fork_count();
};

struct expcache_memory_ref_t {
    std::shared_ptr<expcache::KeptMemory> kept;
    uint64_t forks = expcache::abi::fork_count();
};

namespace expcache {
namespace abi {

// OK for a live cache made in this process; INVALID_ARGUMENT for NULL or a handle the registry
// does not hold, INVALID_STATE for one made before this process forked.
expcache_status_t check_handle(const expcache_t* c);

template <typename T>
expcache_status_t check_struct(const T* p, const char* name) {
    if (!p) return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "%s is NULL", name);
    if (p->struct_size != sizeof(T))
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "%s->struct_size is %u, expected %zu (header/library mismatch?)",
                    name, p->struct_size, sizeof(T));
    return EXPCACHE_OK;
}

// Part sizes asked about (a class lookup): each of the first n 1..EXPCACHE_MAX_PART_BYTES_LIMIT.
inline expcache_status_t check_part_sizes(const uint64_t* bytes, uint32_t n, const char* what) {
    for (uint32_t p = 0; p < n; ++p)
        if (bytes[p] == 0 || bytes[p] > EXPCACHE_MAX_PART_BYTES_LIMIT)
            return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "%s: part %u's size must be 1..2^40, got %llu", what, p,
                        (unsigned long long)bytes[p]);
    return EXPCACHE_OK;
}

// Runs f, maps exceptions, and prefixes any failure with the function name.
template <typename F>
expcache_status_t guarded(const char* function, F&& f) {
    DeferredLog deferred;  // lines reach the callback after the call, its locks released
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
    if (s != EXPCACHE_OK) prefix_last_error(function);
    return s;
}

}  // namespace abi
}  // namespace expcache

#define EXPCACHE_REQUIRE(cond, ...)                                                     \
    do {                                                                                \
        if (!(cond)) return expcache::fail(EXPCACHE_ERR_INVALID_ARGUMENT, __VA_ARGS__); \
    } while (0)

#define EXPCACHE_TRY(expr)                \
    do {                                  \
        expcache_status_t s_ = (expr);    \
        if (s_ != EXPCACHE_OK) return s_; \
    } while (0)
