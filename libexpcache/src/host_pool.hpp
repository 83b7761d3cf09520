// The host pool (expcache_config_t.host_budget_bytes): a tier of pinned host RAM between a source
// the GPU cannot read (pageable memory, a file) and the device cache, holding whole experts, so
// the source serves only the pool's misses. One pool per cache, shared by its classes: one
// allocation (the staging link's pinned chunk: cudaMallocHost, plain aligned memory on the host
// backend) made by expcache_create, cut into slots of one size at its first use (the largest
// expert noted by then). A slot a reader copies from is pinned (never evicted or refilled until the
// reader lets it go), and a slot being filled is invisible to readers until its read succeeded: no
// stale or partial bytes are ever served from it.
//
// Its order is an eviction policy of the registry (policy/registry.cpp), the cache's own
// (config.policy): an instance of its own over the pool's slots, keyed by the dense (layer, expert)
// keys the classes' policies take (LayerState::key_base + expert). A fill entered is a hot insert,
// a pool hit is a hit, a valid slot freed (evicted, or forgotten with its layer) a remove; a slot
// being filled is never in the order. The victim is the policy's among the valid slots no reader
// pins. Its clock is the one the cache's serving calls run on (set_clock, token 0 before the
// first): on a host-lookup cache the host-side calls' (each call's open sets it); on a
// device-lookup cache the device's (kernels/lookup_policy.hpp), which host-side calls and device
// selects advance alike: a host-side call sets it from the token its select ran at (the select's
// tally), the feed from the token a device select lists with each miss (feed_protocol.hpp), each
// before asking the pool, as a host-side call of that layer at that token would
// (LayerTable::clock_at). Its time never runs back: a clock earlier than the last one set (by
// token, then pos; selects on streams that overlap) is ignored.
//
// Thread-safe (one mutex, the policy's calls under it too): the serving calls' thread and the
// feed's threads use it at once.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "backend/staging_ring.hpp"
#include "expcache.h"
#include "layers.hpp"
#include "policy/policy.hpp"

namespace expcache {

// Where each part of an expert of these part sizes lies in a pool slot (64-byte aligned, for
// copy_nt_wide): part_at[p]; the bytes the expert takes.
uint64_t pool_layout(const uint64_t part_bytes[kMaxParts], uint64_t part_at[kMaxParts]);

class HostPool {
public:
    // What a miss of the device cache got from the pool.
    struct Lease {
        int32_t slot = -1;            // -1: none, read past the pool
        bool hit = false;             // the expert is in the slot: read it from there
        unsigned char* at = nullptr;  // the slot's memory (a fill reads the source into it)
        uint64_t part_at[kMaxParts] = {};
    };

    // budget_bytes 0: no pool (every lease is none; the source reads are still counted). policy: the
    // EXPCACHE_POLICY_* id that orders the slots (the cache's, checked by config.cpp).
    HostPool(StagingRing::Transport& link, uint64_t budget_bytes, uint32_t policy);
    ~HostPool();
    HostPool(const HostPool&) = delete;
    HostPool& operator=(const HostPool&) = delete;

    // The budget's memory, once. Status: OK, OUT_OF_HOST_MEMORY.
    expcache_status_t allocate();
    bool enabled() const { return mem_ != nullptr; }
    // A layer of experts of these part sizes reads through the pool: slots (cut at the first use)
    // hold them. Whether such an expert fits a slot (false: its reads go past the pool).
    bool note_expert(const uint64_t part_bytes[kMaxParts]);
    // Whether the slots are cut (the first use); the largest expert that fits: a slot, or the budget before.
    bool cut() const;
    uint64_t room() const;

    // The policy's clock from now on (a host-side serving call opened, or a device select's miss
    // came), unless it is earlier than the clock set last (by token, then pos): the pool's time
    // never runs back.
    void set_clock(const PolicyClock& clock);
    // A miss of `expert` of `layer` (experts of part_bytes; `key` its policy key, the layer's
    // key_base + expert) about to be read: a hit (the slot pinned until end()), a slot to fill
    // (pinned and invisible until end()), or none. Counts the miss as a hit or a source read.
    Lease begin(uint32_t layer, uint32_t expert, uint32_t key, const uint64_t part_bytes[kMaxParts]);
    // The lease's reader is done with it: a hit's slot let go; a fill's slot entered when `ok`
    // (every byte read), else freed and counted failed. Nothing for a lease of none.
    void end(const Lease& lease, bool ok);
    // A fill whose source read is done, on the thread that read it: entered when `ok` and kept
    // pinned as a hit lease (true), else freed (false; counted failed when !ok).
    bool filled(Lease* lease, bool ok);
    // Every expert of `layer` leaves (its source may change): fills under way are not entered.
    void forget_layer(uint32_t layer);

    void stats(expcache_pool_stats_t* out) const;
    void reset_stats();

private:
    enum State : uint8_t { kFree, kFilling, kValid };
    struct Slot {
        uint64_t key = 0;  // key_of(layer, expert): its expert in map_
        uint64_t gen = 0;  // the layer's generation when it was filled (forget_layer)
        uint32_t pins = 0;
        State state = kFree;
        uint32_t policy_key = 0;  // its expert's key in the policy's order (LayerState::key_base + expert)
        bool mapped = false;      // key -> this slot in map_
    };
    static uint64_t key_of(uint32_t layer, uint32_t expert) { return uint64_t(layer) << 32 | expert; }
    void cut_slots();  // at the first use
    int32_t take();
    void enter(int32_t s);                               // a filled slot becomes valid: into the order
    void leave(int32_t s);                               // a valid slot stops being one: out of the order
    void release(int32_t s);                             // back to free, out of the map and the order
    static bool evictable(const void* pool, int32_t s);  // the policy's victims: valid, no reader
    uint64_t gen_of(uint32_t layer) const { return layer < gens_.size() ? gens_[layer] : 0; }

    StagingRing::Transport& link_;
    const uint64_t budget_;
    void* mem_ = nullptr;
    void* marker_ = nullptr;
    mutable std::mutex mu_;
    uint64_t largest_ = 0;     // the largest expert noted (pool_layout's bytes)
    uint64_t slot_bytes_ = 0;  // 0 until cut
    std::vector<Slot> slots_;
    std::vector<int32_t> free_;
    std::unique_ptr<Policy> policy_;  // orders the valid slots (none without a budget)
    PolicyClock clock_;               // the policy's
    std::unordered_map<uint64_t, int32_t> map_;
    std::vector<uint64_t> gens_;  // per layer (grown as needed)
    uint64_t resident_ = 0;
    expcache_pool_stats_t counts_ = {};
};

}  // namespace expcache
