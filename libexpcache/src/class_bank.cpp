// A class's bank: its reserved address range (slots, then staging rows, then batch rows, in each of
// its regions), mapped piece by piece as the class grows and as calls stage experts that got no
// slot (class_table.hpp).
#include <algorithm>

#include "class_table.hpp"
#include "errors.hpp"

namespace expcache {

// SLOTS: one region of rows of slot_bytes, part p at part_off within a row. PARTS: a region per
// part, its rows the part's bytes rounded up to kAlign (placed by reserve_rows).
void ClassTable::lay_out(ClassState& cls, const LayerState& layer) const {
    uint64_t off = 0;
    cls.nparts_ = layer.nparts;
    for (int p = 0; p < kMaxParts; ++p) {
        cls.key_[p] = layer.bytes[p];
        cls.part_off_[p] = p < layer.nparts ? off : 0;
        off += align_up(layer.bytes[p]);
    }
    cls.slot_bytes_ = off;
    cls.arrangement_ = config_.bank_arrangement;
    if (cls.arrangement_ == EXPCACHE_BANK_PARTS) {
        cls.regions_ = layer.nparts;
        for (int p = 0; p < kMaxParts; ++p) {
            cls.region_at_[p] = cls.part_at_[p] = 0;  // reserve_rows places the regions
            cls.region_stride_[p] = cls.part_stride_[p] =
                p < layer.nparts ? std::max(kAlign, align_up(layer.bytes[p])) : 0;
        }
        return;
    }
    cls.regions_ = 1;
    cls.region_at_[0] = 0;
    cls.region_stride_[0] = off;
    for (int p = 0; p < kMaxParts; ++p) {
        cls.part_at_[p] = cls.part_off_[p];
        cls.part_stride_[p] = off;
    }
}

// Slot ids are int32: the rows are at most INT32_MAX.
expcache_status_t ClassTable::reserve_rows(int32_t c, uint64_t slots) {
    ClassState& cls = classes_[c];
    const uint64_t g = arena_.granularity();
    uint64_t smallest = UINT64_MAX;
    for (int k = 0; k < cls.regions_; ++k) smallest = std::min(smallest, cls.region_stride_[k]);
    slots = std::min<uint64_t>(slots, INT32_MAX - kStagingRows - kBatchRows - 3 * (g / smallest + 1));
    // Each range starts past the granule the one before ends in, in every region: their mappings
    // never overlap.
    const auto past = [&](uint64_t row) {
        uint64_t first = row;
        for (int k = 0; k < cls.regions_; ++k) {
            const uint64_t S = cls.region_stride_[k];
            first = std::max(first, ((row * S + g - 1) / g * g + S - 1) / S);
        }
        return first;
    };
    const uint64_t staging_row = past(slots), batch_row = past(staging_row + kStagingRows);
    const uint64_t rows = batch_row + kBatchRows;
    // The regions one after the other, each starting on a granule.
    uint64_t bytes = 0;
    for (int k = 0; k < cls.regions_; ++k) {
        bytes = (bytes + g - 1) / g * g;
        cls.region_at_[k] = bytes;
        bytes += rows * cls.region_stride_[k];
    }
    if (cls.arrangement_ == EXPCACHE_BANK_PARTS)
        for (int p = 0; p < cls.nparts_; ++p) cls.part_at_[p] = cls.region_at_[p];
    void* base = nullptr;
    expcache_status_t s = health_.check(arena_.reserve(bytes, &base));
    if (s != EXPCACHE_OK) return s;
    cls.bank_ = static_cast<unsigned char*>(base);
    cls.rows_ = rows;
    cls.slot_rows_ = slots;
    cls.staging_row_ = staging_row;
    cls.batch_row_ = batch_row;
    cls.forget_mappings();
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
    expcache_status_t s = map_rows(cls, cls.batch_row_, first + n, cls.batch_end_);
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

// Rows [range_row, to_row) of the range that starts at range_row mapped in every region: what a
// region has not mapped yet (end[k]: the offset its mapping reaches) is, granule by granule, counted
// in staging_bytes.
expcache_status_t ClassTable::map_rows(ClassState& cls, uint64_t range_row, uint64_t to_row, uint64_t* end) {
    const uint64_t g = arena_.granularity();
    for (int k = 0; k < cls.regions_; ++k) {
        const uint64_t S = cls.region_stride_[k];
        const uint64_t start = range_row * S / g * g, need = (to_row * S + g - 1) / g * g;
        const uint64_t from = std::max(start, end[k]);
        if (need <= from) continue;
        expcache_status_t s = health_.check(arena_.map(cls.bank_ + cls.region_at_[k] + from, need - from));
        if (s != EXPCACHE_OK) return s;
        end[k] = need;
        cls.staging_bytes_ += need - from;
    }
    return EXPCACHE_OK;
}

expcache_status_t ClassTable::staging_rows(int32_t c, uint32_t n, uint64_t* out_row) {
    ClassState& cls = classes_[c];
    expcache_status_t s = map_rows(cls, cls.staging_row_, cls.staging_row_ + n, cls.staging_end_);
    if (s == EXPCACHE_OK) *out_row = cls.staging_row_;
    return s;
}

expcache_status_t ClassTable::copy_row(const ClassState& cls, uint64_t to, uint64_t from) {
    for (int k = 0; k < cls.regions_; ++k) {
        const uint64_t S = cls.region_stride_[k];
        unsigned char* region = cls.bank_ + cls.region_at_[k];
        expcache_status_t s = health_.check(backend_.copy_d2d(region + to * S, region + from * S, S, nullptr));
        if (s != EXPCACHE_OK) return s;
    }
    return EXPCACHE_OK;
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

// The next piece of the bank: up to slab_bytes of slots, mapped in one piece per region after the
// slots mapped so far (a smaller cap gives back whole pieces: ClassTable::resize).
expcache_status_t ClassTable::grow(int32_t c, uint32_t path) {
    ClassState& cls = classes_[c];
    uint64_t have = cls.slots_.size();
    uint64_t per_slab = std::max<uint64_t>(1, config_.slab_bytes / cls.slot_bytes_);
    uint64_t n = std::min(cls.cap_ - have, per_slab);
    const uint64_t g = arena_.granularity();
    expcache_status_t s = EXPCACHE_OK;
    int k = 0;
    uint64_t ends[kMaxParts] = {};
    for (; k < cls.regions_ && s == EXPCACHE_OK; ++k) {
        ends[k] = ((have + n) * cls.region_stride_[k] + g - 1) / g * g;
        if (ends[k] > cls.mapped_[k])
            s = health_.check(arena_.map(cls.bank_ + cls.region_at_[k] + cls.mapped_[k], ends[k] - cls.mapped_[k]));
    }
    if (s != EXPCACHE_OK) {
        // The regions this growth mapped before the failure give their piece back.
        for (int j = 0; j + 1 < k; ++j)
            if (ends[j] > cls.mapped_[j]) {
                const uint64_t at = cls.region_at_[j] + cls.mapped_[j];
                arena_.unmap_range(cls.bank_, at, at + 1, nullptr);
            }
    }
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
    for (k = 0; k < cls.regions_; ++k) cls.mapped_[k] = std::max(cls.mapped_[k], ends[k]);
    // Every slot the mapped pieces hold whole is the class's (a granule may hold many).
    n = std::min(cls.cap_, cls.whole_rows(cls.mapped_)) - have;
    cls.slots_.resize(have + n);
    cls.policy_->resize(static_cast<int32_t>(have + n));
    for (uint64_t i = n; i-- > 0;) cls.free_slots_.push_back(static_cast<int32_t>(have + i));
    return EXPCACHE_OK;
}

}  // namespace expcache
