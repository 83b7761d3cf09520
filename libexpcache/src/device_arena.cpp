#include "device_arena.hpp"

#include "errors.hpp"

namespace expcache {

expcache_status_t DeviceArena::alloc(uint64_t bytes, void** out) {
    if (inject_count_ > 0) {
        if (inject_skip_ > 0) {
            --inject_skip_;
        } else {
            --inject_count_;
            return fail(EXPCACHE_ERR_OUT_OF_DEVICE_MEMORY, "injected device allocation failure (%llu bytes)",
                        (unsigned long long)bytes);
        }
    }
    void* p = nullptr;
    expcache_status_t s = backend_.alloc(bytes, &p);
    if (s != EXPCACHE_OK) return s;
    allocations_[reinterpret_cast<uintptr_t>(p)] = bytes;
    bytes_ += bytes;
    *out = p;
    return EXPCACHE_OK;
}

void DeviceArena::free_now(void* ptr) {
    auto it = allocations_.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == allocations_.end()) return;
    bytes_ -= it->second;
    allocations_.erase(it);
    backend_.free_now(ptr);
}

expcache_status_t DeviceArena::free_after(void* ptr, void* stream) {
    auto it = allocations_.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == allocations_.end()) return EXPCACHE_OK;
    expcache_status_t s = backend_.free_after(ptr, stream);
    if (s != EXPCACHE_OK) return s;  // still ours: freed with the cache
    bytes_ -= it->second;
    allocations_.erase(it);
    return EXPCACHE_OK;
}

void DeviceArena::free_all() {
    for (auto& kv : allocations_) backend_.free_now(reinterpret_cast<void*>(kv.first));
    allocations_.clear();
    bytes_ = 0;
}

bool DeviceArena::owns(const void* ptr, uint64_t bytes) const {
    uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
    auto it = allocations_.upper_bound(p);
    if (it == allocations_.begin()) return false;
    --it;
    return p >= it->first && bytes <= it->second && p - it->first <= it->second - bytes;
}

void DeviceArena::inject_failures(uint64_t skip, uint64_t count) {
    inject_skip_ = count ? skip : 0;
    inject_count_ = count;
}

}  // namespace expcache
