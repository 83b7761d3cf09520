// A device-lookup cache's residency when a class's cap changes (expcache_budget_set,
// expcache_reserve_set) or a layer leaves (expcache_layer_unregister). These are rare control
// calls: the device is synchronized, the state they change is copied to the host, changed there by
// the rules the select kernel ranks victims by (lookup_rules.hpp) and copied back, so both backends
// run the same code and no kernel is added for them.
#include <algorithm>

#include "device_lookup.hpp"
#include "errors.hpp"
#include "kernels/lookup_rules.hpp"

namespace expcache {

namespace {

// Copies between the device and host vectors, the first failure kept (later ones are skipped).
class Copier {
public:
    Copier(Backend& backend, Health& health) : backend_(backend), health_(health) {}
    template <class T>
    void in(std::vector<T>* dst, const T* src, size_t n) {
        dst->resize(n);
        if (n && s_ == EXPCACHE_OK) s_ = health_.check(backend_.copy_d2h_sync(dst->data(), src, n * sizeof(T)));
    }
    template <class T>
    void out(T* dst, const std::vector<T>& src) {
        if (!src.empty() && s_ == EXPCACHE_OK)
            s_ = health_.check(backend_.copy_h2d_sync(dst, src.data(), src.size() * sizeof(T)));
    }
    template <class T>
    void in_one(T* dst, const T* src) {
        if (s_ == EXPCACHE_OK) s_ = health_.check(backend_.copy_d2h_sync(dst, src, sizeof(T)));
    }
    template <class T>
    void out_one(T* dst, const T& src) {
        if (s_ == EXPCACHE_OK) s_ = health_.check(backend_.copy_h2d_sync(dst, &src, sizeof(T)));
    }
    expcache_status_t status() const { return s_; }

private:
    Backend& backend_;
    Health& health_;
    expcache_status_t s_ = EXPCACHE_OK;
};

// A class's per-slot state for its first n rows, and its counts, on the host.
struct HostSlots {
    std::vector<int32_t> key;
    std::vector<uint64_t> stamp;
    std::vector<uint8_t> pin, opp_cls;
    std::vector<int32_t> opp_tok, opp_pos;
    uint64_t resident = 0;
    DeviceDuel duel = {};

    void read(Copier& io, const DeviceClass& d, uint32_t n) {
        io.in(&key, d.key_of_slot, n);
        io.in(&stamp, d.stamp, n);
        io.in(&pin, d.pin, n);
        io.in_one(&resident, d.resident);
        if (d.policy.opp.cls) {
            io.in(&opp_cls, d.policy.opp.cls, n);
            io.in(&opp_tok, d.policy.opp.tok, n);
            io.in(&opp_pos, d.policy.opp.pos, n);
        }
        if (d.policy.duel) io.in_one(&duel, d.policy.duel);
    }
    void write(Copier& io, const DeviceClass& d) const {
        io.out(d.key_of_slot, key);
        io.out(d.stamp, stamp);
        io.out(d.pin, pin);
        io.out_one(d.resident, resident);
        if (d.policy.opp.cls) {
            io.out(d.policy.opp.cls, opp_cls);
            io.out(d.policy.opp.tok, opp_tok);
            io.out(d.policy.opp.pos, opp_pos);
        }
        if (d.policy.duel) io.out_one(d.policy.duel, duel);
    }
    // Row `from`'s expert moves to free row `to`, keeping its place in the policy's orders.
    void move(uint32_t from, uint32_t to) {
        key[to] = key[from];
        stamp[to] = stamp[from];
        if (!opp_cls.empty()) {
            opp_cls[to] = opp_cls[from];
            opp_tok[to] = opp_tok[from];
            opp_pos[to] = opp_pos[from];
        }
        key[from] = -1;
    }
    // The view lookup_rules.hpp ranks slots by: `d` over these host arrays.
    DeviceClass view(const DeviceClass& d) {
        DeviceClass v = d;
        v.key_of_slot = key.data();
        v.stamp = stamp.data();
        v.pin = pin.data();
        v.resident = &resident;
        if (!opp_cls.empty()) v.policy.opp = DeviceOppSlots{opp_cls.data(), opp_tok.data(), opp_pos.data()};
        if (d.policy.duel) v.policy.duel = &duel;
        return v;
    }
};

}  // namespace

expcache_status_t DeviceLookup::refresh(int32_t c) {
    ClassDevice& d = classes_state_[c];
    const uint64_t cap = classes_[c].slots().size();
    if (cap > d.view.cap) {
        // The new rows' keys are free already (made so, or left so by a shrink); only their pins go.
        expcache_status_t s = health_.check(backend_.sync_device());
        const std::vector<uint8_t> unpinned(cap - d.view.cap, 0);
        if (s == EXPCACHE_OK)
            s = health_.check(backend_.copy_h2d_sync(d.view.pin + d.view.cap, unpinned.data(), unpinned.size()));
        if (s != EXPCACHE_OK) return s;
        d.view.cap = static_cast<uint32_t>(cap);
    }
    // A layer registered again may read a source the GPU cannot read, into a class that had none.
    return needs_feed(c) && !d.view.feed.box ? make_feed(c) : EXPCACHE_OK;
}

expcache_status_t DeviceLookup::shrink(int32_t c, uint64_t cap, uint64_t* evicted) {
    *evicted = 0;
    if (!ready(c) || cap >= classes_state_[c].view.cap) return EXPCACHE_OK;
    ClassDevice& d = classes_state_[c];
    const uint32_t old_cap = d.view.cap;
    Copier io(backend_, health_);
    expcache_status_t s = health_.check(backend_.sync_device());
    if (s != EXPCACHE_OK) return s;
    HostSlots h;
    h.read(io, d.view, old_cap);
    std::vector<int32_t> slot_of;
    io.in(&slot_of, slot_of_key_dev_, keys_);
    DevicePolicyClock clock = {-1, 0, 0};
    if (policy_.clock) io.in_one(&clock, policy_.clock);
    if ((s = io.status()) != EXPCACHE_OK) return s;
    // Where the policy is: its last select's token and layer, as that select ranked its victims.
    DeviceSelectArgs a = {};
    a.cls = h.view(d.view);
    a.policy = policy_;
    a.policy.clock = &clock;
    a.policy.tables = &oppclass_tables();
    const bool known = clock.last_layer >= 0 && static_cast<size_t>(clock.last_layer) < layers_.size() &&
                       layers_[static_cast<size_t>(clock.last_layer)].registered;
    const PolicyNow now = {clock.token, known ? layers_[static_cast<size_t>(clock.last_layer)].rank : 0, 0.0};
    const bool lists = victims_by_lists(a);
    std::vector<Candidate> order;
    uint64_t resident = 0;
    for (uint32_t r = 0; r < old_cap; ++r) {
        if (h.key[r] < 0) continue;
        ++resident;
        if (!h.pin[r]) order.push_back(ranked(a.policy, h.stamp.data(), a.cls.policy.opp, lists, int32_t(r), now));
    }
    const uint64_t n = resident > cap ? resident - cap : 0;
    if (n > order.size())
        return fail(EXPCACHE_ERR_INTERNAL, "class %s: %llu residents are pinned past a cap of %llu",
                    classes_.name(classes_[c]).c_str(), (unsigned long long)(resident - order.size()),
                    (unsigned long long)cap);
    std::sort(order.begin(), order.end(), goes_first);
    for (uint64_t i = 0; i < n; ++i) {
        const int32_t r = order[i].slot;
        slot_of[h.key[r]] = -1;
        h.key[r] = -1;
    }
    h.resident -= n;
    if (d.view.policy.duel) h.duel.resident -= static_cast<int32_t>(n);  // DuelPolicy::on_remove
    // The residents past the cap move into the free rows below it, lowest first; the rows past it
    // are pinned.
    uint32_t to = 0;
    for (uint32_t r = static_cast<uint32_t>(cap); r < old_cap && s == EXPCACHE_OK; ++r) {
        h.pin[r] = 1;
        if (h.key[r] < 0) continue;
        while (h.key[to] >= 0) ++to;  // below cap: the evictions left a free row for each
        s = classes_.copy_row(classes_[c], to, r);
        slot_of[h.key[r]] = static_cast<int32_t>(to);
        h.move(r, to);
    }
    if (s == EXPCACHE_OK) s = health_.check(backend_.sync_device());
    if (s != EXPCACHE_OK) return s;
    h.write(io, d.view);
    io.out(slot_of_key_dev_, slot_of);
    if ((s = io.status()) != EXPCACHE_OK) return s;
    d.view.cap = static_cast<uint32_t>(cap);
    *evicted = n;
    return EXPCACHE_OK;
}

expcache_status_t DeviceLookup::forget_layer(uint32_t layer, int32_t c) {
    if (!enabled_) return EXPCACHE_OK;
    maps_[layer] = LayerMap{};
    if (c < 0 || !ready(c)) return EXPCACHE_OK;  // nothing of the layer ever reached the device
    const LayerState& l = layers_[layer];
    const DeviceClass& d = classes_state_[c].view;
    Copier io(backend_, health_);
    expcache_status_t s = health_.check(backend_.sync_device());
    if (s != EXPCACHE_OK) return s;
    HostSlots h;
    io.in(&h.key, d.key_of_slot, d.cap);
    io.in_one(&h.resident, d.resident);
    if (d.policy.duel) io.in_one(&h.duel, d.policy.duel);
    std::vector<int32_t> slot_of;
    io.in(&slot_of, slot_of_key_dev_ + l.key_base, l.num_experts);
    if ((s = io.status()) != EXPCACHE_OK) return s;
    int32_t left = 0;
    for (int32_t& r : slot_of) {
        if (r < 0) continue;
        h.key[static_cast<size_t>(r)] = -1;
        r = -1;
        ++left;
    }
    h.resident -= static_cast<uint64_t>(left);
    h.duel.resident -= left;
    io.out(d.key_of_slot, h.key);
    io.out_one(d.resident, h.resident);
    if (d.policy.duel) io.out_one(d.policy.duel, h.duel);
    io.out(slot_of_key_dev_ + l.key_base, slot_of);
    // The keys start over, as a new layer's would: no use counted, in no shadow. A shadow row that
    // held one stays taken until the shadow evicts it, as the host's shadows keep a departed key.
    for (KeyCount* counts : {policy_.counts, policy_.shadow_counts})
        if (counts) io.out(counts + l.key_base, std::vector<KeyCount>(l.num_experts, KeyCount{0.0, 0.0}));
    for (int j = 0; j < 2 && d.policy.duel; ++j) {
        std::vector<int32_t> shadow_of, shadow_key;
        io.in(&shadow_of, policy_.shadow_slot[j] + l.key_base, l.num_experts);
        io.in(&shadow_key, d.policy.shadow[j].key, classes_state_[c].rows);
        if (io.status() != EXPCACHE_OK) break;
        for (int32_t& r : shadow_of) {
            if (r >= 0) shadow_key[static_cast<size_t>(r)] = -1;
            r = -1;
        }
        io.out(policy_.shadow_slot[j] + l.key_base, shadow_of);
        io.out(d.policy.shadow[j].key, shadow_key);
    }
    return io.status();
}

}  // namespace expcache
