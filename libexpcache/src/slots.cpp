// A call's slots: finding one for a miss, filling it, and serving what got none
// from staging. Decode and batch share the fill; they differ in whether a call
// may evict, how it ranks what it inserts, and whether it holds what it serves.
#include "cache.hpp"

namespace expcache {

// Hits first, so that no miss of this call can evict them; then each miss into a slot of
// the class. A decode call refreshes its hits and may evict (never a slot this call
// uses or a batch holds). A batch leaves its hits' recency alone, takes free capacity
// only and inserts as the coldest entries, so a prompt cannot flush the decode working
// set; it holds every slot it serves until batch_finish. On failure a batch's holds
// so far stay in batch->held for the caller to undo.
expcache_status_t Cache::fill_slots(ServeCall& call, BatchState* batch, uint32_t* out_direct) {
    LayerState& layer = *call.layer;
    const ClassState& cls = *call.cls;
    CallScratch& scratch = call.scratch;
    auto serve = [&](uint32_t j, int32_t slot) {
        if (batch) {
            classes_.hold(call.c, slot);
            batch->held.push_back(slot);
        }
        scratch.ptrs[j] = cls.ptrs_at(cls.slots()[slot].dev());
    };
    scratch.pending.clear();
    for (uint32_t j = 0; j < scratch.unique.size(); ++j) {
        int32_t slot = layer.slot_of[scratch.unique[j]];
        if (slot < 0) {
            scratch.pending.push_back(j);
            continue;
        }
        if (cls.slots()[slot].prefetch() == kPrefetchPartial) {
            // Not resident when the call began: a miss that finishes its prefetch in place.
            expcache_status_t s = streams_.order_slot(call.c, slot, call.copy_stream);
            if (s == EXPCACHE_OK)
                s = prefetch_.finish_partial(call.c, slot, batch != nullptr, call.copy_stream, call.path);
            if (s != EXPCACHE_OK) return s;
            scratch.inserted.emplace_back(call.c, slot);  // a later upload failure of the call frees it
            serve(j, slot);
            continue;
        }
        expcache_status_t s = streams_.order_slot(call.c, slot, call.stream);
        if (s != EXPCACHE_OK) return s;
        if (cls.slots()[slot].prefetch() != kPrefetchNone) prefetch_.note_use(call.c, slot);
        classes_.hit(call.c, slot, call.path, batch ? 0 : clock_.call);
        serve(j, slot);
    }
    uint32_t direct = 0;
    for (uint32_t j : scratch.pending) {
        uint32_t e = scratch.unique[j];
        Acquired got;
        SlotRequest req;
        req.cls = call.c;
        req.layer = call.layer_index;
        req.path = call.path;
        req.miss = true;
        req.evict = batch ? Evict::kNo : Evict::kDemand;
        req.protect_from = clock_.call;  // a demand call protects the slots it uses (the newest call id)
        expcache_status_t s = classes_.acquire(req, &got);
        if (s != EXPCACHE_OK) return s;
        if (got.dropped_prefetch_layer >= 0)
            prefetch_.dropped_unused(static_cast<uint32_t>(got.dropped_prefetch_layer));
        const int32_t slot = got.slot;
        if (slot < 0) {
            scratch.pending[direct++] = j;  // compacted in place: served from staging
            continue;
        }
        unsigned char* dst[kParts];
        cls.parts_at(cls.slots()[slot].dev(), dst);
        if ((s = streams_.order_slot(call.c, slot, call.copy_stream)) != EXPCACHE_OK ||
            (s = copy_expert(layer, e, dst, call.copy_stream)) != EXPCACHE_OK) {
            classes_.unacquire(call.c, slot);  // never marked resident
            return s;
        }
        classes_.install(call.c, got, call.layer_index, e, batch ? Insert::kCold : Insert::kDemand, clock_.call,
                         call.path);
        scratch.inserted.emplace_back(call.c, slot);
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
        uint32_t j = call.scratch.pending[i];
        unsigned char* entry = base + uint64_t(i) * cls.slot_bytes();
        unsigned char* dst[kParts];
        cls.parts_at(entry, dst);
        expcache_status_t s = copy_expert(layer, call.scratch.unique[j], dst, call.copy_stream);
        if (s != EXPCACHE_OK) return s;
        call.scratch.ptrs[j] = cls.ptrs_at(entry);
        classes_.load_direct(call.c, call.path, call.layer_index, true, false);
    }
    return EXPCACHE_OK;
}

}  // namespace expcache
