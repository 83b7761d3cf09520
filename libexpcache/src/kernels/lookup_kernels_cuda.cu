// The device-side select on the CUDA backend: one grid per select (the table read, the lookup
// or the hits' bookkeeping in its first block, the miss copy in all of them), enqueued on the
// caller's stream with the cache's device current. Nothing here synchronizes or allocates, so a
// select can be captured.
//
// Why one grid. The lookup needs one block (a block-wide minimum per miss), the copy every SM
// (mapped reads cross PCIe; one block per SM reaches the link's rate), and only the lookup
// knows whether anything is to be copied. As two kernels, the copy grid's launch cost about
// 1.2 us per select under graph replay even when nothing missed (an all-hit select of 6 ids:
// 3.27 us, with the copy as a programmatic dependent launch). A conditional graph node (CUDA
// 12.4: the lookup sets an IF node's handle, the copy in its body) skips the copy only inside
// a captured graph, still adds a node the device scheduler must evaluate after the lookup,
// needs the capture spliced by hand (cudaStreamGetCaptureInfo, cudaGraphAddNode,
// cudaStreamUpdateCaptureDependencies) and a second code path outside capture. One grid has one
// node under capture and one launch outside it, on every CUDA version the library builds for:
// its first block to arrive (an atomic ticket per class, so the leader is a block that is
// running, whatever the scheduler started first) does the lookup and publishes each miss with a
// release as soon as it has its slot; the others poll for them and copy each while the leader
// chooses the next one's victim, until the leader says it has listed all. No block waits for one that has not
// started, so it cannot deadlock however few of its blocks are resident; an all-hit select's
// other blocks end as soon as the leader has read the slot map.
#include <algorithm>
#include <cuda/atomic>

#include "../backend/cuda_errors.cuh"
#include "feed_cuda.cuh"
#include "lookup_kernels.hpp"
#include "lookup_policy_cuda.cuh"
#include "table_read_cuda.cuh"

namespace expcache {

namespace {

// Per block (the lookup's, and each copy block's: one per SM reaches the link's rate,
// benchmarks/c/copy_methods.cu).
constexpr int kLookupThreads = lookup_cuda::kThreads;
constexpr int kCopyUnroll = 4;    // 16-byte loads in flight per thread: mapped reads cross PCIe
constexpr unsigned kPollNs = 32;  // between two reads of the leader's word

using DeviceWord = cuda::atomic_ref<uint64_t, cuda::thread_scope_device>;

// The lookup, run by the select's leader block (select_kernel) when some id in range missed. Each
// miss is published (`done`: the select's number, shifted) as soon as it has its slot, so the
// other blocks copy it while the lookup chooses the next one's victim.
__device__ void lookup_block(const DeviceSelectArgs& a, uint64_t done, uint64_t index) {
    __shared__ uint32_t keys[EXPCACHE_MAX_SELECT];
    __shared__ uint32_t first[EXPCACHE_MAX_SELECT];
    __shared__ uint8_t missed[EXPCACHE_MAX_SELECT];
    __shared__ int32_t slot_at[EXPCACHE_MAX_SELECT];    // each first occurrence's slot (-1: none yet)
    __shared__ uint8_t list_of[EXPCACHE_MAX_SELECT];    // each first occurrence's class of count (lookup_rules.hpp)
    __shared__ uint8_t shadow_of[EXPCACHE_MAX_SELECT];  // duel: its class in the shadow's own count
    __shared__ lookup_cuda::PolicyShared policy_s;
    __shared__ PolicyNow now_s;
    __shared__ uint64_t base_s;
    __shared__ uint32_t distinct, hits, misses, evictions;
    const DeviceClass& c = a.cls;
    const uint32_t tid = threadIdx.x;
    if (tid == 0) {
        base_s = select_base(index);
        now_s = open_select(a);
        distinct = hits = misses = evictions = 0;
        if (a.fed) feed_cuda::open(c.feed);
    }
    for (uint32_t i = tid; i < a.count; i += blockDim.x) {
        keys[i] = key_of(a, i);
        if (keys[i] == UINT32_MAX) report_bad_id(a, i);
    }
    __syncthreads();
    const uint64_t base = base_s;
    const PolicyNow now = now_s;
    // Each id's first occurrence; its use counted; hits refreshed (and so protected from this
    // call's misses).
    for (uint32_t i = tid; i < a.count; i += blockDim.x) {
        uint32_t f = i;
        for (uint32_t j = 0; j < i; ++j)
            if (keys[j] == keys[i]) {
                f = j;
                break;
            }
        first[i] = f;
        missed[i] = 0;
        slot_at[i] = -1;
        if (f == i && keys[i] != UINT32_MAX) {
            atomicAdd(&distinct, 1u);
            const int32_t slot = a.slot_of_key[keys[i]];
            list_of[i] = static_cast<uint8_t>(first_use(a, keys[i], slot, base + i, now));
            slot_at[i] = slot;
            if (slot >= 0) {
                atomicAdd(&hits, 1u);
                if (requests_shadows(a)) shadow_of[i] = static_cast<uint8_t>(shadow_count_use(a, keys[i], now));
            } else {
                missed[i] = fills_misses(a);
            }
        }
    }
    __syncthreads();
    // duel: the hits' requests to its shadows, in order of first occurrence; all at once when each
    // hits in both shadows (shadows_all_hit), as they come before the misses' requests.
    const bool duel = requests_shadows(a);
    if (duel && !lookup_cuda::shadows_all_hit(a, keys, first, slot_at, base, shadow_of, now))
        for (uint32_t i = 0; i < a.count; ++i)  // uniform: every thread reads the same shared flags
            if (first[i] == i && slot_at[i] >= 0)
                lookup_cuda::duel_request(a, keys[i], base + i, shadow_of[i], now, policy_s);
    // Misses in order of first occurrence, each given the policy's victim among the evictable
    // slots (a block-wide reduction over the bank), so the choices are the host backend's.
    for (uint32_t i = 0; i < a.count; ++i) {
        if (!missed[i]) continue;  // uniform: every thread reads the same shared flag
        const uint64_t stamp = base + EXPCACHE_MAX_SELECT + i;
        const int32_t v = lookup_cuda::bank_victim(a, base, now, policy_s);
        if (v < 0) continue;  // every slot pinned or used (or, for a batch, not free): the host stages it
        if (tid == 0) {
            int k = list_of[i];
            if (fill_miss(a, v, keys[i], stamp, &k, now, misses)) ++evictions;
            list_of[i] = static_cast<uint8_t>(k);
            if (duel) shadow_of[i] = static_cast<uint8_t>(shadow_count_use(a, keys[i], now));
            ++misses;
            slot_at[i] = v;
            if (a.copy) {  // the miss list's entry is written: the copy may start
                if (a.fed) feed_cuda::list(c.feed, a.layer, keys[i] - a.key_base, now.token, misses - 1, done);
                __threadfence();
                DeviceWord(c.handoff->published).fetch_max(done | misses, cuda::memory_order_release);
            }
        }
        __syncthreads();
        if (duel) lookup_cuda::duel_request(a, keys[i], stamp, shadow_of[i], now, policy_s);
    }
    __syncthreads();  // the all-hit path never entered the loop's barriers
    for (uint32_t i = tid; i < a.count; i += blockDim.x) {
        a.out_slots[i] = slot_at[first[i]];
        if (a.out_filled) a.out_filled[i] = missed[first[i]] && slot_at[first[i]] >= 0;
    }
    if (tid == 0) {
        *c.miss_count = misses;
        write_counts(a, distinct, misses, hits, evictions, now.token);
        if (a.host_call) return;  // counted by the call, on its path
        // Reductions without a result: nothing waits for them (the next select is stream-ordered).
        DeviceCounters& n = *c.counters;
        auto add = [](uint64_t* to, uint64_t v) { atomicAdd(reinterpret_cast<unsigned long long*>(to), v); };
        add(&n.calls, 1);
        if (hits) add(&n.hits, hits);
        if (misses) {
            add(&n.misses, misses);
            add(&n.evictions, evictions);
            add(&n.appends, misses - evictions);
            add(&n.bytes_h2d, uint64_t(misses) * a.expert_bytes());
        }
    }
}

// Every block's share of the copy of the latest select's misses [from, to) (DeviceClass::misses).
__device__ void copy_misses(const DeviceSelectArgs& a, uint32_t from, uint32_t to) {
    const DeviceClass& c = a.cls;
    const uint64_t gtid = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const uint64_t gstride = uint64_t(gridDim.x) * blockDim.x;
    for (uint32_t m = from; m < to; ++m) {
        // Written by the leader block: read past this SM's L1.
        const uint2 raw = __ldcg(reinterpret_cast<const uint2*>(c.misses + m));
        const DeviceMiss miss{raw.x, static_cast<int32_t>(raw.y)};
        for (int p = 0; p < EXPCACHE_MAX_PARTS; ++p) {
            if (a.part_bytes[p] == 0) break;  // past the layer's parts
            const unsigned char* src = a.src[p] + a.src_stride[p] * miss.expert;
            unsigned char* dst = c.bank + c.part_at[p] + uint64_t(miss.slot) * c.part_stride[p];
            const uint64_t bytes = a.part_bytes[p];
            if (!a.aligned) {
                for (uint64_t b = gtid; b < bytes; b += gstride) dst[b] = src[b];
                continue;
            }
            const uint4* s4 = reinterpret_cast<const uint4*>(src);
            uint4* d4 = reinterpret_cast<uint4*>(dst);
            const uint64_t words = bytes / 16;
            for (uint64_t w = gtid; w < words; w += kCopyUnroll * gstride) {
                uint4 v[kCopyUnroll];
#pragma unroll
                for (int u = 0; u < kCopyUnroll; ++u)
                    if (w + u * gstride < words) v[u] = s4[w + u * gstride];
#pragma unroll
                for (int u = 0; u < kCopyUnroll; ++u)
                    if (w + u * gstride < words) d4[w + u * gstride] = v[u];
            }
            for (uint64_t b = words * 16 + gtid; b < bytes; b += gstride) dst[b] = src[b];
        }
    }
}

// One select (see the top of this file and lookup_kernels.hpp): the table read in every block,
// the lookup or the hits' bookkeeping in the leader, the copy in all, each miss as it is listed.
__global__ void __launch_bounds__(kLookupThreads) select_kernel(DeviceSelectArgs a) {
    __shared__ uint32_t keys[EXPCACHE_MAX_SELECT];
    __shared__ int32_t slots[EXPCACHE_MAX_SELECT];
    __shared__ uint64_t ticket_s;
    __shared__ uint32_t distinct_s;
    __shared__ uint64_t word_s;
    __shared__ table_read::Early early_s;
    const DeviceClass& c = a.cls;
    const uint32_t tid = threadIdx.x;
#if __CUDA_ARCH__ >= 900
    // Launched as a programmatic dependent (CudaLookupKernels::select): the grid may be resident
    // before the kernel ahead of it on the stream has finished; nothing is read before it has,
    // and its writes are visible after this wait.
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    if (tid == 0) {
        ticket_s = atomicAdd(reinterpret_cast<unsigned long long*>(&c.handoff->ticket), 1ull);
        distinct_s = 0;
    }
    // The table read, in every block while its ticket is on the way, with what the table read's
    // bookkeeping reads (table_read_cuda.cuh): reads only, so a block that turns out not to lead
    // has changed nothing.
    table_read::load_early(a, early_s);
    table_read::Prefetched pf = {};
    int resident = 1;
    for (uint32_t i = tid; i < a.count; i += blockDim.x) {
        const uint32_t key = key_of(a, i);
        const int32_t slot = key == UINT32_MAX ? -1 : a.slot_of_key[key];
        if (i == tid && key != UINT32_MAX) pf = table_read::prefetch(a, key);
        keys[i] = key;
        slots[i] = slot;
        resident &= key == UINT32_MAX || slot >= 0;
    }
    const bool all_resident = __syncthreads_and(resident);  // also: the ticket and the early loads are in
    const uint64_t grid = gridDim.x;
    const uint64_t index = ticket_s / grid;              // this select's number among its class's
    const uint64_t done = (index + 1) << kPublishShift;  // shifted, + 1: 0 is no select's
    const bool leader = ticket_s % grid == 0;
    DeviceWord published(c.handoff->published);
    if (leader) {
        if (all_resident && a.mode == kModeDecode) {
            // Nothing listed: the other blocks end as soon as they read it.
            if (tid == 0) published.fetch_max(done | kPublishFinal, cuda::memory_order_relaxed);
            table_read::serve(a, keys, slots, &distinct_s, pf, early_s, index);
            return;
        }
        lookup_block(a, done, index);
        __syncthreads();  // the miss list is written
        if (tid == 0) {
            const uint64_t listed = a.copy ? *c.miss_count : 0;  // copy 0: the host copies them
            __threadfence();
            published.fetch_max(done | kPublishFinal | listed, cuda::memory_order_release);
        }
    }
    // Every block copies its share of each miss (by its index in the grid), so every block waits
    // for the leader's word, even one whose table read found every id resident (a block that read
    // the table after the leader of a select with misses had changed it may).
    // Copy the misses as they are listed, until the lookup says it has listed them all. fetch_max:
    // the word only grows, so a word of a later select (only by misuse: selects of one class on
    // unordered streams overlapping) ends the wait.
    uint32_t copied = 0;
    bool mine = true;
    for (;;) {
        if (tid == 0) {
            uint64_t word;
            while ((word = published.load(cuda::memory_order_acquire)) < done ||
                   (word < (done | kPublishFinal) && (word & kPublishCount) <= copied))
                __nanosleep(kPollNs);
            word_s = word;
        }
        __syncthreads();
        const uint64_t word = word_s;
        __syncthreads();  // word_s is written again by the next round
        mine = word < done + (uint64_t(1) << kPublishShift);
        const uint32_t listed = mine ? static_cast<uint32_t>(word & kPublishCount) : copied;
        if (listed > copied) {
            if (a.fed)
                feed_cuda::copy_misses(a, copied, listed, done);
            else
                copy_misses(a, copied, listed);
        }
        copied = listed;
        if (!mine || (word & kPublishFinal)) break;
    }
    // The leader frees the slots of fed misses whose read failed, once every one is done.
    if (a.fed && mine && copied && leader && tid == 0) feed_cuda::settle(a, copied);
}

__global__ void unpin_kernel(uint8_t* pin, const int32_t* slots, uint32_t n) {
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) pin[slots[i]] = 0;
}

// One block: every slot of the class cleared, then the resident counts.
__global__ void __launch_bounds__(kLookupThreads) clear_kernel(DeviceClass c, int32_t* slot_of_key) {
    for (uint32_t s = threadIdx.x; s < c.cap; s += blockDim.x) clear_slot(c, slot_of_key, s);
    __syncthreads();
    if (threadIdx.x == 0) cleared(c);
}

class CudaLookupKernels final : public LookupKernels {
public:
    explicit CudaLookupKernels(int device) {
        int sms = 0;
        if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0) {
            cudaGetLastError();
            sms = 32;
        }
        blocks_ = sms;
        int major = 0;
        if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess)
            cudaGetLastError();
        dependent_ = major >= 9;
    }
    expcache_status_t select(const DeviceSelectArgs& args, void* stream) override {
        // Every select of a class has the same grid: its leader is the block whose ticket is a
        // multiple of blocks_. From compute capability 9.0 a programmatic dependent launch: the
        // grid is scheduled while the kernel ahead of it drains (its launch, about 0.8 us under
        // graph replay, hidden), and waits in the kernel (griddepcontrol.wait) until that one has
        // finished and its writes are visible. After anything but a kernel it is an ordinary
        // launch; under capture the graph keeps the programmatic edge.
        cudaLaunchAttribute attr = {};
        attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr.val.programmaticStreamSerializationAllowed = 1;
        cudaLaunchConfig_t config = {};
        config.gridDim = dim3(blocks_);
        config.blockDim = dim3(kLookupThreads);
        config.stream = static_cast<cudaStream_t>(stream);
        config.attrs = &attr;
        config.numAttrs = dependent_ ? 1 : 0;
        EXPCACHE_CUDA_TRY(cudaLaunchKernelEx(&config, select_kernel, args));
        return EXPCACHE_OK;
    }
    expcache_status_t mapped(const void* host, const unsigned char** out) override {
        cudaPointerAttributes attr = {};
        cudaError_t e = cudaPointerGetAttributes(&attr, host);
        if (e != cudaSuccess) {
            cudaGetLastError();
            return fail(EXPCACHE_ERR_UNSUPPORTED, "cudaPointerGetAttributes(%p): %s", host, cudaGetErrorString(e));
        }
        if (attr.type != cudaMemoryTypeHost || attr.devicePointer == nullptr)
            return fail(EXPCACHE_ERR_UNSUPPORTED,
                        "%p is not pinned host memory the GPU can map (cudaHostAlloc, cudaMallocHost or "
                        "cudaHostRegister make it so)",
                        host);
        *out = static_cast<const unsigned char*>(attr.devicePointer);
        return EXPCACHE_OK;
    }
    expcache_status_t alloc_mapped(uint64_t bytes, void** out_host, void** out_device) override {
        void* host = nullptr;
        cudaError_t e = cudaHostAlloc(&host, bytes, cudaHostAllocMapped);
        if (e != cudaSuccess) {
            cudaGetLastError();
            return fail(EXPCACHE_ERR_OUT_OF_HOST_MEMORY, "cudaHostAlloc(%llu bytes, mapped): %s",
                        (unsigned long long)bytes, cudaGetErrorString(e));
        }
        void* device = nullptr;
        if ((e = cudaHostGetDevicePointer(&device, host, 0)) != cudaSuccess) {
            cudaGetLastError();
            cudaFreeHost(host);
            return fail(EXPCACHE_ERR_UNSUPPORTED, "cudaHostGetDevicePointer: %s", cudaGetErrorString(e));
        }
        *out_host = host;
        *out_device = device;
        return EXPCACHE_OK;
    }
    void free_mapped(void* host) override {
        if (host) cudaFreeHost(host);
    }
    expcache_status_t unpin(uint8_t* pin, const int32_t* slots, uint32_t n, void* stream) override {
        const uint32_t blocks = std::min<uint32_t>((n + kLookupThreads - 1) / kLookupThreads, 64);
        unpin_kernel<<<blocks, kLookupThreads, 0, static_cast<cudaStream_t>(stream)>>>(pin, slots, n);
        EXPCACHE_CUDA_TRY(cudaGetLastError());
        return EXPCACHE_OK;
    }
    expcache_status_t clear(const DeviceClass& c, int32_t* slot_of_key, void* stream) override {
        clear_kernel<<<1, kLookupThreads, 0, static_cast<cudaStream_t>(stream)>>>(c, slot_of_key);
        EXPCACHE_CUDA_TRY(cudaGetLastError());
        return EXPCACHE_OK;
    }
    bool capturing(void* stream) override {
        cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
        if (cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status) != cudaSuccess) {
            cudaGetLastError();
            return true;  // the legacy stream while another stream is captured: treat as capturing
        }
        return status != cudaStreamCaptureStatusNone;
    }

private:
    int blocks_ = 64;         // per select: one per SM
    bool dependent_ = false;  // launched as a programmatic dependent (compute capability 9.0 and later)
};

}  // namespace

std::unique_ptr<LookupKernels> make_cuda_lookup_kernels(int device) {
    return std::unique_ptr<LookupKernels>(new CudaLookupKernels(device));
}

}  // namespace expcache
