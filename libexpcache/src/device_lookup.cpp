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
    uint64_t key_of_slot, stamp, pin, misses, miss_count, handoff;
    uint64_t opp[3] = {}, duel = 0, shadow_key[2] = {}, shadow_stamp[2] = {}, shadow_opp[2][3] = {};
    uint64_t bytes;
    ClassLayout(uint64_t cap, uint32_t policy) {
        Offsets o;
        key_of_slot = o.take(cap * sizeof(int32_t));
        stamp = o.take(cap * sizeof(uint64_t));
        pin = o.take(cap);
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
      copy_threads_(config.copy_threads),
      backend_(backend),
      arena_(arena),
      layers_(layers),
      classes_(classes),
      log_(log),
      health_(health),
      kernels_(std::move(kernels)),
      classes_state_(static_cast<size_t>(classes.size())),
      maps_(layers.size()) {}

DeviceLookup::~DeviceLookup() {
    feed_.reset();  // the threads stop before their rows go
    for (const ClassDevice& d : classes_state_) kernels_->free_mapped(d.feed_host);
    kernels_->free_mapped(mapped_.host);
}

// The table: the clocks, what snapshot() reads (the error, every class's counters and residents,
// adjacent), each key's slot and, for the policies that keep them, each key's count (oppclass,
// duel), its slot in each of duel's shadows, and OppClassLRU's tables.
expcache_status_t DeviceLookup::make_table() {
    // Every key a layer was given, an unregistered layer's too: registered again, it takes them.
    keys_ = 0;
    for (const LayerState& l : layers_) keys_ = std::max(keys_, l.key_base + l.key_span);
    const uint64_t classes = classes_state_.size();
    const bool lists = policy_id_ != EXPCACHE_POLICY_LRU, duel = policy_id_ == EXPCACHE_POLICY_DUEL;
    Offsets o;
    const uint64_t at_clock = o.take(sizeof(uint64_t)), at_policy_clock = o.take(sizeof(DevicePolicyClock));
    const uint64_t at_error = o.take(sizeof(DeviceError)), at_counters = o.take(classes * sizeof(DeviceCounters)),
                   at_resident = o.take(classes * sizeof(uint64_t));
    read_bytes_ = at_resident + classes * sizeof(uint64_t) - at_error;
    const uint64_t at_slots = o.take(uint64_t(keys_) * sizeof(int32_t));
    const uint64_t at_counts = lists ? o.take(uint64_t(keys_) * sizeof(KeyCount)) : 0;
    const uint64_t at_tables = lists ? o.take(sizeof(OppClassTables)) : 0;
    uint64_t at_shadow[2] = {};
    for (int j = 0; j < 2 && duel; ++j) at_shadow[j] = o.take(uint64_t(keys_) * sizeof(int32_t));
    const uint64_t at_shadow_counts = duel ? o.take(uint64_t(keys_) * sizeof(KeyCount)) : 0;
    expcache_status_t s = health_.check(arena_.alloc(o.bytes, &table_));
    if (s != EXPCACHE_OK) return s;
    unsigned char* p = static_cast<unsigned char*>(table_);
    cold_clock_dev_ = reinterpret_cast<uint64_t*>(p + at_clock);
    error_dev_ = reinterpret_cast<DeviceError*>(p + at_error);
    counters_dev_ = reinterpret_cast<DeviceCounters*>(p + at_counters);
    resident_dev_ = reinterpret_cast<uint64_t*>(p + at_resident);
    slot_of_key_dev_ = reinterpret_cast<int32_t*>(p + at_slots);
    // Zeros (the error, the counters, the residents), the cold clock at its start, no key resident.
    std::vector<unsigned char> zeros(at_slots, 0);
    const uint64_t cold_start = kStampStart;
    std::memcpy(zeros.data() + at_clock, &cold_start, sizeof cold_start);
    const std::vector<int32_t> none(keys_, -1);
    if ((s = health_.check(backend_.copy_h2d_sync(p, zeros.data(), zeros.size()))) != EXPCACHE_OK ||
        (keys_ && (s = health_.check(backend_.copy_h2d_sync(slot_of_key_dev_, none.data(), keys_ * sizeof(int32_t)))) !=
                      EXPCACHE_OK))
        return s;
    policy_ = DevicePolicyArgs{};
    policy_.id = policy_id_;
    if (!lists) return EXPCACHE_OK;
    // What the device's policy starts from: the host policy's state at create.
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
    if (duel) {
        policy_.shadow_counts = reinterpret_cast<KeyCount*>(p + at_shadow_counts);
        if (keys_ && (s = health_.check(backend_.copy_h2d_sync(policy_.shadow_counts, counts.data(),
                                                               keys_ * sizeof(KeyCount)))) != EXPCACHE_OK)
            return s;
    }
    for (int j = 0; j < 2 && duel; ++j) {
        policy_.shadow_slot[j] = reinterpret_cast<int32_t*>(p + at_shadow[j]);
        if (keys_ && (s = health_.check(backend_.copy_h2d_sync(policy_.shadow_slot[j], none.data(),
                                                               keys_ * sizeof(int32_t)))) != EXPCACHE_OK)
            return s;
    }
    return EXPCACHE_OK;
}

// The arrays cover every row the bank reserved for slots, so a budget change moves the cap within
// them (device_resize.cpp); the rows past the cap are pinned, so no select takes one, a graph
// captured under a larger cap included.
expcache_status_t DeviceLookup::make_class(int32_t c) {
    const ClassState& cls = classes_[c];
    const uint64_t cap = cls.slots().size(), rows = std::max(cap, cls.slot_rows());
    const ClassLayout at(rows, policy_id_);
    ClassDevice& d = classes_state_[c];
    expcache_status_t s = health_.check(arena_.alloc(at.bytes, &d.base));
    if (s != EXPCACHE_OK) return s;
    unsigned char* p = static_cast<unsigned char*>(d.base);
    d.view.key_of_slot = reinterpret_cast<int32_t*>(p + at.key_of_slot);
    d.view.stamp = reinterpret_cast<uint64_t*>(p + at.stamp);
    d.view.pin = p + at.pin;
    d.view.counters = counters_dev_ + c;
    d.view.resident = resident_dev_ + c;
    d.view.misses = reinterpret_cast<DeviceMiss*>(p + at.misses);
    d.view.miss_count = reinterpret_cast<uint32_t*>(p + at.miss_count);
    d.view.handoff = reinterpret_cast<DeviceHandoff*>(p + at.handoff);
    d.view.cap = static_cast<uint32_t>(cap);
    d.rows = rows;
    d.view.bank = cls.slots().empty() ? nullptr : cls.bank();
    for (int q = 0; q < kMaxParts; ++q) {
        d.view.part_at[q] = cls.part_at(q);
        d.view.part_stride[q] = cls.part_stride(q);
    }
    d.view.policy = DevicePolicyClass{};
    // Zeros everywhere: no pin, the handoff (the tickets count from 0 for the class's whole life)
    // and the policy's state, which starts empty (stamps, lists, duel's counter and sizes); no
    // key in any slot.
    const std::vector<unsigned char> zeros(at.bytes, 0);
    const std::vector<int32_t> free_slots(rows, -1);
    const std::vector<uint8_t> pinned(rows - cap, 1);
    if ((s = health_.check(backend_.copy_h2d_sync(p, zeros.data(), at.bytes))) != EXPCACHE_OK ||
        (s = health_.check(backend_.copy_h2d_sync(d.view.key_of_slot, free_slots.data(), rows * sizeof(int32_t)))) !=
            EXPCACHE_OK ||
        (rows > cap &&
         (s = health_.check(backend_.copy_h2d_sync(d.view.pin + cap, pinned.data(), rows - cap))) != EXPCACHE_OK))
        return s;
    if (policy_id_ == EXPCACHE_POLICY_LRU) return EXPCACHE_OK;
    d.view.policy.opp = opp_at(p, at.opp);
    if (policy_id_ != EXPCACHE_POLICY_DUEL) return EXPCACHE_OK;
    d.view.policy.duel = reinterpret_cast<DeviceDuel*>(p + at.duel);
    for (int j = 0; j < 2; ++j) {  // no key in the shadows
        DeviceShadow& sh = d.view.policy.shadow[j];
        sh.key = reinterpret_cast<int32_t*>(p + at.shadow_key[j]);
        sh.stamp = reinterpret_cast<uint64_t*>(p + at.shadow_stamp[j]);
        if (j == kShadowOpp) sh.opp = opp_at(p, at.shadow_opp[j]);
        if ((s = health_.check(backend_.copy_h2d_sync(sh.key, free_slots.data(), rows * sizeof(int32_t)))) !=
            EXPCACHE_OK)
            return s;
    }
    return EXPCACHE_OK;
}

expcache_status_t DeviceLookup::prepare(int32_t c) {
    if (ready(c)) return refresh(c);
    if (!enabled_ || classes_[c].slots().empty()) return EXPCACHE_OK;
    expcache_status_t s = EXPCACHE_OK;
    if (!table_ && (s = make_table()) != EXPCACHE_OK) return s;
    if ((s = make_class(c)) != EXPCACHE_OK) return s;
    return needs_feed(c) ? make_feed(c) : EXPCACHE_OK;
}

expcache_status_t DeviceLookup::snapshot(DeviceSnapshot* out) {
    const size_t classes = classes_state_.size();
    out->counters.assign(classes, DeviceCounters{});
    out->resident.assign(classes, 0);
    if (!enabled_ || !table_) return EXPCACHE_OK;
    expcache_status_t s = health_.check(backend_.sync_device());
    read_buf_.resize(read_bytes_);
    if (s == EXPCACHE_OK) s = health_.check(backend_.copy_d2h_sync(read_buf_.data(), error_dev_, read_bytes_));
    if (s != EXPCACHE_OK) return s;
    const unsigned char* at = read_buf_.data();
    const auto offset = [&](const void* dev) {
        return static_cast<size_t>(static_cast<const unsigned char*>(dev) -
                                   static_cast<const unsigned char*>(static_cast<void*>(error_dev_)));
    };
    DeviceError error = {};
    std::memcpy(&error, at, sizeof error);
    std::memcpy(out->counters.data(), at + offset(counters_dev_), classes * sizeof(DeviceCounters));
    std::memcpy(out->resident.data(), at + offset(resident_dev_), classes * sizeof(uint64_t));
    if (error.set) {
        report(error);
        const DeviceError none = {};
        if ((s = health_.check(backend_.copy_h2d_sync(error_dev_, &none, sizeof none))) != EXPCACHE_OK) return s;
    }
    return EXPCACHE_OK;
}

expcache_status_t DeviceLookup::reset_counters() {
    if (!enabled_ || !table_) return EXPCACHE_OK;
    const std::vector<DeviceCounters> zeros(classes_state_.size(), DeviceCounters{});
    expcache_status_t s = health_.check(backend_.sync_device());
    return s == EXPCACHE_OK ? health_.check(backend_.copy_h2d_sync(counters_dev_, zeros.data(),
                                                                   zeros.size() * sizeof(DeviceCounters)))
                            : s;
}

expcache_status_t DeviceLookup::clear(int32_t c) {
    if (!ready(c)) return EXPCACHE_OK;
    // The class holds no batch slot (release() is only asked for classes that hold none): every
    // slot is cleared by one kernel, ordered after everything (the device synchronized first and after).
    expcache_status_t s = health_.check(backend_.sync_device());
    if (s == EXPCACHE_OK) s = health_.check(kernels_->clear(classes_state_[c].view, slot_of_key_dev_, nullptr));
    if (s == EXPCACHE_OK) s = health_.check(backend_.sync_device());
    return s;
}

expcache_status_t DeviceLookup::slot_of(uint32_t layer, int32_t c, uint32_t expert, int32_t* out) {
    *out = -1;
    if (!ready(c)) return EXPCACHE_OK;
    expcache_status_t s = health_.check(backend_.sync_device());
    return s == EXPCACHE_OK ? health_.check(backend_.copy_d2h_sync(
                                  out, slot_of_key_dev_ + layers_[layer].key_base + expert, sizeof(int32_t)))
                            : s;
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
// "device" reads any host memory; a file has no address at all). A layer of pageable memory or a
// file is fed: a device select's misses come through the class's feed (feed_protocol.hpp); a
// host-side call's select fills its slots and the host copies.
expcache_status_t DeviceLookup::resolve(uint32_t layer, LayerMap* m) {
    const LayerState& l = layers_[layer];
    m->resolved = true;
    const char* fix =
        "pin the memory so the GPU can map it (cudaHostRegister), or register the layer as pageable memory "
        "(EXPCACHE_SOURCE_PAGEABLE; pyexpcache: HostSource(..., pinned=False)), whose misses the feed threads read";
    // Decided by the layer's declared kind, not by whether this backend could map the memory: the
    // host backend (which could read any memory) feeds what the CUDA backend would.
    if (l.fed()) {
        m->fed = true;
        return EXPCACHE_OK;
    }
    bool aligned = true;
    static const char* names[kThreeParts] = {"gate", "up", "down"};
    for (int p = 0; p < l.nparts; ++p) {
        expcache_status_t s = kernels_->mapped(l.base[p], &m->src[p]);
        if (s != EXPCACHE_OK) {
            m->status = s;
            const std::string part = l.nparts == kThreeParts ? format("%s part", names[p]) : format("part %d", p);
            m->why = format(
                "layer %u's source is pinned memory the GPU cannot map (%s: %s): a device "
                "select copies misses by reading pinned host memory; %s",
                layer, part.c_str(), last_error(), fix);
            clear_last_error();
            return EXPCACHE_OK;
        }
        aligned = aligned && reinterpret_cast<uintptr_t>(m->src[p]) % 16 == 0 && l.stride[p] % 16 == 0;
    }
    m->aligned = aligned;
    return EXPCACHE_OK;
}

expcache_status_t DeviceLookup::args_for(uint32_t layer, int32_t c, uint32_t count, bool host_call,
                                         DeviceSelectArgs* out) {
    LayerMap& m = maps_[layer];
    if (!m.resolved) {
        expcache_status_t s = resolve(layer, &m);
        if (s != EXPCACHE_OK) return s;
    }
    if (m.status != EXPCACHE_OK && !host_call) return fail(m.status, "%s", m.why.c_str());
    const LayerState& l = layers_[layer];
    DeviceSelectArgs& a = *out;
    a = DeviceSelectArgs{};
    a.count = count;
    a.layer = layer;
    a.key_base = l.key_base;
    a.num_experts = l.num_experts;
    a.aligned = m.aligned;
    for (int p = 0; p < kMaxParts; ++p) {
        a.src[p] = m.src[p];
        a.src_stride[p] = l.stride[p];
        a.part_bytes[p] = l.bytes[p];
    }
    a.cls = classes_state_[c].view;
    a.cold_clock = cold_clock_dev_;
    a.slot_of_key = slot_of_key_dev_;
    a.error = error_dev_;
    a.policy = policy_;
    const PolicyClock at = layers_.clock_at(layer, 0);  // the token is the device's (DevicePolicyClock)
    a.policy.pos = at.pos;
    a.policy.positions = at.positions;
    a.mode = kModeDecode;
    a.open_clock = 1;
    a.host_call = host_call;
    // A host-side call copies what the GPU cannot read itself; a device select has it fed.
    a.copy = m.status == EXPCACHE_OK && !(m.fed && host_call);
    a.fed = m.fed && !host_call;
    if (a.fed && !a.cls.feed.box)
        return fail(EXPCACHE_ERR_OUT_OF_HOST_MEMORY,
                    "layer %u's source is one the GPU cannot read, and its class's feed could not be made when the "
                    "class was bound (that call's error said why)",
                    layer);
    return EXPCACHE_OK;
}

expcache_status_t DeviceLookup::select(uint32_t layer, int32_t c, const void* ids, uint32_t id_bits, uint32_t count,
                                       int32_t* out_slots, uint32_t* out_counts, void* stream) {
    const ClassState& cls = classes_[c];
    const uint32_t cap = classes_state_[c].view.cap;
    if (count > cap - std::min<uint64_t>(cls.held(), cap))
        return fail(EXPCACHE_ERR_INVALID_ARGUMENT,
                    "a device select of %u ids needs as many slots it may fill: layer %u's bank has %u%s; raise the "
                    "budget or select fewer ids at once",
                    count, layer, cap,
                    cls.held() ? format(", %llu of them held by batches", (unsigned long long)cls.held()).c_str() : "");
    DeviceSelectArgs a;
    expcache_status_t s = args_for(layer, c, count, false, &a);
    if (s != EXPCACHE_OK) return s;
    a.ids = ids;
    a.id_bits = id_bits;
    a.out_slots = out_slots;
    a.out_counts = out_counts;
    selected_ = true;  // even when the launch fails: the host backend's steps may have run
    return health_.check(kernels_->select(a, stream));
}

// The mapped buffer: a piece's ids, its slots, its tally, its filled flags.
namespace {
constexpr uint64_t kMappedIds = 0;
constexpr uint64_t kMappedSlots = EXPCACHE_MAX_SELECT * sizeof(int32_t);
constexpr uint64_t kMappedTally = 2 * EXPCACHE_MAX_SELECT * sizeof(int32_t);
constexpr uint64_t kMappedFilled = kMappedTally + kTallyWords * sizeof(uint32_t);
constexpr uint64_t kMappedBytes = kMappedFilled + EXPCACHE_MAX_SELECT;
}  // namespace

expcache_status_t DeviceLookup::serve(uint32_t layer, int32_t c, const uint32_t* ids, uint32_t n, uint32_t mode,
                                      void* stream, int32_t* out_slots, uint8_t* out_filled, ServeTally* tally) {
    *tally = ServeTally{};
    expcache_status_t s = EXPCACHE_OK;
    if (!mapped_.host && (s = kernels_->alloc_mapped(kMappedBytes, &mapped_.host, &mapped_.device)) != EXPCACHE_OK)
        return s;
    unsigned char* host = static_cast<unsigned char*>(mapped_.host);
    unsigned char* dev = static_cast<unsigned char*>(mapped_.device);
    // In pieces of at most EXPCACHE_MAX_SELECT ids (a decode call has no more); the first opens
    // the policy clock, as the host's call opens it once.
    for (uint32_t at = 0; at < n; at += EXPCACHE_MAX_SELECT) {
        const uint32_t count = std::min<uint32_t>(n - at, EXPCACHE_MAX_SELECT);
        DeviceSelectArgs a;
        if ((s = args_for(layer, c, count, true, &a)) != EXPCACHE_OK) return s;
        std::memcpy(host + kMappedIds, ids + at, count * sizeof(uint32_t));
        a.ids = dev + kMappedIds;
        a.id_bits = 32;
        a.out_slots = reinterpret_cast<int32_t*>(dev + kMappedSlots);
        a.out_counts = reinterpret_cast<uint32_t*>(dev + kMappedTally);
        a.out_filled = dev + kMappedFilled;
        a.mode = mode;
        a.open_clock = at == 0;
        tally->host_copies = !a.copy;
        if ((s = health_.check(kernels_->select(a, stream))) != EXPCACHE_OK ||
            (s = health_.check(backend_.sync_stream(stream))) != EXPCACHE_OK)
            return s;
        std::memcpy(out_slots + at, host + kMappedSlots, count * sizeof(int32_t));
        std::memcpy(out_filled + at, host + kMappedFilled, count);
        uint32_t t[kTallyWords];
        std::memcpy(t, host + kMappedTally, sizeof t);
        tally->hits += t[kTallyHits];
        tally->fills += t[kCountMisses];
        tally->evictions += t[kTallyEvictions];
        tally->token = static_cast<int32_t>(t[kTallyToken]);
    }
    return EXPCACHE_OK;
}

expcache_status_t DeviceLookup::forget(int32_t c, const std::vector<int32_t>& slots) {
    if (!ready(c) || slots.empty()) return EXPCACHE_OK;
    const DeviceClass& d = classes_state_[c].view;
    expcache_status_t s = health_.check(backend_.sync_device());
    uint64_t resident = 0;
    int32_t duel_resident = 0;  // DuelPolicy's count of slots held, where the policy keeps one
    if (s == EXPCACHE_OK) s = health_.check(backend_.copy_d2h_sync(&resident, d.resident, sizeof resident));
    if (s == EXPCACHE_OK && d.policy.duel)
        s = health_.check(backend_.copy_d2h_sync(&duel_resident, &d.policy.duel->resident, sizeof duel_resident));
    const int32_t none = -1;
    for (size_t i = 0; i < slots.size() && s == EXPCACHE_OK; ++i) {
        int32_t key = -1;
        if ((s = health_.check(backend_.copy_d2h_sync(&key, d.key_of_slot + slots[i], sizeof key))) != EXPCACHE_OK ||
            key < 0)
            continue;
        if ((s = health_.check(backend_.copy_h2d_sync(slot_of_key_dev_ + key, &none, sizeof none))) == EXPCACHE_OK)
            s = health_.check(backend_.copy_h2d_sync(d.key_of_slot + slots[i], &none, sizeof none));
        --resident;
        --duel_resident;
    }
    if (s == EXPCACHE_OK) s = health_.check(backend_.copy_h2d_sync(d.resident, &resident, sizeof resident));
    if (s == EXPCACHE_OK && d.policy.duel)
        s = health_.check(backend_.copy_h2d_sync(&d.policy.duel->resident, &duel_resident, sizeof duel_resident));
    return s;
}

expcache_status_t DeviceLookup::unpin(int32_t c, const std::vector<int32_t>& slots, void* stream) {
    if (!ready(c) || slots.empty()) return EXPCACHE_OK;
    expcache_status_t s = EXPCACHE_OK;
    if (!mapped_.host && (s = kernels_->alloc_mapped(kMappedBytes, &mapped_.host, &mapped_.device)) != EXPCACHE_OK)
        return s;
    for (size_t at = 0; at < slots.size(); at += 2 * EXPCACHE_MAX_SELECT) {
        const uint32_t count = static_cast<uint32_t>(std::min<size_t>(slots.size() - at, 2 * EXPCACHE_MAX_SELECT));
        std::memcpy(mapped_.host, slots.data() + at, count * sizeof(int32_t));
        if ((s = health_.check(kernels_->unpin(classes_state_[c].view.pin, static_cast<int32_t*>(mapped_.device), count,
                                               stream))) != EXPCACHE_OK ||
            (s = health_.check(backend_.sync_stream(stream))) != EXPCACHE_OK)  // the list is read
            return s;
    }
    return EXPCACHE_OK;
}

}  // namespace expcache
