// The checksum kernel: reads every byte of a list of device ranges (the
// memory-bound floor of the expert GEMVs) and sums 64-bit words weighted by
// their position, so a wrong, shifted or stale byte changes the result.
#pragma once

#include <cuda_runtime.h>

#include "../backend/backend.hpp"

namespace expcache {

// Device and pinned scratch one checksum call needs; owned by the backend.
class ChecksumScratch {
public:
    ~ChecksumScratch();
    // One launch: jobs travel in the kernel's parameters (or a device table
    // when there are many), the last block publishes the sums to mapped
    // pinned memory and re-zeroes the accumulators, so a call is one launch
    // and one stream synchronization.
    cudaError_t run(const ChecksumJob* jobs, uint32_t num_jobs, uint32_t num_sums, cudaStream_t stream,
                    uint64_t* out);

    // Frees everything; call with the owning device current.
    void release();

private:
    cudaError_t reserve(uint32_t num_jobs, uint32_t num_sums);
    void* jobs_dev_ = nullptr;         // device job table (large calls only)
    void* jobs_host_ = nullptr;        // pinned staging of that table
    unsigned long long* sums_ = nullptr;      // zeroed accumulators
    unsigned int* counter_ = nullptr;         // blocks finished
    unsigned long long* out_host_ = nullptr;  // mapped pinned results
    uint32_t jobs_cap_ = 0, sums_cap_ = 0;
};

}  // namespace expcache
