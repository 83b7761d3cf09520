// What a caller reads back and sets beside serving: resident and device bytes,
// checksums, classes and counters, and the fault injection the tests drive.
#include "cache.hpp"

#include <algorithm>

#include "errors.hpp"
#include "expcache_testing.h"  // EXPCACHE_CHECKSUM_RESULTS

namespace expcache {

// ---------------------------------------------------------------------------
// Reads and checksums

expcache_status_t Cache::read_resident(uint32_t layer_index, uint32_t expert, void* dst, uint64_t dst_bytes,
                                       uint32_t* out_resident) {
    CallScope scope(*this);
    expcache_status_t s = health_.usable();
    if (s == EXPCACHE_OK) s = layers_.validate(layer_index);
    if (s != EXPCACHE_OK) return s;
    LayerState& layer = layers_[layer_index];
    if (expert >= layer.num_experts)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "expert id %u out of range for layer %u (%u experts)", expert,
                    layer_index, layer.num_experts);
    if (dst_bytes < layer.expert_bytes())
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "dst_bytes %llu < expert size %llu", (unsigned long long)dst_bytes,
                    (unsigned long long)layer.expert_bytes());
    if ((s = prefetch_.settle(false)) != EXPCACHE_OK) return s;
    const int32_t c = classes_.bound(layer);
    int32_t slot = -1;
    if (lookup_.enabled()) {
        if (c >= 0 && (s = lookup_.slot_of(layer_index, c, expert, &slot)) != EXPCACHE_OK) return s;
    } else {
        slot = c >= 0 ? layer.slot_of[expert] : -1;
        if (slot >= 0 && classes_[c].slots()[slot].prefetch() != kPrefetchNone &&
            classes_[c].slots()[slot].prefetch() != kPrefetchUnused)
            slot = -1;  // bytes not all sent
    }
    if (slot < 0) {
        *out_resident = 0;
        return EXPCACHE_OK;
    }
    const ClassState& cls = classes_[c];
    unsigned char* d = static_cast<unsigned char*>(dst);
    for (int p = 0; p < layer.nparts; ++p) {
        if ((s = health_.check(backend_->copy_d2h_sync(d, cls.part(uint64_t(slot), p), layer.bytes[p]))) != EXPCACHE_OK)
            return s;
        d += layer.bytes[p];
    }
    *out_resident = 1;
    return EXPCACHE_OK;
}

expcache_status_t Cache::read_device(const void* src, void* dst, uint64_t n) {
    CallScope scope(*this);
    expcache_status_t s = health_.usable();
    if (s != EXPCACHE_OK) return s;
    if (!arena_.owns(src, n))
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "[%p, +%llu) is not inside memory this cache allocated", src,
                    (unsigned long long)n);
    return health_.check(backend_->copy_d2h_sync(dst, src, n));
}

// The jobs of a checksum: one per part of each expert, each inside memory this cache allocated.
expcache_status_t Cache::checksum_jobs(uint32_t layer_index, const expcache_expert_ptrs_t* ptrs, uint32_t n,
                                       std::vector<ChecksumJob>* out) {
    expcache_status_t s = health_.usable();
    if (s == EXPCACHE_OK) s = layers_.validate(layer_index);
    if (s != EXPCACHE_OK) return s;
    if (n == 0 || n > kMaxCompact)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "n must be 1..%u, got %u", kMaxCompact, n);
    const LayerState& layer = layers_[layer_index];
    if (layer.nparts != kThreeParts)
        return fail(EXPCACHE_ERR_INVALID_STATE,
                    "layer %u's experts have %d parts, and expcache_expert_ptrs_t holds three: checksum its slots "
                    "(expcache_testing_bank_checksum_async)",
                    layer_index, layer.nparts);
    std::vector<ChecksumJob>& jobs = *out;
    jobs.clear();
    for (uint32_t i = 0; i < n; ++i) {
        const void* parts[kThreeParts] = {ptrs[i].gate, ptrs[i].up, ptrs[i].down};
        for (int p = 0; p < kThreeParts; ++p) {
            if (!arena_.owns(parts[p], layer.bytes[p]))
                return fail(EXPCACHE_ERR_INVALID_ARGUMENT,
                            "expert %u part %d at %p (+%llu bytes) is not inside memory this cache allocated", i, p,
                            parts[p], (unsigned long long)layer.bytes[p]);
            jobs.push_back(ChecksumJob{parts[p], layer.bytes[p], i});
        }
    }
    return EXPCACHE_OK;
}

expcache_status_t Cache::checksum(uint32_t layer_index, const expcache_expert_ptrs_t* ptrs, uint32_t n, void* stream,
                                  uint64_t* out_sums) {
    CallScope scope(*this);
    std::vector<ChecksumJob> jobs;
    expcache_status_t s = checksum_jobs(layer_index, ptrs, n, &jobs);
    if (s == EXPCACHE_OK) s = begin_call(stream, true);  // the selects that served ptrs ordered their slots
    // Slots past the public area, so a synchronous checksum never overwrites unread async results.
    const uint32_t first = EXPCACHE_CHECKSUM_RESULTS;
    if (s == EXPCACHE_OK)
        s = health_.check(
            backend_->kernels().checksum_async(jobs.data(), static_cast<uint32_t>(jobs.size()), n, first, stream));
    if (s == EXPCACHE_OK) s = health_.check(backend_->sync_stream(stream));
    if (s == EXPCACHE_OK) s = health_.check(backend_->kernels().checksum_results(first, n, out_sums));
    return s;
}

expcache_status_t Cache::checksum_async(uint32_t layer_index, const expcache_expert_ptrs_t* ptrs, uint32_t n,
                                        void* stream, uint32_t first) {
    CallScope scope(*this);
    if (uint64_t(first) + n > EXPCACHE_CHECKSUM_RESULTS)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "result slots %u..%llu are past the %d slots of the area", first,
                    (unsigned long long)first + n - 1, EXPCACHE_CHECKSUM_RESULTS);
    std::vector<ChecksumJob> jobs;
    expcache_status_t s = checksum_jobs(layer_index, ptrs, n, &jobs);
    if (s == EXPCACHE_OK) s = begin_call(stream, true);  // the selects that served ptrs ordered their slots
    if (s == EXPCACHE_OK)
        s = health_.check(
            backend_->kernels().checksum_async(jobs.data(), static_cast<uint32_t>(jobs.size()), n, first, stream));
    return s;
}

expcache_status_t Cache::bank_checksum_async(uint32_t layer_index, const int32_t* slots, uint32_t n, void* stream,
                                             uint32_t first, bool host_slots) {
    CallScope scope(*this);
    expcache_status_t s = health_.usable();
    if (s == EXPCACHE_OK) s = layers_.validate(layer_index);
    if (s != EXPCACHE_OK) return s;
    if (n == 0 || n > EXPCACHE_MAX_SELECT || uint64_t(first) + n > EXPCACHE_CHECKSUM_RESULTS)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "n must be 1..%d and result slots [%u, +%u) within the %d slots",
                    EXPCACHE_MAX_SELECT, first, n, EXPCACHE_CHECKSUM_RESULTS);
    const int32_t c = classes_.bound(layers_[layer_index]);
    if (c < 0 || classes_[c].slots().empty())
        return fail(EXPCACHE_ERR_INVALID_STATE,
                    "layer %u's bank has no slot yet: its class is not bound, or has not grown (select it once)",
                    layer_index);
    const ClassState& cls = classes_[c];
    BankChecksum b = {};
    b.base = cls.bank();
    for (int p = 0; p < kMaxParts; ++p) {
        b.part_at[p] = cls.part_at(p);
        b.part_stride[p] = cls.part_stride(p);
        b.part_bytes[p] = cls.key(p);
    }
    b.cap = static_cast<uint32_t>(cls.slots().size());
    if (cls.staging_mapped()) {  // the staging rows wholly mapped
        b.staged_from = static_cast<uint32_t>(cls.staging_row());
        b.staged_to = static_cast<uint32_t>(std::max(cls.staging_row(), cls.staging_mapped_to()));
    }
    if (cls.batch_mapped()) {  // the batch rows mapped whole (batch_prepare_slots)
        b.batch_from = static_cast<uint32_t>(cls.batch_row());
        b.batch_to = static_cast<uint32_t>(std::max(cls.batch_row(), cls.batch_mapped_to()));
    }
    b.n = n;
    b.slots = slots;
    if (!host_slots) return health_.check(backend_->kernels().bank_checksum_async(b, first, stream));
    // Not captured: ordered after the select that served the slots, as checksum_async is.
    if ((s = begin_call(stream, true)) != EXPCACHE_OK) return s;
    return health_.check(backend_->kernels().bank_checksum_host_slots_async(b, first, stream));
}

expcache_status_t Cache::checksum_results(uint32_t first, uint32_t n, uint64_t* out) {
    CallScope scope(*this);
    expcache_status_t s = health_.usable();
    if (s != EXPCACHE_OK) return s;
    if (n == 0 || uint64_t(first) + n > EXPCACHE_CHECKSUM_RESULTS)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "result slots [%u, +%u) must be non-empty and within the %d slots",
                    first, n, EXPCACHE_CHECKSUM_RESULTS);
    return health_.check(backend_->kernels().checksum_results(first, n, out));
}

// ---------------------------------------------------------------------------
// Classes and counters

expcache_status_t Cache::class_count(uint32_t* out) const {
    CallScope scope(*this);
    uint32_t n = 0;
    for (const ClassState& c : classes_) n += c.in_use() ? 1 : 0;
    *out = n;
    return EXPCACHE_OK;
}

expcache_status_t Cache::find_class(const uint64_t part_bytes[kMaxParts], uint32_t* out) const {
    CallScope scope(*this);
    const auto same = [&](const uint64_t* bytes) { return std::equal(bytes, bytes + kMaxParts, part_bytes); };
    for (int32_t c = 0; c < classes_.size(); ++c) {
        const ClassState& cls = classes_[c];
        if (cls.in_use() && same(cls.key_array())) {
            *out = static_cast<uint32_t>(c);
            return EXPCACHE_OK;
        }
    }
    int nparts = 0;
    while (nparts < kMaxParts && part_bytes[nparts]) ++nparts;
    const std::string sizes = parts_name(part_bytes, nparts);
    for (uint32_t l = 0; l < layers_.size(); ++l)
        if (layers_[l].registered && same(layers_[l].bytes))
            return fail(EXPCACHE_ERR_INVALID_STATE,
                        "no class holds experts of %s bytes now: bind one of their layers first (layer %u has them; "
                        "expcache_layer_bind_class)",
                        sizes.c_str(), l);
    return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "no registered layer has experts of %s bytes", sizes.c_str());
}

// A device-lookup cache's counters and residents are the device's: one copy for every class.
expcache_status_t Cache::device_snapshot(DeviceSnapshot* out) const {
    return const_cast<DeviceLookup&>(lookup_).snapshot(out);
}

void Cache::fill_info(int32_t c, const DeviceSnapshot& snap, expcache_class_info_t* out) const {
    const ClassState& cls = classes_[c];
    expcache_class_info_t info = {};
    info.struct_size = sizeof info;
    info.in_use = cls.in_use();
    const bool three = cls.nparts() == kThreeParts;
    info.gate_bytes = three ? cls.key(kGate) : 0;
    info.up_bytes = three ? cls.key(kUp) : 0;
    info.down_bytes = three ? cls.key(kDown) : 0;
    info.num_parts = static_cast<uint32_t>(cls.nparts());
    for (int p = 0; p < kMaxParts; ++p) info.part_bytes[p] = cls.key(p);
    info.slot_bytes = cls.slot_bytes();
    info.target_experts = cls.in_use() ? classes_.target(cls) : 0;
    info.cap_experts = cls.cap();
    info.allocated_experts = cls.slots().size();
    info.resident_experts = lookup_.enabled() ? snap.resident[c] : cls.resident();
    info.held_experts = cls.held();
    info.num_layers = cls.layers();
    info.staging_bytes = cls.staging_bytes();
    *out = info;
}

void Cache::fill_stats(int32_t c, uint32_t path, const DeviceSnapshot& snap, expcache_stats_t* out) const {
    *out = classes_.stats(c, path);
    if (lookup_.enabled() && path == EXPCACHE_PATH_DEVICE) {
        const DeviceCounters& n = snap.counters[c];
        out->calls = n.calls;
        out->hits = n.hits;
        out->misses = n.misses;
        out->evictions = n.evictions;
        out->appends = n.appends;
        out->bytes_h2d = n.bytes_h2d;
    }
    out->struct_size = sizeof *out;
}

expcache_status_t Cache::class_info(uint32_t index, expcache_class_info_t* out) const {
    CallScope scope(*this);
    if (index >= static_cast<uint32_t>(classes_.size()))
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "class index %u out of range (max_classes %d)", index,
                    classes_.size());
    DeviceSnapshot snap;
    expcache_status_t s = device_snapshot(&snap);
    if (s == EXPCACHE_OK) fill_info(static_cast<int32_t>(index), snap, out);
    return s;
}

expcache_status_t Cache::layer_class(uint32_t layer, uint32_t* out) {
    CallScope scope(*this);
    expcache_status_t s = health_.usable();
    if (s == EXPCACHE_OK) s = layers_.validate(layer);
    int32_t c = -1;
    if (s == EXPCACHE_OK) s = bind_class(layer, EXPCACHE_PATH_CONTROL, &c);
    if (s != EXPCACHE_OK) return s;
    *out = static_cast<uint32_t>(c);
    return EXPCACHE_OK;
}

expcache_status_t Cache::get_stats(uint32_t index, uint32_t path, expcache_stats_t* out) const {
    CallScope scope(*this);
    if (index >= static_cast<uint32_t>(classes_.size()))
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "class index %u out of range (max_classes %d)", index,
                    classes_.size());
    if (path >= EXPCACHE_NUM_PATHS)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "path %u out of range (0..%d)", path, EXPCACHE_NUM_PATHS - 1);
    DeviceSnapshot snap;
    expcache_status_t s = path == EXPCACHE_PATH_DEVICE ? device_snapshot(&snap) : EXPCACHE_OK;
    if (s == EXPCACHE_OK) fill_stats(static_cast<int32_t>(index), path, snap, out);
    return s;
}

expcache_status_t Cache::read_stats(uint32_t n, expcache_class_info_t* infos, expcache_stats_t* stats) const {
    CallScope scope(*this);
    if (n == 0 || n > static_cast<uint32_t>(classes_.size()))
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "n must be 1..max_classes (%d), got %u", classes_.size(), n);
    DeviceSnapshot snap;
    expcache_status_t s = device_snapshot(&snap);
    if (s != EXPCACHE_OK) return s;
    for (uint32_t c = 0; c < n; ++c) {
        fill_info(static_cast<int32_t>(c), snap, &infos[c]);
        for (uint32_t p = 0; p < EXPCACHE_NUM_PATHS; ++p)
            fill_stats(static_cast<int32_t>(c), p, snap, &stats[uint64_t(c) * EXPCACHE_NUM_PATHS + p]);
    }
    return EXPCACHE_OK;
}

expcache_status_t Cache::get_staging_stats(expcache_staging_stats_t* out) const {
    CallScope scope(*this);
    *out = expcache_staging_stats_t{};
    backend_->staging_stats(out);
    out->struct_size = sizeof *out;
    return EXPCACHE_OK;
}

expcache_status_t Cache::reset_stats() {
    CallScope scope(*this);
    expcache_status_t s = lookup_.reset_counters();
    if (s != EXPCACHE_OK) return s;
    classes_.reset_stats();
    backend_->reset_staging_stats();
    prefetch_.reset_stats();
    pool_.reset_stats();
    return EXPCACHE_OK;
}

// ---------------------------------------------------------------------------
// Fault injection and accounting

expcache_status_t Cache::inject_alloc_failures(uint64_t skip, uint64_t count) {
    CallScope scope(*this);
    backend_->fail_allocs(skip, count);
    return EXPCACHE_OK;
}

expcache_status_t Cache::inject_copy_failures(uint64_t skip, uint64_t count) {
    CallScope scope(*this);
    backend_->fail_copies(skip, count);
    return EXPCACHE_OK;
}

expcache_status_t Cache::inject_staging_failures(uint64_t skip, uint64_t count) {
    CallScope scope(*this);
    backend_->fail_staging(skip, count);
    return EXPCACHE_OK;
}

expcache_status_t Cache::device_bytes_in_use(uint64_t* out) const {
    CallScope scope(*this);
    *out = arena_.bytes_in_use();
    return EXPCACHE_OK;
}

expcache_status_t Cache::device_reads(uint64_t* out_syncs, uint64_t* out_copies) const {
    CallScope scope(*this);
    const InstrumentedBackend::Reads r = backend_->reads();
    *out_syncs = r.syncs;
    *out_copies = r.copies;
    return EXPCACHE_OK;
}

expcache_status_t Cache::spin(void* stream, uint64_t ns) {
    CallScope scope(*this);
    expcache_status_t s = health_.usable();
    return s == EXPCACHE_OK ? health_.check(backend_->kernels().spin_async(ns, stream)) : s;
}

}  // namespace expcache
