// Every byte of device memory a cache holds, by address: so that
// device_bytes_in_use is exact, a pointer a caller hands back (read_device,
// checksum) can be proven to lie inside memory the cache allocated, and
// destruction frees everything. Injected allocation failures are decided here,
// in front of the backend, so every allocation site sees them alike.
//
// It knows nothing of the cache: statuses come back as the backend gave them,
// and the cache decides what a failure means (poisoning, releasing its expert
// caches and retrying, the message it adds).
#pragma once

#include <cstdint>
#include <map>

#include "backend/backend.hpp"
#include "expcache.h"

namespace expcache {

class DeviceArena {
public:
    explicit DeviceArena(Backend& backend) : backend_(backend) {}
    DeviceArena(const DeviceArena&) = delete;
    DeviceArena& operator=(const DeviceArena&) = delete;

    // OK, or the backend's failure; an injected failure is OUT_OF_DEVICE_MEMORY.
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

    // The allocations after the next `skip` fail, `count` of them; count 0 disarms.
    void inject_failures(uint64_t skip, uint64_t count);

private:
    Backend& backend_;
    std::map<uintptr_t, uint64_t> allocations_;  // address -> bytes; ordered, for owns()
    uint64_t bytes_ = 0;
    uint64_t inject_skip_ = 0, inject_count_ = 0;
};

}  // namespace expcache
