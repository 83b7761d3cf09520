// CUDA backend: cudaMalloc'd slabs, async copies on the caller's stream,
// events to fence slot reuse across streams and to defer frees.
#include <cuda_runtime.h>

#include <vector>

#include "backend.hpp"
#include "copy_pool.hpp"
#include "../errors.hpp"
#include "../kernels/checksum.cuh"

namespace expcache {

namespace {

// Errors after which the context is unusable: the handle is poisoned.
bool is_sticky(cudaError_t e) {
    switch (e) {
        case cudaErrorIllegalAddress:
        case cudaErrorLaunchFailure:
        case cudaErrorHardwareStackError:
        case cudaErrorIllegalInstruction:
        case cudaErrorMisalignedAddress:
        case cudaErrorInvalidAddressSpace:
        case cudaErrorInvalidPc:
        case cudaErrorAssert:
        case cudaErrorLaunchTimeout:
        case cudaErrorECCUncorrectable:
            return true;
        default:
            return false;
    }
}

expcache_status_t cuda_fail(cudaError_t e, const char* what) {
    cudaGetLastError();  // clear a non-sticky error so it does not leak into the caller's next check
    if (e == cudaErrorMemoryAllocation)
        return fail(EXPCACHE_ERR_OUT_OF_DEVICE_MEMORY, "%s: %s (%s)", what, cudaGetErrorName(e),
                    cudaGetErrorString(e));
    return fail(is_sticky(e) ? EXPCACHE_ERR_POISONED : EXPCACHE_ERR_CUDA, "%s: %s (%s)", what,
                cudaGetErrorName(e), cudaGetErrorString(e));
}

#define EXPCACHE_CUDA_TRY(call)                                  \
    do {                                                         \
        cudaError_t e_ = (call);                                 \
        if (e_ != cudaSuccess) return cuda_fail(e_, #call);      \
    } while (0)

// Pageable host memory cannot be DMA'd directly at full speed: the driver
// stages it through its own small pinned buffer, one chunk at a time (about
// 6 GB/s on PCIe 5, ../shared/CONTEXT.md). The ring stages it ourselves:
// worker threads copy chunk i+1 into a pinned buffer while chunk i crosses
// the link; a buffer is reused only after the event recorded behind its
// copy has completed.
class PinnedRing {
public:
    PinnedRing(uint32_t threads, uint64_t bytes) : pool_(threads), total_(bytes) {}
    ~PinnedRing() { release(); }

    void release() {
        for (Slot& s : slots_) {
            if (s.used) cudaEventSynchronize(s.done);
            cudaEventDestroy(s.done);
            cudaFreeHost(s.host);
        }
        slots_.clear();
    }

    expcache_status_t upload(void* dst, const void* src, uint64_t bytes, cudaStream_t stream) {
        const char* from = static_cast<const char*>(src);
        return stage(dst, bytes, stream, [&](char* host, uint64_t off, uint64_t n, uint64_t* delta) {
            *delta = 0;
            pool_.copy(host, from + off, n);
            return static_cast<expcache_status_t>(EXPCACHE_OK);
        });
    }

    // File bytes: preads into the ring, split between the threads (several reads in
    // flight). With O_DIRECT the 4096-aligned range around each chunk is read and
    // the transfer starts at the chunk's offset inside it.
    expcache_status_t upload_file(void* dst, const SourceFile& file, uint64_t offset, uint64_t bytes,
                                  cudaStream_t stream) {
        const uint64_t align = SourceFile::kDirectAlign;
        return stage(dst, bytes, stream, [&](char* host, uint64_t off, uint64_t n, uint64_t* delta) {
            uint64_t at = offset + off;
            if (!file.direct()) {
                *delta = 0;
                return pool_.run(n, 4096, [&](uint64_t b, uint64_t len) { return file.read(host + b, at + b, len); });
            }
            uint64_t first = at / align * align;
            uint64_t span = (at + n - first + align - 1) / align * align;
            *delta = at - first;
            return pool_.run(span, align, [&](uint64_t b, uint64_t len) {
                return file.read_aligned(host + b, first + b, len);
            });
        });
    }

private:
    struct Slot {
        void* host = nullptr;
        cudaEvent_t done = nullptr;
        bool used = false;
    };

    // Chunk by chunk: wait until the slot's previous transfer is done, let `fill`
    // put the chunk's bytes at slot + *delta, then enqueue the transfer.
    template <typename Fill>
    expcache_status_t stage(void* dst, uint64_t bytes, cudaStream_t stream, Fill&& fill) {
        if (slots_.empty()) {
            expcache_status_t s = init();
            if (s != EXPCACHE_OK) return s;
        }
        char* to = static_cast<char*>(dst);
        for (uint64_t off = 0; off < bytes; off += chunk_) {
            uint64_t n = bytes - off < chunk_ ? bytes - off : chunk_;
            Slot& slot = slots_[next_];
            next_ = (next_ + 1) % slots_.size();
            if (slot.used) EXPCACHE_CUDA_TRY(cudaEventSynchronize(slot.done));
            slot.used = false;
            uint64_t delta = 0;
            expcache_status_t s = fill(static_cast<char*>(slot.host), off, n, &delta);
            if (s != EXPCACHE_OK) return s;
            EXPCACHE_CUDA_TRY(cudaMemcpyAsync(to + off, static_cast<char*>(slot.host) + delta, n,
                                              cudaMemcpyHostToDevice, stream));
            EXPCACHE_CUDA_TRY(cudaEventRecord(slot.done, stream));
            slot.used = true;
        }
        return EXPCACHE_OK;
    }
    expcache_status_t init() {
        // 2 MiB chunks: small enough that the copy into chunk i+1 overlaps the
        // transfer of chunk i within one expert, large enough that waking the
        // copy threads is cheap next to the copy.
        chunk_ = uint64_t(2) << 20;
        if (total_ < 4 * chunk_) chunk_ = total_ / 4;
        uint64_t n = total_ / chunk_;
        for (uint64_t i = 0; i < n; ++i) {
            Slot s;
            // Room for a chunk plus the alignment slack of an O_DIRECT read around it.
            cudaError_t e = cudaMallocHost(&s.host, chunk_ + 2 * SourceFile::kDirectAlign);
            if (e == cudaSuccess) e = cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming);
            if (e != cudaSuccess) {
                if (s.host) cudaFreeHost(s.host);
                release();
                return cuda_fail(e, "pinned staging ring");
            }
            slots_.push_back(s);
        }
        return EXPCACHE_OK;
    }
    CopyPool pool_;
    uint64_t total_;
    uint64_t chunk_ = 0;
    std::vector<Slot> slots_;
    size_t next_ = 0;
};

class CudaBackend final : public Backend {
public:
    CudaBackend(int device, uint32_t copy_threads, uint64_t staging_bytes)
        : device_(device), copy_threads_(copy_threads), staging_bytes_(staging_bytes) {}
    ~CudaBackend() override {
        enter();
        cudaDeviceSynchronize();
        for (auto& d : deferred_) {
            cudaFree(d.ptr);
            cudaEventDestroy(d.event);
        }
        for (cudaEvent_t e : event_pool_) cudaEventDestroy(e);
        if (fence_event_) cudaEventDestroy(fence_event_);
        checksum_.release();
        if (ring_) ring_->release();
        leave();
    }
    expcache_status_t init() {
        enter();
        cudaError_t e = cudaEventCreateWithFlags(&fence_event_, cudaEventDisableTiming);
        leave();
        return e == cudaSuccess ? EXPCACHE_OK : cuda_fail(e, "cudaEventCreateWithFlags");
    }
    uint32_t kind() const override { return EXPCACHE_BACKEND_CUDA; }

    void enter() override {
        if (depth_++ == 0) {
            saved_device_ = -1;
            if (cudaGetDevice(&saved_device_) != cudaSuccess) saved_device_ = -1;
            if (saved_device_ != device_) cudaSetDevice(device_);
        }
    }
    void leave() override {
        if (--depth_ == 0 && saved_device_ >= 0 && saved_device_ != device_) cudaSetDevice(saved_device_);
    }

    expcache_status_t alloc(uint64_t bytes, void** out) override {
        void* p = nullptr;
        cudaError_t e = cudaMalloc(&p, bytes);
        if (e != cudaSuccess) return cuda_fail(e, "cudaMalloc");
        *out = p;
        return EXPCACHE_OK;
    }
    void free_now(void* ptr) override { cudaFree(ptr); }
    expcache_status_t free_after(void* ptr, void* stream) override {
        cudaEvent_t ev;
        if (event_pool_.empty()) {
            EXPCACHE_CUDA_TRY(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
        } else {
            ev = event_pool_.back();
            event_pool_.pop_back();
        }
        cudaError_t e = cudaEventRecord(ev, static_cast<cudaStream_t>(stream));
        if (e != cudaSuccess) {
            event_pool_.push_back(ev);
            return cuda_fail(e, "cudaEventRecord");
        }
        deferred_.push_back({ptr, ev});
        return EXPCACHE_OK;
    }
    void reclaim() override {
        size_t kept = 0;
        for (size_t i = 0; i < deferred_.size(); ++i) {
            if (cudaEventQuery(deferred_[i].event) == cudaSuccess) {
                cudaFree(deferred_[i].ptr);
                event_pool_.push_back(deferred_[i].event);
            } else {
                deferred_[kept++] = deferred_[i];
            }
        }
        deferred_.resize(kept);
        cudaGetLastError();  // cudaErrorNotReady from queries is not an error
    }
    expcache_status_t mem_info(uint64_t* free_bytes, uint64_t* total_bytes) override {
        size_t f = 0, t = 0;
        EXPCACHE_CUDA_TRY(cudaMemGetInfo(&f, &t));
        *free_bytes = f;
        *total_bytes = t;
        return EXPCACHE_OK;
    }
    expcache_status_t copy_h2d(void* dst, const void* src, uint64_t bytes, bool pinned, void* stream) override {
        if (!pinned && copy_threads_ > 0) return ring().upload(dst, src, bytes, static_cast<cudaStream_t>(stream));
        EXPCACHE_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, static_cast<cudaStream_t>(stream)));
        return EXPCACHE_OK;
    }
    expcache_status_t read_file(void* dst, const SourceFile& file, uint64_t offset, uint64_t bytes,
                                void* stream) override {
        return ring().upload_file(dst, file, offset, bytes, static_cast<cudaStream_t>(stream));
    }
    expcache_status_t copy_d2d(void* dst, const void* src, uint64_t bytes, void* stream) override {
        EXPCACHE_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream)));
        return EXPCACHE_OK;
    }
    expcache_status_t copy_d2h_sync(void* dst, const void* src, uint64_t bytes) override {
        EXPCACHE_CUDA_TRY(cudaDeviceSynchronize());
        EXPCACHE_CUDA_TRY(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
        return EXPCACHE_OK;
    }
    expcache_status_t fence(void* from, void* to) override {
        EXPCACHE_CUDA_TRY(cudaEventRecord(fence_event_, static_cast<cudaStream_t>(from)));
        EXPCACHE_CUDA_TRY(cudaStreamWaitEvent(static_cast<cudaStream_t>(to), fence_event_, 0));
        return EXPCACHE_OK;
    }
    expcache_status_t sync_stream(void* stream) override {
        EXPCACHE_CUDA_TRY(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
        return EXPCACHE_OK;
    }
    expcache_status_t sync_device() override {
        EXPCACHE_CUDA_TRY(cudaDeviceSynchronize());
        return EXPCACHE_OK;
    }
    expcache_status_t checksum_async(const ChecksumJob* jobs, uint32_t num_jobs, uint32_t num_sums, uint32_t first,
                                     void* stream) override {
        EXPCACHE_CUDA_TRY(checksum_.launch(jobs, num_jobs, num_sums, first, static_cast<cudaStream_t>(stream)));
        return EXPCACHE_OK;
    }
    expcache_status_t checksum_results(uint32_t first, uint32_t n, uint64_t* out) override {
        checksum_.results(first, n, out);
        return EXPCACHE_OK;
    }

private:
    // Made on first use: caches over pinned sources never start the threads.
    PinnedRing& ring() {
        if (!ring_) ring_.reset(new PinnedRing(copy_threads_ > 0 ? copy_threads_ - 1 : 0, staging_bytes_));
        return *ring_;
    }

    struct Deferred {
        void* ptr;
        cudaEvent_t event;
    };
    int device_;
    uint32_t copy_threads_;   // 0: pageable copies go straight to cudaMemcpyAsync
    uint64_t staging_bytes_;
    int depth_ = 0;
    int saved_device_ = -1;
    cudaEvent_t fence_event_ = nullptr;
    std::vector<Deferred> deferred_;
    std::vector<cudaEvent_t> event_pool_;
    ChecksumScratch checksum_;
    std::unique_ptr<PinnedRing> ring_;
};

}  // namespace

expcache_status_t make_cuda_backend(int device, uint32_t copy_threads, uint64_t staging_bytes,
                                    std::unique_ptr<Backend>* out) {
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return fail(EXPCACHE_ERR_UNSUPPORTED, "no usable CUDA device: cudaGetDeviceCount: %s (%s)",
                    cudaGetErrorName(e), cudaGetErrorString(e));
    }
    if (device < 0 || device >= count)
        return fail(EXPCACHE_ERR_UNSUPPORTED, "CUDA device %d not present (%d device(s))", device, count);
    std::unique_ptr<CudaBackend> b(new CudaBackend(device, copy_threads, staging_bytes));
    expcache_status_t s = b->init();
    if (s != EXPCACHE_OK) return s;
    out->reset(b.release());
    return EXPCACHE_OK;
}

}  // namespace expcache
