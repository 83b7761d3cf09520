// The one internal interface both backends implement. The cache core above
// it is identical for host and CUDA; a backend only moves bytes, allocates
// "device" memory and orders streams.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "expcache.h"
#include "source_file.hpp"
#include "staging_ring.hpp"
#include "staging_tuning.hpp"

namespace expcache {

class Backend {
public:
    virtual ~Backend() = default;
    virtual uint32_t kind() const = 0;

    // Statuses: OK, OUT_OF_DEVICE_MEMORY, CUDA, POISONED (sticky error).
    virtual expcache_status_t alloc(uint64_t bytes, void** out) = 0;
    virtual void free_now(void* ptr) = 0;
    // Free once the work enqueued on `stream` so far has finished.
    virtual expcache_status_t free_after(void* ptr, void* stream) = 0;
    // Free what free_after deferred and has since become safe; never blocks.
    virtual void reclaim() = 0;
    // Forget `ptr` (from alloc) as if it were freed, without freeing it: the returned function
    // frees it later, from any thread, after this backend is gone too (memory a reference keeps
    // alive past the cache: DeviceArena). Its caller has made sure no work of the backend's
    // still writes to it.
    using FreeFn = void (*)(void* ptr, int device);
    virtual FreeFn disown(void* ptr) = 0;
    virtual int device_ordinal() const { return 0; }

    // Address ranges reserved without memory and backed piece by piece (a class's bank: its
    // address never moves while its memory grows and shrinks, as PyTorch's expandable segments
    // do with cuMemAddressReserve and cuMemMap). Offsets and sizes are multiples of
    // map_granularity(). map() backs [at, at + bytes) of a reservation with device memory
    // (OUT_OF_DEVICE_MEMORY when there is none; counted by mem_info); unmap() frees exactly one
    // range map() backed, the device done with it; unreserve() frees a range with nothing mapped.
    virtual uint64_t map_granularity() const = 0;
    virtual expcache_status_t reserve(uint64_t bytes, void** out) = 0;
    virtual expcache_status_t map(void* at, uint64_t bytes) = 0;
    virtual void unmap(void* at, uint64_t bytes) = 0;
    virtual void unreserve(void* base, uint64_t bytes) = 0;
    // Forget a reservation and its mappings as disown() forgets an allocation: the function
    // returned unmaps the given ranges and frees the reservation later, from any thread.
    struct Mapping {
        void* at;
        uint64_t bytes;
    };
    using UnreserveFn = void (*)(void* base, uint64_t bytes, const Mapping* mappings, size_t n, int device);
    virtual UnreserveFn disown_reserved(void* base, uint64_t bytes, const Mapping* mappings, size_t n) = 0;

    virtual expcache_status_t mem_info(uint64_t* free_bytes, uint64_t* total_bytes) = 0;

    // Uploads: a pinned source is enqueued on `stream` by finish_uploads(), all of a
    // call's pinned uploads together; pageable and file sources may be staged in the
    // background (StagingRing) until then.
    virtual expcache_status_t copy_h2d(void* dst, const void* src, uint64_t bytes, bool pinned, void* stream) = 0;
    // Read `bytes` at `offset` of `file` into device memory at dst.
    virtual expcache_status_t read_file(void* dst, const class SourceFile& file, uint64_t offset, uint64_t bytes,
                                        void* stream) = 0;
    // Wait until every upload asked for since the last call is enqueued on its
    // stream; the first failure among them, or OK. Called at the end of every
    // serving call, and before any memory an upload may write to is freed.
    virtual expcache_status_t finish_uploads() = 0;
    // The staging ring's counters, added to *out (nothing when it was never made).
    virtual void staging_stats(expcache_staging_stats_t* out) const = 0;
    virtual void reset_staging_stats() = 0;
    virtual expcache_status_t copy_d2d(void* dst, const void* src, uint64_t bytes, void* stream) = 0;
    virtual expcache_status_t copy_d2h_sync(void* dst, const void* src, uint64_t bytes) = 0;
    // From pageable host memory, finished when it returns (the device lookup's small tables).
    virtual expcache_status_t copy_h2d_sync(void* dst, const void* src, uint64_t bytes) = 0;

    // Make `to` wait (on the device) for the work enqueued on `from` so far.
    virtual expcache_status_t fence(void* from, void* to) = 0;
    virtual expcache_status_t sync_stream(void* stream) = 0;
    virtual expcache_status_t sync_device() = 0;

    // The cache's own copy stream, where split selects' misses and prefetch pieces go
    // (host: nullptr, its copies finish as they are made).
    virtual void* copy_stream() { return nullptr; }
    // Record the event behind a split select's misses on `stream` and give it (host: nullptr).
    virtual expcache_status_t record_ready(void* stream, void** out_event) {
        (void)stream;
        *out_event = nullptr;
        return EXPCACHE_OK;
    }
    // Whether `event` may be passed to wait_ready: NULL, or the event record_ready gives.
    virtual bool is_ready_event(const void* event) const { return event == nullptr; }
    virtual expcache_status_t wait_ready(void* event, void* stream) {
        (void)event;
        (void)stream;
        return EXPCACHE_OK;
    }
    // Call marks: record mark `i` (0 or 1) on `stream`; make `stream` wait for mark `i`.
    virtual expcache_status_t mark(int i, void* stream) {
        (void)i;
        (void)stream;
        return EXPCACHE_OK;
    }
    virtual expcache_status_t wait_mark(int i, void* stream) {
        (void)i;
        (void)stream;
        return EXPCACHE_OK;
    }
    // The link prefetch pieces cross, from the prefetch thread (the staging ring's transport).
    virtual StagingRing::Transport& link() = 0;

    // Make this backend's device current for the calling thread and restore
    // the caller's on scope exit (host: nothing).
    virtual void enter() {}
    virtual void leave() {}
};

// The staging ring of pageable and file uploads (expcache_config_t fields, and the
// EXPCACHE_STAGING_* variables read when the cache was created).
struct StagingConfig {
    uint32_t copy_threads;  // 0: pageable copies go straight to the link, files are read by the caller
    uint64_t ring_bytes;
    uint64_t chunk_bytes;
    StagingTuning tuning;
};

// What both backends share. Pinned uploads wait in a list until finish_uploads()
// and then go to the link together (one cudaMemcpyBatchAsync per stream: a copy
// engine pays a few microseconds per transfer, which one call of small experts in
// three parts each would otherwise pay 18 times); pageable and file uploads go
// through a StagingRing over the backend's Transport. A backend supplies its
// direct upload, and a batched one where its link has one (CUDA).
class StagingBackend : public Backend {
public:
    struct DirectCopy {
        void* dst;
        const void* src;
        uint64_t bytes;
        void* stream;
    };

    expcache_status_t copy_h2d(void* dst, const void* src, uint64_t bytes, bool pinned, void* stream) final;
    expcache_status_t read_file(void* dst, const SourceFile& file, uint64_t offset, uint64_t bytes,
                                void* stream) final {
        return ring().read(dst, file, offset, bytes, stream);
    }
    expcache_status_t finish_uploads() final;
    void staging_stats(expcache_staging_stats_t* out) const final {
        if (ring_) ring_->stats(out);
    }
    void reset_staging_stats() final {
        if (ring_) ring_->reset_stats();
    }
    // Fault injection (backend/instrumented.hpp): the staged pieces after the next `skip` fail, `count` of them.
    void inject_staging_failures(uint64_t skip, uint64_t count) { ring().inject_failures(skip, count); }
    StagingRing::Transport& link() final { return *transport_; }

protected:
    StagingBackend(const StagingConfig& staging, std::unique_ptr<StagingRing::Transport> transport)
        : staging_(staging), transport_(std::move(transport)) {}
    // One upload, enqueued on `stream` now (a pageable source when copy_threads is 0).
    virtual expcache_status_t copy_h2d_direct(void* dst, const void* src, uint64_t bytes, void* stream) = 0;
    // n >= 1 pinned uploads, all on copies[0].stream, enqueued now in any order among
    // themselves (their destinations never overlap). By default one copy_h2d_direct each.
    virtual expcache_status_t copy_h2d_batch(const DirectCopy* copies, size_t n);
    // Stop the staging threads and free the chunks; a backend calls it first in its destructor,
    // with its device current.
    void release_staging() { ring_.reset(); }

private:
    // Made on first use: caches that never stage start no threads.
    StagingRing& ring() {
        if (!ring_)
            ring_.reset(new StagingRing(*transport_, staging_.copy_threads, staging_.ring_bytes, staging_.chunk_bytes,
                                        staging_.tuning));
        return *ring_;
    }
    expcache_status_t flush_pinned();

    StagingConfig staging_;
    std::unique_ptr<StagingRing::Transport> transport_;
    std::unique_ptr<StagingRing> ring_;  // after transport_: destroyed first
    std::vector<DirectCopy> pinned_;     // pinned uploads not yet enqueued
};

// capacity_bytes: the emulated device size. The host backend stages pageable
// and file uploads through the same ring as the CUDA backend (its "link" is a
// memcpy), so the ring's threads and failures are exercised without a GPU.
std::unique_ptr<StagingBackend> make_host_backend(uint64_t capacity_bytes, const StagingConfig& staging);

// UNSUPPORTED when the library was built without CUDA or no device is usable.
expcache_status_t make_cuda_backend(int device, const StagingConfig& staging, std::unique_ptr<StagingBackend>* out);

}  // namespace expcache
