// The kernels only tests and benchmarks run, apart from the serving path: the checksum that
// reads every byte of cached experts (byte-exactness, and the memory-bound floor of the expert
// GEMVs) and a kernel that only takes time (the benchmark's non-expert work). One implementation
// per backend; a cache holds its backend's in the instrumented backend (backend/instrumented.hpp).
#pragma once

#include <cstdint>
#include <memory>

#include "expcache.h"

#ifdef __CUDACC__
#define EXPCACHE_TEST_HD __host__ __device__
#else
#define EXPCACHE_TEST_HD
#endif

namespace expcache {

// One contiguous range to checksum; results are summed into sums[out].
struct ChecksumJob {
    const void* ptr;
    uint64_t bytes;
    uint32_t out;
};

// The experts of a bank's slots, read by slot id from device memory (what a fused MoE kernel
// given select_device's slots reads): slot slots[i]'s parts sum into one result each.
struct BankChecksum {
    EXPCACHE_TEST_HD bool readable(int32_t slot) const {
        const uint32_t s = static_cast<uint32_t>(slot);
        return slot >= 0 && (s < cap || (s >= staged_from && s < staged_to) || (s >= batch_from && s < batch_to));
    }
    const unsigned char* base;
    uint64_t part_at[EXPCACHE_MAX_PARTS];  // part p of slot s at base + part_at[p] + s * part_stride[p]
    uint64_t part_stride[EXPCACHE_MAX_PARTS];
    uint64_t part_bytes[EXPCACHE_MAX_PARTS];  // 0 past the class's parts
    uint32_t cap;                             // a slot outside [0, cap) and the rows below sums to 0
    uint32_t staged_from, staged_to;          // the bank's mapped staging rows (select_slots)
    uint32_t batch_from, batch_to;            // its mapped batch rows (batch_prepare_slots)
    uint32_t n;
    const int32_t* slots;  // device memory (host memory on the host backend, and for bank_checksum_host_slots_async)
};

class TestKernels {
public:
    virtual ~TestKernels() = default;
    // Weighted 64-bit word sums (see expcache_testing_checksum) into result slots
    // [first, first + num_sums), enqueued on `stream` (the host computes them now); read them
    // with checksum_results once the stream has finished.
    virtual expcache_status_t checksum_async(const ChecksumJob* jobs, uint32_t num_jobs, uint32_t num_sums,
                                             uint32_t first, void* stream) = 0;
    virtual expcache_status_t checksum_results(uint32_t first, uint32_t n, uint64_t* out) = 0;
    // The sums of a bank's slots into result slots [first, first + n), as checksum_async's; the
    // slot ids are read on the device, so the launch can be captured in a graph.
    virtual expcache_status_t bank_checksum_async(const BankChecksum& bank, uint32_t first, void* stream) = 0;
    // bank_checksum_async with bank.slots in host memory (a host select's slots): the CUDA kernels
    // copy them on `stream` into scratch of their result slots first (the host backend's read them
    // where they are), so the caller may reuse its array once the call returns.
    virtual expcache_status_t bank_checksum_host_slots_async(const BankChecksum& bank, uint32_t first,
                                                             void* stream) = 0;
    // `ns` nanoseconds of work on `stream` that only takes time (the host spins now).
    virtual expcache_status_t spin_async(uint64_t ns, void* stream) = 0;
};

std::unique_ptr<TestKernels> make_host_kernels();
// The CUDA build's, for `device` (the stub build: never called, the CUDA backend is refused first).
std::unique_ptr<TestKernels> make_cuda_kernels(int device);

// Checksum of one range, as the kernels compute it (host reference).
uint64_t checksum_host(const void* ptr, uint64_t bytes);

}  // namespace expcache
