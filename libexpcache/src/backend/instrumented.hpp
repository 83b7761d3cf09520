// What tests and benchmarks need of a backend, as a decorator (as rmm's resource adaptors wrap a
// memory resource): every cache's backend is wrapped in one, which forwards every call and, when
// a test arms it (expcache_testing_inject_*), fails the next device allocations, copies or staged
// pieces; it counts the synchronizing reads (device synchronizations and device-to-host copies:
// expcache_testing_device_reads); it also holds the backend's test kernels
// (kernels/test_kernels.hpp). The core's serving path and the backends know nothing of it.
#pragma once

#include <memory>

#include "../errors.hpp"
#include "../kernels/test_kernels.hpp"
#include "backend.hpp"

namespace expcache {

class InstrumentedBackend final : public Backend {
public:
    InstrumentedBackend(std::unique_ptr<StagingBackend> inner, std::unique_ptr<TestKernels> kernels)
        : inner_(std::move(inner)), kernels_(std::move(kernels)) {}
    ~InstrumentedBackend() override {
        inner_->enter();
        kernels_.reset();  // with the device current
        inner_->leave();
    }

    // The next `skip` succeed, then `count` fail (count 0 disarms).
    void fail_allocs(uint64_t skip, uint64_t count) { allocs_.arm(skip, count); }
    void fail_copies(uint64_t skip, uint64_t count) { copies_.arm(skip, count); }
    // Pieces filled by the staging ring's threads (failing the call that staged them).
    void fail_staging(uint64_t skip, uint64_t count) { inner_->inject_staging_failures(count ? skip : 0, count); }

    uint32_t kind() const override { return inner_->kind(); }
    expcache_status_t alloc(uint64_t bytes, void** out) override {
        if (allocs_.fire())
            return fail(EXPCACHE_ERR_OUT_OF_DEVICE_MEMORY, "injected device allocation failure (%llu bytes)",
                        (unsigned long long)bytes);
        return inner_->alloc(bytes, out);
    }
    void free_now(void* ptr) override { inner_->free_now(ptr); }
    expcache_status_t free_after(void* ptr, void* stream) override { return inner_->free_after(ptr, stream); }
    void reclaim() override { inner_->reclaim(); }
    FreeFn disown(void* ptr) override { return inner_->disown(ptr); }
    int device_ordinal() const override { return inner_->device_ordinal(); }
    uint64_t map_granularity() const override { return inner_->map_granularity(); }
    expcache_status_t reserve(uint64_t bytes, void** out) override { return inner_->reserve(bytes, out); }
    // A bank's growth is a device allocation: the same injected failures.
    expcache_status_t map(void* at, uint64_t bytes) override {
        if (allocs_.fire())
            return fail(EXPCACHE_ERR_OUT_OF_DEVICE_MEMORY, "injected device allocation failure (%llu bytes)",
                        (unsigned long long)bytes);
        return inner_->map(at, bytes);
    }
    void unmap(void* at, uint64_t bytes) override { inner_->unmap(at, bytes); }
    void unreserve(void* base, uint64_t bytes) override { inner_->unreserve(base, bytes); }
    UnreserveFn disown_reserved(void* base, uint64_t bytes, const Mapping* mappings, size_t n) override {
        return inner_->disown_reserved(base, bytes, mappings, n);
    }
    expcache_status_t mem_info(uint64_t* free_bytes, uint64_t* total_bytes) override {
        return inner_->mem_info(free_bytes, total_bytes);
    }
    expcache_status_t copy_h2d(void* dst, const void* src, uint64_t bytes, bool pinned, void* stream) override {
        return copies_.fire() ? copy_failure() : inner_->copy_h2d(dst, src, bytes, pinned, stream);
    }
    expcache_status_t read_file(void* dst, const SourceFile& file, uint64_t offset, uint64_t bytes,
                                void* stream) override {
        return copies_.fire() ? copy_failure() : inner_->read_file(dst, file, offset, bytes, stream);
    }
    expcache_status_t finish_uploads() override { return inner_->finish_uploads(); }
    void staging_stats(expcache_staging_stats_t* out) const override { inner_->staging_stats(out); }
    void reset_staging_stats() override { inner_->reset_staging_stats(); }
    expcache_status_t copy_d2d(void* dst, const void* src, uint64_t bytes, void* stream) override {
        return copies_.fire() ? copy_failure() : inner_->copy_d2d(dst, src, bytes, stream);
    }
    expcache_status_t copy_d2h_sync(void* dst, const void* src, uint64_t bytes) override {
        ++reads_.copies;
        return inner_->copy_d2h_sync(dst, src, bytes);
    }
    expcache_status_t copy_h2d_sync(void* dst, const void* src, uint64_t bytes) override {
        return inner_->copy_h2d_sync(dst, src, bytes);
    }
    expcache_status_t fence(void* from, void* to) override { return inner_->fence(from, to); }
    expcache_status_t sync_stream(void* stream) override { return inner_->sync_stream(stream); }
    expcache_status_t sync_device() override {
        ++reads_.syncs;
        return inner_->sync_device();
    }
    void* copy_stream() override { return inner_->copy_stream(); }
    expcache_status_t record_ready(void* stream, void** out_event) override {
        return inner_->record_ready(stream, out_event);
    }
    bool is_ready_event(const void* event) const override { return inner_->is_ready_event(event); }
    expcache_status_t wait_ready(void* event, void* stream) override { return inner_->wait_ready(event, stream); }
    expcache_status_t mark(int i, void* stream) override { return inner_->mark(i, stream); }
    expcache_status_t wait_mark(int i, void* stream) override { return inner_->wait_mark(i, stream); }
    StagingRing::Transport& link() override { return inner_->link(); }
    void enter() override { inner_->enter(); }
    void leave() override { inner_->leave(); }

    TestKernels& kernels() { return *kernels_; }
    // Device synchronizations and device-to-host copies so far.
    struct Reads {
        uint64_t syncs = 0, copies = 0;
    };
    Reads reads() const { return reads_; }

private:
    struct Trigger {
        uint64_t skip = 0, count = 0;
        void arm(uint64_t s, uint64_t c) {
            skip = c ? s : 0;
            count = c;
        }
        bool fire() {
            if (count == 0) return false;
            if (skip > 0) {
                --skip;
                return false;
            }
            --count;
            return true;
        }
    };
    static expcache_status_t copy_failure() { return fail(EXPCACHE_ERR_CUDA, "injected copy failure"); }

    std::unique_ptr<StagingBackend> inner_;
    std::unique_ptr<TestKernels> kernels_;  // destroyed before inner_
    Trigger allocs_, copies_;
    Reads reads_;
};

}  // namespace expcache
