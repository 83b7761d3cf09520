// The lookup kernel's policy steps on the GPU (lookup_kernels_cuda.cu): the rules of
// lookup_rules.hpp in the host's order, one block wide. Every function here is called by all the
// block's threads with the same arguments (they read shared memory written before a barrier);
// thread 0 makes the scalar updates, all threads take part in a victim's reduction.
#pragma once

#include "lookup_rules.hpp"

namespace expcache {

namespace lookup_cuda {

constexpr int kThreads = 256;

// What the policy steps share between the block's threads.
struct PolicyShared {
    Candidate warp_best[kThreads / 32];
    int32_t fill;
};

__device__ inline Candidate warp_best(Candidate v) {
    for (int off = 16; off > 0; off >>= 1) {
        Candidate o;
        o.score = __shfl_down_sync(0xffffffffu, v.score, off);
        o.stamp = __shfl_down_sync(0xffffffffu, v.stamp, off);
        o.slot = __shfl_down_sync(0xffffffffu, v.slot, off);
        o.list = __shfl_down_sync(0xffffffffu, v.list, off);
        if (goes_first(o, v)) v = o;
    }
    return v;
}

// The best of the threads' candidates, to every thread.
__device__ inline Candidate block_best(Candidate v, PolicyShared& sh) {
    v = warp_best(v);
    if ((threadIdx.x & 31) == 0) sh.warp_best[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (uint32_t w = 1; w < blockDim.x / 32; ++w)
            if (goes_first(sh.warp_best[w], v)) v = sh.warp_best[w];
        sh.warp_best[0] = v;
    }
    __syncthreads();
    const Candidate best = sh.warp_best[0];
    __syncthreads();  // warp_best is written again by the next reduction
    return best;
}

// The bank's victim for a miss of the select whose stamps start at `base`.
__device__ inline int32_t bank_victim(const DeviceSelectArgs& a, uint64_t base, const PolicyNow& now,
                                      PolicyShared& sh) {
    const bool lists = victims_by_lists(a);
    Candidate best = no_candidate();
    for (uint32_t s = threadIdx.x; s < a.cls.cap; s += blockDim.x) {
        const Candidate c = slot_candidate(a, s, base, lists, now);
        if (goes_first(c, best)) best = c;
    }
    return block_best(best, sh).slot;
}

// One request to shadow j; true for a hit (the same on every thread).
__device__ inline bool shadow_request(const DeviceSelectArgs& a, int j, uint32_t key, uint64_t stamp, int k,
                                      const PolicyNow& now, PolicyShared& sh) {
    if (threadIdx.x == 0) {
        int32_t fill = -1;
        sh.fill = shadow_lookup(a, j, key, stamp, k, now, &fill) ? -2 : fill;
    }
    __syncthreads();
    int32_t fill = sh.fill;
    __syncthreads();  // sh.fill is written again by the next request
    if (fill == -2) return true;
    if (fill < 0) {
        Candidate best = no_candidate();
        const int32_t held = a.cls.policy.duel->held[j];
        for (int32_t s = threadIdx.x; s < held; s += blockDim.x) {
            const Candidate c = shadow_candidate(a, j, s, now);
            if (goes_first(c, best)) best = c;
        }
        fill = block_best(best, sh).slot;
    }
    if (threadIdx.x == 0) shadow_fill(a, j, fill, key, stamp, k, now);
    __syncthreads();
    return false;
}

// duel: the requests of a select's hits (first[i] == i, slot_at[i] >= 0), when every one of them
// hits in both shadows: they refresh distinct shadow slots and leave the counter alone, so they are
// made at once, each thread its own; returns false (nothing done) otherwise. All threads call it.
__device__ inline bool shadows_all_hit(const DeviceSelectArgs& a, const uint32_t* keys, const uint32_t* first,
                                       const int32_t* slot_at, uint64_t base, const uint8_t* list_of,
                                       const PolicyNow& now) {
    int both = 1;
    for (uint32_t i = threadIdx.x; i < a.count; i += blockDim.x)
        if (first[i] == i && slot_at[i] >= 0) both &= in_both_shadows(a, keys[i]);
    if (!__syncthreads_and(both)) return false;
    for (uint32_t i = threadIdx.x; i < a.count; i += blockDim.x)
        if (first[i] == i && slot_at[i] >= 0) shadows_hit(a, keys[i], base + i, list_of[i], now);
    __syncthreads();
    return true;
}

// duel: a request both shadows see, then the vote.
__device__ inline void duel_request(const DeviceSelectArgs& a, uint32_t key, uint64_t stamp, int k,
                                    const PolicyNow& now, PolicyShared& sh) {
    const bool lru_hit = shadow_request(a, kShadowLru, key, stamp, k, now, sh);
    const bool opp_hit = shadow_request(a, kShadowOpp, key, stamp, k, now, sh);
    if (threadIdx.x == 0) vote(a, lru_hit, opp_hit);
    __syncthreads();
}

}  // namespace lookup_cuda

}  // namespace expcache
