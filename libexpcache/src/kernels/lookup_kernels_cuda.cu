// The device-side select on the CUDA backend: the lookup kernel (one block) and the copy
// kernel (a grid reading mapped pinned memory), enqueued on the caller's stream with the
// cache's device current. Nothing here synchronizes or allocates, so a select can be captured.
#include "../backend/cuda_errors.cuh"
#include "lookup_kernels.hpp"
#include "lookup_policy_cuda.cuh"

namespace expcache {

namespace {

constexpr int kLookupThreads = lookup_cuda::kThreads;
constexpr int kCopyThreads = 256;  // one block of these per SM: the link's rate (benchmarks/c/copy_methods.cu)
constexpr int kCopyUnroll = 4;     // 16-byte loads in flight per thread: mapped reads cross PCIe

__global__ void __launch_bounds__(kLookupThreads) lookup_kernel(DeviceSelectArgs a) {
    __shared__ uint32_t keys[EXPCACHE_MAX_SELECT];
    __shared__ uint32_t first[EXPCACHE_MAX_SELECT];
    __shared__ uint8_t missed[EXPCACHE_MAX_SELECT];
    __shared__ int32_t slot_at[EXPCACHE_MAX_SELECT];  // each first occurrence's slot (-1: none yet)
    __shared__ uint8_t list_of[EXPCACHE_MAX_SELECT];  // each first occurrence's class of count (lookup_rules.hpp)
    __shared__ lookup_cuda::PolicyShared policy_s;
    __shared__ PolicyNow now_s;
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
        now_s = open_select(a);
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
            const int k = count_use(a, keys[i], now);
            list_of[i] = static_cast<uint8_t>(k);
            const int32_t slot = a.slot_of_key[keys[i]];
            slot_at[i] = slot;
            if (slot >= 0) {
                refresh_hit(a, slot, base + i, k, now);
                atomicAdd(&hits, 1u);
            } else {
                missed[i] = 1;
            }
        }
    }
    __syncthreads();
    // duel: the hits' requests to its shadows, in order of first occurrence.
    const bool duel = a.policy.id == EXPCACHE_POLICY_DUEL;
    if (duel)
        for (uint32_t i = 0; i < a.count; ++i)  // uniform: every thread reads the same shared flags
            if (first[i] == i && slot_at[i] >= 0)
                lookup_cuda::duel_request(a, keys[i], base + i, list_of[i], now, policy_s);
    // Misses in order of first occurrence, each given the policy's victim among the evictable
    // slots (a block-wide reduction over the bank), so the choices are the host backend's.
    for (uint32_t i = 0; i < a.count; ++i) {
        if (!missed[i]) continue;  // uniform: every thread reads the same shared flag
        const uint64_t stamp = base + EXPCACHE_MAX_SELECT + i;
        const int32_t v = lookup_cuda::bank_victim(a, base, now, policy_s);
        if (v < 0) continue;  // every slot pinned or used (the host checked n*k fits)
        if (tid == 0) {
            if (install_miss(a, v, keys[i], stamp, list_of[i], now, misses)) ++evictions;
            ++misses;
            slot_at[i] = v;
        }
        __syncthreads();
        if (duel) lookup_cuda::duel_request(a, keys[i], stamp, list_of[i], now, policy_s);
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
