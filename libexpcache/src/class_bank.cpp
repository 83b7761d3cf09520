// A class's bank: its reserved address range (slots, then staging rows), mapped piece by piece as
// the class grows and as decode calls stage experts that got no slot (class_table.hpp).
#include <algorithm>

#include "class_table.hpp"
#include "errors.hpp"

namespace expcache {

// Slot ids are int32: the rows are at most INT32_MAX.
expcache_status_t ClassTable::reserve_rows(int32_t c, uint64_t slots) {
    ClassState& cls = classes_[c];
    const uint64_t g = arena_.granularity(), S = cls.slot_bytes_;
    slots = std::min<uint64_t>(slots, INT32_MAX - kStagingRows - kBatchRows - 3 * (g / S + 1));
    // Each range starts past the granule the one before ends in: their mappings never overlap.
    const auto past = [&](uint64_t row) { return ((row * S + g - 1) / g * g + S - 1) / S; };
    const uint64_t staging_row = past(slots), batch_row = past(staging_row + kStagingRows);
    const uint64_t rows = batch_row + kBatchRows;
    void* base = nullptr;
    expcache_status_t s = health_.check(arena_.reserve(rows * S, &base));
    if (s != EXPCACHE_OK) return s;
    cls.bank_ = static_cast<unsigned char*>(base);
    cls.rows_ = rows;
    cls.slot_rows_ = slots;
    cls.staging_row_ = staging_row;
    cls.batch_row_ = batch_row;
    cls.mapped_ = 0;
    cls.staging_end_ = cls.batch_end_ = cls.staging_bytes_ = 0;
    cls.batch_used_ = cls.batch_users_ = 0;
    return EXPCACHE_OK;
}

expcache_status_t ClassTable::take_batch_rows(int32_t c, uint64_t n, uint64_t* out_row) {
    ClassState& cls = classes_[c];
    if (!cls.bank_)
        return fail(EXPCACHE_ERR_OUT_OF_DEVICE_MEMORY,
                    "class %s has no bank reserved: nowhere to stage a batch by slot id; raise the budget or "
                    "free device memory",
                    name(cls).c_str());
    if (cls.batch_used_ + n > kBatchRows)
        return fail(EXPCACHE_ERR_INVALID_STATE,
                    "class %s: a batch by slot id stages %llu experts and the open batches have taken %llu of the "
                    "bank's %llu batch rows; finish batches first (the rows are reused once none is open)",
                    name(cls).c_str(), (unsigned long long)n, (unsigned long long)cls.batch_used_,
                    (unsigned long long)kBatchRows);
    const uint64_t first = cls.batch_row_ + cls.batch_used_;
    expcache_status_t s = map_rows(cls, cls.batch_row_, first + n, &cls.batch_end_);
    if (s != EXPCACHE_OK) return s;
    cls.batch_used_ += n;
    cls.batch_users_++;
    *out_row = first;
    return EXPCACHE_OK;
}

void ClassTable::give_batch_rows(int32_t c) {
    ClassState& cls = classes_[c];
    if (--cls.batch_users_ == 0) cls.batch_used_ = 0;
}

// Rows [range_row, to_row) of the range that starts at range_row mapped: what the range has not
// mapped yet (*end: the offset its mapping reaches) is, granule by granule, counted in staging_bytes.
expcache_status_t ClassTable::map_rows(ClassState& cls, uint64_t range_row, uint64_t to_row, uint64_t* end) {
    const uint64_t g = arena_.granularity(), S = cls.slot_bytes_;
    const uint64_t start = range_row * S / g * g, need = (to_row * S + g - 1) / g * g;
    const uint64_t from = std::max(start, *end);
    if (need <= from) return EXPCACHE_OK;
    expcache_status_t s = health_.check(arena_.map(cls.bank_ + from, need - from));
    if (s != EXPCACHE_OK) return s;
    *end = need;
    cls.staging_bytes_ += need - from;
    return EXPCACHE_OK;
}

expcache_status_t ClassTable::staging_rows(int32_t c, uint32_t n, unsigned char** out) {
    ClassState& cls = classes_[c];
    expcache_status_t s = map_rows(cls, cls.staging_row_, cls.staging_row_ + n, &cls.staging_end_);
    if (s == EXPCACHE_OK) *out = cls.bank_ + cls.staging_row_ * cls.slot_bytes_;
    return s;
}

// The whole cap at once, piece by piece (a cap of 0, or an allocation that fails, leaves the
// class without slots: its device selects are refused, its host calls stage every expert in the
// bank's staging or batch rows, which a cap of 0 reserves too).
expcache_status_t ClassTable::reserve_bank(int32_t c, uint32_t path) {
    ClassState& cls = classes_[c];
    if (!cls.slots_.empty() || cls.cap_valid_) return EXPCACHE_OK;
    expcache_status_t s = refresh_cap(c, path);
    if (s != EXPCACHE_OK) return s;
    if (!cls.bank_ && (s = reserve_rows(c, cls.cap_)) != EXPCACHE_OK) return s;
    cls.cap_ = std::min(cls.cap_, cls.slot_rows_);  // slot ids are int32
    while (cls.slots_.size() < cls.cap_) {
        const size_t had = cls.slots_.size();
        if ((s = grow(c, path)) != EXPCACHE_OK) return s;
        if (cls.slots_.size() == had) break;  // an allocation failed: grow() capped the class there
    }
    return EXPCACHE_OK;
}

// The next piece of the bank: up to slab_bytes of slots, mapped in one piece after the slots
// mapped so far (a smaller cap gives back whole pieces: ClassTable::resize).
expcache_status_t ClassTable::grow(int32_t c, uint32_t path) {
    ClassState& cls = classes_[c];
    uint64_t have = cls.slots_.size();
    uint64_t per_slab = std::max<uint64_t>(1, config_.slab_bytes / cls.slot_bytes_);
    uint64_t n = std::min(cls.cap_ - have, per_slab);
    const uint64_t g = arena_.granularity();
    const uint64_t end = ((have + n) * cls.slot_bytes_ + g - 1) / g * g;
    expcache_status_t s = EXPCACHE_OK;
    if (end > cls.mapped_) s = health_.check(arena_.map(cls.bank_ + cls.mapped_, end - cls.mapped_));
    if (s == EXPCACHE_ERR_OUT_OF_DEVICE_MEMORY) {
        // Memory is shorter than the cap assumed: stop growing here.
        cls.cap_ = have;
        announce_cap(c, path, format(", a slot allocation failed: %s", last_error()).c_str(),
                     format("free device memory or lower slab_bytes (the allocation asked %s; one expert of this "
                            "class needs %s)",
                            human_bytes(n * cls.slot_bytes_).c_str(), human_bytes(cls.slot_bytes_).c_str())
                         .c_str());
        clear_last_error();
        return EXPCACHE_OK;
    }
    if (s != EXPCACHE_OK) return s;
    cls.mapped_ = std::max(cls.mapped_, end);
    // Every slot the mapped piece holds whole is the class's (a granule may hold many).
    n = std::min(cls.cap_, cls.mapped_ / cls.slot_bytes_) - have;
    cls.slots_.resize(have + n);
    cls.policy_->resize(static_cast<int32_t>(have + n));
    for (uint64_t i = 0; i < n; ++i) cls.slots_[have + i].dev_ = cls.bank_ + (have + i) * cls.slot_bytes_;
    for (uint64_t i = n; i-- > 0;) cls.free_slots_.push_back(static_cast<int32_t>(have + i));
    return EXPCACHE_OK;
}

}  // namespace expcache
