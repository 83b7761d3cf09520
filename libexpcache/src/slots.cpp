// A call's slots: finding one for a miss, filling it, and serving what got none
// from staging. Decode and batch share the fill; they differ in whether a call
// may evict, how it ranks what it inserts, and whether it holds what it serves.
#include "cache.hpp"

namespace expcache {

namespace {

// Which slots a miss may evict: none held by a batch or loading a prefetch, and for a demand call
// none this call uses, for a prefetch none the current or previous serving call used.
struct EvictableCtx {
    const std::vector<SlotState>* slots;
    uint64_t first_protected_call;  // slots with last_call >= this stay
};

bool slot_evictable(const void* ctx, int32_t s) {
    auto* c = static_cast<const EvictableCtx*>(ctx);
    const SlotState& slot = (*c->slots)[static_cast<size_t>(s)];
    return slot.holds == 0 && slot.prefetch != kPrefetchLoading && slot.prefetch != kPrefetchPartial &&
           slot.last_call < c->first_protected_call;
}

}  // namespace

// A slot for a miss: a free one, else a new one within the cap, else (if
// allowed) the policy's victim among the evictable slots. *out = -1 when none
// may be had.
expcache_status_t Cache::acquire_slot(int32_t c, bool allow_grow, Evict evict_mode, uint32_t path, int32_t* out) {
    ClassState& cls = classes_[c];
    if (cls.free_slots.empty() && allow_grow) {
        if (!cls.cap_valid) {
            expcache_status_t s = refresh_cap(c, path);
            if (s != EXPCACHE_OK) return s;
        }
        if (cls.slots.size() < cls.cap) {
            expcache_status_t s = grow(c, path);
            if (s != EXPCACHE_OK) return s;
        }
    }
    if (!cls.free_slots.empty()) {
        *out = cls.free_slots.back();
        cls.free_slots.pop_back();
        return EXPCACHE_OK;
    }
    *out = -1;
    if (evict_mode != Evict::kNo) {
        // A demand call protects the slots it uses (last_call == call_, the newest id).
        EvictableCtx ctx{&cls.slots, evict_mode == Evict::kPrefetch ? prev_call_ : call_};
        int32_t v = cls.policy->victim(slot_evictable, &ctx);
        if (v >= 0) {
            evict(c, v, path);
            *out = v;
        }
    }
    return EXPCACHE_OK;
}

void Cache::evict(int32_t c, int32_t s, uint32_t path) {
    ClassState& cls = classes_[c];
    SlotState& slot = cls.slots[s];
    if (slot.prefetch != kPrefetchNone) drop_prefetched(slot);
    layers_[slot.layer].slot_of[slot.expert] = -1;
    cls.policy->on_remove(s);
    slot.layer = -1;
    cls.resident--;
    cls.stats[path].evictions++;
}

// A slot filled by this call whose upload failed: free again, never served.
void Cache::uninstall(int32_t c, int32_t s) {
    ClassState& cls = classes_[c];
    SlotState& slot = cls.slots[s];
    if (slot.layer < 0) return;
    layers_[slot.layer].slot_of[slot.expert] = -1;
    cls.policy->on_remove(s);
    slot.layer = -1;
    cls.resident--;
    cls.free_slots.push_back(s);
}

// Hits first, so that no miss of this call can evict them; then each miss into a slot of
// the class. A decode call refreshes its hits and may evict (never a slot this call
// uses or a batch holds). A batch leaves its hits' recency alone, takes free capacity
// only and inserts as the coldest entries, so a prompt cannot flush the decode working
// set; it holds every slot it serves until batch_finish. On failure a batch's holds
// so far stay in batch->held for the caller to undo.
expcache_status_t Cache::fill_slots(ServeCall& call, BatchState* batch, uint32_t* out_direct) {
    LayerState& layer = *call.layer;
    ClassState& cls = *call.cls;
    expcache_stats_t& st = *call.st;
    auto serve = [&](uint32_t j, int32_t slot) {
        SlotState& ss = cls.slots[slot];
        if (batch) {
            if (ss.holds++ == 0) cls.held++;
            batch->held.push_back(slot);
        }
        ptrs_[j] = cls.ptrs_at(ss.dev);
    };
    pending_.clear();
    for (uint32_t j = 0; j < unique_.size(); ++j) {
        int32_t slot = layer.slot_of[unique_[j]];
        if (slot < 0) {
            pending_.push_back(j);
            continue;
        }
        if (cls.slots[slot].prefetch == kPrefetchPartial) {
            // Not resident when the call began: a miss that finishes its prefetch in place.
            expcache_status_t s = order_slot(call.c, slot, call.copy_stream);
            if (s == EXPCACHE_OK) s = finish_partial(call, slot, batch != nullptr);
            if (s != EXPCACHE_OK) return s;
            serve(j, slot);
            continue;
        }
        expcache_status_t s = order_slot(call.c, slot, call.stream);
        if (s != EXPCACHE_OK) return s;
        if (cls.slots[slot].prefetch != kPrefetchNone) note_use(cls, slot);
        if (!batch) {
            cls.policy->on_hit(slot);
            cls.slots[slot].last_call = call_;
        }
        st.hits++;
        serve(j, slot);
    }
    uint32_t direct = 0;
    for (uint32_t j : pending_) {
        uint32_t e = unique_[j];
        st.misses++;
        int32_t slot = -1;
        uint64_t evictions_before = st.evictions;
        expcache_status_t s = acquire_slot(call.c, true, batch ? Evict::kNo : Evict::kDemand, call.path, &slot);
        if (s != EXPCACHE_OK) return s;
        if (slot < 0) {
            pending_[direct++] = j;  // compacted in place: served from staging
            continue;
        }
        SlotState& ss = cls.slots[slot];
        unsigned char* dst[kParts];
        cls.parts_at(ss.dev, dst);
        if ((s = order_slot(call.c, slot, call.copy_stream)) != EXPCACHE_OK ||
            (s = copy_expert(layer, e, dst, call.copy_stream)) != EXPCACHE_OK) {
            cls.free_slots.push_back(slot);  // never marked resident
            return s;
        }
        ss.layer = static_cast<int32_t>(call.layer_index);
        ss.expert = e;
        ss.last_call = call_;
        layer.slot_of[e] = slot;
        inserted_.emplace_back(call.c, slot);
        cls.resident++;
        cls.policy->on_insert(slot, batch != nullptr, layer.key_base + e);
        if (st.evictions == evictions_before) st.appends++;
        st.bytes_h2d += layer.expert_bytes();
        serve(j, slot);
    }
    *out_direct = direct;
    return EXPCACHE_OK;
}

// The misses fill_slots() left without a slot, loaded into `base` laid out as
// consecutive slots of the class, for this call only.
expcache_status_t Cache::stage_overflow(ServeCall& call, unsigned char* base, uint32_t direct) {
    const LayerState& layer = *call.layer;
    const ClassState& cls = *call.cls;
    for (uint32_t i = 0; i < direct; ++i) {
        uint32_t j = pending_[i];
        unsigned char* entry = base + uint64_t(i) * cls.slot_bytes;
        unsigned char* dst[kParts];
        cls.parts_at(entry, dst);
        expcache_status_t s = copy_expert(layer, unique_[j], dst, call.copy_stream);
        if (s != EXPCACHE_OK) return s;
        ptrs_[j] = cls.ptrs_at(entry);
        call.st->direct_loads++;
        call.st->bytes_h2d += layer.expert_bytes();
    }
    return EXPCACHE_OK;
}

}  // namespace expcache
