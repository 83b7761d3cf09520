// Every byte of device memory a cache holds, by address: so that
// device_bytes_in_use is exact, a pointer a caller hands back (read_device,
// checksum) can be proven to lie inside memory the cache allocated, and
// destruction frees everything.
//
// It knows nothing of the cache: statuses come back as the backend gave them,
// and the cache decides what a failure means (poisoning, releasing its expert
// caches and retrying, the message it adds).
//
// An allocation may be kept alive past its free by references (retain(): what
// expcache_memory_retain hands out, e.g. for zero-copy views and the tensors
// made from them). Freeing a kept allocation only disowns it: it leaves the
// arena and the backend's accounting at once, and the last reference frees it,
// from any thread, after the cache is gone too.
#pragma once

#include <cstdint>
#include <map>
#include <memory>

#include "backend/backend.hpp"
#include "expcache.h"

namespace expcache {

// One allocation that references keep alive; freed by the last of them once disowned.
class KeptMemory {
public:
    explicit KeptMemory(void* ptr) : ptr_(ptr) {}
    ~KeptMemory() {
        if (free_) free_(ptr_, device_);
    }
    KeptMemory(const KeptMemory&) = delete;
    KeptMemory& operator=(const KeptMemory&) = delete;
    void disown(Backend::FreeFn free, int device) {
        free_ = free;
        device_ = device;
    }

private:
    void* ptr_;
    Backend::FreeFn free_ = nullptr;  // set once the arena let go of it
    int device_ = 0;
};

class DeviceArena {
public:
    explicit DeviceArena(Backend& backend) : backend_(backend) {}
    DeviceArena(const DeviceArena&) = delete;
    DeviceArena& operator=(const DeviceArena&) = delete;

    // OK, or the backend's failure.
    expcache_status_t alloc(uint64_t bytes, void** out);
    // A pointer alloc() did not return (or one already freed) is ignored, as is nullptr.
    void free_now(void* ptr);
    // Freed once the work enqueued on `stream` so far has finished; counted as freed now.
    expcache_status_t free_after(void* ptr, void* stream);
    // Everything, now: the caller has waited for the device.
    void free_all();

    // [ptr, ptr + bytes) lies inside one allocation.
    bool owns(const void* ptr, uint64_t bytes) const;
    uint64_t bytes_in_use() const { return bytes_; }

    // A reference keeping alive the allocation that holds `ptr`; false when none does.
    bool retain(const void* ptr, std::shared_ptr<KeptMemory>* out);
    // Allocations freed so far while references kept them (each was disowned, not freed).
    uint64_t disowned() const { return disowned_; }
    // The caller's expcache_memory_dropped_fn: called by notify_dropped() when allocations were
    // disowned since the count `since` (the end of a call).
    void set_dropped_callback(expcache_memory_dropped_fn fn, void* user) {
        dropped_fn_ = fn;
        dropped_user_ = user;
    }
    void notify_dropped(uint64_t since) const {
        if (disowned_ != since && dropped_fn_) dropped_fn_(dropped_user_);
    }

private:
    struct Allocation {
        uint64_t bytes;
        std::shared_ptr<KeptMemory> kept;  // made by the first retain()
    };
    using Map = std::map<uintptr_t, Allocation>;  // by address; ordered, for owns()

    Map::const_iterator containing(const void* ptr, uint64_t bytes) const;
    // A reference besides the arena's own holds the allocation.
    static bool kept_elsewhere(const Allocation& a) { return a.kept && a.kept.use_count() > 1; }
    // Removes `it` from the map: true when references keep it (disowned, not to be freed).
    bool let_go(Map::iterator it);

    Backend& backend_;
    Map allocations_;
    uint64_t bytes_ = 0;
    uint64_t disowned_ = 0;
    expcache_memory_dropped_fn dropped_fn_ = nullptr;
    void* dropped_user_ = nullptr;
};

}  // namespace expcache
