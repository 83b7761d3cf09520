#include "device_arena.hpp"

#include "errors.hpp"

namespace expcache {

expcache_status_t DeviceArena::alloc(uint64_t bytes, void** out) {
    void* p = nullptr;
    expcache_status_t s = backend_.alloc(bytes, &p);
    if (s != EXPCACHE_OK) return s;
    Allocation a;
    a.bytes = bytes;
    allocations_[reinterpret_cast<uintptr_t>(p)] = std::move(a);
    bytes_ += bytes;
    *out = p;
    return EXPCACHE_OK;
}

expcache_status_t DeviceArena::reserve(uint64_t bytes, void** out) {
    const uint64_t g = granularity();
    bytes = (bytes + g - 1) / g * g;
    void* p = nullptr;
    expcache_status_t s = backend_.reserve(bytes, &p);
    if (s != EXPCACHE_OK) return s;
    Allocation a;
    a.bytes = bytes;
    a.reservation = true;
    allocations_[reinterpret_cast<uintptr_t>(p)] = std::move(a);
    *out = p;
    return EXPCACHE_OK;
}

expcache_status_t DeviceArena::map(void* at, uint64_t bytes) {
    auto found = containing(at, bytes);
    if (found == allocations_.end() || !found->second.reservation)
        return fail(EXPCACHE_ERR_INTERNAL, "map: %llu bytes at %p lie in no reservation", (unsigned long long)bytes,
                    at);
    expcache_status_t s = backend_.map(at, bytes);
    if (s != EXPCACHE_OK) return s;
    allocations_[found->first].mapped[reinterpret_cast<uintptr_t>(at) - found->first] = bytes;
    bytes_ += bytes;
    return EXPCACHE_OK;
}

bool DeviceArena::unmap_range(void* base, uint64_t from, uint64_t to, uint64_t* out_first) {
    if (out_first) *out_first = to;
    auto it = allocations_.find(reinterpret_cast<uintptr_t>(base));
    if (it == allocations_.end() || !it->second.reservation) return true;
    if (kept_elsewhere(it->second)) return false;
    auto& mapped = it->second.mapped;
    auto m = mapped.lower_bound(from);
    if (out_first && m != mapped.end() && m->first < to) *out_first = m->first;
    for (; m != mapped.end() && m->first < to; m = mapped.erase(m)) {
        backend_.unmap(static_cast<unsigned char*>(base) + m->first, m->second);
        bytes_ -= m->second;
    }
    return true;
}

bool DeviceArena::kept(const void* base) const {
    auto it = allocations_.find(reinterpret_cast<uintptr_t>(base));
    return it != allocations_.end() && kept_elsewhere(it->second);
}

uint64_t DeviceArena::in_use(const Allocation& a) {
    if (!a.reservation) return a.bytes;
    uint64_t n = 0;
    for (const auto& m : a.mapped) n += m.second;
    return n;
}

void DeviceArena::release(uintptr_t base, const Allocation& a) {
    void* ptr = reinterpret_cast<void*>(base);
    if (!a.reservation) {
        backend_.free_now(ptr);
        return;
    }
    for (const auto& m : a.mapped) backend_.unmap(static_cast<unsigned char*>(ptr) + m.first, m.second);
    backend_.unreserve(ptr, a.bytes);
}

bool DeviceArena::let_go(Map::iterator it) {
    const uintptr_t base = it->first;
    void* ptr = reinterpret_cast<void*>(base);
    Allocation a = std::move(it->second);
    bytes_ -= in_use(a);
    allocations_.erase(it);
    // Only the cache makes references (under its lock), so none appears meanwhile; one may go
    // away on another thread, which then frees the memory once disown() gave it the way.
    if (!a.kept || a.kept.use_count() == 1) {  // the moved-out copy is the only one
        release(base, a);
        return false;
    }
    const int device = backend_.device_ordinal();
    if (!a.reservation) {
        Backend::FreeFn free = backend_.disown(ptr);
        a.kept->disown([free, ptr, device] { free(ptr, device); });
    } else {
        std::vector<Backend::Mapping> mappings;
        for (const auto& m : a.mapped) mappings.push_back({static_cast<unsigned char*>(ptr) + m.first, m.second});
        Backend::UnreserveFn free = backend_.disown_reserved(ptr, a.bytes, mappings.data(), mappings.size());
        const uint64_t bytes = a.bytes;
        a.kept->disown(
            [free, ptr, bytes, mappings, device] { free(ptr, bytes, mappings.data(), mappings.size(), device); });
    }
    ++disowned_;
    return true;
}

void DeviceArena::free_now(void* ptr) {
    auto it = allocations_.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == allocations_.end()) return;
    let_go(it);
}

expcache_status_t DeviceArena::free_after(void* ptr, void* stream) {
    auto it = allocations_.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == allocations_.end()) return EXPCACHE_OK;
    if (it->second.reservation) return fail(EXPCACHE_ERR_INTERNAL, "free_after: %p is a reservation", ptr);
    if (!kept_elsewhere(it->second)) {
        expcache_status_t s = backend_.free_after(ptr, stream);
        if (s != EXPCACHE_OK) return s;  // still ours: freed with the cache
        bytes_ -= it->second.bytes;
        allocations_.erase(it);
        return EXPCACHE_OK;
    }
    let_go(it);  // a kept one is freed by its last reference (a CUDA free waits for the device)
    return EXPCACHE_OK;
}

void DeviceArena::free_all() {
    while (!allocations_.empty()) let_go(allocations_.begin());
}

DeviceArena::Map::const_iterator DeviceArena::containing(const void* ptr, uint64_t bytes) const {
    uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
    auto it = allocations_.upper_bound(p);
    if (it == allocations_.begin()) return allocations_.end();
    --it;
    bool inside = p >= it->first && bytes <= it->second.bytes && p - it->first <= it->second.bytes - bytes;
    return inside ? it : allocations_.end();
}

// The mappings cover [offset, offset + bytes) without a gap.
bool DeviceArena::mapped_covers(const Allocation& a, uint64_t offset, uint64_t bytes) {
    auto m = a.mapped.upper_bound(offset);
    if (m == a.mapped.begin()) return false;
    --m;
    uint64_t end = offset + bytes;
    while (true) {
        const uint64_t m_end = m->first + m->second;
        if (m->first > offset || m_end <= offset) return false;
        if (m_end >= end) return true;
        offset = m_end;
        if (++m == a.mapped.end()) return false;
    }
}

bool DeviceArena::owns(const void* ptr, uint64_t bytes) const {
    auto it = containing(ptr, bytes);
    if (it == allocations_.end()) return false;
    return !it->second.reservation || mapped_covers(it->second, reinterpret_cast<uintptr_t>(ptr) - it->first, bytes);
}

bool DeviceArena::retain(const void* ptr, std::shared_ptr<KeptMemory>* out) {
    auto found = containing(ptr, 1);
    if (found == allocations_.end()) return false;
    auto it = allocations_.find(found->first);  // the same entry, mutable
    if (!it->second.kept) it->second.kept = std::make_shared<KeptMemory>();
    *out = it->second.kept;
    return true;
}

}  // namespace expcache
