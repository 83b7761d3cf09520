// Eviction policy interface: one file per policy, listed in the table of
// registry.cpp, chosen per cache at create time. A policy orders a class's resident slots, or the host
// pool's (host_pool.hpp: an instance of the cache's policy); the core decides which slots may be
// evicted (not used by the current call, not held; in the pool, not being read).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace expcache {

// Where the engine is: token counts calls that start a new token (a call
// whose layer is not after the previous call's), pos is the layer's rank
// among the registered MoE layers, positions their number.
struct PolicyClock {
    int32_t token = 0;
    int32_t pos = 0;
    int32_t positions = 1;
};

class Policy {
public:
    using Evictable = bool (*)(const void* ctx, int32_t slot);

    virtual ~Policy() = default;
    // Slots are numbered 0..n-1; called when a class grows.
    virtual void resize(int32_t num_slots) = 0;
    // Called at the start of every serving call, before any other hook.
    virtual void set_clock(const PolicyClock&) {}
    // A slot now holds expert `key` (a dense (layer, expert) index, stable for
    // the cache's life). `cold`: it should be among the first to go (prefill
    // appends), else it is the most recently used.
    virtual void on_insert(int32_t slot, bool cold, uint32_t key) = 0;
    virtual void on_hit(int32_t slot) = 0;
    // A hint: the slot's expert is expected soon. By default a hit.
    virtual void on_hint(int32_t slot) { on_hit(slot); }
    // A prefetch put expert `key` here: among the first to go until a use. By default a cold insert.
    virtual void on_prefetch(int32_t slot, uint32_t key) { on_insert(slot, true, key); }
    virtual void on_remove(int32_t slot) = 0;
    // The expert of slot `from` now lives in free slot `to` (a class shrinking packs its residents
    // below its new cap): `to` takes `from`'s place in every order the policy keeps, nothing else
    // moves, and `from` is free.
    virtual void move(int32_t from, int32_t to) = 0;
    // The slot to evict next among those `evictable` accepts, or -1.
    virtual int32_t victim(Evictable evictable, const void* ctx) const = 0;
    // Forget every slot (a host-lookup class's release).
    virtual void clear() = 0;
};

// The policy table (registry.cpp), by EXPCACHE_POLICY_* id.
const char* policy_name(uint32_t id);              // nullptr for an unknown id
std::string policy_list();                         // "0 lru, 1 oppclass", for messages
std::unique_ptr<Policy> make_policy(uint32_t id);  // a known id (config.cpp checked it)

}  // namespace expcache
