// The decode path: a token's experts for one layer, each served from a slot of
// the layer's class (hits refreshed, misses inserted, evicting as needed); what
// the class cannot hold at once comes from the overflow staging. A split select
// sends the misses on the cache's own copy stream, so the hits can be used while
// they cross.
#include "cache.hpp"

#include "errors.hpp"

namespace expcache {

expcache_status_t Cache::serve_decode(ServeCall& call, const uint32_t* ids, uint32_t k, expcache_expert_ptrs_t* out) {
    uint32_t direct = 0;
    expcache_status_t s = fill_slots(call, nullptr, &direct);
    if (s != EXPCACHE_OK) return s;
    if (direct > 0) {
        // The class cannot hold the whole request: serve the overflow from staging. It never
        // releases the caches: the hits resolved above point into them.
        if ((s = reserve_buffer(call, staging_.overflow, uint64_t(direct) * call.cls->slot_bytes, false)) !=
            EXPCACHE_OK)
            return s;
        if ((s = stage_overflow(call, static_cast<unsigned char*>(staging_.overflow.ptr), direct)) != EXPCACHE_OK)
            return s;
    }
    if ((s = call.uploads.settle()) != EXPCACHE_OK) return s;
    const LayerState& layer = *call.layer;
    for (uint32_t i = 0; i < k; ++i) out[i] = call.scratch.ptrs[layer.seen_pos[ids[i]]];
    log_(EXPCACHE_LOG_DEBUG, "select layer %u k %u: %zu unique, %zu hits, %zu misses, %u direct", call.layer_index, k,
         call.scratch.unique.size(), call.scratch.unique.size() - call.scratch.pending.size(),
         call.scratch.pending.size(), direct);
    return EXPCACHE_OK;
}

expcache_status_t Cache::select(uint32_t layer_index, const uint32_t* ids, uint32_t k, void* stream,
                                expcache_expert_ptrs_t* out) {
    ServeCall call(*this, EXPCACHE_PATH_DECODE, layer_index, stream);
    expcache_status_t s = open_call(call, ids, k, EXPCACHE_MAX_SELECT, "k");
    if (s != EXPCACHE_OK) return s;
    return serve_decode(call, ids, k, out);
}

expcache_status_t Cache::select_split(uint32_t layer_index, const uint32_t* ids, uint32_t k, void* stream,
                                      expcache_expert_ptrs_t* out, uint8_t* out_resident, void** out_ready) {
    ServeCall call(*this, EXPCACHE_PATH_DECODE, layer_index, stream);
    expcache_status_t s = open_call(call, ids, k, EXPCACHE_MAX_SELECT, "k");
    if (s != EXPCACHE_OK) return s;
    const LayerState& layer = *call.layer;
    std::vector<uint8_t>& resident = call.scratch.resident;
    resident.resize(call.scratch.unique.size());
    bool any_miss = false;
    for (size_t j = 0; j < call.scratch.unique.size(); ++j) {
        const int32_t slot = layer.slot_of[call.scratch.unique[j]];
        resident[j] = slot >= 0 && call.cls->slots[slot].prefetch != kPrefetchPartial;
        any_miss = any_miss || !resident[j];
    }
    void* copy = backend_->copy_stream();
    if (any_miss && copy) {
        // The misses may overwrite slots that work enqueued on `stream` so far still reads.
        if ((s = health_.check(backend_->fence(stream, copy))) != EXPCACHE_OK) return s;
        call.copy_stream = copy;
    }
    if ((s = serve_decode(call, ids, k, out)) != EXPCACHE_OK) {
        if (call.copy_stream != stream) streams_.copy_dirty();  // some copies may have gone out
        return s;
    }
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
