// A call's slots: finding one for a miss, filling it, and serving what got none
// from staging. Decode and batch share the fill; they differ in whether a call
// may evict, how it ranks what it inserts, and whether it holds what it serves.
#include "cache.hpp"

#include "kernels/lookup_kernels.hpp"

namespace expcache {

// Hits first, so that no miss of this call can evict them; then each miss into a slot of
// the class. A decode call refreshes its hits and may evict (never a slot this call
// uses or a batch holds). A batch leaves its hits' recency alone, takes free capacity
// only and inserts as the coldest entries, so a prompt cannot flush the decode working
// set; it holds every slot it serves until batch_finish. On failure a batch's holds
// so far stay in batch->held for the caller to undo.
expcache_status_t Cache::fill_slots(ServeCall& call, BatchState* batch, uint32_t* out_direct) {
    if (lookup_.enabled()) return fill_on_device(call, batch, out_direct);
    LayerState& layer = *call.layer;
    const ClassState& cls = *call.cls;
    CallScratch& scratch = call.scratch;
    auto serve = [&](uint32_t j, int32_t slot) {
        if (batch) {
            classes_.hold(call.c, slot);
            batch->held.push_back(slot);
        }
        scratch.ptrs[j] = cls.ptrs_of(uint64_t(slot));
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
        unsigned char* dst[kMaxParts];
        cls.parts_of(uint64_t(slot), dst);
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

// On a device-lookup cache the residency is the device's: the select kernel finds the call's
// slots in the path's mode (a decode's misses get the policy's victims, a batch's free slots
// only, pinned there and held here until batch_finish; a compact load's none) and copies what it
// filled, or, from a source the GPU cannot read, leaves the copies to the call (ordered on its
// stream; a failed one frees its slot). What got none is left as fill_slots leaves it.
expcache_status_t Cache::fill_on_device(ServeCall& call, BatchState* batch, uint32_t* out_direct) {
    CallScratch& scratch = call.scratch;
    const ClassState& cls = *call.cls;
    const uint32_t n = static_cast<uint32_t>(scratch.unique.size());
    const uint32_t mode = call.path == EXPCACHE_PATH_BATCH     ? kModeAppend
                          : call.path == EXPCACHE_PATH_COMPACT ? kModeLend
                                                               : kModeDecode;
    scratch.slots.assign(n, -1);
    scratch.filled.assign(n, 0);
    ServeTally t;
    expcache_status_t s = EXPCACHE_OK;
    if (lookup_.ready(call.c)) {  // else a class of cap 0: no slot, everything served from staging
        s = lookup_.serve(call.layer_index, call.c, scratch.unique.data(), n, mode, call.stream, scratch.slots.data(),
                          scratch.filled.data(), &t);
        if (s != EXPCACHE_OK) return s;
        // The pool times the call's uses by the device's policy clock, which device selects advance too.
        pool_.set_clock(layers_.clock_at(call.layer_index, t.token));
    }
    scratch.pending.clear();
    for (uint32_t j = 0; j < n; ++j) {
        const int32_t slot = scratch.slots[j];
        if (slot < 0) {
            scratch.pending.push_back(j);
            continue;
        }
        if (batch) {  // every slot the select pinned: the batch's unhold unpins them, on failure too
            classes_.hold(call.c, slot);
            batch->held.push_back(slot);
        }
        scratch.ptrs[j] = cls.ptrs_of(uint64_t(slot));
    }
    for (uint32_t j = 0; j < n && t.host_copies; ++j) {
        const int32_t slot = scratch.slots[j];
        if (slot < 0 || !scratch.filled[j]) continue;
        unsigned char* dst[kMaxParts];
        cls.parts_of(uint64_t(slot), dst);
        scratch.inserted.emplace_back(call.c, slot);  // a later upload failure of the call frees it
        if ((s = copy_expert(*call.layer, scratch.unique[j], dst, call.copy_stream)) != EXPCACHE_OK) {
            // This fill and those not copied yet never get their bytes.
            std::vector<int32_t> lost;
            for (uint32_t r = j; r < n; ++r)
                if (scratch.slots[r] >= 0 && scratch.filled[r]) lost.push_back(scratch.slots[r]);
            scratch.inserted.pop_back();
            const std::string why = last_error();
            if (lookup_.forget(call.c, lost) != EXPCACHE_OK) restore_last_error(why);
            return s;
        }
    }
    expcache_stats_t add = {};
    add.hits = t.hits;
    add.misses = n - t.hits;
    add.evictions = t.evictions;
    add.appends = t.fills - t.evictions;
    add.bytes_h2d = t.fills * call.layer->expert_bytes();
    classes_.record(call.c, call.path, add);
    *out_direct = static_cast<uint32_t>(scratch.pending.size());
    return EXPCACHE_OK;
}

// The misses fill_slots() left without a slot, loaded for this call only into the bank's rows from
// `row` on (buffer nullptr), or into `buffer` laid out as consecutive whole slots of the class.
expcache_status_t Cache::stage_overflow(ServeCall& call, unsigned char* buffer, uint64_t row, uint32_t direct) {
    const LayerState& layer = *call.layer;
    const ClassState& cls = *call.cls;
    for (uint32_t i = 0; i < direct; ++i) {
        uint32_t j = call.scratch.pending[i];
        unsigned char* dst[kMaxParts];
        unsigned char* entry = buffer ? buffer + uint64_t(i) * cls.slot_bytes() : nullptr;
        if (entry)
            cls.parts_at(entry, dst);
        else
            cls.parts_of(row + i, dst);
        expcache_status_t s = copy_expert(layer, call.scratch.unique[j], dst, call.copy_stream);
        if (s != EXPCACHE_OK) return s;
        call.scratch.ptrs[j] = entry ? cls.ptrs_at(entry) : cls.ptrs_of(row + i);
        classes_.load_direct(call.c, call.path, call.layer_index, true, false);
    }
    return EXPCACHE_OK;
}

}  // namespace expcache
