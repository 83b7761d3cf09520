// What the three serving paths share: the preamble of a call, its uploads and the
// staging buffers the cache keeps between calls.
#include "cache.hpp"

#include <exception>
#include <new>

#include "errors.hpp"
#include "paths.hpp"

namespace expcache {

// ---------------------------------------------------------------------------
// The preamble

// The checks every serving path makes before touching anything.
expcache_status_t Cache::validate_request(uint32_t layer, const uint32_t* ids, uint64_t n, uint64_t max_n,
                                          const char* count_name) const {
    expcache_status_t s = health_.usable();
    if (s == EXPCACHE_OK) s = layers_.validate(layer);
    if (s != EXPCACHE_OK) return s;
    if (n == 0 || n > max_n)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "%s must be 1..%llu, got %llu", count_name,
                    (unsigned long long)max_n, (unsigned long long)n);
    uint32_t ne = layers_[layer].num_experts;
    for (uint64_t i = 0; i < n; ++i)
        if (ids[i] >= ne)
            return fail(EXPCACHE_ERR_INVALID_ARGUMENT,
                        "expert id %u (index %llu) out of range for layer %u (%u experts)", ids[i],
                        (unsigned long long)i, layer, ne);
    return EXPCACHE_OK;
}

expcache_status_t Cache::narrow_decode(uint32_t layer, const void* ids, uint32_t id_bits, uint32_t k,
                                       const uint32_t** out, const char* count_name) {
    thread_local std::vector<uint32_t> narrowed;  // at most EXPCACHE_MAX_SELECT: the hot path allocates nothing
    expcache_status_t s = narrow_ids(layer, ids, id_bits, k, EXPCACHE_MAX_SELECT, count_name, &narrowed);
    *out = narrowed.data();
    return s;
}

expcache_status_t Cache::narrow(uint32_t layer, const void* ids, uint32_t id_bits, uint64_t n,
                                std::vector<uint32_t>* out) {
    if (id_bits != 32 && id_bits != 64)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "id_bits must be 32 or 64, got %u", id_bits);
    std::vector<uint32_t>& narrowed = *out;
    narrowed.resize(n);
    for (uint64_t i = 0; i < n; ++i) {
        const int64_t id = id_bits == 32 ? static_cast<const int32_t*>(ids)[i] : static_cast<const int64_t*>(ids)[i];
        if (id < 0 || id > int64_t(UINT32_MAX))
            return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "expert id %lld (index %llu) out of range for layer %u",
                        (long long)id, (unsigned long long)i, layer);
        narrowed[i] = static_cast<uint32_t>(id);
    }
    return EXPCACHE_OK;
}

expcache_status_t Cache::narrow_ids(uint32_t layer, const void* ids, uint32_t id_bits, uint64_t n, uint64_t max_n,
                                    const char* count_name, std::vector<uint32_t>* out) {
    if (n == 0 || n > max_n)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "%s must be 1..%llu, got %llu", count_name,
                    (unsigned long long)max_n, (unsigned long long)n);
    return narrow(layer, ids, id_bits, n, out);
}

int32_t Cache::row_of(int32_t c, const expcache_expert_ptrs_t& ptrs) const {
    const ClassState& cls = classes_[c];
    return static_cast<int32_t>(cls.row_of(static_cast<const unsigned char*>(ptrs.gate)));
}

// Every call that enqueues work starts here: finish deferred frees, cancel the
// prefetches still queued (a demand miss never waits behind them), and when the
// stream changes, make the new stream wait for the old one's work so that no
// slot or staging byte is overwritten while a kernel may still read it; likewise
// for what the cache's copy stream sent: split selects' misses always, prefetch
// pieces only where the call touches their slots when it orders them per slot.
expcache_status_t Cache::begin_call(void* stream, bool per_slot) {
    backend_->reclaim();
    expcache_status_t s = prefetch_.settle(true, true);
    if (s != EXPCACHE_OK) return s;
    return streams_.begin(stream, per_slot, prefetch_.active());
}

// The request's checks and the path's own come before anything changes. Then the
// stream is ordered, the layer's class bound and a new call opened on the path: the
// clock the policy sees advances (a call whose layer is not after the previous call's
// starts a new token), and the call's unique experts are listed.
expcache_status_t Cache::open_call(ServeCall& call, const uint32_t* ids, uint64_t n, uint64_t max_n,
                                   const char* count_name, expcache_status_t (Cache::*admit)() const) {
    const uint32_t layer = call.layer_index;
    expcache_status_t s = validate_request(layer, ids, n, max_n, count_name);
    if (s == EXPCACHE_OK && call.ptrs && layers_[layer].nparts != kThreeParts)
        s = fail(EXPCACHE_ERR_INVALID_STATE,
                 "layer %u's experts have %d parts, and expcache_expert_ptrs_t holds three: serve it by slot id "
                 "(%s) and read each part at its bank's part_offset (expcache_class_bank_get)",
                 layer, layers_[layer].nparts, call.ptrs);
    if (s == EXPCACHE_OK && admit) s = (this->*admit)();
    if (s == EXPCACHE_OK) s = begin_call(call.stream, true);
    if (s == EXPCACHE_OK) s = bind_class(layer, call.path, &call.c);
    if (s != EXPCACHE_OK) return s;
    clock_.open_serving(layer, layers_);
    classes_.open_call(call.c, call.path, clock_.call, clock_.policy);
    // The pool's policy runs on the serving calls' clock too; on a device-lookup cache on the
    // device's, which device selects advance as well (fill_on_device sets it).
    if (!lookup_.enabled()) pool_.set_clock(clock_.policy);
    call.layer = &layers_[layer];
    call.layer->prefetched = 0;  // the layer's prefetches are answered: a new limit for the next ones
    call.cls = &classes_[call.c];
    call.scratch.dedupe(*call.layer, ids, n, clock_.call);
    prefetch_.resolve_partial(call.c, layer, call.path != EXPCACHE_PATH_COMPACT);
    return EXPCACHE_OK;
}

// ---------------------------------------------------------------------------
// Uploads

// Copies the layer's parts, merging parts that are adjacent both in the
// source and in the destination into one transfer.
expcache_status_t Cache::copy_expert(const LayerState& layer, uint32_t expert, unsigned char* const dst[kMaxParts],
                                     void* stream) {
    if (!layer.source.pinned()) {
        bool done = false;
        expcache_status_t s = copy_through_pool(layer, expert, dst, stream, &done);
        if (s != EXPCACHE_OK || done) return s;
    }
    int p = 0;
    while (p < layer.nparts) {
        const unsigned char* src = layer.source_at(p, expert);
        unsigned char* d = dst[p];
        uint64_t bytes = layer.bytes[p];
        int q = p + 1;
        const ExpertSource source = layer.source_of(p, expert);
        while (q < layer.nparts && layer.source_at(q, expert) == src + bytes && dst[q] == d + bytes &&
               layer.source_of(q, expert).file == source.file) {
            bytes += layer.bytes[q];
            ++q;
        }
        expcache_status_t s = health_.check(source.upload(*backend_, d, src, bytes, stream));
        if (s != EXPCACHE_OK) return s;
        p = q;
    }
    return EXPCACHE_OK;
}

void Cache::UploadScope::abandon() {
    if (settled_) return;
    settled_ = true;
    std::string why = last_error();
    if (c_.settle_uploads(inserted_) != EXPCACHE_OK) {
        std::string also = last_error();
        // Only the message is set here: the call returns its own status.
        fail(EXPCACHE_ERR_IO, "%s (an upload issued earlier in the call failed too: %s)", why.c_str(), also.c_str());
    }
}

expcache_status_t Cache::settle_uploads(std::vector<std::pair<int32_t, int32_t>>& inserted) {
    expcache_status_t s = health_.check(backend_->finish_uploads());
    release_pool_leases();  // the uploads have read them
    if (s != EXPCACHE_OK && lookup_.enabled()) {
        // The device's residency: each class's failed slots forgotten there (the call's own error stays).
        const std::string why = last_error();
        for (const auto& cs : inserted)
            if (lookup_.forget(cs.first, {cs.second}) != EXPCACHE_OK) break;
        restore_last_error(why);
    } else if (s != EXPCACHE_OK) {
        for (const auto& cs : inserted) classes_.uninstall(cs.first, cs.second);
    }
    inserted.clear();
    return s;
}

// ---------------------------------------------------------------------------
// Staging buffers

// Staging is tried first; only when device memory is really short are the
// expert caches released (all classes not holding batch slots) and the
// allocation retried, exactly once.
expcache_status_t Cache::alloc_staging(uint64_t bytes, int32_t c, uint32_t path, void** out) {
    expcache_status_t s = health_.check(arena_.alloc(bytes, out));
    if (s != EXPCACHE_ERR_OUT_OF_DEVICE_MEMORY) return s;
    std::string first = last_error();
    s = release_unheld(path);
    if (s != EXPCACHE_OK) return s;
    classes_.note_alloc_retry(c, path);
    log_(EXPCACHE_LOG_NOTICE, "%s staging of %.1f MiB failed (%s); released the expert caches and retrying once",
         path_name(path), double(bytes) / double(1 << 20), first.c_str());
    s = health_.check(arena_.alloc(bytes, out));
    if (s == EXPCACHE_ERR_OUT_OF_DEVICE_MEMORY)
        return fail(s, "%s staging of %llu bytes failed even after releasing the expert caches: %s", path_name(path),
                    (unsigned long long)bytes, last_error());
    return s;
}

// Grows an owned buffer to `bytes`; the old memory is freed once the stream's work on it
// has finished. may_release: the allocation may release the expert caches and retry
// (alloc_staging), which only a call that has not resolved any hit yet can allow.
expcache_status_t Cache::reserve_buffer(ServeCall& call, OwnedBuffer& buf, uint64_t bytes, bool may_release) {
    if (buf.bytes >= bytes) return EXPCACHE_OK;
    expcache_status_t s;
    if (buf.ptr && (s = health_.check(arena_.free_after(buf.ptr, call.stream))) != EXPCACHE_OK) return s;
    buf = OwnedBuffer{};
    void* p = nullptr;
    s = may_release ? alloc_staging(bytes, call.c, call.path, &p) : health_.check(arena_.alloc(bytes, &p));
    if (s != EXPCACHE_OK) return s;
    buf.ptr = p;
    buf.bytes = bytes;
    return EXPCACHE_OK;
}

}  // namespace expcache
