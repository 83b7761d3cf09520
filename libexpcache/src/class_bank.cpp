// A class's bank: its reserved address range (slots, then staging rows), mapped piece by piece as
// the class grows and as decode calls stage experts that got no slot (class_table.hpp).
#include <algorithm>

#include "class_table.hpp"
#include "errors.hpp"

namespace expcache {

// Slot ids are int32: the rows are at most INT32_MAX.
expcache_status_t ClassTable::reserve_rows(int32_t c, uint64_t slots) {
    ClassState& cls = classes_[c];
    const uint64_t g = arena_.granularity(), S = cls.slot_bytes;
    slots = std::min<uint64_t>(slots, INT32_MAX - kStagingRows - 2 * (g / S + 1));
    // The staging rows start past the granule the last slot ends in: their mappings never
    // overlap the slots'.
    const uint64_t staging_row = ((slots * S + g - 1) / g * g + S - 1) / S;
    const uint64_t rows = staging_row + kStagingRows;
    void* base = nullptr;
    expcache_status_t s = health_.check(arena_.reserve(rows * S, &base));
    if (s != EXPCACHE_OK) return s;
    cls.bank = static_cast<unsigned char*>(base);
    cls.rows = rows;
    cls.slot_rows = slots;
    cls.staging_row = staging_row;
    cls.mapped = 0;
    cls.staging_end = cls.staging_bytes = 0;
    return EXPCACHE_OK;
}

expcache_status_t ClassTable::staging_rows(int32_t c, uint32_t n, unsigned char** out) {
    ClassState& cls = classes_[c];
    const uint64_t g = arena_.granularity(), S = cls.slot_bytes;
    const uint64_t start = cls.staging_row * S / g * g, end = ((cls.staging_row + n) * S + g - 1) / g * g;
    const uint64_t from = std::max(start, cls.staging_end);
    if (end > from) {
        expcache_status_t s = health_.check(arena_.map(cls.bank + from, end - from));
        if (s != EXPCACHE_OK) return s;
        cls.staging_end = end;
        cls.staging_bytes += end - from;
    }
    *out = cls.bank + cls.staging_row * S;
    return EXPCACHE_OK;
}

// The whole cap in one allocation, once (a cap of 0, or an allocation that fails, leaves the
// class without a bank: its device selects are refused, its host calls load directly).
expcache_status_t ClassTable::reserve_bank(int32_t c, uint32_t path) {
    ClassState& cls = classes_[c];
    if (!cls.slots.empty() || cls.cap_valid) return EXPCACHE_OK;
    expcache_status_t s = refresh_cap(c, path);
    if (s != EXPCACHE_OK || cls.cap == 0) return s;
    if (!cls.bank && (s = reserve_rows(c, cls.cap)) != EXPCACHE_OK) return s;
    cls.cap = std::min(cls.cap, cls.slot_rows);  // slot ids are int32
    return grow(c, path);
}

// The next piece of the bank: up to slab_bytes of slots (a fixed bank: all of its cap), mapped
// in one piece after the slots mapped so far.
expcache_status_t ClassTable::grow(int32_t c, uint32_t path) {
    ClassState& cls = classes_[c];
    uint64_t have = cls.slots.size();
    uint64_t per_slab = banked_ ? cls.cap : std::max<uint64_t>(1, config_.slab_bytes / cls.slot_bytes);
    uint64_t n = std::min(cls.cap - have, per_slab);
    const uint64_t g = arena_.granularity();
    const uint64_t end = ((have + n) * cls.slot_bytes + g - 1) / g * g;
    expcache_status_t s = EXPCACHE_OK;
    if (end > cls.mapped) s = health_.check(arena_.map(cls.bank + cls.mapped, end - cls.mapped));
    if (s == EXPCACHE_ERR_OUT_OF_DEVICE_MEMORY) {
        // Memory is shorter than the cap assumed: stop growing here.
        cls.cap = have;
        announce_cap(c, path, format(", a slot allocation failed: %s", last_error()).c_str(),
                     format("free device memory or lower slab_bytes (the allocation asked %s; one expert of this "
                            "class needs %s)",
                            human_bytes(n * cls.slot_bytes).c_str(), human_bytes(cls.slot_bytes).c_str())
                         .c_str());
        clear_last_error();
        return EXPCACHE_OK;
    }
    if (s != EXPCACHE_OK) return s;
    cls.mapped = std::max(cls.mapped, end);
    // Every slot the mapped piece holds whole is the class's (a granule may hold many).
    n = std::min(cls.cap, cls.mapped / cls.slot_bytes) - have;
    cls.slots.resize(have + n);
    cls.policy->resize(static_cast<int32_t>(have + n));
    for (uint64_t i = 0; i < n; ++i) cls.slots[have + i].dev = cls.bank + (have + i) * cls.slot_bytes;
    for (uint64_t i = n; i-- > 0;) cls.free_slots.push_back(static_cast<int32_t>(have + i));
    return EXPCACHE_OK;
}

}  // namespace expcache
