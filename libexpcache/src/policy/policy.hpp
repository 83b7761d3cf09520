// Eviction policy interface: one file per policy, chosen per cache at
// create time. A policy orders a class's resident slots; the core decides
// which slots may be evicted (not used by the current call, not held).
#pragma once

#include <cstdint>
#include <memory>

namespace expcache {

class Policy {
public:
    using Evictable = bool (*)(const void* ctx, int32_t slot);

    virtual ~Policy() = default;
    // Slots are numbered 0..n-1; called when a class grows.
    virtual void resize(int32_t num_slots) = 0;
    // A slot now holds an expert. `cold`: it should be among the first to
    // go (prefill appends), else it is the most recently used.
    virtual void on_insert(int32_t slot, bool cold) = 0;
    virtual void on_hit(int32_t slot) = 0;
    virtual void on_remove(int32_t slot) = 0;
    // The slot to evict next among those `evictable` accepts, or -1.
    virtual int32_t victim(Evictable evictable, const void* ctx) const = 0;
    // Forget every slot.
    virtual void clear() = 0;
};

std::unique_ptr<Policy> make_lru_policy();

}  // namespace expcache
