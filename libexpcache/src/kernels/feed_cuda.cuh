// The select kernel's side of the feed (feed_protocol.hpp) on the CUDA backend: the leader lists
// each miss for the feed threads; every block copies claimed chunks of each miss out of its row
// as their pieces are ready; the leader frees the slots whose read failed. Included by
// lookup_kernels_cuda.cu only.
#pragma once

#include <cuda/atomic>

#include "feed_protocol.hpp"
#include "lookup_kernels.hpp"
#include "lookup_rules.hpp"

namespace expcache {
namespace feed_cuda {

using SysWord = cuda::atomic_ref<uint64_t, cuda::thread_scope_system>;
using DevWord = cuda::atomic_ref<uint32_t, cuda::thread_scope_device>;
using DevWide = cuda::atomic_ref<uint64_t, cuda::thread_scope_device>;

__device__ inline uint64_t now_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// The leader's thread 0, when a select starts: no miss done yet.
__device__ inline void open(const DeviceFeed& f) {
    *f.done = 0;
    *f.failed_n = 0;
}

// The leader's thread 0: miss m (expert `expert` of `layer`, the select's policy token `token`)
// listed for the feed threads, its chunk counters reset first (no block looks at them before the
// miss is published).
__device__ inline void list(const DeviceFeed& f, uint32_t layer, uint32_t expert, int32_t token, uint32_t m,
                            uint64_t done) {
    f.claim[m] = 0;
    f.completed[m] = 0;
    volatile FeedEntry* e = &f.box->entry[m];
    e->layer = layer;
    e->expert = expert;
    e->token = token;
    SysWord(f.box->listed).store(done | (m + 1), cuda::memory_order_release);
}

// Thread 0 of a block needing piece q of part p in row r for the miss `tag`: its ready word (the
// tag, kFeedFailed set when the read failed) and, in *delta, where its bytes start in its region.
// The first block there polls the word across the link and mirrors both in device memory, where
// the others poll, so each piece crosses the link for its words once.
__device__ inline uint64_t wait_piece(const DeviceFeed& f, uint32_t r, int p, uint32_t q, uint64_t tag,
                                      uint64_t* delta) {
    const uint32_t at = (r * EXPCACHE_MAX_PARTS + p) * kFeedPieces + q;
    DevWide mirror(f.mirror[at]);
    if (atomicMax(reinterpret_cast<unsigned long long*>(f.watch + at), tag) < tag) {
        const uint64_t start = now_ns();
        uint64_t found = tag | kFeedFailed;  // after kFeedTimeoutNs
        while (now_ns() - start < kFeedTimeoutNs) {
            const uint64_t w = SysWord(f.box->ready[r][p][q]).load(cuda::memory_order_acquire);
            if ((w & ~kFeedFailed) == tag) {
                found = w;
                break;
            }
            __nanosleep(256);
        }
        // Written by the thread before the ready word it released, which was acquired.
        *delta = found & kFeedFailed ? 0 : *static_cast<volatile const uint64_t*>(&f.box->delta[r][p][q]);
        f.mirror_delta[at] = *delta;
        mirror.store(found, cuda::memory_order_release);
        return found;
    }
    uint64_t w;
    while (((w = mirror.load(cuda::memory_order_acquire)) & ~kFeedFailed) != tag) __nanosleep(64);
    // Stored before the mirror, which was acquired; rewritten only for the row's next miss, after
    // this one is consumed.
    *delta = f.mirror_delta[at];
    return w;
}

// Bytes [at, at + n) of one part, row to slot, by the block: 16-byte loads past every cache
// (__ldcv: the row is rewritten by the host between misses) where both ends allow them.
__device__ inline void copy_chunk(unsigned char* dst, const unsigned char* src, uint64_t n) {
    constexpr int kUnroll = 4;
    const uint32_t tid = threadIdx.x;
    if ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | n) % 16 == 0) {
        const uint4* s4 = reinterpret_cast<const uint4*>(src);
        uint4* d4 = reinterpret_cast<uint4*>(dst);
        const uint32_t words = static_cast<uint32_t>(n / 16);
        uint4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            if (tid + u * blockDim.x < words) v[u] = __ldcv(s4 + tid + u * blockDim.x);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            if (tid + u * blockDim.x < words) d4[tid + u * blockDim.x] = v[u];
        return;
    }
    for (uint32_t b = tid; b < n; b += blockDim.x) dst[b] = __ldcv(src + b);
}

// Every block's share of the fed misses [from, to) of the select whose number is `done`: chunks
// of kFeedChunk bytes claimed one at a time (so the copy never waits for a block not running),
// each copied once its piece is ready.
__device__ inline void copy_misses(const DeviceSelectArgs& a, uint32_t from, uint32_t to, uint64_t done) {
    static_assert(kFeedChunk == 16 * 4 * 256, "a chunk is one pass of a block of 256 threads");
    __shared__ uint32_t chunk_s;
    __shared__ uint64_t ready_s, delta_s;
    const DeviceClass& c = a.cls;
    const DeviceFeed& f = c.feed;
    const uint32_t tid = threadIdx.x;
    uint32_t chunks[EXPCACHE_MAX_PARTS], total = 0;
    for (int p = 0; p < EXPCACHE_MAX_PARTS; ++p)
        total += chunks[p] = static_cast<uint32_t>((a.part_bytes[p] + kFeedChunk - 1) / kFeedChunk);
    if (total == 0) total = 1;  // parts of no bytes: one empty chunk marks the miss done
    for (uint32_t m = from; m < to; ++m) {
        const uint32_t r = m % kFeedRows;
        const uint64_t tag = done | m;
        const int32_t slot = static_cast<int32_t>(__ldcg(reinterpret_cast<const uint2*>(c.misses + m)).y);
        const unsigned char* row = f.rows + uint64_t(r) * f.row_bytes;
        for (;;) {
            if (tid == 0) chunk_s = atomicAdd(&f.claim[m], 1u);
            __syncthreads();
            uint32_t ch = chunk_s;
            if (ch >= total) break;  // uniform: every thread read the same chunk
            int p = 0;
            while (p < EXPCACHE_MAX_PARTS - 1 && ch >= chunks[p]) ch -= chunks[p++];
            const uint64_t at = uint64_t(ch) * kFeedChunk;  // within the part
            const uint32_t q = static_cast<uint32_t>(at / f.piece);
            if (tid == 0 && a.part_bytes[p]) ready_s = wait_piece(f, r, p, q, tag, &delta_s);
            __syncthreads();
            if (a.part_bytes[p] && !(ready_s & kFeedFailed)) {
                const uint64_t n = a.part_bytes[p] - at < kFeedChunk ? a.part_bytes[p] - at : kFeedChunk;
                const unsigned char* piece = row + f.part_at[p] + q * (f.piece + 2 * kFeedAlign) + delta_s;
                copy_chunk(c.bank + c.part_at[p] + uint64_t(slot) * c.part_stride[p] + at,
                           piece + (at - uint64_t(q) * f.piece), n);
            }
            __syncthreads();  // the chunk is written, and chunk_s, ready_s and delta_s read
            if (tid == 0) {
                if (a.part_bytes[p] && (ready_s & kFeedFailed))
                    atomicMax(reinterpret_cast<unsigned long long*>(f.fail_tag + r), tag);
                __threadfence();
                if (atomicAdd(&f.completed[m], 1u) + 1 == total) {  // the miss's last chunk: the row is free
                    if (DevWide(f.fail_tag[r]).load(cuda::memory_order_relaxed) == tag)
                        f.failed[atomicAdd(f.failed_n, 1u)] = slot;
                    __threadfence_system();
                    SysWord(f.box->consumed[r]).store(tag, cuda::memory_order_release);
                    DevWord(*f.done).fetch_add(1u, cuda::memory_order_release);
                }
            }
        }
        __syncthreads();  // chunk_s is written again at the next miss
    }
}

// The leader's thread 0, after its own copy: every one of the select's `misses` done, the failed
// ones' slots freed and their ids given slot -1 (nobody reads bytes that never came).
__device__ inline void settle(const DeviceSelectArgs& a, uint32_t misses) {
    const DeviceFeed& f = a.cls.feed;
    while (DevWord(*f.done).load(cuda::memory_order_acquire) < misses) __nanosleep(128);
    const uint32_t failed = *f.failed_n;
    for (uint32_t i = 0; i < failed; ++i) forget_slot(a.cls, a.slot_of_key, static_cast<uint32_t>(f.failed[i]));
    if (!failed) return;
    atomicAdd(reinterpret_cast<unsigned long long*>(f.failures), failed);
    for (uint32_t i = 0; i < a.count; ++i)  // the ids whose expert never came: no slot, as an id out of range
        for (uint32_t j = 0; j < failed; ++j)
            if (a.out_slots[i] == f.failed[j]) a.out_slots[i] = -1;
}

}  // namespace feed_cuda
}  // namespace expcache
