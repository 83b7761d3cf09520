#include "prefetch_coordinator.hpp"

#include <exception>

#include "errors.hpp"

namespace expcache {

Prefetcher& PrefetchCoordinator::pump() {
    if (!prefetcher_)
        prefetcher_.reset(new Prefetcher(x_.backend.link(), x_.backend.copy_stream(), x_.config.prefetch_piece_bytes));
    return *prefetcher_;
}

expcache_status_t PrefetchCoordinator::settle(bool cancel_queued, bool keep_partial) {
    for (const PrefetchJob& job : partial_) cancel(job.cls, job.slot);
    partial_.clear();
    if (!prefetcher_) return EXPCACHE_OK;
    taken_.done.clear();
    taken_.cancelled.clear();
    taken_.failed.clear();
    taken_.error = EXPCACHE_OK;
    prefetcher_->take(cancel_queued, &taken_);
    for (const PrefetchJob& job : taken_.done) x_.classes.set_prefetch(job.cls, job.slot, kPrefetchUnused);
    for (const PrefetchJob& job : taken_.failed) cancel(job.cls, job.slot);
    for (const PrefetchJob& job : taken_.cancelled) {
        if (keep_partial) {
            x_.classes.set_prefetch(job.cls, job.slot, kPrefetchPartial);
            partial_.push_back(job);
        } else {
            cancel(job.cls, job.slot);
        }
    }
    if (taken_.error != EXPCACHE_OK && error_ == EXPCACHE_OK) {
        // Reported by the next prefetch call: a demand call is not the one that failed.
        error_ = taken_.error;
        message_ = taken_.message;
        x_.log(EXPCACHE_LOG_WARNING, "%s", taken_.message.c_str());
    }
    return EXPCACHE_OK;
}

// A prefetch that will not be finished: its slot is freed, never served.
void PrefetchCoordinator::cancel(int32_t c, int32_t s) {
    LayerState& layer = x_.layers[x_.classes.slot(c, s).layer()];
    stats_.cancelled++;
    stats_.bytes_cancelled += layer.expert_bytes();
    if (layer.prefetched > 0) layer.prefetched--;
    x_.classes.uninstall(c, s);
}

void PrefetchCoordinator::resolve_partial(int32_t c, uint32_t layer_index, bool inserts) {
    if (partial_.empty()) return;
    const LayerState& layer = x_.layers[layer_index];
    size_t kept = 0;
    for (const PrefetchJob& job : partial_) {
        const SlotState& slot = x_.classes.slot(job.cls, job.slot);
        const bool listed = inserts && job.cls == c && slot.layer() == static_cast<int32_t>(layer_index) &&
                            layer.seen[slot.expert()] == x_.clock.call;
        if (listed) {
            partial_[kept++] = job;
        } else {
            cancel(job.cls, job.slot);
        }
    }
    partial_.resize(kept);
}

expcache_status_t PrefetchCoordinator::finish_partial(int32_t c, int32_t s, bool cold, void* stream, uint32_t path) {
    size_t i = 0;
    while (i < partial_.size() && !(partial_[i].cls == c && partial_[i].slot == s)) ++i;
    if (i == partial_.size()) return fail(EXPCACHE_ERR_INTERNAL, "a partial prefetch of slot %d is not on record", s);
    const PrefetchJob job = partial_[i];
    partial_.erase(partial_.begin() + static_cast<long>(i));
    const LayerState& layer = x_.layers[x_.classes.slot(c, s).layer()];
    uint64_t sent = 0;
    for (int p = job.part; p < job.num_parts; ++p) {
        const PrefetchJob::Part& part = job.parts[p];
        const uint64_t from = p == job.part ? job.offset : 0;
        expcache_status_t st = x_.health.check(
            job.part_source(p).upload(x_.backend, part.dst + from, part.src + from, part.bytes - from, stream));
        if (st != EXPCACHE_OK) {
            cancel(c, s);  // its bytes are incomplete: freed, counted cancelled
            return st;
        }
        sent += part.bytes - from;
    }
    x_.classes.reinstall(c, s, cold, x_.clock.call, path, sent);
    // A demand miss, never a prefetch used: the prefetch's share of the bytes is counted late.
    stats_.late++;
    stats_.bytes_late_sent += layer.expert_bytes() - sent;
    return EXPCACHE_OK;
}

void PrefetchCoordinator::note_use(int32_t c, int32_t s) {
    stats_.used++;
    stats_.bytes_used += x_.layers[x_.classes.slot(c, s).layer()].expert_bytes();
    x_.classes.set_prefetch(c, s, kPrefetchNone);
}

void PrefetchCoordinator::dropped_unused(uint32_t layer) {
    stats_.wasted++;
    stats_.bytes_wasted += x_.layers[layer].expert_bytes();
}

expcache_status_t PrefetchCoordinator::quiesce() {
    expcache_status_t s = settle(true);
    if (s == EXPCACHE_OK) s = x_.health.check(x_.backend.sync_device());
    if (s == EXPCACHE_OK) x_.streams.forget_copy_pending();
    return s;
}

expcache_status_t PrefetchCoordinator::vacate(const std::vector<int32_t>& classes) {
    if (classes.empty()) return EXPCACHE_OK;
    expcache_status_t s = quiesce();
    if (s != EXPCACHE_OK) return s;
    for (int32_t c : classes)
        for (const SlotState& slot : x_.classes[c].slots())
            if (slot.layer() >= 0 && slot.prefetch() != kPrefetchNone)
                dropped_unused(static_cast<uint32_t>(slot.layer()));
    return EXPCACHE_OK;
}

expcache_status_t PrefetchCoordinator::bind_class(uint32_t layer, uint32_t path, int32_t* out_cls) {
    const int32_t reused = x_.classes.bind_releases(layer);
    expcache_status_t s = reused >= 0 ? vacate({reused}) : EXPCACHE_OK;
    return s == EXPCACHE_OK ? x_.classes.bind(layer, path, out_cls) : s;
}

expcache_status_t PrefetchCoordinator::prefetch(uint32_t layer_index, const uint32_t* ids, uint32_t n, void* stream,
                                                uint32_t* out_queued) {
    expcache_status_t s = take_error();
    if (s != EXPCACHE_OK) return s;
    x_.backend.reclaim();
    stats_.calls++;
    const bool first = !prefetcher_;
    Prefetcher& thread = pump();
    if ((s = settle(false)) != EXPCACHE_OK) return s;
    int32_t c = -1;
    if ((s = bind_class(layer_index, EXPCACHE_PATH_CONTROL, &c)) != EXPCACHE_OK) return s;
    LayerState& layer = x_.layers[layer_index];
    const ClassState& cls = x_.classes[c];
    x_.classes.set_policy_clock(c, x_.clock.policy);  // where the engine is now, for the victims' ages
    ++x_.clock.call;                                  // for dedupe only: a prefetch is not a serving call
    scratch_.dedupe(layer, ids, n, x_.clock.call);
    // The pieces must not overwrite a slot an older call's kernels may still read.
    bool ordered = false;
    uint32_t queued = 0;
    for (uint32_t e : scratch_.unique) {
        if (layer.slot_of[e] >= 0) {
            stats_.skipped++;
            continue;
        }
        if (layer.prefetched >= x_.config.prefetch_max_per_layer) {
            stats_.dropped++;
            continue;
        }
        Acquired got;
        SlotRequest req;
        req.cls = c;
        req.layer = layer_index;
        req.path = EXPCACHE_PATH_CONTROL;
        req.evict = Evict::kPrefetch;
        req.protect_from = x_.clock.prev;
        if ((s = x_.classes.acquire(req, &got)) != EXPCACHE_OK) return s;
        if (got.dropped_prefetch_layer >= 0) dropped_unused(static_cast<uint32_t>(got.dropped_prefetch_layer));
        const int32_t slot = got.slot;
        if (slot < 0) {
            stats_.dropped++;
            continue;
        }
        if (!ordered) {
            if ((s = x_.streams.order_prefetch(first, stream)) != EXPCACHE_OK) {
                x_.classes.unacquire(c, slot);
                return s;
            }
            ordered = true;
        }
        PrefetchJob job;
        job.cls = c;
        job.slot = slot;
        job.source = layer.source;
        unsigned char* dst[kMaxParts];
        cls.parts_of(uint64_t(slot), dst);
        for (int p = 0; p < layer.nparts; ++p) {
            PrefetchJob::Part& last = job.parts[job.num_parts > 0 ? job.num_parts - 1 : 0];
            const unsigned char* src = layer.source_at(p, e);
            const SourceFile* file = layer.source_of(p, e).file;
            if (job.num_parts > 0 && last.src + last.bytes == src && last.dst + last.bytes == dst[p] &&
                last.file == file) {
                last.bytes += layer.bytes[p];  // adjacent in source and slot: one transfer
            } else {
                job.parts[job.num_parts++] = {dst[p], src, layer.bytes[p], file};
            }
        }
        x_.classes.install(c, got, layer_index, e, Insert::kPrefetch, 0, EXPCACHE_PATH_CONTROL);
        x_.streams.copy_pending(c, slot);
        layer.prefetched++;
        try {
            thread.submit(job);
        } catch (const std::exception& ex) {
            layer.prefetched--;
            x_.classes.uninstall(c, slot);
            return fail(EXPCACHE_ERR_OUT_OF_HOST_MEMORY, "the prefetch thread could not take a job: %s", ex.what());
        }
        stats_.issued++;
        stats_.bytes_issued += layer.expert_bytes();
        ++queued;
    }
    if (out_queued) *out_queued = queued;
    x_.log(EXPCACHE_LOG_DEBUG, "prefetch layer %u n %u: %u queued", layer_index, n, queued);
    return EXPCACHE_OK;
}

expcache_status_t PrefetchCoordinator::hint(uint32_t layer_index, const uint32_t* ids, uint32_t n) {
    LayerState& layer = x_.layers[layer_index];
    ++x_.clock.call;  // for dedupe only
    scratch_.dedupe(layer, ids, n, x_.clock.call);
    stats_.hints += scratch_.unique.size();
    int32_t c = x_.classes.bound(layer);
    if (c < 0) return EXPCACHE_OK;  // nothing of the layer is resident yet
    const ClassState& cls = x_.classes[c];
    x_.classes.set_policy_clock(c, x_.clock.policy);  // a refresh is dated now, not at the class's last serving call
    for (uint32_t e : scratch_.unique) {
        int32_t slot = layer.slot_of[e];
        if (slot < 0 || cls.slots()[slot].prefetch() == kPrefetchLoading ||
            cls.slots()[slot].prefetch() == kPrefetchPartial)
            continue;
        x_.classes.hint(c, slot);
        stats_.hint_refreshes++;
    }
    return EXPCACHE_OK;
}

void PrefetchCoordinator::stats(expcache_prefetch_stats_t* out) const {
    expcache_prefetch_stats_t st = stats_;
    if (prefetcher_) {
        st.bytes_sent = prefetcher_->bytes_sent();
        st.pieces = prefetcher_->pieces();
    }
    st.struct_size = out->struct_size;
    *out = st;
}

void PrefetchCoordinator::reset_stats() {
    stats_ = expcache_prefetch_stats_t{};
    if (prefetcher_) prefetcher_->reset_counters();
}

expcache_status_t PrefetchCoordinator::take_error() {
    if (error_ == EXPCACHE_OK) return EXPCACHE_OK;
    const expcache_status_t s = error_;
    error_ = EXPCACHE_OK;
    return x_.health.check(fail(s, "%s", message_.c_str()));
}

// Every queued prefetch sent and landed: each is resident (kPrefetchUnused), so a serving call
// that lists it is a hit. The thread needs no cache lock, so waiting under it cannot deadlock.
expcache_status_t PrefetchCoordinator::wait() {
    if (!prefetcher_) return EXPCACHE_OK;
    if (const size_t left = prefetcher_->drain())
        return fail(EXPCACHE_ERR_INVALID_STATE,
                    "the prefetch thread is paused (expcache_testing_prefetch_pause): %zu prefetches stay queued",
                    left);
    expcache_status_t s = x_.health.check(x_.backend.sync_stream(x_.backend.copy_stream()));
    if (s != EXPCACHE_OK) return s;
    x_.streams.forget_copy_pending();  // every piece landed
    if ((s = settle(false)) != EXPCACHE_OK) return s;
    return take_error();
}

}  // namespace expcache
