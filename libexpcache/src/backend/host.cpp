// Host backend: host memory stands in for device memory, with an emulated
// capacity, so every cache path (free-memory caps, the reserve, each
// out-of-memory branch) runs and is tested on machines without a GPU.
// Copies complete before returning, so streams and fences are no-ops.
// Pageable and file uploads go through the same StagingRing as on the CUDA
// backend, with a memcpy for the link.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cerrno>
#include <cstring>
#include <unordered_map>
#include <vector>

#include "backend.hpp"
#include "staging_ring.hpp"
#include "../errors.hpp"

namespace expcache {

namespace {

// The host "link": chunks are plain aligned memory and a transfer is a memcpy.
class HostTransport final : public StagingRing::Transport {
public:
    expcache_status_t alloc_chunk(uint64_t bytes, void** host, void** marker) override {
        *host = std::aligned_alloc(SourceFile::kDirectAlign, (bytes + 4095) & ~uint64_t(4095));
        *marker = nullptr;
        return *host ? EXPCACHE_OK
                     : fail(EXPCACHE_ERR_OUT_OF_HOST_MEMORY, "staging chunk of %llu bytes", (unsigned long long)bytes);
    }
    void free_chunk(void* host, void*) override { std::free(host); }
    expcache_status_t send(void* dst, const void* src, uint64_t n, void*, void*) override {
        std::memcpy(dst, src, n);
        return EXPCACHE_OK;
    }
    expcache_status_t wait(void*) override { return EXPCACHE_OK; }
};

class HostBackend final : public StagingBackend {
public:
    HostBackend(uint64_t capacity, const StagingConfig& staging)
        : StagingBackend(staging, std::unique_ptr<StagingRing::Transport>(new HostTransport())), capacity_(capacity) {}
    ~HostBackend() override {
        release_staging();
        for (auto& kv : sizes_) std::free(kv.first);
    }
    uint32_t kind() const override { return EXPCACHE_BACKEND_HOST; }

    expcache_status_t alloc(uint64_t bytes, void** out) override {
        uint64_t rounded = (bytes + 255) & ~uint64_t(255);
        if (bytes == 0 || rounded > capacity_ - used_)
            return fail(EXPCACHE_ERR_OUT_OF_DEVICE_MEMORY,
                        "emulated device memory exhausted: %llu bytes asked, %llu of %llu free",
                        (unsigned long long)bytes, (unsigned long long)(capacity_ - used_),
                        (unsigned long long)capacity_);
        void* p = std::aligned_alloc(256, rounded);
        if (!p)
            return fail(EXPCACHE_ERR_OUT_OF_HOST_MEMORY, "host allocation of %llu bytes failed",
                        (unsigned long long)rounded);
        sizes_[p] = rounded;
        used_ += rounded;
        *out = p;
        return EXPCACHE_OK;
    }
    void free_now(void* ptr) override {
        auto it = sizes_.find(ptr);
        if (it == sizes_.end()) return;
        used_ -= it->second;
        sizes_.erase(it);
        std::free(ptr);
    }
    expcache_status_t free_after(void* ptr, void*) override {
        free_now(ptr);
        return EXPCACHE_OK;
    }
    void reclaim() override {}
    FreeFn disown(void* ptr) override {
        auto it = sizes_.find(ptr);
        if (it != sizes_.end()) {
            used_ -= it->second;
            sizes_.erase(it);
        }
        return [](void* p, int) { std::free(p); };
    }
    // Reservations are anonymous mappings without access; map() opens the pages it covers and
    // counts its bytes against the emulated capacity, as alloc() does. The granularity is the
    // slot alignment, finer than a page: unmap() closes only the pages wholly inside its range
    // (a page it shares with a neighbouring mapping stays open).
    uint64_t map_granularity() const override { return 256; }
    expcache_status_t reserve(uint64_t bytes, void** out) override {
        void* p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED)
            return fail(EXPCACHE_ERR_OUT_OF_HOST_MEMORY, "reserving %llu bytes of addresses: %s",
                        (unsigned long long)bytes, std::strerror(errno));
        *out = p;
        return EXPCACHE_OK;
    }
    expcache_status_t map(void* at, uint64_t bytes) override {
        if (bytes == 0 || bytes > capacity_ - used_)
            return fail(EXPCACHE_ERR_OUT_OF_DEVICE_MEMORY,
                        "emulated device memory exhausted: %llu bytes asked, %llu of %llu free",
                        (unsigned long long)bytes, (unsigned long long)(capacity_ - used_),
                        (unsigned long long)capacity_);
        const uintptr_t a = reinterpret_cast<uintptr_t>(at);
        const uintptr_t from = a & ~(page() - 1), to = (a + bytes + page() - 1) & ~(page() - 1);
        if (mprotect(reinterpret_cast<void*>(from), to - from, PROT_READ | PROT_WRITE) != 0)
            return fail(EXPCACHE_ERR_OUT_OF_HOST_MEMORY, "mapping %llu bytes: %s", (unsigned long long)bytes,
                        std::strerror(errno));
        used_ += bytes;
        return EXPCACHE_OK;
    }
    void unmap(void* at, uint64_t bytes) override {
        used_ -= bytes;
        close_pages(at, bytes);
    }
    void unreserve(void* base, uint64_t bytes) override { munmap(base, bytes); }
    UnreserveFn disown_reserved(void*, uint64_t, const Mapping* mappings, size_t n) override {
        for (size_t i = 0; i < n; ++i) used_ -= mappings[i].bytes;
        return [](void* base, uint64_t bytes, const Mapping*, size_t, int) { munmap(base, bytes); };
    }

    expcache_status_t mem_info(uint64_t* free_bytes, uint64_t* total_bytes) override {
        *free_bytes = capacity_ - used_;
        *total_bytes = capacity_;
        return EXPCACHE_OK;
    }
    expcache_status_t copy_h2d_direct(void* dst, const void* src, uint64_t bytes, void*) override {
        std::memcpy(dst, src, bytes);
        return EXPCACHE_OK;
    }
    expcache_status_t copy_d2d(void* dst, const void* src, uint64_t bytes, void*) override {
        std::memcpy(dst, src, bytes);
        return EXPCACHE_OK;
    }
    expcache_status_t copy_d2h_sync(void* dst, const void* src, uint64_t bytes) override {
        std::memcpy(dst, src, bytes);
        return EXPCACHE_OK;
    }
    expcache_status_t copy_h2d_sync(void* dst, const void* src, uint64_t bytes) override {
        std::memcpy(dst, src, bytes);
        return EXPCACHE_OK;
    }
    expcache_status_t fence(void*, void*) override { return EXPCACHE_OK; }
    expcache_status_t sync_stream(void*) override { return EXPCACHE_OK; }
    expcache_status_t sync_device() override { return EXPCACHE_OK; }

private:
    static uintptr_t page() {
        static const uintptr_t size = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
        return size;
    }
    // Gives back and closes the pages wholly inside [at, at + bytes).
    static void close_pages(void* at, uint64_t bytes) {
        const uintptr_t a = reinterpret_cast<uintptr_t>(at);
        const uintptr_t from = (a + page() - 1) & ~(page() - 1), to = (a + bytes) & ~(page() - 1);
        if (to <= from) return;
        madvise(reinterpret_cast<void*>(from), to - from, MADV_DONTNEED);
        mprotect(reinterpret_cast<void*>(from), to - from, PROT_NONE);
    }

    uint64_t capacity_;
    uint64_t used_ = 0;
    std::unordered_map<void*, uint64_t> sizes_;
};

}  // namespace

std::unique_ptr<StagingBackend> make_host_backend(uint64_t capacity_bytes, const StagingConfig& staging) {
    return std::unique_ptr<StagingBackend>(new HostBackend(capacity_bytes, staging));
}

}  // namespace expcache
