#include "device_lookup.hpp"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "errors.hpp"
#include "paths.hpp"
#include "policy/policy.hpp"

namespace expcache {

namespace {

// Offsets in one allocation, each 256-byte aligned.
class Offsets {
public:
    uint64_t take(uint64_t n) {
        const uint64_t at = bytes;
        bytes = align_up(bytes + n);
        return at;
    }
    uint64_t bytes = 0;
};

// Where DeviceClass's arrays are: the slots' and, for the policies that keep them, OppClassLRU's
// lists (oppclass, duel) and duel's counter and shadows.
struct ClassLayout {
    uint64_t key_of_slot, stamp, pin, counters, misses, miss_count, handoff;
    uint64_t opp[3] = {}, duel = 0, shadow_key[2] = {}, shadow_stamp[2] = {}, shadow_opp[2][3] = {};
    uint64_t bytes;
    ClassLayout(uint64_t cap, uint32_t policy) {
        Offsets o;
        key_of_slot = o.take(cap * sizeof(int32_t));
        stamp = o.take(cap * sizeof(uint64_t));
        pin = o.take(cap);
        counters = o.take(sizeof(DeviceCounters));
        misses = o.take(EXPCACHE_MAX_SELECT * sizeof(DeviceMiss));
        miss_count = o.take(sizeof(uint32_t));
        handoff = o.take(sizeof(DeviceHandoff));
        auto take_opp = [&](uint64_t* at) {
            at[0] = o.take(cap);                    // cls
            at[1] = o.take(cap * sizeof(int32_t));  // tok
            at[2] = o.take(cap * sizeof(int32_t));  // pos
        };
        if (policy != EXPCACHE_POLICY_LRU) take_opp(opp);
        if (policy == EXPCACHE_POLICY_DUEL) {
            duel = o.take(sizeof(DeviceDuel));
            for (int j = 0; j < 2; ++j) {
                shadow_key[j] = o.take(cap * sizeof(int32_t));
                shadow_stamp[j] = o.take(cap * sizeof(uint64_t));
                if (j == kShadowOpp) take_opp(shadow_opp[j]);
            }
        }
        bytes = o.bytes;
    }
};

DeviceOppSlots opp_at(unsigned char* p, const uint64_t* at) {
    return DeviceOppSlots{p + at[0], reinterpret_cast<int32_t*>(p + at[1]), reinterpret_cast<int32_t*>(p + at[2])};
}

}  // namespace

DeviceLookup::DeviceLookup(const expcache_config_t& config, Backend& backend, DeviceArena& arena, LayerTable& layers,
                           ClassTable& classes, const Log& log, Health& health, std::unique_ptr<LookupKernels> kernels)
    : enabled_(config.lookup == EXPCACHE_LOOKUP_DEVICE),
      policy_id_(config.policy),
      backend_(backend),
      arena_(arena),
      layers_(layers),
      classes_(classes),
      log_(log),
      health_(health),
      kernels_(std::move(kernels)),
      classes_state_(static_cast<size_t>(classes.size())),
      maps_(layers.size()) {}

// The table: the clocks, the error, each key's slot and, for the policies that keep them, each
// key's count (oppclass, duel), its slot in each of duel's shadows, and OppClassLRU's tables.
expcache_status_t DeviceLookup::make_table() {
    keys_ = 0;
    for (const LayerState& l : layers_)
        if (l.registered) keys_ = std::max(keys_, l.key_base + l.num_experts);
    key_layer_.assign(keys_, 0);
    for (size_t i = 0; i < layers_.size(); ++i)
        if (layers_[i].registered)
            std::fill_n(key_layer_.begin() + layers_[i].key_base, layers_[i].num_experts, static_cast<uint32_t>(i));
    const bool lists = policy_id_ != EXPCACHE_POLICY_LRU, duel = policy_id_ == EXPCACHE_POLICY_DUEL;
    Offsets o;
    const uint64_t at_clock = o.take(sizeof(uint64_t)), at_policy_clock = o.take(sizeof(DevicePolicyClock)),
                   at_error = o.take(sizeof(DeviceError)), at_slots = o.take(uint64_t(keys_) * sizeof(int32_t));
    const uint64_t at_counts = lists ? o.take(uint64_t(keys_) * sizeof(KeyCount)) : 0;
    const uint64_t at_tables = lists ? o.take(sizeof(OppClassTables)) : 0;
    uint64_t at_shadow[2] = {};
    for (int j = 0; j < 2 && duel; ++j) at_shadow[j] = o.take(uint64_t(keys_) * sizeof(int32_t));
    expcache_status_t s = health_.check(arena_.alloc(o.bytes, &table_));
    if (s != EXPCACHE_OK) return s;
    unsigned char* p = static_cast<unsigned char*>(table_);
    clock_dev_ = reinterpret_cast<uint64_t*>(p + at_clock);
    error_dev_ = reinterpret_cast<DeviceError*>(p + at_error);
    slot_of_key_dev_ = reinterpret_cast<int32_t*>(p + at_slots);
    policy_ = DevicePolicyArgs{};
    policy_.id = policy_id_;
    if (!lists) return EXPCACHE_OK;
    // What the device's policy starts from (the host policy's state at create; push never writes it).
    policy_.clock = reinterpret_cast<DevicePolicyClock*>(p + at_policy_clock);
    policy_.counts = reinterpret_cast<KeyCount*>(p + at_counts);
    policy_.tables = reinterpret_cast<const OppClassTables*>(p + at_tables);
    const DevicePolicyClock clock = {-1, 0, 0};
    const std::vector<KeyCount> counts(keys_, KeyCount{0.0, 0.0});
    if ((s = health_.check(backend_.copy_h2d_sync(policy_.clock, &clock, sizeof clock))) != EXPCACHE_OK ||
        (s = health_.check(backend_.copy_h2d_sync(p + at_tables, &oppclass_tables(), sizeof(OppClassTables)))) !=
            EXPCACHE_OK ||
        (keys_ && (s = health_.check(backend_.copy_h2d_sync(policy_.counts, counts.data(),
                                                            keys_ * sizeof(KeyCount)))) != EXPCACHE_OK))
        return s;
    const std::vector<int32_t> none(keys_, -1);
    for (int j = 0; j < 2 && duel; ++j) {
        policy_.shadow_slot[j] = reinterpret_cast<int32_t*>(p + at_shadow[j]);
        if (keys_ && (s = health_.check(backend_.copy_h2d_sync(policy_.shadow_slot[j], none.data(),
                                                               keys_ * sizeof(int32_t)))) != EXPCACHE_OK)
            return s;
    }
    return EXPCACHE_OK;
}

expcache_status_t DeviceLookup::make_class(int32_t c) {
    const ClassState& cls = classes_[c];
    const uint64_t cap = cls.slots().size();
    const ClassLayout at(cap, policy_id_);
    ClassDevice& d = classes_state_[c];
    expcache_status_t s = health_.check(arena_.alloc(at.bytes, &d.base));
    if (s != EXPCACHE_OK) return s;
    unsigned char* p = static_cast<unsigned char*>(d.base);
    d.view.key_of_slot = reinterpret_cast<int32_t*>(p + at.key_of_slot);
    d.view.stamp = reinterpret_cast<uint64_t*>(p + at.stamp);
    d.view.pin = p + at.pin;
    d.view.counters = reinterpret_cast<DeviceCounters*>(p + at.counters);
    d.view.misses = reinterpret_cast<DeviceMiss*>(p + at.misses);
    d.view.miss_count = reinterpret_cast<uint32_t*>(p + at.miss_count);
    d.view.handoff = reinterpret_cast<DeviceHandoff*>(p + at.handoff);
    d.view.cap = static_cast<uint32_t>(cap);
    d.view.bank = cls.slots().empty() ? nullptr : cls.bank();
    d.view.slot_bytes = cls.slot_bytes();
    for (int q = 0; q < kParts; ++q) d.view.part_off[q] = cls.part_off(q);
    d.view.policy = DevicePolicyClass{};
    // Zeros everywhere: the handoff (the tickets count from 0 for the class's whole life) and the
    // policies' state, which starts empty here and lives on the device alone (stamps, lists,
    // duel's counter and sizes; LRU's stamps are then written by push from the host's order).
    const std::vector<unsigned char> zeros(at.bytes, 0);
    if ((s = health_.check(backend_.copy_h2d_sync(p, zeros.data(), at.bytes))) != EXPCACHE_OK) return s;
    if (policy_id_ == EXPCACHE_POLICY_LRU) return EXPCACHE_OK;
    d.view.policy.opp = opp_at(p, at.opp);
    if (policy_id_ != EXPCACHE_POLICY_DUEL) return EXPCACHE_OK;
    d.view.policy.duel = reinterpret_cast<DeviceDuel*>(p + at.duel);
    const std::vector<int32_t> none(cap, -1);  // no key in the shadows
    for (int j = 0; j < 2; ++j) {
        DeviceShadow& sh = d.view.policy.shadow[j];
        sh.key = reinterpret_cast<int32_t*>(p + at.shadow_key[j]);
        sh.stamp = reinterpret_cast<uint64_t*>(p + at.shadow_stamp[j]);
        if (j == kShadowOpp) sh.opp = opp_at(p, at.shadow_opp[j]);
        if (cap &&
            (s = health_.check(backend_.copy_h2d_sync(sh.key, none.data(), cap * sizeof(int32_t)))) != EXPCACHE_OK)
            return s;
    }
    return EXPCACHE_OK;
}

expcache_status_t DeviceLookup::admit_host_serving(uint32_t path) const {
    if (!enabled_ || policy_id_ == EXPCACHE_POLICY_LRU) return EXPCACHE_OK;
    return fail(EXPCACHE_ERR_UNSUPPORTED,
                "the %s path is not available on a device-lookup cache with policy %s: the policy's state (its "
                "use counts%s) lives on the device, where select_device keeps it, and a host-side serving call "
                "would need it on the host; serve with select_device, or make the cache with policy lru (host "
                "and device calls then share one LRU order) or with lookup host",
                path_name(path), policy_name(policy_id_),
                policy_id_ == EXPCACHE_POLICY_DUEL ? ", its shadow caches and their counter" : " and lists");
}

expcache_status_t DeviceLookup::pull() {
    if (!enabled_ || !table_ || !selected_) return EXPCACHE_OK;
    expcache_status_t s = health_.check(backend_.sync_device());
    if (s != EXPCACHE_OK) return s;
    DeviceError error = {};
    if ((s = health_.check(backend_.copy_d2h_sync(&clock_, clock_dev_, sizeof(clock_)))) != EXPCACHE_OK ||
        (s = health_.check(backend_.copy_d2h_sync(&error, error_dev_, sizeof(error)))) != EXPCACHE_OK)
        return s;
    std::vector<int32_t> keys;
    std::vector<uint64_t> stamps;
    for (int32_t c = 0; c < classes_.size(); ++c) {
        if (!ready(c)) continue;
        const DeviceClass& d = classes_state_[c].view;
        keys.resize(d.cap);
        stamps.resize(d.cap);
        DeviceCounters n = {};
        const bool lru = policy_id_ == EXPCACHE_POLICY_LRU;  // the host rebuilds only LRU's order
        if (d.cap &&
            ((s = health_.check(backend_.copy_d2h_sync(keys.data(), d.key_of_slot, d.cap * sizeof(int32_t)))) !=
                 EXPCACHE_OK ||
             (lru && (s = health_.check(backend_.copy_d2h_sync(stamps.data(), d.stamp, d.cap * sizeof(uint64_t)))) !=
                         EXPCACHE_OK)))
            return s;
        if ((s = health_.check(backend_.copy_d2h_sync(&n, d.counters, sizeof(n)))) != EXPCACHE_OK) return s;
        classes_.adopt(c, keys, stamps, key_layer_, lru);  // the mirror: slots, slot maps, free list, LRU order
        expcache_stats_t& st = classes_.mirror_stats(c, EXPCACHE_PATH_DEVICE);
        st.calls = n.calls;
        st.hits = n.hits;
        st.misses = n.misses;
        st.evictions = n.evictions;
        st.appends = n.appends;
        st.bytes_h2d = n.bytes_h2d;
    }
    report(error);
    return EXPCACHE_OK;
}

// A select's id out of range is the caller's bug, found on the device after the call returned:
// the call that reads it back does its own work and says so in the log (a warning), once.
void DeviceLookup::report(const DeviceError& error) {
    if (!error.set) return;
    log_(EXPCACHE_LOG_WARNING,
         "a device select of layer %u got expert id %lld (index %u) out of range (%u experts); its slot was "
         "given as -1 (the first such id since the last report)",
         error.layer, (long long)error.id, error.index, layers_[error.layer].num_experts);
}

void DeviceLookup::report_pending() {
    if (!enabled_ || !table_ || !selected_) return;
    DeviceError error = {};
    if (health_.check(backend_.sync_device()) != EXPCACHE_OK ||
        health_.check(backend_.copy_d2h_sync(&error, error_dev_, sizeof(error))) != EXPCACHE_OK)
        return;
    report(error);
}

expcache_status_t DeviceLookup::push() {
    if (!enabled_) return EXPCACHE_OK;
    bool any = false;
    for (const ClassState& cls : classes_) any = any || (cls.in_use() && !cls.slots().empty());
    if (!any && !table_) return EXPCACHE_OK;
    expcache_status_t s = health_.check(backend_.sync_device());
    if (s != EXPCACHE_OK) return s;
    if (!table_ && (s = make_table()) != EXPCACHE_OK) return s;
    std::vector<int32_t> slot_of_key(keys_, -1);
    std::vector<int32_t> keys, order;
    std::vector<uint64_t> stamps;
    std::vector<uint8_t> pins;
    for (int32_t c = 0; c < classes_.size(); ++c) {
        const ClassState& cls = classes_[c];
        if (!cls.in_use() || cls.slots().empty()) continue;
        if (!ready(c) && (s = make_class(c)) != EXPCACHE_OK) return s;
        const DeviceClass& d = classes_state_[c].view;
        keys.assign(d.cap, -1);
        stamps.assign(d.cap, 0);
        pins.assign(d.cap, 0);
        const bool lru = policy_id_ == EXPCACHE_POLICY_LRU;  // the other policies' order is the device's alone
        order.clear();
        if (lru) classes_.policy_order(c, &order);
        for (int32_t slot : order) stamps[slot] = ++clock_;
        for (uint32_t i = 0; i < d.cap; ++i) {
            const SlotState& slot = cls.slots()[i];
            pins[i] = slot.holds() > 0;
            if (slot.layer() < 0) continue;
            keys[i] = static_cast<int32_t>(layers_[slot.layer()].key_base + slot.expert());
            slot_of_key[keys[i]] = static_cast<int32_t>(i);
        }
        const expcache_stats_t& st = classes_.stats(c, EXPCACHE_PATH_DEVICE);
        const DeviceCounters n = {st.calls, st.hits, st.misses, st.evictions, st.appends, st.bytes_h2d};
        if (d.cap &&
            ((s = health_.check(backend_.copy_h2d_sync(d.key_of_slot, keys.data(), d.cap * sizeof(int32_t)))) !=
                 EXPCACHE_OK ||
             (lru && (s = health_.check(backend_.copy_h2d_sync(d.stamp, stamps.data(), d.cap * sizeof(uint64_t)))) !=
                         EXPCACHE_OK) ||
             (s = health_.check(backend_.copy_h2d_sync(d.pin, pins.data(), d.cap))) != EXPCACHE_OK))
            return s;
        if ((s = health_.check(backend_.copy_h2d_sync(d.counters, &n, sizeof(n)))) != EXPCACHE_OK) return s;
        if (d.policy.duel) {  // the slots held now (a release empties them); duel's counter and shadows stay
            const int32_t resident = static_cast<int32_t>(cls.resident());
            if ((s = health_.check(backend_.copy_h2d_sync(&d.policy.duel->resident, &resident, sizeof resident))) !=
                EXPCACHE_OK)
                return s;
        }
    }
    const DeviceError none = {};
    if ((s = health_.check(backend_.copy_h2d_sync(clock_dev_, &clock_, sizeof(clock_)))) != EXPCACHE_OK ||
        (s = health_.check(backend_.copy_h2d_sync(error_dev_, &none, sizeof(none)))) != EXPCACHE_OK)
        return s;
    if (keys_) s = health_.check(backend_.copy_h2d_sync(slot_of_key_dev_, slot_of_key.data(), keys_ * sizeof(int32_t)));
    return s;
}

expcache_status_t DeviceLookup::table_reads(int32_t c, uint64_t* out) {
    *out = 0;
    if (!ready(c)) return EXPCACHE_OK;
    DeviceHandoff h = {};
    expcache_status_t s = health_.check(backend_.sync_device());
    if (s == EXPCACHE_OK) s = health_.check(backend_.copy_d2h_sync(&h, classes_state_[c].view.handoff, sizeof(h)));
    if (s == EXPCACHE_OK) *out = h.table_reads;
    return s;
}

// Where the device reads the layer's parts: its pinned source, mapped (the host backend's
// "device" reads any host memory; a file has no address at all).
expcache_status_t DeviceLookup::resolve(uint32_t layer, LayerMap* m) {
    const LayerState& l = layers_[layer];
    m->resolved = true;
    const char* fix = policy_id_ == EXPCACHE_POLICY_LRU
                          ? "register the layer with a pinned source (EXPCACHE_SOURCE_PINNED; pyexpcache: "
                            "HostSource(..., pinned=True)), or use the host-side select"
                          : "register the layer with a pinned source (EXPCACHE_SOURCE_PINNED; pyexpcache: "
                            "HostSource(..., pinned=True)), or serve it with the host-side select of a cache "
                            "made with lookup host (or with policy lru)";
    // Refused by the layer's declared kind, not by whether this backend could map the memory: the
    // host backend (which could read any memory) keeps the CUDA backend's contract.
    if (!l.source.pinned()) {
        m->status = EXPCACHE_ERR_UNSUPPORTED;
        m->why = format(
            "layer %u's source is %s, which the GPU cannot read: a device select copies misses by "
            "reading pinned host memory; %s",
            layer, l.source.kind == EXPCACHE_SOURCE_FILE ? "a file" : "pageable memory", fix);
        return EXPCACHE_OK;
    }
    bool aligned = true;
    for (int p = 0; p < kParts; ++p) {
        expcache_status_t s = kernels_->mapped(l.base[p], &m->src[p]);
        if (s != EXPCACHE_OK) {
            m->status = s;
            m->why = format(
                "layer %u's source is pinned memory the GPU cannot map (%s part: %s): a device "
                "select copies misses by reading pinned host memory; %s",
                layer,
                p == kGate ? "gate"
                : p == kUp ? "up"
                           : "down",
                last_error(), fix);
            clear_last_error();
            return EXPCACHE_OK;
        }
        aligned = aligned && reinterpret_cast<uintptr_t>(m->src[p]) % 16 == 0 && l.stride[p] % 16 == 0;
    }
    m->aligned = aligned;
    return EXPCACHE_OK;
}

expcache_status_t DeviceLookup::select(uint32_t layer, int32_t c, const void* ids, uint32_t id_bits, uint32_t count,
                                       int32_t* out_slots, uint32_t* out_counts, void* stream) {
    LayerMap& m = maps_[layer];
    if (!m.resolved) {
        expcache_status_t s = resolve(layer, &m);
        if (s != EXPCACHE_OK) return s;
    }
    if (m.status != EXPCACHE_OK) return fail(m.status, "%s", m.why.c_str());
    const ClassState& cls = classes_[c];
    const DeviceClass& d = classes_state_[c].view;
    if (count > d.cap - std::min<uint64_t>(cls.held(), d.cap))
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT,
                    "a device select of %u ids needs as many slots it may fill: layer %u's bank has %u%s; raise the "
                    "budget or select fewer ids at once",
                    count, layer, d.cap,
                    cls.held() ? format(", %llu of them held by batches", (unsigned long long)cls.held()).c_str() : "");
    const LayerState& l = layers_[layer];
    DeviceSelectArgs a = {};
    a.ids = ids;
    a.id_bits = id_bits;
    a.count = count;
    a.out_slots = out_slots;
    a.out_counts = out_counts;
    a.layer = layer;
    a.key_base = l.key_base;
    a.num_experts = l.num_experts;
    a.aligned = m.aligned;
    for (int p = 0; p < kParts; ++p) {
        a.src[p] = m.src[p];
        a.src_stride[p] = l.stride[p];
        a.part_bytes[p] = l.bytes[p];
    }
    a.cls = d;
    a.clock = clock_dev_;
    a.slot_of_key = slot_of_key_dev_;
    a.error = error_dev_;
    a.policy = policy_;
    a.policy.pos = l.rank;
    a.policy.positions = layers_.registered();
    selected_ = true;  // even when the launch fails: the host backend's steps may have run
    return health_.check(kernels_->select(a, stream));
}

}  // namespace expcache
