// The device-side select on the CUDA backend: the lookup kernel (one block) and the copy
// kernel (a grid reading mapped pinned memory), enqueued on the caller's stream with the
// cache's device current. Nothing here synchronizes or allocates, so a select can be captured.
#include "../backend/cuda_errors.cuh"
#include "lookup_kernels.hpp"

namespace expcache {

namespace {

constexpr int kLookupThreads = 256;
constexpr int kCopyThreads = 256;  // one block of these per SM: the link's rate (benchmarks/c/copy_methods.cu)
constexpr int kCopyUnroll = 4;     // 16-byte loads in flight per thread: mapped reads cross PCIe

// A candidate victim: the least stamp, then the least slot; slot -1 is none.
struct Candidate {
    uint64_t stamp;
    int32_t slot;
};

__device__ bool better(const Candidate& a, const Candidate& b) {
    if (a.slot < 0) return false;
    if (b.slot < 0) return true;
    return a.stamp != b.stamp ? a.stamp < b.stamp : a.slot < b.slot;
}

__device__ Candidate warp_best(Candidate v) {
    for (int off = 16; off > 0; off >>= 1) {
        Candidate o;
        o.stamp = __shfl_down_sync(0xffffffffu, v.stamp, off);
        o.slot = __shfl_down_sync(0xffffffffu, v.slot, off);
        if (better(o, v)) v = o;
    }
    return v;
}

__global__ void __launch_bounds__(kLookupThreads) lookup_kernel(DeviceSelectArgs a) {
    __shared__ uint32_t keys[EXPCACHE_MAX_SELECT];
    __shared__ uint32_t first[EXPCACHE_MAX_SELECT];
    __shared__ uint8_t missed[EXPCACHE_MAX_SELECT];
    __shared__ int32_t slot_at[EXPCACHE_MAX_SELECT];  // each first occurrence's slot (-1: none yet)
    __shared__ Candidate warp_bests[kLookupThreads / 32];
    __shared__ uint64_t base_s;
    __shared__ uint32_t distinct, hits, misses, evictions;
    const DeviceClass& c = a.cls;
    const uint32_t tid = threadIdx.x;
#if __CUDA_ARCH__ >= 900
    // The copy grid may start launching now (programmatic dependent launch): it waits for this
    // grid's completion before it reads anything, so its launch overlaps the lookup.
    cudaTriggerProgrammaticLaunchCompletion();
#endif
    if (tid == 0) {
        base_s = atomicAdd(reinterpret_cast<unsigned long long*>(a.clock), kStampsPerSelect) + 1;
        distinct = hits = misses = evictions = 0;
    }
    for (uint32_t i = tid; i < a.count; i += blockDim.x) {
        const int64_t id =
            a.id_bits == 64 ? static_cast<const int64_t*>(a.ids)[i] : static_cast<const int32_t*>(a.ids)[i];
        if (id < 0 || id >= static_cast<int64_t>(a.num_experts)) {
            if (atomicCAS(&a.error->set, 0u, 1u) == 0u) {
                a.error->layer = a.layer;
                a.error->index = i;
                a.error->id = id;
            }
            keys[i] = UINT32_MAX;
        } else {
            keys[i] = a.key_base + static_cast<uint32_t>(id);
        }
    }
    __syncthreads();
    const uint64_t base = base_s;
    // Each id's first occurrence; hits refreshed (and so protected from this call's misses).
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
            slot_at[i] = slot;
            if (slot >= 0) {
                c.stamp[slot] = base + i;
                atomicAdd(&hits, 1u);
            } else {
                missed[i] = 1;
            }
        }
    }
    __syncthreads();
    // Misses in order of first occurrence, each given the least recently used evictable slot
    // (a block-wide minimum over the bank), so the choices are the host backend's.
    for (uint32_t i = 0; i < a.count; ++i) {
        if (!missed[i]) continue;  // uniform: every thread reads the same shared flag
        Candidate best{0, -1};
        for (uint32_t s = tid; s < c.cap; s += blockDim.x) {
            const Candidate here{c.stamp[s], static_cast<int32_t>(s)};
            if (evictable(here.stamp, c.pin[s], base) && better(here, best)) best = here;
        }
        best = warp_best(best);
        if ((tid & 31) == 0) warp_bests[tid / 32] = best;
        __syncthreads();
        if (tid == 0) {
            for (uint32_t w = 1; w < blockDim.x / 32; ++w)
                if (better(warp_bests[w], best)) best = warp_bests[w];
            if (best.slot >= 0) {
                const int32_t v = best.slot;
                const int32_t old = c.key_of_slot[v];
                if (old >= 0) {
                    a.slot_of_key[old] = -1;
                    ++evictions;
                }
                c.key_of_slot[v] = static_cast<int32_t>(keys[i]);
                c.stamp[v] = base + EXPCACHE_MAX_SELECT + i;
                a.slot_of_key[keys[i]] = v;
                slot_at[i] = v;
                c.misses[misses++] = DeviceMiss{keys[i] - a.key_base, v};
            }
        }
        __syncthreads();
    }
    __syncthreads();  // the all-hit path never entered the loop's barriers
    for (uint32_t i = tid; i < a.count; i += blockDim.x) a.out_slots[i] = slot_at[first[i]];
    if (tid == 0) {
        *c.miss_count = misses;
        if (a.out_counts) {
            a.out_counts[kCountDistinct] = distinct;
            a.out_counts[kCountMisses] = misses;
        }
        // Reductions without a result: nothing waits for them (the next select is stream-ordered).
        DeviceCounters& n = *c.counters;
        auto add = [](uint64_t* to, uint64_t v) { atomicAdd(reinterpret_cast<unsigned long long*>(to), v); };
        add(&n.calls, 1);
        if (hits) add(&n.hits, hits);
        if (misses) {
            add(&n.misses, misses);
            add(&n.evictions, evictions);
            add(&n.appends, misses - evictions);
            add(&n.bytes_h2d, uint64_t(misses) * (a.part_bytes[0] + a.part_bytes[1] + a.part_bytes[2]));
        }
    }
}

__global__ void __launch_bounds__(kCopyThreads) copy_kernel(DeviceSelectArgs a) {
#if __CUDA_ARCH__ >= 900
    cudaGridDependencySynchronize();  // the lookup grid has finished and its writes are visible
#endif
    const DeviceClass& c = a.cls;
    const uint32_t n = *c.miss_count;
    const uint64_t gtid = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const uint64_t gstride = uint64_t(gridDim.x) * blockDim.x;
    for (uint32_t m = 0; m < n; ++m) {
        const DeviceMiss miss = c.misses[m];
        unsigned char* slot = c.bank + uint64_t(miss.slot) * c.slot_bytes;
        for (int p = 0; p < 3; ++p) {
            const unsigned char* src = a.src[p] + a.src_stride[p] * miss.expert;
            unsigned char* dst = slot + c.part_off[p];
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

class CudaLookupKernels final : public LookupKernels {
public:
    explicit CudaLookupKernels(int device) {
        int sms = 0;
        if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0) {
            cudaGetLastError();
            sms = 32;
        }
        copy_blocks_ = sms;
        int major = 0;
        if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
            cudaGetLastError();
            major = 0;
        }
        dependent_launch_ = major >= 9;
    }
    expcache_status_t select(const DeviceSelectArgs& args, void* stream) override {
        cudaStream_t s = static_cast<cudaStream_t>(stream);
        lookup_kernel<<<1, kLookupThreads, 0, s>>>(args);
        EXPCACHE_CUDA_TRY(cudaGetLastError());
        if (!dependent_launch_) {
            copy_kernel<<<copy_blocks_, kCopyThreads, 0, s>>>(args);
            EXPCACHE_CUDA_TRY(cudaGetLastError());
            return EXPCACHE_OK;
        }
        // Hopper and later: the copy grid launches while the lookup runs (an all-hit select's
        // second kernel then costs little more than its exit).
        cudaLaunchAttribute attr = {};
        attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr.val.programmaticStreamSerializationAllowed = 1;
        cudaLaunchConfig_t config = {};
        config.gridDim = dim3(static_cast<unsigned>(copy_blocks_));
        config.blockDim = dim3(kCopyThreads);
        config.stream = s;
        config.attrs = &attr;
        config.numAttrs = 1;
        EXPCACHE_CUDA_TRY(cudaLaunchKernelEx(&config, copy_kernel, args));
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
    bool capturing(void* stream) override {
        cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
        if (cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status) != cudaSuccess) {
            cudaGetLastError();
            return true;  // the legacy stream while another stream is captured: treat as capturing
        }
        return status != cudaStreamCaptureStatusNone;
    }

private:
    int copy_blocks_ = 64;
    bool dependent_launch_ = false;  // programmatic dependent launch of the copy (compute capability 9+)
};

}  // namespace

std::unique_ptr<LookupKernels> make_cuda_lookup_kernels(int device) {
    return std::unique_ptr<LookupKernels>(new CudaLookupKernels(device));
}

}  // namespace expcache
