// Every byte of device memory a cache holds, by address: so that
// device_bytes_in_use is exact, a pointer a caller hands back (read_device,
// checksum) can be proven to lie inside memory the cache allocated, and
// destruction frees everything.
//
// Two kinds of memory: allocations (staging buffers, the device lookup's
// tables) and reservations (the classes' banks): a range of addresses reserved
// whole, backed by mappings piece by piece, so a bank grows and shrinks without
// moving. A reservation's mapped bytes are what it counts as in use.
//
// It knows nothing of the cache: statuses come back as the backend gave them,
// and the cache decides what a failure means (poisoning, releasing its expert
// caches and retrying, the message it adds).
//
// An allocation or a reservation may be kept alive past its free by references
// (retain(): what expcache_memory_retain hands out, e.g. for zero-copy views and
// the tensors made from them). Freeing a kept one only disowns it: it leaves the
// arena and the backend's accounting at once, and the last reference frees it,
// from any thread, after the cache is gone too. A kept reservation's mappings are
// never unmapped while the cache lives (unmap_from() leaves them).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "backend/backend.hpp"
#include "expcache.h"

namespace expcache {

// One allocation (or reservation) that references keep alive; freed by the last of them once
// disowned.
class KeptMemory {
public:
    KeptMemory() = default;
    ~KeptMemory() {
        if (free_) free_();
    }
    KeptMemory(const KeptMemory&) = delete;
    KeptMemory& operator=(const KeptMemory&) = delete;
    void disown(std::function<void()> free) { free_ = std::move(free); }

private:
    std::function<void()> free_;  // set once the arena let go of it
};

class DeviceArena {
public:
    explicit DeviceArena(Backend& backend) : backend_(backend) {}
    DeviceArena(const DeviceArena&) = delete;
    DeviceArena& operator=(const DeviceArena&) = delete;

    // OK, or the backend's failure.
    expcache_status_t alloc(uint64_t bytes, void** out);
    // Reservations: `bytes` of addresses (rounded up to the granularity), no memory yet.
    uint64_t granularity() const { return backend_.map_granularity(); }
    expcache_status_t reserve(uint64_t bytes, void** out);
    // Back [at, at + bytes) of a reservation of ours, unmapped so far, with memory (both multiples
    // of the granularity): OK, or the backend's failure (nothing mapped then).
    expcache_status_t map(void* at, uint64_t bytes);
    // Give back the memory of the reservation at `base` mapped at offsets >= `from` (each mapping
    // starting there); the caller has waited for the device. False, and nothing given back, when
    // references keep the reservation.
    bool unmap_from(void* base, uint64_t from) { return unmap_range(base, from, UINT64_MAX, nullptr); }
    // unmap_from for the mappings starting in [from, to) only; *out_first (may be nullptr): the
    // offset of the first one given back, `to` when none was.
    bool unmap_range(void* base, uint64_t from, uint64_t to, uint64_t* out_first);
    // Whether references besides the arena's keep the allocation or reservation at `base`.
    bool kept(const void* base) const;
    // A pointer alloc() or reserve() did not return (or one already freed) is ignored, as is
    // nullptr. A reservation's mappings go with it.
    void free_now(void* ptr);
    // Freed once the work enqueued on `stream` so far has finished; counted as freed now.
    expcache_status_t free_after(void* ptr, void* stream);
    // Everything, now: the caller has waited for the device.
    void free_all();

    // [ptr, ptr + bytes) lies inside one allocation, or inside the mapped part of a reservation.
    bool owns(const void* ptr, uint64_t bytes) const;
    uint64_t bytes_in_use() const { return bytes_; }

    // A reference keeping alive the allocation or reservation that holds `ptr` (mapped or not);
    // false when none does.
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
        if (disowned_ != since) ask_to_let_go();
    }
    // The same callback before memory that references keep is given back (a bank's release):
    // references the caller keeps for reuse go, so that only those in use keep it.
    void ask_to_let_go() const {
        if (dropped_fn_) dropped_fn_(dropped_user_);
    }

private:
    struct Allocation {
        uint64_t bytes = 0;                // an allocation's size, a reservation's addresses
        std::shared_ptr<KeptMemory> kept;  // made by the first retain()
        bool reservation = false;
        std::map<uint64_t, uint64_t> mapped;  // a reservation's mappings: offset -> bytes
    };
    using Map = std::map<uintptr_t, Allocation>;  // by address; ordered, for owns()

    // The allocation or reservation holding [ptr, ptr + bytes), mapped or not.
    Map::const_iterator containing(const void* ptr, uint64_t bytes) const;
    static bool mapped_covers(const Allocation& a, uint64_t offset, uint64_t bytes);
    // The bytes an entry counts as in use.
    static uint64_t in_use(const Allocation& a);
    // Frees an entry's memory now (its reservation's mappings, then the range).
    void release(uintptr_t base, const Allocation& a);
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
