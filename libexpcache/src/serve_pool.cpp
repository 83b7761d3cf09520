// The host pool (host_pool.hpp) on the serving calls' side: a miss of a pageable or file source
// that a host-side call copies (a decode select, a compact load, a batch; on a device-lookup cache
// too) looks in the pool first. A pool hit is staged from the pool's RAM; a pool miss is read from
// the source into the pool by the calling thread, entered, then staged from there. The slot stays
// pinned until the call's uploads have read it: the staging ring copies it into its chunks before
// finish_uploads() returns (settle_uploads lets it go then); without the ring's threads
// (copy_threads 0) the copy from pinned memory is asynchronous, so the stream is synchronized.
#include "cache.hpp"

namespace expcache {

expcache_status_t Cache::copy_through_pool(const LayerState& layer, uint32_t expert,
                                           unsigned char* const dst[kMaxParts], void* stream, bool* done) {
    *done = false;
    const uint32_t layer_index = static_cast<uint32_t>(&layer - &layers_[0]);
    HostPool::Lease lease = pool_.begin(layer_index, expert, layer.key_base + expert, layer.bytes);
    if (lease.slot < 0) return EXPCACHE_OK;
    expcache_status_t s = EXPCACHE_OK;
    if (!lease.hit) {
        for (int p = 0; p < layer.nparts && s == EXPCACHE_OK; ++p)
            s = layer.source_of(p, expert).fill(lease.at + lease.part_at[p], layer.source_at(p, expert), 0,
                                                layer.bytes[p]);
        if (!pool_.filled(&lease, s == EXPCACHE_OK)) return s;  // a failed read is not entered
    }
    pool_leases_.push_back(lease);
    for (int p = 0; p < layer.nparts && s == EXPCACHE_OK; ++p)
        s = health_.check(backend_->copy_h2d(dst[p], lease.at + lease.part_at[p], layer.bytes[p], false, stream));
    if (s == EXPCACHE_OK && config_.copy_threads == 0) s = health_.check(backend_->sync_stream(stream));
    *done = s == EXPCACHE_OK;
    return s;
}

void Cache::release_pool_leases() {
    for (const HostPool::Lease& lease : pool_leases_) pool_.end(lease, true);
    pool_leases_.clear();
}

void Cache::note_pool_layer(uint32_t layer) {
    pool_.forget_layer(layer);
    const LayerState& l = layers_[layer];
    if (l.source.pinned() || !pool_.enabled() || pool_.note_expert(l.bytes) || pool_warned_) return;
    pool_warned_ = true;
    uint64_t part_at[kMaxParts];
    log_(EXPCACHE_LOG_WARNING,
         "layer %u's experts take %s in the host pool, more than %s (%s): their misses are read past the pool (and "
         "any other layer's that do not fit, said once); raise host_budget_bytes%s",
         layer, human_bytes(pool_layout(l.bytes, part_at)).c_str(), human_bytes(pool_.room()).c_str(),
         pool_.cut() ? "its slots, cut at its first use" : "host_budget_bytes",
         pool_.cut() ? ", or register the layers of the largest experts before the first call" : "");
}

expcache_status_t Cache::get_pool_stats(expcache_pool_stats_t* out) const {
    CallScope scope(*this);
    pool_.stats(out);
    return EXPCACHE_OK;
}

}  // namespace expcache
