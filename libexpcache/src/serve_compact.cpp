// The compact path: one layer's listed experts copied, in the order listed and
// duplicates included, into one buffer of part arrays (gate, up, down for three parts),
// from their slots where resident and from the source otherwise. Nothing is
// inserted: the cache only lends its hits.
#include "cache.hpp"

namespace expcache {

namespace {

// Where expert i of a compact buffer at `base` with regions at `off` goes, part by part.
void compact_parts(const LayerState& layer, unsigned char* base, const uint64_t* off, uint32_t i,
                   unsigned char* dst[kMaxParts]) {
    for (int p = 0; p < kMaxParts; ++p) dst[p] = p < layer.nparts ? base + off[p] + layer.bytes[p] * i : nullptr;
}

}  // namespace

// On a device-lookup cache: the device select, lending (kModeLend: hits refreshed as the policy
// sees a compact load's, nothing inserted), says which ids are resident; each is copied from its
// slot or from the source.
expcache_status_t Cache::compact_on_device(ServeCall& call, const uint32_t* ids, uint32_t n, unsigned char* base,
                                           const uint64_t* off) {
    uint32_t missing = 0;
    expcache_status_t s = fill_on_device(call, nullptr, &missing);
    if (s != EXPCACHE_OK) return s;
    const LayerState& layer = *call.layer;
    const ClassState& cls = *call.cls;
    const uint64_t* b = layer.bytes;
    expcache_stats_t lent = {};
    uint32_t next_unique = 0;  // the call's unique ids are in first-appearance order
    for (uint32_t i = 0; i < n; ++i) {
        const uint32_t j = layer.seen_pos[ids[i]];
        const bool first = j == next_unique;
        if (first) ++next_unique;
        unsigned char* dst[kMaxParts];
        compact_parts(layer, base, off, i, dst);
        const int32_t slot = call.scratch.slots[j];
        if (slot >= 0) {
            for (int p = 0; p < layer.nparts; ++p)
                if ((s = health_.check(backend_->copy_d2d(dst[p], cls.part(uint64_t(slot), p), b[p], call.stream))) !=
                    EXPCACHE_OK)
                    return s;
            lent.bytes_d2d += layer.expert_bytes();
        } else {
            if ((s = copy_expert(layer, ids[i], dst, call.stream)) != EXPCACHE_OK) return s;
            classes_.load_direct(call.c, call.path, call.layer_index, first, false);
        }
    }
    classes_.record(call.c, call.path, lent);
    return EXPCACHE_OK;
}

// From the class table: each id copied from its slot (a hit, lent) or from the source.
expcache_status_t Cache::compact_from_table(ServeCall& call, const uint32_t* ids, uint32_t n, unsigned char* base,
                                            const uint64_t* off) {
    const LayerState& layer = *call.layer;
    const ClassState& cls = *call.cls;
    const uint64_t* b = layer.bytes;
    void* stream = call.stream;
    expcache_status_t s = EXPCACHE_OK;
    uint32_t next_unique = 0;  // the call's unique ids are in first-appearance order
    for (uint32_t i = 0; i < n; ++i) {
        uint32_t e = ids[i];
        bool first = layer.seen_pos[e] == next_unique;
        if (first) ++next_unique;
        unsigned char* dst[kMaxParts];
        compact_parts(layer, base, off, i, dst);
        int32_t slot = layer.slot_of[e];
        if (slot >= 0) {
            const SlotState& ss = cls.slots()[slot];
            classes_.touch(call.c, slot, clock_.call);  // read on `stream` now: no prefetch may overwrite it
                                                        // before the next call
            if ((s = streams_.order_slot(call.c, slot, stream)) != EXPCACHE_OK) return s;
            if (ss.prefetch() != kPrefetchNone) prefetch_.note_use(call.c, slot);
            for (int p = 0; p < layer.nparts; ++p)
                if ((s = health_.check(backend_->copy_d2d(dst[p], cls.part(uint64_t(slot), p), b[p], stream))) !=
                    EXPCACHE_OK)
                    return s;
            classes_.lend(call.c, slot, call.path, first);
        } else {
            if ((s = copy_expert(layer, e, dst, stream)) != EXPCACHE_OK) return s;
            classes_.load_direct(call.c, call.path, call.layer_index, first, first);
        }
    }
    return EXPCACHE_OK;
}

expcache_status_t Cache::load_compact(uint32_t layer_index, const uint32_t* ids, uint32_t n, void* stream,
                                      expcache_compact_t* out) {
    ServeCall call(*this, EXPCACHE_PATH_COMPACT, layer_index, stream);
    expcache_status_t s = open_call(call, ids, n, kMaxCompact, "n");
    if (s != EXPCACHE_OK) return s;
    const LayerState& layer = *call.layer;
    const uint64_t* b = layer.bytes;
    // One region per part, each starting aligned.
    uint64_t off[kMaxParts] = {}, total = 0;
    for (int p = 0; p < layer.nparts; ++p) {
        off[p] = align_up(total);
        total = off[p] + b[p] * n;
    }

    // Allocate before resolving hits: the retry may release the caches.
    if ((s = reserve_buffer(call, staging_.compact, total, true)) != EXPCACHE_OK) return s;
    unsigned char* base = static_cast<unsigned char*>(staging_.compact.ptr);
    if (lookup_.enabled())
        s = compact_on_device(call, ids, n, base, off);
    else
        s = compact_from_table(call, ids, n, base, off);
    if (s != EXPCACHE_OK) return s;
    if ((s = call.uploads.settle()) != EXPCACHE_OK) return s;
    out->num_experts = n;
    out->base = staging_.compact.ptr;
    out->bytes = total;
    out->num_parts = static_cast<uint32_t>(layer.nparts);
    out->reserved = 0;
    for (int p = 0; p < kMaxParts; ++p) {
        out->part_offset[p] = off[p];
        out->part_bytes[p] = b[p];
    }
    const bool three = layer.nparts == kThreeParts;
    out->gate_offset = three ? off[kGate] : 0;
    out->up_offset = three ? off[kUp] : 0;
    out->down_offset = three ? off[kDown] : 0;
    out->gate_bytes = three ? b[kGate] : 0;
    out->up_bytes = three ? b[kUp] : 0;
    out->down_bytes = three ? b[kDown] : 0;
    log_(EXPCACHE_LOG_DEBUG, "load_compact layer %u n %u: %.1f MiB buffer", layer_index, n,
         double(total) / double(1 << 20));
    return EXPCACHE_OK;
}

}  // namespace expcache
