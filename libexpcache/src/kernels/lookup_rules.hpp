// The per-id rules of a device select, one source for both implementations (the CUDA kernel,
// lookup_kernels_cuda.cu with lookup_policy_cuda.cuh and table_read_cuda.cuh, and the host
// backend's, lookup_kernels_host.cpp): an id's key and the report of one out of range, the call's
// own counts, the policy clock, a key's count, a hit's refresh, the rank of a slot as a victim, a
// miss's install and duel's shadows. Each implementation only orders these steps (the host in a
// loop, the GPU with a block's threads and reductions), in the order the host's policy sees the
// same select (slots.cpp): the hits in order of first occurrence, then each miss in that order,
// its victim chosen when it comes; duel's shadows see each hit and each insert.
#pragma once

#include <cstdint>

#include "lookup_kernels.hpp"
#include "policy/duel_vote.hpp"
#include "policy/oppclass_count.hpp"

namespace expcache {

static_assert(EXPCACHE_POLICY_COUNT == 3,
              "a new policy runs in the device lookup too: give it its rules here (the kernels choose by "
              "DevicePolicyArgs::id) or refuse it for lookup device in config.cpp");

// Where the engine is, for the policy: the select's token, its layer's position, the time.
struct PolicyNow {
    int32_t token;
    int32_t pos;
    double time;
};

// Id i of the select (int32 or int64, as id_bits says).
EXPCACHE_HOST_DEVICE inline int64_t id_at(const DeviceSelectArgs& a, uint32_t i) {
    return a.id_bits == 64 ? static_cast<const int64_t*>(a.ids)[i] : static_cast<const int32_t*>(a.ids)[i];
}

// Id i of the select as a key (key_base + id), UINT32_MAX when the id is out of range: no slot,
// and reported (report_bad_id).
EXPCACHE_HOST_DEVICE inline uint32_t key_of(const DeviceSelectArgs& a, uint32_t i) {
    const int64_t id = id_at(a, i);
    return id < 0 || id >= static_cast<int64_t>(a.num_experts) ? UINT32_MAX : a.key_base + static_cast<uint32_t>(id);
}

// Id i is out of range: kept in a.error unless an earlier one is there, for the host to report. On
// the GPU the first thread to set the flag writes it.
EXPCACHE_HOST_DEVICE inline void report_bad_id(const DeviceSelectArgs& a, uint32_t i) {
    const int64_t id = id_at(a, i);
#ifdef __CUDA_ARCH__
    if (atomicCAS(&a.error->set, 0u, 1u) != 0u) return;
    a.error->layer = a.layer;
    a.error->index = i;
    a.error->id = id;
#else
    if (!a.error->set) *a.error = DeviceError{1, a.layer, i, 0, id};
#endif
}

// What a select writes of its own counts (DeviceSelectArgs::out_counts, when asked for): its
// distinct ids in range and its misses; a host-side call's also its hits, evictions and the
// token of the policy clock it ran at (PolicyNow::token).
EXPCACHE_HOST_DEVICE inline void write_counts(const DeviceSelectArgs& a, uint32_t distinct, uint32_t misses,
                                              uint32_t hits, uint32_t evictions, int32_t token) {
    if (!a.out_counts) return;
    a.out_counts[kCountDistinct] = distinct;
    a.out_counts[kCountMisses] = misses;
    if (!a.host_call) return;
    a.out_counts[kTallyHits] = hits;
    a.out_counts[kTallyEvictions] = evictions;
    a.out_counts[kTallyToken] = static_cast<uint32_t>(token);
}

// Whether the policy keeps OppClassLRU's lists (and so counts its keys' uses).
EXPCACHE_HOST_DEVICE inline bool keeps_lists(const DevicePolicyArgs& p) {
    return p.id == EXPCACHE_POLICY_OPPCLASS || p.id == EXPCACHE_POLICY_DUEL;
}

// A select opens the policy clock `c` (the policy's, or a copy the caller loaded early and stores
// back): it advances as the host's does for a serving call (not for a later piece of one host-side
// call).
EXPCACHE_HOST_DEVICE inline PolicyNow open_clock(const DeviceSelectArgs& a, DevicePolicyClock& c) {
    if (a.open_clock && (c.last_layer < 0 || static_cast<int64_t>(a.layer) <= c.last_layer)) ++c.token;
    c.last_layer = a.layer;
    return PolicyNow{c.token, a.policy.pos, oppclass_time(c.token, a.policy.pos, a.policy.positions)};
}

EXPCACHE_HOST_DEVICE inline PolicyNow open_select(const DeviceSelectArgs& a) {
    return keeps_lists(a.policy) ? open_clock(a, *a.policy.clock) : PolicyNow{0, 0, 0.0};
}

// A request of `key` (a hit or a demand insert): its use counted; returns its class (0 for LRU).
EXPCACHE_HOST_DEVICE inline int count_use(const DeviceSelectArgs& a, uint32_t key, const PolicyNow& now) {
    return keeps_lists(a.policy) ? oppclass_use(*a.policy.tables, a.policy.counts[key], now.time) : 0;
}

// duel's OppClassLRU shadow counts a request of `key` in a count of its own, as the host's shadow
// does (duel.cpp: a batch's append counts in the real order alone, so the two part after a
// prefill); returns the class of count the shadow places the key in.
EXPCACHE_HOST_DEVICE inline int shadow_count_use(const DeviceSelectArgs& a, uint32_t key, const PolicyNow& now) {
    return oppclass_use(*a.policy.tables, a.policy.shadow_counts[key], now.time);
}

// Slot s of an order (the bank's, or a shadow's) takes its last use now: stamp, and with lists its
// list k and the clock. The hot end of its list, as the host's on_hit and on_insert(hot).
EXPCACHE_HOST_DEVICE inline void place(uint64_t* stamps, const DeviceOppSlots& opp, bool lists, int32_t s,
                                       uint64_t stamp, int k, const PolicyNow& now) {
    stamps[s] = stamp;
    if (!lists) return;
    opp.cls[s] = static_cast<uint8_t>(k);
    opp.tok[s] = now.token;
    opp.pos[s] = now.pos;
}

// A victim candidate; slot -1 is none. free (list -1) goes first, lowest slot first, as the
// host's free list; then the order's: OppClassLRU's larger score, lower list, older stamp; LRU's
// older stamp (score 0, list 0); then the lower slot.
struct Candidate {
    double score;
    uint64_t stamp;
    int32_t slot;
    int32_t list;
};

EXPCACHE_HOST_DEVICE inline Candidate no_candidate() {
    return Candidate{0.0, 0, -1, 0};
}

EXPCACHE_HOST_DEVICE inline bool goes_first(const Candidate& a, const Candidate& b) {
    if (a.slot < 0 || b.slot < 0) return a.slot >= 0 && b.slot < 0;
    const bool a_free = a.list < 0, b_free = b.list < 0;
    if (a_free != b_free) return a_free;
    if (!a_free) {
        if (a.score != b.score) return a.score > b.score;
        if (a.list != b.list) return a.list < b.list;
        if (a.stamp != b.stamp) return a.stamp < b.stamp;
    }
    return a.slot < b.slot;
}

// Slot s of an order as a candidate: by OppClassLRU's lists (`lists`) or by LRU.
EXPCACHE_HOST_DEVICE inline Candidate ranked(const DevicePolicyArgs& p, const uint64_t* stamps,
                                             const DeviceOppSlots& opp, bool lists, int32_t s, const PolicyNow& now) {
    Candidate c{0.0, stamps[s], s, 0};
    if (lists) {
        c.list = opp.cls[s];
        c.score = oppclass_score(*p.tables, oppclass_missed(now.token, now.pos, opp.tok[s], opp.pos[s]), c.list);
    }
    return c;
}

// Whose order picks the bank's victims now: OppClassLRU's (oppclass; duel while its counter says so).
EXPCACHE_HOST_DEVICE inline bool victims_by_lists(const DeviceSelectArgs& a) {
    if (a.policy.id == EXPCACHE_POLICY_DUEL) return duel_follows_oppclass(a.cls.policy.duel->psel);
    return a.policy.id == EXPCACHE_POLICY_OPPCLASS;
}

// Bank slot s as the victim of a miss of the select whose stamps start at `base`: none when a
// batch pins it or this select uses it (stamp >= base); a free slot first.
EXPCACHE_HOST_DEVICE inline Candidate slot_candidate(const DeviceSelectArgs& a, uint32_t s, uint64_t base, bool lists,
                                                     const PolicyNow& now) {
    const DeviceClass& c = a.cls;
    if (c.pin[s]) return no_candidate();
    if (c.key_of_slot[s] < 0) return Candidate{0.0, 0, static_cast<int32_t>(s), -1};
    if (c.stamp[s] >= base || a.mode == kModeAppend) return no_candidate();  // a batch never evicts
    return ranked(a.policy, c.stamp, c.policy.opp, lists, static_cast<int32_t>(s), now);
}

// A hit in bank slot s, its key of class k: refreshed (the request's stamp).
EXPCACHE_HOST_DEVICE inline void refresh_hit(const DeviceSelectArgs& a, int32_t s, uint64_t stamp, int k,
                                             const PolicyNow& now) {
    place(a.cls.stamp, a.cls.policy.opp, keeps_lists(a.policy), s, stamp, k, now);
}

// A miss of `key` (class k) into bank slot v, the policy's victim: the expert it held (if any)
// leaves, the key enters at its list's hot end, the copy is listed. Returns whether it evicted.
EXPCACHE_HOST_DEVICE inline bool install_miss(const DeviceSelectArgs& a, int32_t v, uint32_t key, uint64_t stamp, int k,
                                              const PolicyNow& now, uint32_t miss_index) {
    const DeviceClass& c = a.cls;
    const int32_t old = c.key_of_slot[v];
    if (old >= 0) a.slot_of_key[old] = -1;
    c.key_of_slot[v] = static_cast<int32_t>(key);
    a.slot_of_key[key] = v;
    place(c.stamp, c.policy.opp, keeps_lists(a.policy), v, stamp, k, now);
    c.misses[miss_index] = DeviceMiss{key - a.key_base, v};
    if (old < 0) ++*c.resident;
    if (a.policy.id == EXPCACHE_POLICY_DUEL && old < 0) {  // DuelPolicy::grew (an eviction is a remove and an insert)
        DeviceDuel& d = *c.policy.duel;
        if (++d.resident > d.room) d.room = d.resident;
    }
    return old >= 0;
}

// Slot s of class c forgets its expert (a release): out of the slot map, the slot free. The policy's
// counts and duel's shadows stay, as the host's policy keeps them.
EXPCACHE_HOST_DEVICE inline void clear_slot(const DeviceClass& c, int32_t* slot_of_key, uint32_t s) {
    const int32_t key = c.key_of_slot[s];
    if (key < 0) return;
    slot_of_key[key] = -1;
    c.key_of_slot[s] = -1;
}

// After every slot of class c is cleared: nothing resident (duel's room and counter stay).
EXPCACHE_HOST_DEVICE inline void cleared(const DeviceClass& c) {
    *c.resident = 0;
    if (c.policy.duel) c.policy.duel->resident = 0;
}

// Slot s of class c forgets its expert, whose bytes never came (a fed miss whose read failed:
// feed_protocol.hpp): free again, the resident counts with it, so the next select reads it again.
EXPCACHE_HOST_DEVICE inline void forget_slot(const DeviceClass& c, int32_t* slot_of_key, uint32_t s) {
    if (c.key_of_slot[s] < 0) return;
    clear_slot(c, slot_of_key, s);
    *c.resident -= 1;
    if (c.policy.duel) c.policy.duel->resident -= 1;
}

// The first occurrence of `key` in a select, found in bank slot `slot` (-1: not resident), as the
// host's call sees it: a decode counts every use and refreshes a hit; a compact load (kModeLend)
// only its hits; a batch (kModeAppend) pins a hit and leaves its recency alone, and counts a miss
// only when it takes a slot (fill_miss). Returns the key's class of count.
EXPCACHE_HOST_DEVICE inline int first_use(const DeviceSelectArgs& a, uint32_t key, int32_t slot, uint64_t stamp,
                                          const PolicyNow& now) {
    if (a.mode == kModeAppend) {
        if (slot >= 0) a.cls.pin[slot] = 1;
        return 0;
    }
    if (slot < 0 && a.mode == kModeLend) return 0;
    const int k = count_use(a, key, now);
    if (slot >= 0) refresh_hit(a, slot, stamp, k, now);
    return k;
}

// Whether the select's misses take slots (a compact load's never do).
EXPCACHE_HOST_DEVICE inline bool fills_misses(const DeviceSelectArgs& a) {
    return a.mode != kModeLend;
}

// Whether duel's shadows see the select's requests (a batch's appends are not requests).
EXPCACHE_HOST_DEVICE inline bool requests_shadows(const DeviceSelectArgs& a) {
    return a.policy.id == EXPCACHE_POLICY_DUEL && a.mode != kModeAppend;
}

// A miss of `key` (class *k) given bank slot v: a decode's enters at its list's hot end with
// `stamp`; a batch's is counted, enters list 0's cold end as if never used, and is pinned.
// Returns whether it evicted.
EXPCACHE_HOST_DEVICE inline bool fill_miss(const DeviceSelectArgs& a, int32_t v, uint32_t key, uint64_t stamp, int* k,
                                           const PolicyNow& now, uint32_t miss_index) {
    if (a.mode != kModeAppend) return install_miss(a, v, key, stamp, *k, now, miss_index);
    count_use(a, key, now);
    *k = 0;
    a.cls.pin[v] = 1;
    const PolicyNow cold = {OppClassTables::kNever, 0, now.time};
    return install_miss(a, v, key, --*a.cold_clock, 0, cold, miss_index);
}

// Shadow j's slot s as its victim (a shadow evicts any of its keys).
EXPCACHE_HOST_DEVICE inline Candidate shadow_candidate(const DeviceSelectArgs& a, int j, int32_t s,
                                                       const PolicyNow& now) {
    const DeviceShadow& sh = a.cls.policy.shadow[j];
    return ranked(a.policy, sh.stamp, sh.opp, j == kShadowOpp, s, now);
}

// Whether `key` is in both of duel's shadows: its request would hit in both, a refresh of its two
// shadow slots that moves neither the counter nor any other key.
EXPCACHE_HOST_DEVICE inline bool in_both_shadows(const DeviceSelectArgs& a, uint32_t key) {
    return a.policy.shadow_slot[kShadowLru][key] >= 0 && a.policy.shadow_slot[kShadowOpp][key] >= 0;
}

// A request that hits in both shadows (in_both_shadows), in their slots `slot`: both refreshed.
EXPCACHE_HOST_DEVICE inline void shadows_hit_at(const DeviceSelectArgs& a, const int32_t slot[2], uint64_t stamp, int k,
                                                const PolicyNow& now) {
    for (int j = 0; j < 2; ++j) {
        const DeviceShadow& sh = a.cls.policy.shadow[j];
        place(sh.stamp, sh.opp, j == kShadowOpp, slot[j], stamp, k, now);
    }
}

// A request of `key` that hits in both shadows (in_both_shadows): both refreshed.
EXPCACHE_HOST_DEVICE inline void shadows_hit(const DeviceSelectArgs& a, uint32_t key, uint64_t stamp, int k,
                                             const PolicyNow& now) {
    const int32_t slot[2] = {a.policy.shadow_slot[kShadowLru][key], a.policy.shadow_slot[kShadowOpp][key]};
    shadows_hit_at(a, slot, stamp, k, now);
}

// A request of `key` (class k, stamp `stamp`) to shadow j (duel.cpp's Shadow::request): true for a
// hit, refreshed. On a miss *fill is the slot the key takes: a new one while the shadow holds fewer
// keys than the room, else -1: the caller finds the shadow's victim and calls shadow_fill with it.
EXPCACHE_HOST_DEVICE inline bool shadow_lookup(const DeviceSelectArgs& a, int j, uint32_t key, uint64_t stamp, int k,
                                               const PolicyNow& now, int32_t* fill) {
    const DeviceShadow& sh = a.cls.policy.shadow[j];
    DeviceDuel& d = *a.cls.policy.duel;
    const int32_t s = a.policy.shadow_slot[j][key];
    if (s >= 0) {
        place(sh.stamp, sh.opp, j == kShadowOpp, s, stamp, k, now);
        return true;
    }
    *fill = d.held[j] < d.room ? d.held[j]++ : -1;
    return false;
}

// The missing key takes shadow slot s (new, or the victim, whose key the shadow forgets).
EXPCACHE_HOST_DEVICE inline void shadow_fill(const DeviceSelectArgs& a, int j, int32_t s, uint32_t key, uint64_t stamp,
                                             int k, const PolicyNow& now) {
    const DeviceShadow& sh = a.cls.policy.shadow[j];
    if (sh.key[s] >= 0) a.policy.shadow_slot[j][sh.key[s]] = -1;
    sh.key[s] = static_cast<int32_t>(key);
    a.policy.shadow_slot[j][key] = s;
    place(sh.stamp, sh.opp, j == kShadowOpp, s, stamp, k, now);
}

// Both shadows saw the request: the counter moves toward the one that hit alone.
EXPCACHE_HOST_DEVICE inline void vote(const DeviceSelectArgs& a, bool lru_hit, bool opp_hit) {
    duel_vote(a.cls.policy.duel->psel, lru_hit, opp_hit);
}

}  // namespace expcache
