// The kernels only tests and benchmarks run, apart from the serving path: the checksum that
// reads every byte of cached experts (byte-exactness, and the memory-bound floor of the expert
// GEMVs) and a kernel that only takes time (the benchmark's non-expert work). One implementation
// per backend; a cache holds its backend's in the instrumented backend (backend/instrumented.hpp).
#pragma once

#include <cstdint>
#include <memory>

#include "expcache.h"

namespace expcache {

// One contiguous range to checksum; results are summed into sums[out].
struct ChecksumJob {
    const void* ptr;
    uint64_t bytes;
    uint32_t out;
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
    // `ns` nanoseconds of work on `stream` that only takes time (the host spins now).
    virtual expcache_status_t spin_async(uint64_t ns, void* stream) = 0;
};

std::unique_ptr<TestKernels> make_host_kernels();
// The CUDA build's, for `device` (the stub build: never called, the CUDA backend is refused first).
std::unique_ptr<TestKernels> make_cuda_kernels(int device);

// Checksum of one range, as the kernels compute it (host reference).
uint64_t checksum_host(const void* ptr, uint64_t bytes);

}  // namespace expcache
