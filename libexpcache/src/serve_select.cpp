// The decode path: a token's experts for one layer, each served from a slot of
// the layer's class (hits refreshed, misses inserted, evicting as needed); what
// the class cannot hold at once is staged in its bank's staging rows. A split select
// sends the misses on the cache's own copy stream, so the hits can be used while
// they cross.
#include "cache.hpp"

#include "errors.hpp"

namespace expcache {

namespace {
const char* const kSlotSelects = "expcache_select_slots_async or expcache_select_device_async";
}  // namespace

expcache_status_t Cache::serve_decode(ServeCall& call, uint32_t k) {
    uint32_t direct = 0;
    expcache_status_t s = fill_slots(call, nullptr, &direct);
    if (s != EXPCACHE_OK) return s;
    if (direct > 0) {
        // The class cannot hold the whole request: stage the rest in the bank's staging rows
        // (addressed by slot id as the slots are). It never releases the caches: the hits
        // resolved above point into them.
        uint64_t row = 0;
        if ((s = classes_.staging_rows(call.c, direct, &row)) != EXPCACHE_OK ||
            (s = stage_overflow(call, nullptr, row, direct)) != EXPCACHE_OK)
            return s;
    }
    if ((s = call.uploads.settle()) != EXPCACHE_OK) return s;
    log_(EXPCACHE_LOG_DEBUG, "select layer %u k %u: %zu unique, %zu hits, %zu misses, %u direct", call.layer_index, k,
         call.scratch.unique.size(), call.scratch.unique.size() - call.scratch.pending.size(),
         call.scratch.pending.size(), direct);
    return EXPCACHE_OK;
}

void Cache::write_ptrs(const ServeCall& call, const uint32_t* ids, uint32_t k, expcache_expert_ptrs_t* out) const {
    const LayerState& layer = *call.layer;
    for (uint32_t i = 0; i < k; ++i) out[i] = call.scratch.ptrs[layer.seen_pos[ids[i]]];
}

expcache_status_t Cache::select(uint32_t layer_index, const uint32_t* ids, uint32_t k, void* stream,
                                expcache_expert_ptrs_t* out) {
    ServeCall call(*this, EXPCACHE_PATH_DECODE, layer_index, stream);
    call.ptrs = kSlotSelects;
    expcache_status_t s = open_call(call, ids, k, EXPCACHE_MAX_SELECT, "k");
    if (s == EXPCACHE_OK) s = serve_decode(call, k);
    if (s == EXPCACHE_OK) write_ptrs(call, ids, k, out);
    return s;
}

expcache_status_t Cache::select_ids(uint32_t layer_index, const void* ids, uint32_t id_bits, uint32_t k, void* stream,
                                    expcache_expert_ptrs_t* out) {
    const uint32_t* narrowed = nullptr;
    expcache_status_t s = narrow_decode(layer_index, ids, id_bits, k, &narrowed);
    return s == EXPCACHE_OK ? select(layer_index, narrowed, k, stream, out) : s;
}

expcache_status_t Cache::select_slots(uint32_t layer_index, const void* ids, uint32_t id_bits, uint32_t k, int32_t* out,
                                      void* stream) {
    const uint32_t* narrowed = nullptr;
    expcache_status_t s = narrow_decode(layer_index, ids, id_bits, k, &narrowed);
    if (s != EXPCACHE_OK) return s;
    ServeCall call(*this, EXPCACHE_PATH_DECODE, layer_index, stream);
    if ((s = open_call(call, narrowed, k, EXPCACHE_MAX_SELECT, "k")) != EXPCACHE_OK) return s;
    if ((s = serve_decode(call, k)) != EXPCACHE_OK) return s;
    const LayerState& layer = *call.layer;
    for (uint32_t i = 0; i < k; ++i) out[i] = row_of(call.c, call.scratch.ptrs[layer.seen_pos[narrowed[i]]]);
    return EXPCACHE_OK;
}

// A split select sends its misses on the cache's copy stream while the hits are used; a
// device-lookup cache's select copies its misses inside its own grid, on the caller's stream.
expcache_status_t Cache::split_room() const {
    if (!lookup_.enabled()) return EXPCACHE_OK;
    return fail(EXPCACHE_ERR_UNSUPPORTED,
                "select_split is not available on a device-lookup cache: its select copies the misses inside its "
                "own grid on the caller's stream, so there is no copy to overlap; use select (or select_device, "
                "which never leaves the device)");
}

expcache_status_t Cache::select_split(uint32_t layer_index, const uint32_t* ids, uint32_t k, void* stream,
                                      expcache_expert_ptrs_t* out, uint8_t* out_resident, void** out_ready) {
    ServeCall call(*this, EXPCACHE_PATH_DECODE, layer_index, stream);
    call.ptrs = kSlotSelects;
    expcache_status_t s = open_call(call, ids, k, EXPCACHE_MAX_SELECT, "k", &Cache::split_room);
    if (s != EXPCACHE_OK) return s;
    const LayerState& layer = *call.layer;
    std::vector<uint8_t>& resident = call.scratch.resident;
    resident.resize(call.scratch.unique.size());
    bool any_miss = false;
    for (size_t j = 0; j < call.scratch.unique.size(); ++j) {
        const int32_t slot = layer.slot_of[call.scratch.unique[j]];
        resident[j] = slot >= 0 && call.cls->slots()[slot].prefetch() != kPrefetchPartial;
        any_miss = any_miss || !resident[j];
    }
    void* copy = backend_->copy_stream();
    if (any_miss && copy) {
        // The misses may overwrite slots that work enqueued on `stream` so far still reads.
        if ((s = health_.check(backend_->fence(stream, copy))) != EXPCACHE_OK) return s;
        call.copy_stream = copy;
    }
    if ((s = serve_decode(call, k)) != EXPCACHE_OK) {
        if (call.copy_stream != stream) streams_.copy_dirty();  // some copies may have gone out
        return s;
    }
    write_ptrs(call, ids, k, out);
    void* ready = nullptr;
    if (call.copy_stream != stream) {
        streams_.copy_dirty();
        if ((s = health_.check(backend_->record_ready(copy, &ready))) != EXPCACHE_OK) return s;
    }
    for (uint32_t i = 0; i < k; ++i) out_resident[i] = resident[layer.seen_pos[ids[i]]];
    *out_ready = ready;
    return EXPCACHE_OK;
}

expcache_status_t Cache::wait_ready(void* ready, void* stream) {
    CallScope scope(*this);
    expcache_status_t s = health_.usable();
    if (s != EXPCACHE_OK) return s;
    if (!backend_->is_ready_event(ready))
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "ready %p is not an event of this cache's split selects", ready);
    return health_.check(backend_->wait_ready(ready, stream));
}

}  // namespace expcache
