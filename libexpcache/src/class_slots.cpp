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
    return slot.holds == 0 && slot.prefetch != kPrefetchLoading && slot.prefetch != kPrefetchPartial &&
           slot.last_call < c->first_protected_call && (c->layer < 0 || slot.layer == c->layer);
}

}  // namespace

expcache_status_t ClassTable::acquire(const SlotRequest& req, Acquired* out) {
    const int32_t c = req.cls;
    const uint32_t layer = req.layer, path = req.path;
    ClassState& cls = classes_[c];
    if (req.miss) cls.stats[path].misses++;
    int32_t only = -1;  // the layer a victim must be of
    if (config_.partition == EXPCACHE_PARTITION_LAYER) {
        if (!cls.cap_valid) {
            expcache_status_t s = refresh_cap(c, path);
            if (s != EXPCACHE_OK) return s;
        }
        const std::vector<int32_t>& held = layers_[layer].slot_of;
        const uint64_t holds = static_cast<uint64_t>(held.size() - std::count(held.begin(), held.end(), -1));
        if (holds >= layer_share(cls, layer)) only = static_cast<int32_t>(layer);
    }
    if (only < 0 && cls.free_slots.empty() && req.allow_grow) {  // a full share: its own victim or nothing
        if (!cls.cap_valid) {
            expcache_status_t s = refresh_cap(c, path);
            if (s != EXPCACHE_OK) return s;
        }
        if (cls.slots.size() < cls.cap) {
            expcache_status_t s = grow(c, path);
            if (s != EXPCACHE_OK) return s;
        }
    }
    *out = Acquired{};
    if (only < 0 && !cls.free_slots.empty()) {
        out->slot = cls.free_slots.back();
        cls.free_slots.pop_back();
        return EXPCACHE_OK;
    }
    if (req.evict != Evict::kNo) {
        EvictableCtx ctx{&cls.slots, req.protect_from, only};
        int32_t v = cls.policy->victim(slot_evictable, &ctx);
        if (v >= 0) evict(c, v, path, out);
    }
    return EXPCACHE_OK;
}

void ClassTable::install(int32_t c, const Acquired& got, uint32_t layer_index, uint32_t expert, Insert how,
                         uint64_t call, uint32_t path) {
    const int32_t s = got.slot;
    ClassState& cls = classes_[c];
    SlotState& slot = cls.slots[s];
    LayerState& layer = layers_[layer_index];
    slot.layer = static_cast<int32_t>(layer_index);
    slot.expert = expert;
    slot.last_call = call;
    slot.prefetch = how == Insert::kPrefetch ? kPrefetchLoading : kPrefetchNone;
    layer.slot_of[expert] = s;
    cls.resident++;
    if (how == Insert::kPrefetch)
        cls.policy->on_prefetch(s, layer.key_base + expert);
    else
        cls.policy->on_insert(s, how == Insert::kCold, layer.key_base + expert);
    if (how == Insert::kPrefetch) return;
    if (!got.evicted) cls.stats[path].appends++;
    cls.stats[path].bytes_h2d += layer.expert_bytes();
}

void ClassTable::reinstall(int32_t c, int32_t s, bool cold, uint64_t call, uint32_t path, uint64_t sent) {
    ClassState& cls = classes_[c];
    SlotState& slot = cls.slots[s];
    slot.prefetch = kPrefetchNone;
    slot.last_call = call;
    cls.policy->on_remove(s);
    cls.policy->on_insert(s, cold, layers_[slot.layer].key_base + slot.expert);
    expcache_stats_t& st = cls.stats[path];
    st.misses++;
    st.appends++;
    st.bytes_h2d += sent;
}

void ClassTable::hit(int32_t c, int32_t s, uint32_t path, uint64_t refresh_call) {
    ClassState& cls = classes_[c];
    if (refresh_call > 0) {
        cls.policy->on_hit(s);
        cls.slots[s].last_call = refresh_call;
    }
    cls.stats[path].hits++;
}

void ClassTable::lend(int32_t c, int32_t s, uint32_t path, bool first) {
    ClassState& cls = classes_[c];
    if (first) {
        cls.policy->on_hit(s);
        cls.stats[path].hits++;
    }
    cls.stats[path].bytes_d2d += layers_[cls.slots[s].layer].expert_bytes();
}

void ClassTable::load_direct(int32_t c, uint32_t path, uint32_t layer, bool direct, bool new_miss) {
    expcache_stats_t& st = classes_[c].stats[path];
    if (new_miss) st.misses++;
    if (direct) st.direct_loads++;
    st.bytes_h2d += layers_[layer].expert_bytes();
}

// Only an unused prefetch can be a victim among prefetched slots (a loading or partial one is
// never evictable): the caller counts it wasted.
void ClassTable::evict(int32_t c, int32_t s, uint32_t path, Acquired* out) {
    ClassState& cls = classes_[c];
    SlotState& slot = cls.slots[s];
    out->slot = s;
    out->evicted = true;
    if (slot.prefetch != kPrefetchNone) out->dropped_prefetch_layer = slot.layer;
    slot.prefetch = kPrefetchNone;
    layers_[slot.layer].slot_of[slot.expert] = -1;
    cls.policy->on_remove(s);
    slot.layer = -1;
    cls.resident--;
    cls.stats[path].evictions++;
}

void ClassTable::uninstall(int32_t c, int32_t s) {
    ClassState& cls = classes_[c];
    SlotState& slot = cls.slots[s];
    if (slot.layer < 0) return;
    layers_[slot.layer].slot_of[slot.expert] = -1;
    cls.policy->on_remove(s);
    slot.layer = -1;
    slot.prefetch = kPrefetchNone;
    cls.resident--;
    cls.free_slots.push_back(s);
}

void ClassTable::hold(int32_t c, int32_t s) {
    ClassState& cls = classes_[c];
    if (cls.slots[s].holds++ == 0) cls.held++;
}

void ClassTable::unhold(int32_t c, int32_t s, uint64_t read_by) {
    ClassState& cls = classes_[c];
    SlotState& slot = cls.slots[s];
    if (--slot.holds == 0) cls.held--;
    slot.last_call = std::max(slot.last_call, read_by);
}

bool ClassTable::mark_copy_pending(int32_t c, int32_t s) {
    SlotState& slot = classes_[c].slots[s];
    if (slot.copy_pending) return false;
    slot.copy_pending = true;
    return true;
}

void ClassTable::clear_copy_pending(int32_t c, int32_t s) {
    ClassState& cls = classes_[c];
    if (s < static_cast<int32_t>(cls.slots.size())) cls.slots[s].copy_pending = false;
}

void ClassTable::adopt(int32_t c, const std::vector<int32_t>& keys, const std::vector<uint64_t>& stamps,
                       const std::vector<uint32_t>& key_layer, bool lru) {
    ClassState& cls = classes_[c];
    for (size_t s = 0; s < cls.slots.size(); ++s) {
        SlotState& slot = cls.slots[s];
        const int32_t host_key = slot.layer < 0 ? -1 : static_cast<int32_t>(layers_[slot.layer].key_base + slot.expert);
        if (host_key == keys[s]) continue;
        if (slot.layer >= 0) {
            layers_[slot.layer].slot_of[slot.expert] = -1;
            slot.layer = -1;
            cls.resident--;
        }
        if (keys[s] >= 0) {
            const uint32_t layer = key_layer[keys[s]];
            slot.layer = static_cast<int32_t>(layer);
            slot.expert = static_cast<uint32_t>(keys[s]) - layers_[layer].key_base;
            slot.last_call = 0;
            layers_[layer].slot_of[slot.expert] = static_cast<int32_t>(s);
            cls.resident++;
        }
    }
    std::vector<int32_t> order;
    cls.free_slots.clear();
    for (size_t s = cls.slots.size(); s-- > 0;) {
        if (cls.slots[s].layer < 0)
            cls.free_slots.push_back(static_cast<int32_t>(s));
        else
            order.push_back(static_cast<int32_t>(s));
    }
    if (!lru) return;  // the policy's state is the device's alone
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return stamps[a] != stamps[b] ? stamps[a] < stamps[b] : a < b; });
    cls.policy->clear();
    for (int32_t s : order) cls.policy->on_insert(s, false, layers_[cls.slots[s].layer].key_base + cls.slots[s].expert);
}

}  // namespace expcache
