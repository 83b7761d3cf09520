// The class table's slots: which one a miss gets (a free one, a new one within the cap, or the
// policy's victim), and an expert entering or leaving one.
#include "class_table.hpp"

#include <algorithm>

namespace expcache {

namespace {

struct EvictableCtx {
    const std::vector<SlotState>* slots;
    uint64_t first_protected_call;  // slots with last_call >= this stay
    int32_t layer;                  // >= 0: only that layer's slots (EXPCACHE_PARTITION_LAYER)
};

bool slot_evictable(const void* ctx, int32_t s) {
    auto* c = static_cast<const EvictableCtx*>(ctx);
    const SlotState& slot = (*c->slots)[static_cast<size_t>(s)];
    return slot.holds() == 0 && slot.prefetch() != kPrefetchLoading && slot.prefetch() != kPrefetchPartial &&
           slot.last_call() < c->first_protected_call && (c->layer < 0 || slot.layer() == c->layer);
}

}  // namespace

expcache_status_t ClassTable::acquire(const SlotRequest& req, Acquired* out) {
    const int32_t c = req.cls;
    const uint32_t layer = req.layer, path = req.path;
    ClassState& cls = classes_[c];
    if (req.miss) cls.stats_[path].misses++;
    int32_t only = -1;  // the layer a victim must be of
    if (config_.partition == EXPCACHE_PARTITION_LAYER) {
        if (!cls.cap_valid_) {
            expcache_status_t s = refresh_cap(c, path);
            if (s != EXPCACHE_OK) return s;
        }
        const std::vector<int32_t>& held = layers_[layer].slot_of;
        const uint64_t holds = static_cast<uint64_t>(held.size() - std::count(held.begin(), held.end(), -1));
        if (holds >= layer_share(cls, layer)) only = static_cast<int32_t>(layer);
    }
    if (only < 0 && cls.free_slots_.empty() && req.allow_grow) {  // a full share: its own victim or nothing
        if (!cls.cap_valid_) {
            expcache_status_t s = refresh_cap(c, path);
            if (s != EXPCACHE_OK) return s;
        }
        if (cls.slots_.size() < cls.cap_) {
            expcache_status_t s = grow(c, path);
            if (s != EXPCACHE_OK) return s;
        }
    }
    *out = Acquired{};
    if (only < 0 && !cls.free_slots_.empty()) {
        out->slot = cls.free_slots_.back();
        cls.free_slots_.pop_back();
        return EXPCACHE_OK;
    }
    if (req.evict != Evict::kNo) {
        EvictableCtx ctx{&cls.slots_, req.protect_from, only};
        int32_t v = cls.policy_->victim(slot_evictable, &ctx);
        if (v >= 0) evict(c, v, path, out);
    }
    return EXPCACHE_OK;
}

void ClassTable::install(int32_t c, const Acquired& got, uint32_t layer_index, uint32_t expert, Insert how,
                         uint64_t call, uint32_t path) {
    const int32_t s = got.slot;
    ClassState& cls = classes_[c];
    SlotState& slot = cls.slots_[s];
    LayerState& layer = layers_[layer_index];
    slot.layer_ = static_cast<int32_t>(layer_index);
    slot.expert_ = expert;
    slot.last_call_ = call;
    slot.prefetch_ = how == Insert::kPrefetch ? kPrefetchLoading : kPrefetchNone;
    layer.slot_of[expert] = s;
    cls.resident_++;
    if (how == Insert::kPrefetch)
        cls.policy_->on_prefetch(s, layer.key_base + expert);
    else
        cls.policy_->on_insert(s, how == Insert::kCold, layer.key_base + expert);
    if (how == Insert::kPrefetch) return;
    if (!got.evicted) cls.stats_[path].appends++;
    cls.stats_[path].bytes_h2d += layer.expert_bytes();
}

void ClassTable::reinstall(int32_t c, int32_t s, bool cold, uint64_t call, uint32_t path, uint64_t sent) {
    ClassState& cls = classes_[c];
    SlotState& slot = cls.slots_[s];
    slot.prefetch_ = kPrefetchNone;
    slot.last_call_ = call;
    cls.policy_->on_remove(s);
    cls.policy_->on_insert(s, cold, layers_[slot.layer_].key_base + slot.expert_);
    expcache_stats_t& st = cls.stats_[path];
    st.misses++;
    st.appends++;
    st.bytes_h2d += sent;
}

void ClassTable::hit(int32_t c, int32_t s, uint32_t path, uint64_t refresh_call) {
    ClassState& cls = classes_[c];
    if (refresh_call > 0) {
        cls.policy_->on_hit(s);
        cls.slots_[s].last_call_ = refresh_call;
    }
    cls.stats_[path].hits++;
}

void ClassTable::lend(int32_t c, int32_t s, uint32_t path, bool first) {
    ClassState& cls = classes_[c];
    if (first) {
        cls.policy_->on_hit(s);
        cls.stats_[path].hits++;
    }
    cls.stats_[path].bytes_d2d += layers_[cls.slots_[s].layer_].expert_bytes();
}

void ClassTable::load_direct(int32_t c, uint32_t path, uint32_t layer, bool direct, bool new_miss) {
    expcache_stats_t& st = classes_[c].stats_[path];
    if (new_miss) st.misses++;
    if (direct) st.direct_loads++;
    st.bytes_h2d += layers_[layer].expert_bytes();
}

// Only an unused prefetch can be a victim among prefetched slots (a loading or partial one is
// never evictable): the caller counts it wasted.
void ClassTable::evict(int32_t c, int32_t s, uint32_t path, Acquired* out) {
    ClassState& cls = classes_[c];
    SlotState& slot = cls.slots_[s];
    out->slot = s;
    out->evicted = true;
    if (slot.prefetch_ != kPrefetchNone) out->dropped_prefetch_layer = slot.layer_;
    slot.prefetch_ = kPrefetchNone;
    layers_[slot.layer_].slot_of[slot.expert_] = -1;
    cls.policy_->on_remove(s);
    slot.layer_ = -1;
    cls.resident_--;
    cls.stats_[path].evictions++;
}

uint64_t ClassTable::evict_victims(int32_t c, uint64_t n, uint32_t path, std::vector<int32_t>* dropped) {
    ClassState& cls = classes_[c];
    EvictableCtx ctx{&cls.slots_, UINT64_MAX, -1};
    uint64_t done = 0;
    for (; done < n; ++done) {
        const int32_t v = cls.policy_->victim(slot_evictable, &ctx);
        if (v < 0) break;
        Acquired got;
        evict(c, v, path, &got);
        if (got.dropped_prefetch_layer >= 0) dropped->push_back(got.dropped_prefetch_layer);
        cls.free_slots_.push_back(v);
    }
    return done;
}

void ClassTable::move_slot(int32_t c, int32_t from, int32_t to) {
    ClassState& cls = classes_[c];
    SlotState& src = cls.slots_[from];
    SlotState& dst = cls.slots_[to];
    dst.layer_ = src.layer_;
    dst.expert_ = src.expert_;
    dst.last_call_ = src.last_call_;
    dst.prefetch_ = src.prefetch_;
    layers_[src.layer_].slot_of[src.expert_] = to;
    cls.policy_->move(from, to);
    src.layer_ = -1;
    src.prefetch_ = kPrefetchNone;
}

void ClassTable::forget_layer(uint32_t layer_index) {
    LayerState& layer = layers_[layer_index];
    const int32_t c = bound(layer);
    if (c < 0) return;
    if (!banked_)  // a device-lookup cache's residency is the device's (DeviceLookup::forget_layer)
        for (const int32_t s : layer.slot_of)
            if (s >= 0) uninstall(c, s);
    if (classes_[c].layers_ > 0) classes_[c].layers_--;
}

void ClassTable::uninstall(int32_t c, int32_t s) {
    ClassState& cls = classes_[c];
    SlotState& slot = cls.slots_[s];
    if (slot.layer_ < 0) return;
    layers_[slot.layer_].slot_of[slot.expert_] = -1;
    cls.policy_->on_remove(s);
    slot.layer_ = -1;
    slot.prefetch_ = kPrefetchNone;
    cls.resident_--;
    cls.free_slots_.push_back(s);
}

void ClassTable::hold(int32_t c, int32_t s) {
    ClassState& cls = classes_[c];
    if (cls.slots_[s].holds_++ == 0) cls.held_++;
}

void ClassTable::unhold(int32_t c, int32_t s, uint64_t read_by) {
    ClassState& cls = classes_[c];
    SlotState& slot = cls.slots_[s];
    if (--slot.holds_ == 0) cls.held_--;
    slot.last_call_ = std::max(slot.last_call_, read_by);
}

bool ClassTable::mark_copy_pending(int32_t c, int32_t s) {
    SlotState& slot = classes_[c].slots_[s];
    if (slot.copy_pending_) return false;
    slot.copy_pending_ = true;
    return true;
}

void ClassTable::clear_copy_pending(int32_t c, int32_t s) {
    ClassState& cls = classes_[c];
    if (s < static_cast<int32_t>(cls.slots_.size())) cls.slots_[s].copy_pending_ = false;
}

void ClassTable::record(int32_t c, uint32_t path, const expcache_stats_t& add) {
    expcache_stats_t& st = classes_[c].stats_[path];
    st.hits += add.hits;
    st.misses += add.misses;
    st.evictions += add.evictions;
    st.appends += add.appends;
    st.bytes_h2d += add.bytes_h2d;
    st.bytes_d2d += add.bytes_d2d;
}

}  // namespace expcache
