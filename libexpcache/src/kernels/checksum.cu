#include <cstring>

#include "checksum.cuh"

namespace expcache {

namespace {

// Each block sums one chunk of one job; blocks of a job are contiguous in
// the grid, so a job's first block index locates it by binary search.
constexpr uint64_t kChunkBytes = 256 * 1024;
constexpr int kThreads = 256;

struct DeviceJob {
    const unsigned char* ptr;
    uint64_t bytes;
    uint64_t first_block;
    uint32_t out;
    uint32_t pad;
};

__device__ __forceinline__ uint64_t load_word(const unsigned char* p, uint64_t j, uint64_t bytes, bool aligned) {
    uint64_t off = 8 * j;
    if (aligned && off + 8 <= bytes) return *reinterpret_cast<const uint64_t*>(p + off);
    uint64_t w = 0;
    for (int b = 0; b < 8 && off + b < bytes; ++b) w |= uint64_t(p[off + b]) << (8 * b);
    return w;
}

__global__ void checksum_kernel(const DeviceJob* jobs, uint32_t num_jobs, unsigned long long* sums) {
    uint32_t lo = 0, hi = num_jobs;
    uint64_t block = blockIdx.x;
    while (hi - lo > 1) {
        uint32_t mid = (lo + hi) / 2;
        if (jobs[mid].first_block <= block) lo = mid; else hi = mid;
    }
    const DeviceJob job = jobs[lo];
    uint64_t begin = (block - job.first_block) * kChunkBytes;
    uint64_t end = begin + kChunkBytes < job.bytes ? begin + kChunkBytes : job.bytes;
    bool aligned16 = (reinterpret_cast<uintptr_t>(job.ptr) & 15) == 0;
    uint64_t sum = 0;
    if (aligned16) {
        // 16-byte loads for bandwidth; begin is a multiple of 16.
        uint64_t full = (end - begin) / 16;
        const ulonglong2* v = reinterpret_cast<const ulonglong2*>(job.ptr + begin);
        for (uint64_t i = threadIdx.x; i < full; i += kThreads) {
            ulonglong2 w = __ldg(v + i);
            uint64_t j = (begin / 8) + 2 * i;
            sum += uint64_t(w.x) * (2 * j + 1) + uint64_t(w.y) * (2 * j + 3);
        }
        for (uint64_t j = (begin + 16 * full) / 8 + threadIdx.x; 8 * j < end; j += kThreads)
            sum += load_word(job.ptr, j, job.bytes, true) * (2 * j + 1);
    } else {
        for (uint64_t j = begin / 8 + threadIdx.x; 8 * j < end; j += kThreads)
            sum += load_word(job.ptr, j, job.bytes, false) * (2 * j + 1);
    }
    // Integer addition modulo 2^64 is associative, so any reduction order is exact.
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, o);
    __shared__ uint64_t warp_sums[kThreads / 32];
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x / 32] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        uint64_t total = 0;
        for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w];
        atomicAdd(&sums[job.out], static_cast<unsigned long long>(total));
    }
}

}  // namespace

size_t checksum_scratch_bytes(uint32_t num_jobs, uint32_t num_sums) {
    return sizeof(DeviceJob) * num_jobs + sizeof(uint64_t) * num_sums;
}

cudaError_t launch_checksum(const ChecksumJob* jobs, uint32_t num_jobs, uint32_t num_sums, void* scratch,
                            void* host_scratch, cudaStream_t stream) {
    DeviceJob* hj = static_cast<DeviceJob*>(host_scratch);
    uint64_t blocks = 0;
    for (uint32_t i = 0; i < num_jobs; ++i) {
        hj[i] = DeviceJob{static_cast<const unsigned char*>(jobs[i].ptr), jobs[i].bytes, blocks, jobs[i].out, 0};
        blocks += (jobs[i].bytes + kChunkBytes - 1) / kChunkBytes;
    }
    DeviceJob* dj = static_cast<DeviceJob*>(scratch);
    unsigned long long* dsums = reinterpret_cast<unsigned long long*>(dj + num_jobs);
    cudaError_t e = cudaMemcpyAsync(dj, hj, sizeof(DeviceJob) * num_jobs, cudaMemcpyHostToDevice, stream);
    if (e != cudaSuccess) return e;
    e = cudaMemsetAsync(dsums, 0, sizeof(uint64_t) * num_sums, stream);
    if (e != cudaSuccess) return e;
    if (blocks > 0) {
        checksum_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(dj, num_jobs, dsums);
        e = cudaGetLastError();
        if (e != cudaSuccess) return e;
    }
    unsigned long long* hsums = reinterpret_cast<unsigned long long*>(hj + num_jobs);
    return cudaMemcpyAsync(hsums, dsums, sizeof(uint64_t) * num_sums, cudaMemcpyDeviceToHost, stream);
}

void read_checksum_results(const void* host_scratch, uint32_t num_jobs, uint32_t num_sums, uint64_t* out) {
    const DeviceJob* hj = static_cast<const DeviceJob*>(host_scratch);
    std::memcpy(out, hj + num_jobs, sizeof(uint64_t) * num_sums);
}

}  // namespace expcache
