// The device path: a select whose ids never leave the device (DeviceLookup's kernels), and the
// banks its slots index. Only the first call of a layer does host work that depends on the
// cache's state (binding the class: its bank and device state); after that a call checks its
// arguments and enqueues, so it can be captured into a graph.
#include "cache.hpp"

#include "errors.hpp"

namespace expcache {

// A device-path call's first checks: a usable cache, a registered layer, a device lookup (`what`
// says what needs one).
expcache_status_t Cache::device_call(uint32_t layer_index, const char* what) const {
    expcache_status_t s = health_.usable();
    if (s == EXPCACHE_OK) s = layers_.validate(layer_index);
    if (s != EXPCACHE_OK) return s;
    if (!lookup_.enabled())
        return fail(EXPCACHE_ERR_INVALID_STATE,
                    "%s: create the cache with config.lookup = EXPCACHE_LOOKUP_DEVICE (pyexpcache: "
                    "ExpertCache(..., lookup=\"device\"))",
                    what);
    return EXPCACHE_OK;
}

expcache_status_t Cache::select_device(uint32_t layer_index, const void* ids, uint32_t id_bits, uint32_t n, uint32_t k,
                                       int32_t* out_slots, uint32_t* out_counts, void* stream) {
    CallScope scope(*this);
    expcache_status_t s = device_call(layer_index, "select_device needs a device-lookup cache");
    if (s != EXPCACHE_OK) return s;
    if (id_bits != 32 && id_bits != 64)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "id_bits must be 32 or 64, got %u", id_bits);
    const uint64_t count = uint64_t(n) * k;
    if (n == 0 || k == 0 || count > EXPCACHE_MAX_SELECT)
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "n*k must be 1..%d ids, got n %u, k %u", EXPCACHE_MAX_SELECT, n, k);
    int32_t c = classes_.bound(layers_[layer_index]);
    if (c < 0 || !lookup_.ready(c)) {
        if (lookup_.capturing(stream))
            return fail(EXPCACHE_ERR_INVALID_STATE,
                        "layer %u's class is not bound yet, and binding allocates its bank, which a stream capture "
                        "does not allow: bind it before capturing (expcache_layer_bind_class; pyexpcache: "
                        "cache.bank(layer), or one select_device outside the capture)",
                        layer_index);
        if ((s = bind_class(layer_index, EXPCACHE_PATH_DEVICE, &c)) != EXPCACHE_OK) return s;
    }
    if (!lookup_.ready(c))  // the class has no slot
        return health_.usable() != EXPCACHE_OK
                   ? EXPCACHE_ERR_POISONED
                   : fail(EXPCACHE_ERR_OUT_OF_DEVICE_MEMORY,
                          "layer %u's class %s has no slot: its cap is 0 experts (see the cap notice in the log); "
                          "raise the budget or free device memory",
                          layer_index, classes_.name(classes_[c]).c_str());
    return lookup_.select(layer_index, c, ids, id_bits, static_cast<uint32_t>(count), out_slots, out_counts, stream);
}

expcache_status_t Cache::table_reads(uint32_t layer_index, uint64_t* out) {
    CallScope scope(*this);
    expcache_status_t s = device_call(layer_index, "table reads are a device select's");
    if (s != EXPCACHE_OK) return s;
    const int32_t c = classes_.bound(layers_[layer_index]);
    if (c < 0) {
        *out = 0;
        return EXPCACHE_OK;
    }
    return lookup_.table_reads(c, out);
}

expcache_status_t Cache::bank(uint32_t index, expcache_bank_t* out) {
    CallScope scope(*this);
    if (index >= static_cast<uint32_t>(classes_.size()))
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "class index %u out of range (max_classes %d)", index,
                    classes_.size());
    const ClassState& cls = classes_[static_cast<int32_t>(index)];
    if (!cls.in_use())
        return fail(EXPCACHE_ERR_INVALID_STATE, "class index %u holds no class (bind a layer first)", index);
    expcache_bank_t b = {};
    b.struct_size = sizeof b;
    b.base = cls.bank();
    b.arrangement = cls.arrangement();
    b.slot_stride = cls.arrangement() == EXPCACHE_BANK_SLOTS ? cls.slot_bytes() : 0;
    b.cap = cls.slots().size();
    b.rows = cls.rows();
    b.num_parts = static_cast<uint32_t>(cls.nparts());
    for (int p = 0; p < kMaxParts; ++p) {
        b.part_offset[p] = cls.part_at(p);
        b.part_stride[p] = cls.part_stride(p);
        b.part_bytes[p] = cls.key(p);
    }
    if (cls.nparts() == kThreeParts) {
        b.gate_offset = cls.part_at(kGate);
        b.up_offset = cls.part_at(kUp);
        b.down_offset = cls.part_at(kDown);
        b.gate_bytes = cls.key(kGate);
        b.up_bytes = cls.key(kUp);
        b.down_bytes = cls.key(kDown);
    }
    *out = b;
    return EXPCACHE_OK;
}

}  // namespace expcache
