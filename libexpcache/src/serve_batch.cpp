// The batch (prefill) path: a prompt's experts for one layer, deduplicated and
// held in place until batch_finish, so a kernel may read them for as long as
// the batch runs. Misses only take free capacity; what finds none is staged in
// memory of the batch's own, freed with it.
#include "cache.hpp"

#include <algorithm>

#include "errors.hpp"

namespace expcache {

expcache_status_t Cache::batch_room() const {
    if (batches_.open.size() >= EXPCACHE_MAX_BATCHES)
        return fail(EXPCACHE_ERR_INVALID_STATE, "%d batches are unfinished; call expcache_batch_finish first",
                    EXPCACHE_MAX_BATCHES);
    return EXPCACHE_OK;
}

expcache_status_t Cache::unhold(const BatchState& batch, void* stream) {
    // Read by the batch's work up to now: no prefetch may overwrite it before the next call.
    for (int32_t slot : batch.held) classes_.unhold(batch.cls, slot, clock_.cur);
    if (batch.rows) classes_.give_batch_rows(batch.cls);
    if (!lookup_.enabled() || batch.held.empty()) return EXPCACHE_OK;
    // The device's pins of the slots no other batch holds go, after the batch's work on `stream`.
    std::vector<int32_t> free;
    for (int32_t slot : batch.held)
        if (classes_[batch.cls].slots()[slot].holds() == 0) free.push_back(slot);
    return lookup_.unpin(batch.cls, free, stream);
}

expcache_status_t Cache::batch_prepare_slots(uint32_t layer_index, const void* ids, uint32_t id_bits, uint64_t n,
                                             void* stream, uint32_t* out_ids, int32_t* out_slots, uint32_t* out_count,
                                             uint64_t* out_batch) {
    std::vector<uint32_t> narrowed;  // a prompt's: freed with the call
    expcache_status_t s = narrow_ids(layer_index, ids, id_bits, n, kMaxBatchIds, "n", &narrowed);
    return s == EXPCACHE_OK ? batch_prepare(layer_index, narrowed.data(), n, stream, out_ids, nullptr, out_slots,
                                            out_count, out_batch)
                            : s;
}

expcache_status_t Cache::batch_prepare(uint32_t layer_index, const uint32_t* ids, uint64_t n, void* stream,
                                       uint32_t* out_ids, expcache_expert_ptrs_t* out_ptrs, int32_t* out_slots,
                                       uint32_t* out_count, uint64_t* out_batch) {
    ServeCall call(*this, EXPCACHE_PATH_BATCH, layer_index, stream);
    if (out_ptrs) call.ptrs = "expcache_batch_prepare_slots_async";
    expcache_status_t s = open_call(call, ids, n, kMaxBatchIds, "n", &Cache::batch_room);
    if (s != EXPCACHE_OK) return s;
    BatchState batch;
    batch.id = batches_.next_id;
    batch.layer = layer_index;
    batch.cls = call.c;
    uint32_t direct = 0;
    if ((s = fill_slots(call, &batch, &direct)) != EXPCACHE_OK) {
        unhold(batch, stream);
        return s;
    }
    if (direct > 0 && out_slots) {
        // By slot id: staged in the class's batch rows, addressed as its slots are (mapped out of
        // the reserve, as batch staging is; never releasing the caches).
        uint64_t row = 0;
        if ((s = classes_.take_batch_rows(call.c, direct, &row)) != EXPCACHE_OK) {
            unhold(batch, stream);
            return s;
        }
        batch.rows = true;
        if ((s = stage_overflow(call, nullptr, row, direct)) != EXPCACHE_OK) {
            call.uploads.abandon();  // earlier uploads may still write into the rows
            unhold(batch, stream);
            return s;
        }
    } else if (direct > 0) {
        // Batch staging comes out of what the caches leave free (the reserve); it never releases
        // them, so a prompt cannot flush the decode working set even when memory is short.
        const uint64_t bytes = uint64_t(direct) * call.cls->slot_bytes();
        if ((s = health_.check(arena_.alloc(bytes, &batch.staging))) != EXPCACHE_OK) {
            unhold(batch, stream);
            if (s == EXPCACHE_ERR_OUT_OF_DEVICE_MEMORY)
                return fail(s,
                            "batch staging of %u experts (%llu bytes) does not fit next to the caches (%s); "
                            "split the batch, finish other batches, or raise reserve_bytes",
                            direct, (unsigned long long)bytes, last_error());
            return s;
        }
        if ((s = stage_overflow(call, static_cast<unsigned char*>(batch.staging), 0, direct)) != EXPCACHE_OK) {
            unhold(batch, stream);
            call.uploads.abandon();  // earlier uploads may still write into the staging
            health_.check(arena_.free_after(batch.staging, stream));
            return s;
        }
    }
    if ((s = call.uploads.settle()) != EXPCACHE_OK) {
        unhold(batch, stream);
        if (batch.staging) health_.check(arena_.free_after(batch.staging, stream));
        return s;
    }
    const CallScratch& scratch = call.scratch;
    for (uint32_t j = 0; j < scratch.unique.size(); ++j) {
        out_ids[j] = scratch.unique[j];
        if (out_ptrs)
            out_ptrs[j] = scratch.ptrs[j];
        else
            out_slots[j] = row_of(call.c, scratch.ptrs[j]);
    }
    *out_count = static_cast<uint32_t>(scratch.unique.size());
    *out_batch = batch.id;
    ++batches_.next_id;
    log_(EXPCACHE_LOG_DEBUG, "batch %llu layer %u: %llu ids, %zu unique, %zu misses, %u direct",
         (unsigned long long)batch.id, layer_index, (unsigned long long)n, scratch.unique.size(),
         scratch.pending.size(), direct);
    batches_.open.push_back(std::move(batch));
    return EXPCACHE_OK;
}

expcache_status_t Cache::batch_finish(uint64_t id, void* stream) {
    CallScope scope(*this);
    auto it = std::find_if(batches_.open.begin(), batches_.open.end(), [&](const BatchState& b) { return b.id == id; });
    if (it == batches_.open.end())
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "batch %llu is unknown or already finished", (unsigned long long)id);
    expcache_status_t s = health_.usable();
    if (s == EXPCACHE_OK && it->staging) s = health_.check(arena_.free_after(it->staging, stream));
    if (s != EXPCACHE_OK) return s;
    s = unhold(*it, stream);
    batches_.open.erase(it);
    return s;
}

}  // namespace expcache
