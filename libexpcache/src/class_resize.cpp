// A class's cap changed while the cache lives (expcache_budget_set, expcache_reserve_set): the caps
// as create computes them, a shrink that takes the policy's victims and packs the rest below the
// new cap, and the bank's pieces past it given back, its base address kept.
#include <algorithm>

#include "class_table.hpp"
#include "errors.hpp"

namespace expcache {

expcache_status_t ClassTable::plan_caps(std::vector<uint64_t>* caps) const {
    uint64_t free_bytes = 0, total = 0;
    expcache_status_t s = health_.check(backend_.mem_info(&free_bytes, &total));
    if (s != EXPCACHE_OK) return s;
    // The slots' own memory counts as free: a class may keep what it holds, or give it to another.
    unsigned __int128 room = (unsigned __int128)free_bytes + slots_mapped();
    room = room > config_.reserve_bytes ? room - config_.reserve_bytes : 0;
    caps->assign(classes_.size(), 0);
    for (size_t c = 0; c < classes_.size(); ++c) {
        const ClassState& cls = classes_[c];
        if (!cls.in_use_) continue;
        uint64_t cap = target(cls);
        if (cls.bank_) cap = std::min(cap, cls.slot_rows_);
        cap = static_cast<uint64_t>(std::min<unsigned __int128>(cap, room / cls.slot_bytes_));
        room -= (unsigned __int128)cap * cls.slot_bytes_;
        (*caps)[c] = cap;
    }
    return EXPCACHE_OK;
}

expcache_status_t ClassTable::resize(int32_t c, uint64_t cap, uint32_t path, std::vector<int32_t>* dropped) {
    ClassState& cls = classes_[c];
    const uint64_t old_cap = cls.cap_;
    const bool announced = cls.cap_valid_ && cls.cap_announced_;
    expcache_status_t s = EXPCACHE_OK;
    if (cap < cls.slots_.size()) {
        if (!banked_) {
            if (cls.resident_ > cap) evict_victims(c, cls.resident_ - cap, path, dropped);
            if ((s = pack(c, cap)) != EXPCACHE_OK) return s;
        }
        cls.slots_.resize(cap);
        cls.policy_->resize(static_cast<int32_t>(cap));
        cls.free_slots_.clear();
        for (uint64_t i = cap; i-- > 0;)
            if (cls.slots_[i].layer_ < 0) cls.free_slots_.push_back(static_cast<int32_t>(i));
        unmap_past(c, cap);
    }
    cls.cap_ = cap;
    cls.target_ = target(cls);
    cls.cap_valid_ = true;
    // A fixed bank holds its whole cap; any other grows into it as misses come.
    while (banked_ && cls.slots_.size() < cls.cap_) {
        const size_t had = cls.slots_.size();
        if ((s = grow(c, path)) != EXPCACHE_OK) return s;
        if (cls.slots_.size() == had) break;  // grow() announced the cap an allocation failure left
    }
    if (announced && cls.cap_ == old_cap) return EXPCACHE_OK;
    const std::string why = cls.cap_ < cls.target_
                                ? format(", limited by free device memory minus the reserve (reserve %s)",
                                         human_bytes(config_.reserve_bytes).c_str())
                                : std::string();
    announce_cap(c, path, why.c_str(), "lower the reserve (expcache_reserve_set) or free device memory");
    return EXPCACHE_OK;
}

// The residents at or past `cap` move into the free slots below it, lowest first, each slot's bytes
// copied on the device (idle: the caller vacated the class), which is synchronized before the
// slots past the cap are let go.
expcache_status_t ClassTable::pack(int32_t c, uint64_t cap) {
    ClassState& cls = classes_[c];
    std::vector<int32_t> below;
    for (uint64_t i = 0; i < cap; ++i)
        if (cls.slots_[i].layer_ < 0) below.push_back(static_cast<int32_t>(i));
    size_t next = 0;
    bool copied = false;
    for (uint64_t i = cap; i < cls.slots_.size(); ++i) {
        if (cls.slots_[i].layer_ < 0) continue;
        if (next == below.size())
            return fail(EXPCACHE_ERR_INTERNAL, "class %s: its residents do not fit a cap of %llu slots",
                        name(cls).c_str(), (unsigned long long)cap);
        const int32_t to = below[next++];
        expcache_status_t s = copy_row(cls, static_cast<uint64_t>(to), i);
        if (s != EXPCACHE_OK) return s;
        move_slot(c, static_cast<int32_t>(i), to);
        copied = true;
    }
    return copied ? health_.check(backend_.sync_device()) : EXPCACHE_OK;
}

// The bank's slot pieces that start past the first `cap` slots are unmapped, in every region. Each
// piece is what one growth mapped (at most slab_bytes): the one the cap ends in stays mapped, and
// the next growth fills it first. Views of the bank keep all of it.
void ClassTable::unmap_past(int32_t c, uint64_t cap) {
    ClassState& cls = classes_[c];
    const uint64_t g = arena_.granularity();
    const auto need = [&](int k) { return (cap * cls.region_stride_[k] + g - 1) / g * g; };
    bool past = false;
    for (int k = 0; k < cls.regions_; ++k) past = past || need(k) < cls.mapped_[k];
    if (!past) return;
    if (arena_.kept(cls.bank_)) arena_.ask_to_let_go();  // views cached for reuse let go
    for (int k = 0; k < cls.regions_; ++k) {
        if (need(k) >= cls.mapped_[k]) continue;
        const uint64_t at = cls.region_at_[k], staging = cls.staging_row_ * cls.region_stride_[k] / g * g;
        uint64_t first = at + staging;
        if (!arena_.unmap_range(cls.bank_, at + need(k), at + staging, &first)) {
            log_(EXPCACHE_LOG_NOTICE, "class %s: its bank stays mapped (%s): views of it are alive", name(cls).c_str(),
                 human_bytes(cls.mapped_bytes()).c_str());
            return;
        }
        cls.mapped_[k] = std::min(cls.mapped_[k], first - at);
    }
}

}  // namespace expcache
