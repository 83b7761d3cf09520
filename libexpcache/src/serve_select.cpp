// The decode path: a token's experts for one layer, each served from a slot of
// the layer's class (hits refreshed, misses inserted, evicting as needed); what
// the class cannot hold at once comes from the overflow staging.
#include "cache.hpp"

namespace expcache {

expcache_status_t Cache::select(uint32_t layer_index, const uint32_t* ids, uint32_t k, void* stream,
                                expcache_expert_ptrs_t* out) {
    ServeCall call(*this, EXPCACHE_PATH_DECODE, layer_index, stream);
    expcache_status_t s = open_call(call, ids, k, EXPCACHE_MAX_SELECT, "k");
    if (s != EXPCACHE_OK) return s;
    uint32_t direct = 0;
    if ((s = fill_slots(call, nullptr, &direct)) != EXPCACHE_OK) return s;
    if (direct > 0) {
        // The class cannot hold the whole request: serve the overflow from staging. It never
        // releases the caches: the hits resolved above point into them.
        if ((s = reserve_buffer(call, overflow_, uint64_t(direct) * call.cls->slot_bytes, false)) != EXPCACHE_OK)
            return s;
        if ((s = stage_overflow(call, static_cast<unsigned char*>(overflow_.ptr), direct)) != EXPCACHE_OK) return s;
    }
    if ((s = call.uploads.settle()) != EXPCACHE_OK) return s;
    const LayerState& layer = *call.layer;
    for (uint32_t i = 0; i < k; ++i) out[i] = ptrs_[layer.seen_pos[ids[i]]];
    log(EXPCACHE_LOG_DEBUG, "select layer %u k %u: %zu unique, %zu hits, %zu misses, %u direct", layer_index, k,
        unique_.size(), unique_.size() - pending_.size(), pending_.size(), direct);
    return EXPCACHE_OK;
}

}  // namespace expcache
