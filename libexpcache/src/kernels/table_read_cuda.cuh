// The select served by its table read on the GPU (lookup_kernels_cuda.cu's select_kernel): when
// every id in range is resident, the leader does the policy's hit bookkeeping and nothing else.
//
// Why it loads early. A select's time when nothing misses is a chain of reads across the device's
// memory, each waiting for the one before: the ids, their slots, then the policy's clock, each
// key's count, duel's shadow slots and OppClassLRU's tables (a class of count is a bisection over
// them, each step a read). Every block therefore loads, beside its table read and before it knows
// whether it leads, what the leader's bookkeeping reads: the policy clock and the tables (into
// shared memory), and for each thread's first id its counts and shadow slots (into registers).
// They are reads only, so a block that does not lead has changed nothing; the leader then
// computes from what it holds, and its chain is the table read's: the ids, then their slots.
// The stamps need no clock either: a select's are its number among its class's (its ticket), as
// select_base says. The select's writes (stamps, counts, the clock, the counters) wait for nothing.
#pragma once

#include "lookup_policy_cuda.cuh"

namespace expcache {

namespace table_read {

constexpr int kThreads = lookup_cuda::kThreads;

// What the leader's bookkeeping reads that is the same for every id: loaded by every block.
struct Early {
    DevicePolicyClock clock;
    OppClassTables tables;
};

// A thread's first id's policy state (i == threadIdx.x), loaded with its slot.
struct Prefetched {
    KeyCount count;         // oppclass, duel
    KeyCount shadow_count;  // duel
    int32_t shadow_slot[2];
};

static_assert(sizeof(OppClassTables) % sizeof(uint64_t) == 0, "the tables are copied in 8-byte words");

// Every thread of every block: the clock and the tables into `e` (lists kept), visible after the
// block's next barrier.
__device__ inline void load_early(const DeviceSelectArgs& a, Early& e) {
    if (!keeps_lists(a.policy)) return;
    constexpr uint32_t words = sizeof(OppClassTables) / sizeof(uint64_t);
    constexpr uint32_t mine = (words + kThreads - 1) / kThreads;
    const uint64_t* __restrict__ from = reinterpret_cast<const uint64_t*>(a.policy.tables);
    uint64_t* to = reinterpret_cast<uint64_t*>(&e.tables);
    // Every load issued before the first store, so the copy costs one read's wait, not `mine`.
    uint64_t v[mine];
#pragma unroll
    for (uint32_t k = 0; k < mine; ++k)
        if (threadIdx.x + k * kThreads < words) v[k] = __ldg(from + threadIdx.x + k * kThreads);
    if (threadIdx.x == kThreads - 1) e.clock = *a.policy.clock;
#pragma unroll
    for (uint32_t k = 0; k < mine; ++k)
        if (threadIdx.x + k * kThreads < words) to[threadIdx.x + k * kThreads] = v[k];
}

// The policy state of `key` (in range) the bookkeeping of its hit reads.
__device__ inline Prefetched prefetch(const DeviceSelectArgs& a, uint32_t key) {
    Prefetched p = {};
    if (keeps_lists(a.policy)) p.count = a.policy.counts[key];
    if (a.policy.id == EXPCACHE_POLICY_DUEL) {
        p.shadow_count = a.policy.shadow_counts[key];
        p.shadow_slot[kShadowLru] = a.policy.shadow_slot[kShadowLru][key];
        p.shadow_slot[kShadowOpp] = a.policy.shadow_slot[kShadowOpp][key];
    }
    return p;
}

// A count's use, from the count `c` held (a copy), stored back: the key's class of count.
__device__ inline int use_count(const OppClassTables& t, KeyCount c, KeyCount* at, double now) {
    const int k = oppclass_use(t, c, now);
    *at = c;
    return k;
}

// The select `index` of its class served by its table read (every id in range resident: keys and
// slots from it, `pf` this thread's first id's state, `e` the early loads): what lookup_block leaves
// when nothing misses, without its bank search: each id's slot, an id out of range reported, the
// policy clock opened, each hit (a first occurrence) counted and refreshed, in parallel (each
// touches its own key and slot), then duel's shadow requests and vote in order of first occurrence
// (serial, as in lookup_block: the shadows' victims depend on the order), the counts and the
// counters. Every policy's state ends as the lookup would leave it (lookup_rules.hpp).
__device__ inline void serve(const DeviceSelectArgs& a, const uint32_t* keys, const int32_t* slots, uint32_t* distinct,
                             const Prefetched& pf, const Early& e, uint64_t index) {
    constexpr uint8_t kNoRequest = 0xff;  // list_of: not a first occurrence in range
    static_assert(OppClassTables::kClasses < kNoRequest, "a class of count fits below kNoRequest");
    __shared__ PolicyNow now_s;
    __shared__ uint8_t list_of[EXPCACHE_MAX_SELECT];  // duel: each first occurrence's class of count
    __shared__ lookup_cuda::PolicyShared policy_s;
    const DeviceClass& c = a.cls;
    const uint32_t tid = threadIdx.x;
    const bool lists = keeps_lists(a.policy), duel = a.policy.id == EXPCACHE_POLICY_DUEL;
    const uint64_t base = select_base(index);
    if (tid == 0) {
        if (lists) {
            DevicePolicyClock clock = e.clock;
            now_s = open_clock(a, clock);
            *a.policy.clock = clock;
        } else {
            now_s = PolicyNow{0, 0, 0.0};
        }
    }
    static_assert(EXPCACHE_MAX_SELECT <= 32 * kThreads, "a thread's ids fit in one mask");
    uint32_t first = 0, mine = 0;  // bit n: the thread's n-th id is its key's first occurrence
    for (uint32_t i = tid, n = 0; i < a.count; i += blockDim.x, ++n) {
        a.out_slots[i] = slots[i];
        if (a.out_filled) a.out_filled[i] = 0;
        if (keys[i] == UINT32_MAX) {
            report_bad_id(a, i);
            continue;
        }
        bool is_first = true;
        for (uint32_t j = 0; j < i && is_first; ++j) is_first = keys[j] != keys[i];
        if (is_first) {
            first |= 1u << n;
            ++mine;
        }
    }
    if (mine) atomicAdd(distinct, mine);
    __syncthreads();  // the policy clock and the distinct count
    const PolicyNow now = now_s;
    int both = 1;  // duel: every request of this thread hits in both shadows
    for (uint32_t i = tid, n = 0; i < a.count; i += blockDim.x, ++n) {
        uint8_t list = kNoRequest;
        if (first >> n & 1u) {
            const uint32_t key = keys[i];
            const bool held = i == tid;  // its state is in pf
            const int k =
                lists ? use_count(e.tables, held ? pf.count : a.policy.counts[key], &a.policy.counts[key], now.time)
                      : 0;
            refresh_hit(a, slots[i], base + i, k, now);
            if (duel) {
                list = static_cast<uint8_t>(use_count(e.tables, held ? pf.shadow_count : a.policy.shadow_counts[key],
                                                      &a.policy.shadow_counts[key], now.time));
                both &=
                    held ? pf.shadow_slot[kShadowLru] >= 0 && pf.shadow_slot[kShadowOpp] >= 0 : in_both_shadows(a, key);
            }
        }
        if (duel) list_of[i] = list;
    }
    if (duel) {
        // Every request a hit in both shadows (the usual all-hit select): refreshes, all at once.
        if (__syncthreads_and(both)) {  // also: list_of is written
            for (uint32_t i = tid; i < a.count; i += blockDim.x) {
                if (list_of[i] == kNoRequest) continue;
                if (i == tid)
                    shadows_hit_at(a, pf.shadow_slot, base + i, list_of[i], now);
                else
                    shadows_hit(a, keys[i], base + i, list_of[i], now);
            }
        } else {
            for (uint32_t i = 0; i < a.count; ++i)  // uniform: every thread reads the same shared flags
                if (list_of[i] != kNoRequest)
                    lookup_cuda::duel_request(a, keys[i], base + i, list_of[i], now, policy_s);
        }
    }
    if (tid == 0) {
        const uint32_t hits = *distinct;
        *c.miss_count = 0;
        write_counts(a, hits, 0, hits, 0, now.token);
        auto add = [](uint64_t* to, uint64_t v) { atomicAdd(reinterpret_cast<unsigned long long*>(to), v); };
        if (!a.host_call) {
            add(&c.counters->calls, 1);
            if (hits) add(&c.counters->hits, hits);
            add(&c.handoff->table_reads, 1);
        }
    }
}

}  // namespace table_read

}  // namespace expcache
