// The CUDA build's test kernels: the checksum kernel and the spin kernel, launched on the
// caller's stream with the cache's device current (the cache's call scope makes it so).
#include "../backend/cuda_errors.cuh"
#include "checksum.cuh"
#include "spin.cuh"
#include "test_kernels.hpp"

namespace expcache {

namespace {

class CudaKernels final : public TestKernels {
public:
    explicit CudaKernels(int device) : device_(device) {}
    ~CudaKernels() override {
        int previous = -1;
        if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
        if (previous != device_) cudaSetDevice(device_);
        checksum_.release();
        if (previous >= 0 && previous != device_) cudaSetDevice(previous);
    }
    expcache_status_t checksum_async(const ChecksumJob* jobs, uint32_t num_jobs, uint32_t num_sums, uint32_t first,
                                     void* stream) override {
        EXPCACHE_CUDA_TRY(checksum_.launch(jobs, num_jobs, num_sums, first, static_cast<cudaStream_t>(stream)));
        return EXPCACHE_OK;
    }
    expcache_status_t bank_checksum_async(const BankChecksum& bank, uint32_t first, void* stream) override {
        EXPCACHE_CUDA_TRY(checksum_.launch_bank(bank, first, static_cast<cudaStream_t>(stream)));
        return EXPCACHE_OK;
    }
    expcache_status_t bank_checksum_host_slots_async(const BankChecksum& bank, uint32_t first, void* stream) override {
        EXPCACHE_CUDA_TRY(checksum_.launch_bank_host_slots(bank, first, static_cast<cudaStream_t>(stream)));
        return EXPCACHE_OK;
    }
    expcache_status_t checksum_results(uint32_t first, uint32_t n, uint64_t* out) override {
        checksum_.results(first, n, out);
        return EXPCACHE_OK;
    }
    expcache_status_t spin_async(uint64_t ns, void* stream) override {
        EXPCACHE_CUDA_TRY(launch_spin(ns, static_cast<cudaStream_t>(stream)));
        return EXPCACHE_OK;
    }

private:
    int device_;
    ChecksumScratch checksum_;
};

}  // namespace

std::unique_ptr<TestKernels> make_cuda_kernels(int device) {
    return std::unique_ptr<TestKernels>(new CudaKernels(device));
}

}  // namespace expcache
