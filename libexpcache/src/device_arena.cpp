#include "device_arena.hpp"

#include "errors.hpp"

namespace expcache {

expcache_status_t DeviceArena::alloc(uint64_t bytes, void** out) {
    void* p = nullptr;
    expcache_status_t s = backend_.alloc(bytes, &p);
    if (s != EXPCACHE_OK) return s;
    allocations_[reinterpret_cast<uintptr_t>(p)] = Allocation{bytes, nullptr};
    bytes_ += bytes;
    *out = p;
    return EXPCACHE_OK;
}

bool DeviceArena::let_go(Map::iterator it) {
    void* ptr = reinterpret_cast<void*>(it->first);
    std::shared_ptr<KeptMemory> kept = std::move(it->second.kept);
    bytes_ -= it->second.bytes;
    allocations_.erase(it);
    // Only the cache makes references (under its lock), so none appears meanwhile; one may go
    // away on another thread, which then frees the memory once disown() gave it the way.
    if (!kept || kept.use_count() == 1) return false;  // the moved-out copy is the only one
    kept->disown(backend_.disown(ptr), backend_.device_ordinal());
    ++disowned_;
    return true;
}

void DeviceArena::free_now(void* ptr) {
    auto it = allocations_.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == allocations_.end()) return;
    if (!let_go(it)) backend_.free_now(ptr);
}

expcache_status_t DeviceArena::free_after(void* ptr, void* stream) {
    auto it = allocations_.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == allocations_.end()) return EXPCACHE_OK;
    if (!kept_elsewhere(it->second)) {
        expcache_status_t s = backend_.free_after(ptr, stream);
        if (s != EXPCACHE_OK) return s;  // still ours: freed with the cache
    }
    let_go(it);  // a kept one is freed by its last reference (a CUDA free waits for the device)
    return EXPCACHE_OK;
}

void DeviceArena::free_all() {
    while (!allocations_.empty()) {
        auto it = allocations_.begin();
        void* ptr = reinterpret_cast<void*>(it->first);
        if (!let_go(it)) backend_.free_now(ptr);
    }
}

DeviceArena::Map::const_iterator DeviceArena::containing(const void* ptr, uint64_t bytes) const {
    uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
    auto it = allocations_.upper_bound(p);
    if (it == allocations_.begin()) return allocations_.end();
    --it;
    bool inside = p >= it->first && bytes <= it->second.bytes && p - it->first <= it->second.bytes - bytes;
    return inside ? it : allocations_.end();
}

bool DeviceArena::owns(const void* ptr, uint64_t bytes) const {
    return containing(ptr, bytes) != allocations_.end();
}

bool DeviceArena::retain(const void* ptr, std::shared_ptr<KeptMemory>* out) {
    auto found = containing(ptr, 1);
    if (found == allocations_.end()) return false;
    auto it = allocations_.find(found->first);  // the same entry, mutable
    if (!it->second.kept) it->second.kept = std::make_shared<KeptMemory>(reinterpret_cast<void*>(it->first));
    *out = it->second.kept;
    return true;
}

}  // namespace expcache
