// Prefetch and hints: experts expected soon, copied over the link's idle time by the
// prefetch thread (prefetcher.hpp) or only refreshed in the policy. A prefetched
// expert takes its slot at once, marked loading: never served, never evicted, and
// cancelled by the next serving call if its bytes are not all sent by then. Once
// sent it is resident like any other, first to go until a select uses it.
#include "cache.hpp"

#include <new>
#include <system_error>

#include "errors.hpp"

namespace expcache {

Prefetcher& Cache::prefetcher() {
    if (!prefetcher_)
        prefetcher_.reset(new Prefetcher(backend_->link(), backend_->copy_stream(), config_.prefetch_piece_bytes));
    return *prefetcher_;
}

// Takes back what the prefetch thread finished (and, with cancel, everything still queued).
// Called under the mutex by every serving call (cancel, keep_partial: what the call lists may
// be finished by it, resolve_partial), by releases (cancel) and by the calls that look at
// residency. Partial slots left by a call that failed are freed first.
expcache_status_t Cache::settle_prefetches(bool cancel, bool keep_partial) {
    for (const PrefetchJob& job : partial_) cancel_prefetch(job.cls, job.slot);
    partial_.clear();
    if (!prefetcher_) return EXPCACHE_OK;
    taken_.done.clear();
    taken_.cancelled.clear();
    taken_.failed.clear();
    taken_.error = EXPCACHE_OK;
    prefetcher_->take(cancel, &taken_);
    for (const PrefetchJob& job : taken_.done) classes_[job.cls].slots[job.slot].prefetch = kPrefetchUnused;
    for (const PrefetchJob& job : taken_.failed) cancel_prefetch(job.cls, job.slot);
    for (const PrefetchJob& job : taken_.cancelled) {
        if (keep_partial) {
            classes_[job.cls].slots[job.slot].prefetch = kPrefetchPartial;
            partial_.push_back(job);
        } else {
            cancel_prefetch(job.cls, job.slot);
        }
    }
    if (taken_.error != EXPCACHE_OK && prefetch_error_ == EXPCACHE_OK) {
        // Reported by the next prefetch call: a demand call is not the one that failed.
        prefetch_error_ = taken_.error;
        prefetch_message_ = taken_.message;
        log(EXPCACHE_LOG_WARNING, "%s", taken_.message.c_str());
    }
    return EXPCACHE_OK;
}

// A prefetch that will not be finished: its slot is freed, never served.
void Cache::cancel_prefetch(int32_t c, int32_t s) {
    SlotState& slot = classes_[c].slots[s];
    LayerState& layer = layers_[slot.layer];
    pstats_.cancelled++;
    pstats_.bytes_cancelled += layer.expert_bytes();
    if (layer.prefetched > 0) layer.prefetched--;
    slot.prefetch = kPrefetchNone;
    uninstall(c, s);
}

// After the serving call's ids are known: the partial prefetches it lists (decode and batch,
// which insert) are finished by fill_slots; the others are freed.
void Cache::resolve_partial(ServeCall& call) {
    size_t kept = 0;
    for (const PrefetchJob& job : partial_) {
        const SlotState& slot = classes_[job.cls].slots[job.slot];
        const bool listed = call.path != EXPCACHE_PATH_COMPACT && job.cls == call.c &&
                            slot.layer == static_cast<int32_t>(call.layer_index) &&
                            call.layer->seen[slot.expert] == call_;
        if (listed) {
            partial_[kept++] = job;
        } else {
            cancel_prefetch(job.cls, job.slot);
        }
    }
    partial_.resize(kept);
}

// A miss whose prefetch was cut short: what is left of its bytes goes now, into the same slot,
// on the call's copy stream, and it enters the policy as any miss of the call would. Counted
// late, not used: only a prefetch whose bytes were all sent before the call is a hit.
expcache_status_t Cache::finish_partial(ServeCall& call, int32_t s, bool cold) {
    size_t i = 0;
    while (i < partial_.size() && !(partial_[i].cls == call.c && partial_[i].slot == s)) ++i;
    if (i == partial_.size()) return fail(EXPCACHE_ERR_INTERNAL, "a partial prefetch of slot %d is not on record", s);
    const PrefetchJob job = partial_[i];
    partial_.erase(partial_.begin() + static_cast<long>(i));
    ClassState& cls = *call.cls;
    SlotState& slot = cls.slots[s];
    const LayerState& layer = *call.layer;
    uint64_t sent_now = 0;
    for (int p = job.part; p < job.num_parts; ++p) {
        const PrefetchJob::Part& part = job.parts[p];
        const uint64_t from = p == job.part ? job.offset : 0;
        expcache_status_t st = injected_copy_failure();
        if (st == EXPCACHE_OK) st = upload(layer, part.dst + from, part.src + from, part.bytes - from, call.copy_stream);
        if (st != EXPCACHE_OK) {
            cancel_prefetch(call.c, s);  // its bytes are incomplete: freed, counted cancelled
            return st;
        }
        sent_now += part.bytes - from;
    }
    slot.prefetch = kPrefetchNone;
    slot.last_call = call_;
    inserted_.emplace_back(call.c, s);  // a later upload failure of the call frees it
    cls.policy->on_remove(s);
    cls.policy->on_insert(s, cold, layer.key_base + slot.expert);
    // A demand miss, never a prefetch used: the prefetch's share of the bytes is counted late.
    pstats_.late++;
    pstats_.bytes_late_sent += layer.expert_bytes() - sent_now;
    call.st->misses++;
    call.st->appends++;
    call.st->bytes_h2d += sent_now;
    return EXPCACHE_OK;
}

void Cache::note_use(ClassState& cls, int32_t s) {
    SlotState& slot = cls.slots[s];
    LayerState& layer = layers_[slot.layer];
    pstats_.used++;
    pstats_.bytes_used += layer.expert_bytes();
    slot.prefetch = kPrefetchNone;
}

// A landed prefetch leaving its slot unused.
void Cache::drop_prefetched(SlotState& slot) {
    LayerState& layer = layers_[slot.layer];
    pstats_.wasted++;
    pstats_.bytes_wasted += layer.expert_bytes();
    slot.prefetch = kPrefetchNone;
}

expcache_status_t Cache::prefetch(uint32_t layer_index, const uint32_t* ids, uint32_t n, void* stream,
                                  uint32_t* out_queued) {
    CallScope scope(*this);
    expcache_status_t s = validate_request(layer_index, ids, n, EXPCACHE_MAX_SELECT, "n");
    if (s != EXPCACHE_OK) return s;
    if ((s = take_prefetch_error()) != EXPCACHE_OK) return s;
    backend_->reclaim();
    pstats_.calls++;
    const bool first = !prefetcher_;
    Prefetcher& pump = prefetcher();
    if ((s = settle_prefetches(false)) != EXPCACHE_OK) return s;
    int32_t c = -1;
    if ((s = bind(layer_index, EXPCACHE_PATH_CONTROL, &c)) != EXPCACHE_OK) return s;
    LayerState& layer = layers_[layer_index];
    ClassState& cls = classes_[c];
    cls.policy->set_clock(clock_);  // where the engine is now, for the victims' ages
    ++call_;  // for dedupe only: a prefetch is not a serving call
    dedupe(layer, ids, n);
    // The pieces must not overwrite a slot an older call's kernels may still read: they wait for
    // the start of the previous serving call, or, before two were marked, for `stream` so far.
    void* copy = backend_->copy_stream();
    bool ordered = false;
    uint32_t queued = 0;
    for (uint32_t e : unique_) {
        if (layer.slot_of[e] >= 0) {
            pstats_.skipped++;
            continue;
        }
        if (layer.prefetched >= config_.prefetch_max_per_layer) {
            pstats_.dropped++;
            continue;
        }
        int32_t slot = -1;
        if ((s = acquire_slot(c, true, Evict::kPrefetch, EXPCACHE_PATH_CONTROL, &slot)) != EXPCACHE_OK) return s;
        if (slot < 0) {
            pstats_.dropped++;
            continue;
        }
        if (!ordered) {
            s = check(!first && marks_ >= 2 ? backend_->wait_mark(prev_mark_, copy) : backend_->fence(stream, copy));
            if (s != EXPCACHE_OK) {
                cls.free_slots.push_back(slot);
                return s;
            }
            ordered = true;
        }
        SlotState& ss = cls.slots[slot];
        PrefetchJob job;
        job.cls = c;
        job.slot = slot;
        job.file = layer.file;
        job.pinned = layer.pinned;
        unsigned char* dst[kParts];
        cls.parts_at(ss.dev, dst);
        for (int p = 0; p < kParts; ++p) {
            PrefetchJob::Part& last = job.parts[job.num_parts > 0 ? job.num_parts - 1 : 0];
            const unsigned char* src = layer.source(p, e);
            if (job.num_parts > 0 && last.src + last.bytes == src && last.dst + last.bytes == dst[p]) {
                last.bytes += layer.bytes[p];  // adjacent in source and slot: one transfer
            } else {
                job.parts[job.num_parts++] = {dst[p], src, layer.bytes[p]};
            }
        }
        ss.layer = static_cast<int32_t>(layer_index);
        ss.expert = e;
        ss.last_call = 0;
        ss.prefetch = kPrefetchLoading;
        if (!ss.copy_pending) {
            ss.copy_pending = true;
            copy_pending_.emplace_back(c, slot);
        }
        layer.slot_of[e] = slot;
        layer.prefetched++;
        cls.resident++;
        cls.policy->on_prefetch(slot, layer.key_base + e);
        try {
            pump.submit(job);
        } catch (const std::exception& ex) {
            layer.prefetched--;
            ss.prefetch = kPrefetchNone;
            uninstall(c, slot);
            return fail(EXPCACHE_ERR_OUT_OF_HOST_MEMORY, "the prefetch thread could not take a job: %s", ex.what());
        }
        pstats_.issued++;
        pstats_.bytes_issued += layer.expert_bytes();
        ++queued;
    }
    if (out_queued) *out_queued = queued;
    log(EXPCACHE_LOG_DEBUG, "prefetch layer %u n %u: %u queued", layer_index, n, queued);
    return EXPCACHE_OK;
}

expcache_status_t Cache::hint(uint32_t layer_index, const uint32_t* ids, uint32_t n) {
    CallScope scope(*this);
    expcache_status_t s = validate_request(layer_index, ids, n, EXPCACHE_MAX_SELECT, "n");
    if (s != EXPCACHE_OK) return s;
    LayerState& layer = layers_[layer_index];
    ++call_;  // for dedupe only
    dedupe(layer, ids, n);
    pstats_.hints += unique_.size();
    int32_t c = bound_class(layer);
    if (c < 0) return EXPCACHE_OK;  // nothing of the layer is resident yet
    ClassState& cls = classes_[c];
    cls.policy->set_clock(clock_);  // a refresh is dated now, not at the class's last serving call
    for (uint32_t e : unique_) {
        int32_t slot = layer.slot_of[e];
        if (slot < 0 || cls.slots[slot].prefetch == kPrefetchLoading || cls.slots[slot].prefetch == kPrefetchPartial)
            continue;
        cls.policy->on_hint(slot);
        pstats_.hint_refreshes++;
    }
    return EXPCACHE_OK;
}

expcache_status_t Cache::get_prefetch_stats(expcache_prefetch_stats_t* out) const {
    CallScope scope(*this);
    expcache_prefetch_stats_t st = pstats_;
    if (prefetcher_) {
        st.bytes_sent = prefetcher_->bytes_sent();
        st.pieces = prefetcher_->pieces();
    }
    st.struct_size = out->struct_size;
    *out = st;
    return EXPCACHE_OK;
}

expcache_status_t Cache::take_prefetch_error() {
    if (prefetch_error_ == EXPCACHE_OK) return EXPCACHE_OK;
    const expcache_status_t s = prefetch_error_;
    prefetch_error_ = EXPCACHE_OK;
    return check(fail(s, "%s", prefetch_message_.c_str()));
}

// Every queued prefetch sent and landed: each is resident (kPrefetchUnused), so a serving call
// that lists it is a hit. The thread needs no cache lock, so waiting under ours cannot deadlock.
expcache_status_t Cache::prefetch_wait() {
    CallScope scope(*this);
    expcache_status_t s = usable();
    if (s != EXPCACHE_OK || !prefetcher_) return s;
    if (const size_t left = prefetcher_->drain())
        return fail(EXPCACHE_ERR_INVALID_STATE,
                    "the prefetch thread is paused (expcache_testing_prefetch_pause): %zu prefetches stay queued",
                    left);
    if ((s = check(backend_->sync_stream(backend_->copy_stream()))) != EXPCACHE_OK) return s;
    forget_copy_pending();  // every piece landed
    if ((s = settle_prefetches(false)) != EXPCACHE_OK) return s;
    return take_prefetch_error();
}

expcache_status_t Cache::prefetch_pause(bool paused) {
    CallScope scope(*this);
    prefetcher().pause(paused);
    return EXPCACHE_OK;
}

}  // namespace expcache
