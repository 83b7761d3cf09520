#include <cstring>

#include "checksum.cuh"
#include "expcache_testing.h"  // EXPCACHE_CHECKSUM_RESULTS

namespace expcache {

namespace {

// Each block sums one chunk of one job; blocks of a job are contiguous in
// the grid, so a job's first block index locates it by binary search.
constexpr uint64_t kChunkBytes = 64 * 1024;  // one unrolled pass of 256 threads; ~650 blocks for six q2 experts
constexpr int kThreads = 256;
constexpr uint32_t kInlineJobs = 24;

struct DeviceJob {
    const unsigned char* ptr;
    uint64_t bytes;
    uint64_t first_block;
    uint32_t out;
    uint32_t pad;
};

struct Params {
    DeviceJob inline_jobs[kInlineJobs];
    const DeviceJob* table;  // used when num_jobs > kInlineJobs
    uint32_t num_jobs;
    uint32_t num_sums;
    unsigned long long* sums;
    unsigned int* counter;
    unsigned long long* out;
};

__device__ __forceinline__ uint64_t load_word(const unsigned char* p, uint64_t j, uint64_t bytes, bool aligned) {
    uint64_t off = 8 * j;
    if (aligned && off + 8 <= bytes) return *reinterpret_cast<const uint64_t*>(p + off);
    uint64_t w = 0;
    for (int b = 0; b < 8 && off + b < bytes; ++b) w |= uint64_t(p[off + b]) << (8 * b);
    return w;
}

// This thread's share of the weighted sum of bytes [begin, end) of the range at ptr.
__device__ uint64_t chunk_sum(const unsigned char* ptr, uint64_t bytes, uint64_t begin, uint64_t end) {
    const DeviceJob job{ptr, bytes, 0, 0, 0};
    bool aligned16 = (reinterpret_cast<uintptr_t>(job.ptr) & 15) == 0;
    uint64_t sum = 0;
    if (aligned16) {
        // 16-byte loads for bandwidth; begin is a multiple of 16.
        uint64_t full = (end - begin) / 16;
        const ulonglong2* v = reinterpret_cast<const ulonglong2*>(job.ptr + begin);
        // Four independent 16-byte loads in flight per thread before any is used.
        constexpr int kUnroll = 4;
        uint64_t i = threadIdx.x;
        for (; i + (kUnroll - 1) * kThreads < full; i += kUnroll * kThreads) {
            ulonglong2 w[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) w[u] = __ldg(v + i + u * kThreads);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                uint64_t j = (begin / 8) + 2 * (i + u * kThreads);
                sum += uint64_t(w[u].x) * (2 * j + 1) + uint64_t(w[u].y) * (2 * j + 3);
            }
        }
        for (; i < full; i += kThreads) {
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
    return sum;
}

// The block's sum into sums[out]; the last block of the grid writes sums[0, num_sums) to `dst`
// and zeroes them and the counter for the next launch.
__device__ void finish_block(uint64_t sum, uint32_t out, uint32_t num_sums, unsigned long long* sums,
                             unsigned int* counter, unsigned long long* dst) {
    // Integer addition modulo 2^64 is associative, so any reduction order is exact.
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, o);
    __shared__ uint64_t warp_sums[kThreads / 32];
    __shared__ bool last;
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x / 32] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        uint64_t total = 0;
        for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w];
        atomicAdd(&sums[out], static_cast<unsigned long long>(total));
        __threadfence();
        last = atomicAdd(counter, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (last) {
        // Every other block's sums are visible (they fenced before counting).
        __threadfence();
        for (uint32_t i = threadIdx.x; i < num_sums; i += kThreads) dst[i] = atomicExch(&sums[i], 0ull);
        if (threadIdx.x == 0) *counter = 0;
    }
}

__global__ void checksum_kernel(const __grid_constant__ Params prm) {
    const DeviceJob* jobs = prm.num_jobs > kInlineJobs ? prm.table : prm.inline_jobs;
    uint32_t lo = 0, hi = prm.num_jobs;
    uint64_t block = blockIdx.x;
    while (hi - lo > 1) {
        uint32_t mid = (lo + hi) / 2;
        if (jobs[mid].first_block <= block)
            lo = mid;
        else
            hi = mid;
    }
    const DeviceJob job = jobs[lo];
    uint64_t begin = (block - job.first_block) * kChunkBytes;
    uint64_t end = begin + kChunkBytes < job.bytes ? begin + kChunkBytes : job.bytes;
    finish_block(chunk_sum(job.ptr, job.bytes, begin, end), job.out, prm.num_sums, prm.sums, prm.counter, prm.out);
}

struct BankParams {
    BankChecksum bank;
    uint64_t part_blocks[EXPCACHE_MAX_PARTS];  // chunks of each part
    uint64_t expert_blocks;                    // their sum: the blocks of one slot
    unsigned long long* sums;
    unsigned int* counter;
    unsigned long long* out;
};

// Block b reads chunk (b % expert_blocks) of slot slots[b / expert_blocks].
__global__ void bank_checksum_kernel(const __grid_constant__ BankParams prm) {
    const uint32_t i = blockIdx.x / prm.expert_blocks;
    uint64_t r = blockIdx.x % prm.expert_blocks;
    int p = 0;
    while (r >= prm.part_blocks[p]) r -= prm.part_blocks[p++];
    const int32_t slot = prm.bank.slots[i];
    uint64_t sum = 0;
    if (prm.bank.readable(slot)) {
        const uint64_t bytes = prm.bank.part_bytes[p];
        const uint64_t begin = r * kChunkBytes;
        const uint64_t end = begin + kChunkBytes < bytes ? begin + kChunkBytes : bytes;
        sum = chunk_sum(prm.bank.base + prm.bank.part_at[p] + uint64_t(slot) * prm.bank.part_stride[p], bytes, begin,
                        end);
    }
    finish_block(sum, i, prm.bank.n, prm.sums, prm.counter, prm.out);
}

}  // namespace

ChecksumScratch::~ChecksumScratch() {
    release();
}

void ChecksumScratch::release() {
    if (jobs_dev_) cudaFree(jobs_dev_);
    if (jobs_host_) cudaFreeHost(jobs_host_);
    if (table_copied_) cudaEventDestroy(table_copied_);
    if (sums_) cudaFree(sums_);
    if (counter_) cudaFree(counter_);
    if (results_) cudaFreeHost(results_);
    if (slots_dev_) cudaFree(slots_dev_);
    if (slots_host_) cudaFreeHost(slots_host_);
    slots_dev_ = slots_host_ = nullptr;
    jobs_dev_ = jobs_host_ = nullptr;
    table_copied_ = nullptr;
    table_pending_ = false;
    sums_ = results_ = nullptr;
    counter_ = nullptr;
    jobs_cap_ = sums_cap_ = 0;
    results_cap_ = 0;
}

// Buffers that earlier, still running launches may use are only replaced after
// the device has finished them.
cudaError_t ChecksumScratch::reserve(uint32_t num_jobs, uint32_t num_sums, uint64_t results) {
    cudaError_t e = cudaSuccess;
    if (num_sums > sums_cap_) {
        if ((e = cudaDeviceSynchronize()) != cudaSuccess) return e;
        if (sums_) cudaFree(sums_);
        sums_ = nullptr;
        sums_cap_ = 0;
        if ((e = cudaMalloc(&sums_, sizeof(uint64_t) * num_sums)) != cudaSuccess) return e;
        if ((e = cudaMemset(sums_, 0, sizeof(uint64_t) * num_sums)) != cudaSuccess) return e;
        sums_cap_ = num_sums;
    }
    if (results > results_cap_) {
        if ((e = cudaDeviceSynchronize()) != cudaSuccess) return e;
        unsigned long long* grown = nullptr;
        if ((e = cudaHostAlloc(&grown, sizeof(uint64_t) * results, cudaHostAllocMapped)) != cudaSuccess) return e;
        std::memset(grown, 0, sizeof(uint64_t) * results);
        if (results_) {
            std::memcpy(grown, results_, sizeof(uint64_t) * results_cap_);  // slots not read yet survive
            cudaFreeHost(results_);
        }
        results_ = grown;
        results_cap_ = results;
    }
    if (!counter_) {
        if ((e = cudaMalloc(&counter_, sizeof(unsigned int))) != cudaSuccess) return e;
        if ((e = cudaMemset(counter_, 0, sizeof(unsigned int))) != cudaSuccess) return e;
    }
    if (!table_copied_ && (e = cudaEventCreateWithFlags(&table_copied_, cudaEventDisableTiming)) != cudaSuccess)
        return e;
    if (num_jobs > kInlineJobs && num_jobs > jobs_cap_) {
        if (table_pending_ && (e = cudaEventSynchronize(table_copied_)) != cudaSuccess) return e;
        table_pending_ = false;
        if (jobs_dev_) {
            if ((e = cudaDeviceSynchronize()) != cudaSuccess) return e;
            cudaFree(jobs_dev_);
        }
        if (jobs_host_) cudaFreeHost(jobs_host_);
        jobs_dev_ = jobs_host_ = nullptr;
        jobs_cap_ = 0;
        if ((e = cudaMalloc(&jobs_dev_, sizeof(DeviceJob) * num_jobs)) != cudaSuccess) return e;
        if ((e = cudaMallocHost(&jobs_host_, sizeof(DeviceJob) * num_jobs)) != cudaSuccess) return e;
        jobs_cap_ = num_jobs;
    }
    return e;
}

cudaError_t ChecksumScratch::launch(const ChecksumJob* jobs, uint32_t num_jobs, uint32_t num_sums, uint32_t first,
                                    cudaStream_t stream) {
    cudaError_t e = reserve(num_jobs, num_sums, uint64_t(first) + num_sums);
    if (e != cudaSuccess) return e;
    Params prm;
    std::memset(&prm, 0, sizeof prm);
    bool table = num_jobs > kInlineJobs;
    if (table && table_pending_) {
        // The previous table may not have been copied yet: wait before rewriting it.
        if ((e = cudaEventSynchronize(table_copied_)) != cudaSuccess) return e;
        table_pending_ = false;
    }
    DeviceJob* out_jobs = table ? static_cast<DeviceJob*>(jobs_host_) : prm.inline_jobs;
    uint64_t blocks = 0;
    for (uint32_t i = 0; i < num_jobs; ++i) {
        out_jobs[i] = DeviceJob{static_cast<const unsigned char*>(jobs[i].ptr), jobs[i].bytes, blocks, jobs[i].out, 0};
        blocks += (jobs[i].bytes + kChunkBytes - 1) / kChunkBytes;
    }
    if (blocks == 0 || blocks > 0x7fffffffu) return cudaErrorInvalidValue;
    if (table) {
        e = cudaMemcpyAsync(jobs_dev_, jobs_host_, sizeof(DeviceJob) * num_jobs, cudaMemcpyHostToDevice, stream);
        if (e == cudaSuccess) e = cudaEventRecord(table_copied_, stream);
        if (e != cudaSuccess) return e;
        table_pending_ = true;
        prm.table = static_cast<const DeviceJob*>(jobs_dev_);
    }
    prm.num_jobs = num_jobs;
    prm.num_sums = num_sums;
    prm.sums = sums_;
    prm.counter = counter_;
    unsigned long long* results_dev = nullptr;
    if ((e = cudaHostGetDevicePointer(reinterpret_cast<void**>(&results_dev), results_, 0)) != cudaSuccess) return e;
    prm.out = results_dev + first;
    checksum_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(prm);
    return cudaGetLastError();
}

cudaError_t ChecksumScratch::launch_bank(const BankChecksum& bank, uint32_t first, cudaStream_t stream) {
    cudaError_t e = reserve(0, bank.n, uint64_t(first) + bank.n);
    if (e != cudaSuccess) return e;
    BankParams prm;
    std::memset(&prm, 0, sizeof prm);
    prm.bank = bank;
    for (int p = 0; p < EXPCACHE_MAX_PARTS; ++p) {
        prm.part_blocks[p] = (bank.part_bytes[p] + kChunkBytes - 1) / kChunkBytes;
        prm.expert_blocks += prm.part_blocks[p];
    }
    const uint64_t blocks = prm.expert_blocks * bank.n;
    if (blocks == 0 || blocks > 0x7fffffffu) return cudaErrorInvalidValue;
    prm.sums = sums_;
    prm.counter = counter_;
    unsigned long long* results_dev = nullptr;
    if ((e = cudaHostGetDevicePointer(reinterpret_cast<void**>(&results_dev), results_, 0)) != cudaSuccess) return e;
    prm.out = results_dev + first;
    bank_checksum_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(prm);
    return cudaGetLastError();
}

cudaError_t ChecksumScratch::launch_bank_host_slots(const BankChecksum& bank, uint32_t first, cudaStream_t stream) {
    cudaError_t e = cudaSuccess;
    if (uint64_t(first) + bank.n > EXPCACHE_CHECKSUM_RESULTS) return cudaErrorInvalidValue;
    if (!slots_dev_ && (e = cudaMalloc(&slots_dev_, sizeof(int32_t) * EXPCACHE_CHECKSUM_RESULTS)) != cudaSuccess)
        return e;
    if (!slots_host_ && (e = cudaMallocHost(&slots_host_, sizeof(int32_t) * EXPCACHE_CHECKSUM_RESULTS)) != cudaSuccess)
        return e;
    std::memcpy(slots_host_ + first, bank.slots, sizeof(int32_t) * bank.n);
    e = cudaMemcpyAsync(slots_dev_ + first, slots_host_ + first, sizeof(int32_t) * bank.n, cudaMemcpyHostToDevice,
                        stream);
    if (e != cudaSuccess) return e;
    BankChecksum on_device = bank;
    on_device.slots = slots_dev_ + first;
    return launch_bank(on_device, first, stream);
}

void ChecksumScratch::results(uint32_t first, uint32_t n, uint64_t* out) const {
    std::memcpy(out, results_ + first, sizeof(uint64_t) * n);
}

}  // namespace expcache
