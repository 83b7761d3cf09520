// CUDA backend: cudaMalloc'd buffers, banks of cuMemMap'd pieces, async copies on the caller's stream,
// events to fence slot reuse across streams and to defer frees.
#include <cuda.h>
#include <cuda_runtime.h>

#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "backend.hpp"
#include "cuda_errors.cuh"
#include "staging_ring.hpp"

namespace expcache {

namespace {

// The arrays of one cudaMemcpyBatchAsync, kept between calls. A copy engine pays a few
// microseconds per transfer: measured on an H200 (benchmarks/c/copy_methods.cu), 18 parts of
// 160-192 KiB cross at 52 GB/s in one batch, at 30 GB/s one cudaMemcpyAsync each.
class MemcpyBatch {
public:
    // Enqueue n copies, host to device, on `s` in one call; fill(i) sets copy i (set()). *done
    // is false (and the status OK) when they must go one by one instead: a single copy, the
    // legacy default stream (which the batch function refuses), a driver without the function,
    // or an argument refused (the copies one by one then say which, if one is wrong).
    template <typename Fill>
    expcache_status_t send_all(size_t n, cudaStream_t s, Fill&& fill, bool* done) {
        *done = false;
        if (n < 2 || !supported_ || s == nullptr || s == cudaStreamLegacy) return EXPCACHE_OK;
        expcache_status_t st = resize(n);
        if (st != EXPCACHE_OK) return st;
        for (size_t i = 0; i < n; ++i) fill(i);
        return send(n, s, done);
    }
    void set(size_t i, void* dst, const void* src, size_t bytes) {
        dst_[i] = dst;
        src_[i] = src;
        bytes_[i] = bytes;
    }

private:
    expcache_status_t resize(size_t n) {
        try {
            dst_.resize(n);
            src_.resize(n);
            bytes_.resize(n);
        } catch (const std::bad_alloc&) {
            return fail(EXPCACHE_ERR_OUT_OF_HOST_MEMORY, "no host memory for a batch of %zu uploads", n);
        }
        return EXPCACHE_OK;
    }
    expcache_status_t send(size_t n, cudaStream_t s, bool* done) {
        *done = false;
        cudaMemcpyAttributes attr = {};
        attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
        size_t first = 0;
        cudaError_t e = cudaMemcpyBatchAsync(dst_.data(), src_.data(), bytes_.data(), n, &attr, &first, 1, s);
        if (e == cudaSuccess) {
            *done = true;
            return EXPCACHE_OK;
        }
        if (e != cudaErrorNotSupported && e != cudaErrorInvalidValue) return cuda_fail(e, "cudaMemcpyBatchAsync");
        cudaGetLastError();
        if (e == cudaErrorNotSupported) supported_ = false;
        return EXPCACHE_OK;
    }

    bool supported_ = true;
    std::vector<void*> dst_;
    std::vector<const void*> src_;
    std::vector<size_t> bytes_;
};

// The driver's virtual memory functions (a bank: a reserved range backed piece by piece), taken
// through the runtime's entry-point query so that the library does not link libcuda itself.
struct Vmm {
    decltype(&cuMemAddressReserve) reserve = nullptr;
    decltype(&cuMemAddressFree) free = nullptr;
    decltype(&cuMemCreate) create = nullptr;
    decltype(&cuMemRelease) release = nullptr;
    decltype(&cuMemMap) map = nullptr;
    decltype(&cuMemUnmap) unmap = nullptr;
    decltype(&cuMemSetAccess) set_access = nullptr;
    decltype(&cuMemGetAllocationGranularity) granularity = nullptr;
    decltype(&cuGetErrorName) error_name = nullptr;
    expcache_status_t status = EXPCACHE_OK;
    std::string why;

    static const Vmm& get() {
        static Vmm vmm;
        static std::once_flag once;
        std::call_once(once, [] { vmm.load(); });
        return vmm;
    }
    // A driver error as a status (an allocation failure is OUT_OF_DEVICE_MEMORY).
    expcache_status_t fail_with(CUresult r, const char* what) const {
        const char* name = "?";
        if (error_name) error_name(r, &name);
        return fail(r == CUDA_ERROR_OUT_OF_MEMORY ? EXPCACHE_ERR_OUT_OF_DEVICE_MEMORY : EXPCACHE_ERR_CUDA, "%s: %s",
                    what, name);
    }

private:
    template <typename F>
    void take(const char* symbol, F* out) {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
        cudaError_t e = cudaGetDriverEntryPointByVersion(symbol, &fn, 12000, cudaEnableDefault, &found);
        if (e != cudaSuccess || found != cudaDriverEntryPointSuccess || !fn) {
            cudaGetLastError();
            if (status == EXPCACHE_OK) {
                status = EXPCACHE_ERR_UNSUPPORTED;
                why = std::string("the driver has no ") + symbol;
            }
            return;
        }
        *out = reinterpret_cast<F>(fn);
    }
    void load() {
        take("cuMemAddressReserve", &reserve);
        take("cuMemAddressFree", &free);
        take("cuMemCreate", &create);
        take("cuMemRelease", &release);
        take("cuMemMap", &map);
        take("cuMemUnmap", &unmap);
        take("cuMemSetAccess", &set_access);
        take("cuMemGetAllocationGranularity", &granularity);
        take("cuGetErrorName", &error_name);
    }
};

// Pageable host memory cannot be DMA'd directly at full speed: the driver
// stages it through its own small pinned buffer, one chunk at a time (about
// 6 GB/s on PCIe 5, ../shared/CONTEXT.md). The StagingRing stages it (and
// file reads) ourselves, into chunks of page-locked memory; this is its link:
// a cudaMemcpyAsync on the caller's stream, and an event behind it that the
// ring waits on before it refills the chunk.
class CudaTransport final : public StagingRing::Transport {
public:
    explicit CudaTransport(int device) : device_(device) {}
    expcache_status_t alloc_chunk(uint64_t bytes, void** host, void** marker) override {
        *host = nullptr;
        cudaEvent_t ev = nullptr;
        cudaError_t e = cudaMallocHost(host, bytes);
        if (e == cudaSuccess) e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
        if (e != cudaSuccess) {
            if (*host) cudaFreeHost(*host);
            return cuda_fail(e, "pinned staging chunk");
        }
        *marker = ev;
        return EXPCACHE_OK;
    }
    void free_chunk(void* host, void* marker) override {
        cudaEventDestroy(static_cast<cudaEvent_t>(marker));
        cudaFreeHost(host);
    }
    expcache_status_t send(void* dst, const void* src, uint64_t n, void* stream, void* marker) override {
        cudaStream_t s = static_cast<cudaStream_t>(stream);
        EXPCACHE_CUDA_TRY(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, s));
        EXPCACHE_CUDA_TRY(cudaEventRecord(static_cast<cudaEvent_t>(marker), s));
        return EXPCACHE_OK;
    }
    // The pieces filled together: one cudaMemcpyBatchAsync, then each chunk's event.
    expcache_status_t send_batch(const Send* sends, size_t n, void* stream, size_t* sent) override {
        cudaStream_t s = static_cast<cudaStream_t>(stream);
        *sent = 0;
        bool done = false;
        expcache_status_t st =
            batch_.send_all(n, s, [&](size_t i) { batch_.set(i, sends[i].dst, sends[i].src, sends[i].n); }, &done);
        if (st != EXPCACHE_OK) return st;
        if (!done) return Transport::send_batch(sends, n, stream, sent);
        for (size_t i = 0; i < n; ++i) {
            cudaError_t e = cudaEventRecord(static_cast<cudaEvent_t>(sends[i].marker), s);
            if (e != cudaSuccess) {
                // The copies are enqueued but some chunks have no event behind them: let the
                // copies finish before those chunks can be refilled.
                cudaStreamSynchronize(s);
                *sent = n;
                return cuda_fail(e, "cudaEventRecord");
            }
        }
        *sent = n;
        return EXPCACHE_OK;
    }
    expcache_status_t wait(void* marker) override {
        EXPCACHE_CUDA_TRY(cudaEventSynchronize(static_cast<cudaEvent_t>(marker)));
        return EXPCACHE_OK;
    }
    bool done(void* marker) override {
        // A failed transfer counts as done here; wait() reports it.
        return cudaEventQuery(static_cast<cudaEvent_t>(marker)) != cudaErrorNotReady;
    }
    void thread_start() override { cudaSetDevice(device_); }

private:
    int device_;
    MemcpyBatch batch_;  // the caller's thread's (send_batch)
};

class CudaBackend final : public StagingBackend {
public:
    CudaBackend(int device, const StagingConfig& staging)
        : StagingBackend(staging, std::unique_ptr<StagingRing::Transport>(new CudaTransport(device))),
          device_(device) {}
    ~CudaBackend() override {
        enter();
        release_staging();
        cudaDeviceSynchronize();
        for (auto& d : deferred_) {
            cudaFree(d.ptr);
            cudaEventDestroy(d.event);
        }
        for (cudaEvent_t e : event_pool_) cudaEventDestroy(e);
        for (cudaEvent_t e : {fence_event_, ready_event_, marks_[0], marks_[1]})
            if (e) cudaEventDestroy(e);
        if (copy_stream_) cudaStreamDestroy(copy_stream_);
        leave();
    }
    expcache_status_t init() {
        enter();
        cudaError_t e = cudaSuccess;
        for (cudaEvent_t* ev : {&fence_event_, &ready_event_, &marks_[0], &marks_[1]})
            if (e == cudaSuccess) e = cudaEventCreateWithFlags(ev, cudaEventDisableTiming);
        // Non-blocking: the legacy default stream must not serialize with it; the cache orders it
        // against the caller's streams with events.
        if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking);
        leave();
        if (e != cudaSuccess) return cuda_fail(e, "creating the cache's events and copy stream");
        const Vmm& vmm = Vmm::get();
        if (vmm.status != EXPCACHE_OK)
            return fail(vmm.status, "the CUDA driver lacks virtual memory management (%s), which the slot banks need",
                        vmm.why.c_str());
        CUmemAllocationProp prop = {};
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = device_;
        size_t granularity = 0;
        CUresult r = vmm.granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
        if (r != CUDA_SUCCESS) return vmm.fail_with(r, "cuMemGetAllocationGranularity");
        granularity_ = granularity;
        return EXPCACHE_OK;
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
    FreeFn disown(void*) override {
        // cudaFree waits for the device, so work still reading the memory finishes first.
        return [](void* p, int device) {
            int previous = -1;
            if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
            if (previous != device) cudaSetDevice(device);
            cudaFree(p);
            if (previous >= 0 && previous != device) cudaSetDevice(previous);
            cudaGetLastError();  // nothing to report to: the cache may be gone
        };
    }
    int device_ordinal() const override { return device_; }

    // Banks: cuMemAddressReserve'd ranges, backed by cuMemCreate'd pieces mapped into them. A
    // piece's handle is released as soon as it is mapped: the mapping keeps its memory until
    // cuMemUnmap.
    uint64_t map_granularity() const override { return granularity_; }
    expcache_status_t reserve(uint64_t bytes, void** out) override {
        const Vmm& vmm = Vmm::get();
        CUdeviceptr p = 0;
        CUresult r = vmm.reserve(&p, bytes, 0, 0, 0);
        if (r != CUDA_SUCCESS) return vmm.fail_with(r, "cuMemAddressReserve");
        *out = reinterpret_cast<void*>(p);
        return EXPCACHE_OK;
    }
    expcache_status_t map(void* at, uint64_t bytes) override {
        const Vmm& vmm = Vmm::get();
        CUmemAllocationProp prop = {};
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = device_;
        CUmemGenericAllocationHandle handle = 0;
        CUresult r = vmm.create(&handle, bytes, &prop, 0);
        if (r != CUDA_SUCCESS) return vmm.fail_with(r, "cuMemCreate");
        const CUdeviceptr p = reinterpret_cast<CUdeviceptr>(at);
        r = vmm.map(p, bytes, 0, handle, 0);
        vmm.release(handle);
        if (r != CUDA_SUCCESS) return vmm.fail_with(r, "cuMemMap");
        CUmemAccessDesc access = {};
        access.location = prop.location;
        access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        r = vmm.set_access(p, bytes, &access, 1);
        if (r != CUDA_SUCCESS) {
            vmm.unmap(p, bytes);
            return vmm.fail_with(r, "cuMemSetAccess");
        }
        return EXPCACHE_OK;
    }
    void unmap(void* at, uint64_t bytes) override { Vmm::get().unmap(reinterpret_cast<CUdeviceptr>(at), bytes); }
    void unreserve(void* base, uint64_t bytes) override { Vmm::get().free(reinterpret_cast<CUdeviceptr>(base), bytes); }
    UnreserveFn disown_reserved(void*, uint64_t, const Mapping*, size_t) override {
        // Work still reading the memory finishes first (cuMemUnmap does not wait for it).
        return [](void* base, uint64_t bytes, const Mapping* mappings, size_t n, int device) {
            int previous = -1;
            if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
            if (previous != device) cudaSetDevice(device);
            cudaDeviceSynchronize();
            const Vmm& vmm = Vmm::get();
            for (size_t i = 0; i < n; ++i) vmm.unmap(reinterpret_cast<CUdeviceptr>(mappings[i].at), mappings[i].bytes);
            vmm.free(reinterpret_cast<CUdeviceptr>(base), bytes);
            if (previous >= 0 && previous != device) cudaSetDevice(previous);
            cudaGetLastError();  // nothing to report to: the cache may be gone
        };
    }

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
    expcache_status_t copy_h2d_direct(void* dst, const void* src, uint64_t bytes, void* stream) override {
        EXPCACHE_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, static_cast<cudaStream_t>(stream)));
        return EXPCACHE_OK;
    }
    // One cudaMemcpyBatchAsync for the lot (MemcpyBatch), or one by one where it cannot be.
    expcache_status_t copy_h2d_batch(const DirectCopy* copies, size_t n) override {
        bool done = false;
        expcache_status_t st = batch_.send_all(
            n, static_cast<cudaStream_t>(copies[0].stream),
            [&](size_t i) { batch_.set(i, copies[i].dst, copies[i].src, copies[i].bytes); }, &done);
        if (st != EXPCACHE_OK || done) return st;
        return StagingBackend::copy_h2d_batch(copies, n);
    }
    expcache_status_t copy_d2d(void* dst, const void* src, uint64_t bytes, void* stream) override {
        EXPCACHE_CUDA_TRY(
            cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream)));
        return EXPCACHE_OK;
    }
    expcache_status_t copy_d2h_sync(void* dst, const void* src, uint64_t bytes) override {
        EXPCACHE_CUDA_TRY(cudaDeviceSynchronize());
        EXPCACHE_CUDA_TRY(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
        return EXPCACHE_OK;
    }
    expcache_status_t copy_h2d_sync(void* dst, const void* src, uint64_t bytes) override {
        EXPCACHE_CUDA_TRY(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
        return EXPCACHE_OK;
    }
    expcache_status_t fence(void* from, void* to) override {
        EXPCACHE_CUDA_TRY(cudaEventRecord(fence_event_, static_cast<cudaStream_t>(from)));
        EXPCACHE_CUDA_TRY(cudaStreamWaitEvent(static_cast<cudaStream_t>(to), fence_event_, 0));
        return EXPCACHE_OK;
    }
    void* copy_stream() override { return copy_stream_; }
    expcache_status_t record_ready(void* stream, void** out_event) override {
        EXPCACHE_CUDA_TRY(cudaEventRecord(ready_event_, static_cast<cudaStream_t>(stream)));
        *out_event = ready_event_;
        return EXPCACHE_OK;
    }
    bool is_ready_event(const void* event) const override { return event == nullptr || event == ready_event_; }
    expcache_status_t wait_ready(void* event, void* stream) override {
        if (event)
            EXPCACHE_CUDA_TRY(
                cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0));
        return EXPCACHE_OK;
    }
    expcache_status_t mark(int i, void* stream) override {
        EXPCACHE_CUDA_TRY(cudaEventRecord(marks_[i & 1], static_cast<cudaStream_t>(stream)));
        return EXPCACHE_OK;
    }
    expcache_status_t wait_mark(int i, void* stream) override {
        EXPCACHE_CUDA_TRY(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), marks_[i & 1], 0));
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

private:
    struct Deferred {
        void* ptr;
        cudaEvent_t event;
    };
    int device_;
    uint64_t granularity_ = uint64_t(2) << 20;
    MemcpyBatch batch_;
    int depth_ = 0;
    int saved_device_ = -1;
    cudaEvent_t fence_event_ = nullptr;
    cudaEvent_t ready_event_ = nullptr;  // behind a split select's misses
    cudaEvent_t marks_[2] = {};          // the starts of the last two serving calls (prefetch ordering)
    cudaStream_t copy_stream_ = nullptr;
    std::vector<Deferred> deferred_;
    std::vector<cudaEvent_t> event_pool_;
};

}  // namespace

expcache_status_t make_cuda_backend(int device, const StagingConfig& staging, std::unique_ptr<StagingBackend>* out) {
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return fail(EXPCACHE_ERR_UNSUPPORTED, "no usable CUDA device: cudaGetDeviceCount: %s (%s)", cudaGetErrorName(e),
                    cudaGetErrorString(e));
    }
    if (device < 0 || device >= count)
        return fail(EXPCACHE_ERR_UNSUPPORTED, "CUDA device %d not present (%d device(s))", device, count);
    std::unique_ptr<CudaBackend> b(new CudaBackend(device, staging));
    expcache_status_t s = b->init();
    if (s != EXPCACHE_OK) return s;
    out->reset(b.release());
    return EXPCACHE_OK;
}

}  // namespace expcache
