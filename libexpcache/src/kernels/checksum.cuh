// The checksum kernel: reads every byte of a list of device ranges (the
// memory-bound floor of the expert GEMVs) and sums 64-bit words weighted by
// their position, so a wrong, shifted or stale byte changes the result.
#pragma once

#include <cuda_runtime.h>

#include "test_kernels.hpp"

namespace expcache {

// Device and pinned scratch one checksum call needs; owned by the CUDA test kernels.
class ChecksumScratch {
public:
    ~ChecksumScratch();
    // One launch on `stream`: jobs travel in the kernel's parameters (or a device
    // table when there are many); the last block writes the sums to result slots
    // [first, first + num_sums) of a mapped pinned area and re-zeroes the
    // accumulators. Nothing waits: read the slots after synchronizing the stream.
    cudaError_t launch(const ChecksumJob* jobs, uint32_t num_jobs, uint32_t num_sums, uint32_t first,
                       cudaStream_t stream);
    // The sums of a bank's slots (test_kernels.hpp) into result slots [first, first + n): one
    // launch whose grid depends on the class only, the slot ids read on the device.
    cudaError_t launch_bank(const BankChecksum& bank, uint32_t first, cudaStream_t stream);
    // launch_bank with bank.slots in host memory: copied to pinned scratch, then on `stream` to
    // device scratch, both at the result slots' own place [first, first + n) (launches into
    // distinct result slots never share scratch; one into the same ones must wait until the
    // earlier one's stream has finished: the pinned staging is written at once), and the kernel
    // reads them there.
    cudaError_t launch_bank_host_slots(const BankChecksum& bank, uint32_t first, cudaStream_t stream);
    // Result slots [first, first + n) as the kernels left them.
    void results(uint32_t first, uint32_t n, uint64_t* out) const;
    // Frees everything; call with the owning device current.
    void release();

private:
    cudaError_t reserve(uint32_t num_jobs, uint32_t num_sums, uint64_t results);
    void* jobs_dev_ = nullptr;            // device job table (large calls only)
    void* jobs_host_ = nullptr;           // pinned staging of that table
    cudaEvent_t table_copied_ = nullptr;  // the table's copy has run: jobs_host_ may be rewritten
    bool table_pending_ = false;
    unsigned long long* sums_ = nullptr;     // zeroed accumulators
    unsigned int* counter_ = nullptr;        // blocks finished
    unsigned long long* results_ = nullptr;  // mapped pinned result slots
    int32_t* slots_dev_ = nullptr;           // launch_bank_host_slots: slot ids by result slot, on the device
    int32_t* slots_host_ = nullptr;          // ... and their pinned staging
    uint32_t jobs_cap_ = 0, sums_cap_ = 0;
    uint64_t results_cap_ = 0;
};

}  // namespace expcache
