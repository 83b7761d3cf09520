// The host backend's test kernels: computed on the calling thread, at once.
#include <chrono>
#include <cstring>
#include <vector>

#include "test_kernels.hpp"

namespace expcache {

uint64_t checksum_host(const void* ptr, uint64_t bytes) {
    const unsigned char* p = static_cast<const unsigned char*>(ptr);
    uint64_t sum = 0;
    uint64_t words = bytes / 8;
    for (uint64_t j = 0; j < words; ++j) {
        uint64_t w;
        std::memcpy(&w, p + 8 * j, 8);
        sum += w * (2 * j + 1);
    }
    uint64_t tail = bytes % 8;
    if (tail) {
        uint64_t w = 0;
        std::memcpy(&w, p + 8 * words, tail);
        sum += w * (2 * words + 1);
    }
    return sum;
}

namespace {

class HostKernels final : public TestKernels {
public:
    expcache_status_t checksum_async(const ChecksumJob* jobs, uint32_t num_jobs, uint32_t num_sums, uint32_t first,
                                     void*) override {
        if (results_.size() < uint64_t(first) + num_sums) results_.resize(uint64_t(first) + num_sums, 0);
        for (uint32_t i = 0; i < num_sums; ++i) results_[first + i] = 0;
        for (uint32_t i = 0; i < num_jobs; ++i)
            results_[first + jobs[i].out] += checksum_host(jobs[i].ptr, jobs[i].bytes);
        return EXPCACHE_OK;
    }
    expcache_status_t bank_checksum_async(const BankChecksum& b, uint32_t first, void*) override {
        if (results_.size() < uint64_t(first) + b.n) results_.resize(uint64_t(first) + b.n, 0);
        for (uint32_t i = 0; i < b.n; ++i) {
            const int32_t slot = b.slots[i];
            uint64_t sum = 0;
            if (b.readable(slot))
                for (int p = 0; p < EXPCACHE_MAX_PARTS; ++p)
                    sum += checksum_host(b.base + b.part_at[p] + uint64_t(slot) * b.part_stride[p], b.part_bytes[p]);
            results_[first + i] = sum;
        }
        return EXPCACHE_OK;
    }
    expcache_status_t bank_checksum_host_slots_async(const BankChecksum& b, uint32_t first, void* stream) override {
        return bank_checksum_async(b, first, stream);  // the host backend's slots are in host memory already
    }
    expcache_status_t checksum_results(uint32_t first, uint32_t n, uint64_t* out) override {
        for (uint32_t i = 0; i < n; ++i) out[i] = uint64_t(first) + i < results_.size() ? results_[first + i] : 0;
        return EXPCACHE_OK;
    }
    expcache_status_t spin_async(uint64_t ns, void*) override {
        const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(ns);
        while (std::chrono::steady_clock::now() < until) {
        }
        return EXPCACHE_OK;
    }

private:
    std::vector<uint64_t> results_;  // checksum result slots
};

}  // namespace

std::unique_ptr<TestKernels> make_host_kernels() {
    return std::unique_ptr<TestKernels>(new HostKernels());
}

}  // namespace expcache
