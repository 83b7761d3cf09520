// A class's copy-engine path (kernels/engine_protocol.hpp): the mailbox a device select lists its
// misses of pinned sources in, for the poller to copy them by a copy engine.
#include <algorithm>
#include <cstring>

#include "device_lookup.hpp"
#include "errors.hpp"

namespace expcache {

namespace {

// The copier with the backend's injected copy failures (expcache_testing_inject_copy_failures):
// a failing batch enqueues nothing, as a refused enqueue.
class FaultingCopier final : public EngineCopier {
public:
    FaultingCopier(std::unique_ptr<EngineCopier> inner, Backend& backend)
        : inner_(std::move(inner)), backend_(backend) {}
    expcache_status_t copy(void* const* dst, const void* const* src, const uint64_t* bytes, size_t n) override {
        if (n && backend_.copy_fault()) return fail(EXPCACHE_ERR_CUDA, "injected copy failure");
        return inner_->copy(dst, src, bytes, n);
    }
    expcache_status_t signal(uint64_t* word, uint64_t value) override { return inner_->signal(word, value); }

private:
    std::unique_ptr<EngineCopier> inner_;
    Backend& backend_;
};

}  // namespace

bool DeviceLookup::needs_engine(int32_t c) const {
    if (miss_copy_ == EXPCACHE_MISS_COPY_SM) return false;
    const ClassState& cls = classes_[c];
    if (miss_copy_ == EXPCACHE_MISS_COPY_AUTO && cls.expert_bytes() < EXPCACHE_MISS_COPY_ENGINE_MIN_BYTES) return false;
    for (const LayerState& l : layers_)
        if (l.registered && !l.fed() && std::equal(l.bytes, l.bytes + kMaxParts, cls.key_array())) return true;
    return false;
}

expcache_status_t DeviceLookup::make_engine(int32_t c) {
    ClassDevice& d = classes_state_[c];
    d.engine_tried = true;
    const ClassState& cls = classes_[c];
    std::unique_ptr<EngineCopier> copier;
    expcache_status_t s = kernels_->make_copier(&copier);
    if (s == EXPCACHE_ERR_UNSUPPORTED) {  // the grid copies, as with miss_copy SM
        log_(EXPCACHE_LOG_NOTICE, "class %s: a device select's misses are copied by its grid: %s",
             classes_.name(cls).c_str(), last_error());
        clear_last_error();
        return EXPCACHE_OK;
    }
    if (s != EXPCACHE_OK) return s;
    copier.reset(new FaultingCopier(std::move(copier), backend_));
    void* host = nullptr;
    void* dev = nullptr;
    if ((s = kernels_->alloc_mapped(sizeof(EngineBox), &host, &dev)) != EXPCACHE_OK) return s;
    d.engine_host = host;  // freed with the lookup, made or not
    std::memset(host, 0, sizeof(EngineBox));
    // The device's words, zero: the copier's, the failures.
    void* words = nullptr;
    const uint64_t zeros[2] = {0, 0};
    if ((s = health_.check(arena_.alloc(sizeof zeros, &words))) != EXPCACHE_OK ||
        (s = health_.check(backend_.copy_h2d_sync(words, zeros, sizeof zeros))) != EXPCACHE_OK)
        return s;
    DeviceEngine& e = d.view.engine;
    EngineRing ring;
    ring.box = static_cast<EngineBox*>(host);
    ring.done = static_cast<uint64_t*>(words);
    ring.bank = d.view.bank;
    for (int p = 0; p < kMaxParts; ++p) {
        ring.part_at[p] = d.view.part_at[p];
        ring.part_stride[p] = d.view.part_stride[p];
    }
    if ((s = feed_threads().watch_engine(ring, std::move(copier))) != EXPCACHE_OK) return s;
    e.done = ring.done;
    e.failures = ring.done + 1;
    e.box = static_cast<EngineBox*>(dev);  // set last: a class whose path is half made has none
    log_(EXPCACHE_LOG_NOTICE,
         "class %s: a device select's misses from pinned memory are moved by a copy engine (miss_copy %s)",
         classes_.name(cls).c_str(), miss_copy_ == EXPCACHE_MISS_COPY_ENGINE ? "engine" : "auto");
    return EXPCACHE_OK;
}

}  // namespace expcache
