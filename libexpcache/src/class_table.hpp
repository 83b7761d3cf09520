// The size classes: per class its slots (a bank: one reserved address range at a fixed stride,
// mapped as the class grows), which expert each holds, the
// eviction policy's state, its budget and runtime cap, and its counters. A class is bound by
// the layers whose experts have its byte sizes; at most max_classes exist at once. ClassState's
// and SlotState's fields are private to ClassTable: every other file reads them through const
// getters (operator[], slot()) and changes them only through the table's verbs: bind, grow,
// acquire/unacquire, install/reinstall/uninstall, evict, hold/unhold, touch, hit, lend,
// set_prefetch, mark/clear_copy_pending, hint, record, release, each recording its own counters
// (class_table.cpp: classes, caps and budgets; class_bank.cpp: the banks' reservations and mappings;
// class_slots.cpp: a slot's acquisition, residency, holds and prefetch state).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "device_arena.hpp"
#include "expcache.h"
#include "layers.hpp"
#include "log.hpp"
#include "policy/policy.hpp"

namespace expcache {

constexpr uint64_t kAlign = 256;  // where each part of a slot, and of the compact buffer, starts
constexpr uint64_t kGiB = uint64_t(1) << 30;
// A bank's staging rows: what one decode call may stage (its distinct ids).
constexpr uint64_t kStagingRows = EXPCACHE_MAX_SELECT;
// A bank's batch rows: what the open prefill batches given by slot id stage (their experts that
// found no free slot), each batch a run of rows, until no such batch of the class is open.
constexpr uint64_t kBatchRows = EXPCACHE_MAX_BATCH_ROWS;

inline uint64_t align_up(uint64_t v) {
    return (v + kAlign - 1) & ~(kAlign - 1);
}

// Bytes as GiB, MiB, KiB or B (the host backend's emulated devices and scaled layouts are small).
std::string human_bytes(uint64_t n);
// Part sizes for messages: "gate 528, up 528, down 264" for three, "parts 1024, 32, 512, 16" else.
std::string parts_name(const uint64_t* bytes, int nparts);

enum PrefetchState : uint8_t {
    kPrefetchNone = 0,
    kPrefetchLoading = 1,  // queued on the prefetch thread: never evicted, never served; every
                           // serving call cancels it first
    kPrefetchUnused = 2,   // every byte sent; the first use counts it as used, an eviction as wasted
    kPrefetchPartial = 3,  // cancelled by the serving call under way with bytes left to send: if that call
                           // lists it, it sends the rest into the same slot (a miss, counted late);
                           // otherwise the slot is freed (cancelled)
};

// Which slots a miss may evict: kDemand none the call uses (last_call >= protect_from), kPrefetch
// none the current or previous serving call used; never one a batch holds or a prefetch loads.
enum class Evict { kNo, kDemand, kPrefetch };
// How an expert enters a slot: as the most recently used (a decode miss), among the first to go
// (a batch's append), or as a prefetch (loading, until a use).
enum class Insert { kDemand, kCold, kPrefetch };

// A slot of a class: read by anyone (const getters), written only by ClassTable's verbs.
class SlotState {
public:
    int32_t layer() const { return layer_; }  // -1: free
    uint32_t expert() const { return expert_; }
    uint32_t holds() const { return holds_; }  // unfinished batches using it
    uint64_t last_call() const {
        return last_call_;
    }  // protects it from eviction during that call (and
       // from a prefetch's during the next one)
    uint8_t prefetch() const { return prefetch_; }  // kPrefetch*: what a prefetch put here and nothing used yet
    bool copy_pending() const {
        return copy_pending_;
    }  // a prefetch's bytes may still cross on the copy
       // stream: a call that reads or rewrites the slot waits
       // for that stream first (StreamOrder)

private:
    friend class ClassTable;
    int32_t layer_ = -1;
    uint32_t expert_ = 0;
    uint32_t holds_ = 0;
    uint64_t last_call_ = 0;
    uint8_t prefetch_ = 0;
    bool copy_pending_ = false;
};

// A size class: read by anyone (const getters), written only by ClassTable's verbs.
class ClassState {
public:
    bool in_use() const { return in_use_; }
    int nparts() const { return nparts_; }
    uint64_t key(int p) const { return key_[p]; }  // the bytes of part p (0 past nparts)
    const uint64_t* key_array() const { return key_; }
    // Where part p starts within a slot laid out whole (a batch's own staging buffer).
    uint64_t part_off(int p) const { return part_off_[p]; }
    uint64_t expert_bytes() const {
        uint64_t n = 0;
        for (int p = 0; p < nparts_; ++p) n += key_[p];
        return n;
    }
    uint64_t slot_bytes() const { return slot_bytes_; }             // device bytes a row takes, every part aligned
    const std::vector<SlotState>& slots() const { return slots_; }  // the mapped slots: rows 0..size-1
    // The bank: a reserved range (kept across releases; replaced when the class is reused for
    // other sizes) of `rows` rows: slots 0..slot_rows-1, mapped from the start as the class grows,
    // then kStagingRows rows from `staging_row` on, mapped when a decode call stages experts that
    // got no slot, then kBatchRows rows from `batch_row` on, mapped when batches given by slot id
    // stage experts. Each range starts past the granule the one before ends in, in every region.
    // Its arrangement (EXPCACHE_BANK_*): SLOTS, one region of rows of slot_bytes, each holding
    // every part of its expert; PARTS, a region per part, each its part's rows side by side. Either
    // way part p of row r is at bank + part_at(p) + r * part_stride(p): every address of a row's
    // part is computed by part() (or parts_of, ptrs_of), here or, from the same two arrays, in
    // the kernels' arguments.
    unsigned char* bank() const { return bank_; }
    uint32_t arrangement() const { return arrangement_; }
    uint64_t part_at(int p) const { return part_at_[p]; }
    uint64_t part_stride(int p) const { return part_stride_[p]; }
    unsigned char* part(uint64_t row, int p) const { return bank_ + part_at_[p] + row * part_stride_[p]; }
    void parts_of(uint64_t row, unsigned char* out[kMaxParts]) const {
        for (int p = 0; p < kMaxParts; ++p) out[p] = p < nparts_ ? part(row, p) : nullptr;
    }
    expcache_expert_ptrs_t ptrs_of(uint64_t row) const { return {part(row, kGate), part(row, kUp), part(row, kDown)}; }
    // The row whose gate (part 0) is at `gate`.
    uint64_t row_of(const unsigned char* gate) const {
        return static_cast<uint64_t>(gate - bank_ - part_at_[kGate]) / part_stride_[kGate];
    }
    // The regions a mapping of rows covers (one for SLOTS, a part's each for PARTS): region k's row
    // r at bank + region_at(k) + r * region_stride(k).
    int regions() const { return regions_; }
    uint64_t region_at(int k) const { return region_at_[k]; }
    uint64_t region_stride(int k) const { return region_stride_[k]; }
    uint64_t rows() const { return rows_; }
    uint64_t staging_row() const { return staging_row_; }
    // The staging rows mapped whole so far (from staging_row on).
    uint64_t staging_mapped_to() const { return whole_rows(staging_end_); }
    uint64_t staging_bytes() const { return staging_bytes_; }  // mapped for the staging and batch rows
    uint64_t batch_row() const { return batch_row_; }
    bool staging_mapped() const { return staging_end_[0] > 0; }
    bool batch_mapped() const { return batch_end_[0] > 0; }
    // The batch rows mapped whole so far (from batch_row on).
    uint64_t batch_mapped_to() const { return whole_rows(batch_end_); }
    uint64_t mapped_bytes() const {  // mapped for the slots, every region
        uint64_t n = 0;
        for (int k = 0; k < regions_; ++k) n += mapped_[k];
        return n;
    }
    // Whether a release must keep the class: batches hold its slots or stage in its batch rows.
    bool busy() const { return held_ > 0 || batch_users_ > 0; }
    uint64_t slot_rows() const { return slot_rows_; }  // the rows reserved for slots: the most cap can grow to
    uint64_t cap() const { return cap_; }              // the runtime cap, in slots
    uint64_t resident() const { return resident_; }
    uint64_t held() const { return held_; }      // slots batches hold
    uint64_t layers() const { return layers_; }  // layers bound to it

    // Where each part of the entry laid out as a whole slot at `base` goes (a batch's own staging
    // buffer; never the bank: parts_of).
    void parts_at(unsigned char* base, unsigned char* out[kMaxParts]) const {
        for (int p = 0; p < kMaxParts; ++p) out[p] = p < nparts_ ? base + part_off_[p] : nullptr;
    }
    expcache_expert_ptrs_t ptrs_at(unsigned char* base) const {
        return {base + part_off_[kGate], base + part_off_[kUp], base + part_off_[kDown]};
    }

private:
    friend class ClassTable;
    bool in_use_ = false;
    uint64_t gen_ = 0;
    int nparts_ = 0;
    uint64_t key_[kMaxParts] = {};
    uint64_t part_off_[kMaxParts] = {};
    uint64_t slot_bytes_ = 0;
    uint32_t arrangement_ = EXPCACHE_BANK_SLOTS;
    uint64_t part_at_[kMaxParts] = {}, part_stride_[kMaxParts] = {};
    int regions_ = 1;
    uint64_t region_at_[kMaxParts] = {}, region_stride_[kMaxParts] = {};
    void forget_mappings() {
        std::fill(mapped_, mapped_ + kMaxParts, 0);
        std::fill(staging_end_, staging_end_ + kMaxParts, 0);
        std::fill(batch_end_, batch_end_ + kMaxParts, 0);
        staging_bytes_ = 0;
    }
    // The rows whole in every region given each region's mapped end (bytes from its start).
    uint64_t whole_rows(const uint64_t* end) const {
        uint64_t n = UINT64_MAX;
        for (int k = 0; k < regions_; ++k) n = std::min(n, end[k] / region_stride_[k]);
        return n;
    }
    uint64_t last_used_ = 0;  // call id, for reusing the least recently used class
    std::vector<SlotState> slots_;
    std::vector<int32_t> free_slots_;
    unsigned char* bank_ = nullptr;
    uint64_t rows_ = 0, slot_rows_ = 0, staging_row_ = 0, batch_row_ = 0;
    // Per region, the offset from its start its mapping reaches: the slots', the staging rows', the
    // batch rows'.
    uint64_t mapped_[kMaxParts] = {}, staging_end_[kMaxParts] = {}, batch_end_[kMaxParts] = {};
    uint64_t batch_used_ = 0, batch_users_ = 0;  // batch rows taken by open batches, and those batches
    uint64_t staging_bytes_ = 0;
    std::unique_ptr<Policy> policy_;
    uint64_t target_ = 0, cap_ = 0;
    bool cap_valid_ = false;      // recompute before the next growth
    bool cap_announced_ = false;  // a notice was given for `cap`
    uint64_t resident_ = 0, held_ = 0, layers_ = 0;
    // Per path: recorded only by the table's verbs (ClassTable::stats reads them).
    expcache_stats_t stats_[EXPCACHE_NUM_PATHS] = {};
};

// Whether a class holds device memory a release gives back: slots, or staging or batch rows.
inline bool has_memory(const ClassState& cls) {
    return !cls.slots().empty() || cls.staging_mapped() || cls.batch_mapped();
}

// What a miss asks of acquire(): a slot of class `cls` for an expert of `layer`.
struct SlotRequest {
    int32_t cls = -1;
    uint32_t layer = 0;
    uint32_t path = 0;
    bool miss = false;       // a serving call's miss: counted (misses) when asked, whatever comes of it
    bool allow_grow = true;  // may allocate a new slot within the cap
    Evict evict = Evict::kNo;
    uint64_t protect_from = 0;  // see Evict
};

// What acquire() did to get its slot: the victim it evicted, if any, and whether that victim held
// a prefetched expert nothing used (the caller counts it wasted: the table never calls out).
struct Acquired {
    int32_t slot = -1;                    // -1: none may be had
    bool evicted = false;                 // the slot was taken from a resident expert
    int32_t dropped_prefetch_layer = -1;  // >= 0: the victim was an unused prefetch of this layer
};

class ClassTable {
public:
    ClassTable(const expcache_config_t& config, Backend& backend, DeviceArena& arena, LayerTable& layers, Log& log,
               Health& health);

    // Read-only: every change goes through the verbs below.
    const ClassState& operator[](int32_t c) const { return classes_[static_cast<size_t>(c)]; }
    const SlotState& slot(int32_t c, int32_t s) const { return classes_[c].slots_[static_cast<size_t>(s)]; }
    // Device memory mapped for the slots of every class in use: what a budget or cap change may
    // count as free (a class keeps what it holds, or gives it to another).
    uint64_t slots_mapped() const {
        uint64_t n = 0;
        for (const ClassState& cls : classes_) n += cls.in_use_ ? cls.mapped_bytes() : 0;
        return n;
    }
    int32_t size() const { return static_cast<int32_t>(classes_.size()); }
    std::vector<ClassState>::const_iterator begin() const { return classes_.begin(); }
    std::vector<ClassState>::const_iterator end() const { return classes_.end(); }

    // The class a layer is bound to, or -1 (never bound, or its class was reused since).
    int32_t bound(const LayerState& layer) const;
    // Binds the layer to the class of its sizes: its own, a free one, or the least recently used
    // one not holding batch slots (released and reused: the caller vacates it first, see
    // release()).
    expcache_status_t bind(uint32_t layer, uint32_t path, int32_t* out_cls);
    // The class whose slots bind(layer) would free to reuse it, or -1 (nothing freed).
    int32_t bind_releases(uint32_t layer) const;
    // The classes whose slots release_unheld() frees.
    std::vector<int32_t> unheld() const;
    // Frees a class's slots (every resident expert becomes non-resident). The caller vacates
    // them first: no prefetch sends into them any more, the device has finished reading them,
    // and their unused prefetches are counted (PrefetchCoordinator::vacate). Never calls out.
    expcache_status_t release(int32_t c, uint32_t path);
    // Every class not holding batch slots (unheld(), vacated first).
    expcache_status_t release_unheld(uint32_t path);
    // A layer leaves (Cache::unregister_layer): on a host-lookup cache its residents leave their
    // slots, free for the class's other layers; its class counts one layer less. The caller
    // vacated the slots first (nothing in flight into them, the device done reading them).
    void forget_layer(uint32_t layer);

    // A budget or reserve changed (class_resize.cpp). plan_caps: the cap of each class in use
    // (0 for the others) under the config's budgets and reserve now, computed as create computes
    // them, in class order: the target, limited by the bank's rows and by what device memory
    // leaves after the reserve and the classes before it, every class's slots counted free.
    expcache_status_t plan_caps(std::vector<uint64_t>* caps) const;
    // Class c takes `cap` now. Below its slots: on a host-lookup cache the policy's victims go
    // (evictions on `path`; an unused prefetch among them listed in *dropped by layer, for the
    // caller to count wasted) until `cap` hold every resident, and those past it move into free
    // slots below it, their bytes copied on the device; on a device-lookup cache the device's
    // residency moved them first (DeviceLookup::shrink). The bank's pieces past the cap are then
    // unmapped, its base kept. Above: a fixed bank maps the slots now, any other as it grows. The
    // caller vacated the class (nothing in flight, the device idle) and no batch holds it.
    expcache_status_t resize(int32_t c, uint64_t cap, uint32_t path, std::vector<int32_t>* dropped);
    // The device copy of row `from` into row `to`, every region (class_bank.cpp), unordered with
    // any stream: the caller synchronizes the device after its copies.
    expcache_status_t copy_row(const ClassState& cls, uint64_t to, uint64_t from);
    // Budget shares depend on the whole layout: caps are recomputed before the next growth.
    void invalidate_caps();
    // Every class's slots are a bank (a reserved range, reserved when the class is bound, at one
    // address until the class is reused for other sizes). A device-lookup cache maps all `cap`
    // slots when the class is bound and keeps them until the cache is destroyed or a budget change
    // resizes them (fixed); a host-lookup cache maps them as the class grows and unmaps them when
    // it is released.
    bool fixed_banks() const { return banked_; }

    // The counters of class c on `path`, recorded by the verbs below (each says which it records).
    const expcache_stats_t& stats(int32_t c, uint32_t path) const { return classes_[c].stats_[path]; }
    // A call whose slots a device-lookup cache found on the device (Cache::fill_on_device) adds
    // its hits, misses, evictions, appends and bytes (h2d, d2d) on `path`.
    void record(int32_t c, uint32_t path, const expcache_stats_t& add);
    void reset_stats();

    // The first n (<= kStagingRows) staging rows of class c's bank, mapped (*out_row: the first
    // one's row): where a decode call stages the experts that got no slot (valid until the next
    // call, as slots are). Mapped as calls need more of them, unmapped with the slots when the
    // class is released.
    expcache_status_t staging_rows(int32_t c, uint32_t n, uint64_t* out_row);
    // n batch rows of class c's bank, mapped, for one batch (*out_row: the first one's row):
    // after the rows the open batches took (INVALID_STATE when kBatchRows would not hold them).
    // The class keeps them until give_batch_rows(); they are reused once no batch holds rows.
    expcache_status_t take_batch_rows(int32_t c, uint64_t n, uint64_t* out_row);
    void give_batch_rows(int32_t c);
    // A serving call of class c opens on `path` (calls): the class is the most recently used, and
    // its policy sees the call's clock.
    void open_call(int32_t c, uint32_t path, uint64_t call, const PolicyClock& clock);
    // Staging could only be had by releasing the caches (alloc_retries).
    void note_alloc_retry(int32_t c, uint32_t path) { classes_[c].stats_[path].alloc_retries++; }
    // A serving call finds its expert in slot s (hits). refresh_call > 0: a decode hit, the
    // policy refreshed and the slot used by that call; 0: a batch's hit, its recency left alone.
    void hit(int32_t c, int32_t s, uint32_t path, uint64_t refresh_call);
    // The slot is read by call `call` (protected from eviction during it).
    void touch(int32_t c, int32_t s, uint64_t call) { classes_[c].slots_[s].last_call_ = call; }
    // A compact load copied slot s out (bytes_d2d); first: the call's first listing of the
    // expert (a hit, the policy refreshed).
    void lend(int32_t c, int32_t s, uint32_t path, bool first);
    // An expert of `layer` served from outside the slots (bytes_h2d): staged (direct: a
    // direct load) or repeated in a compact load; new_miss: a miss acquire() did not count.
    void load_direct(int32_t c, uint32_t path, uint32_t layer, bool direct, bool new_miss);

    // A slot for a miss of `req.layer` (misses when req.miss): a free one, else a new one within
    // the cap, else (evict) the policy's victim among the evictable slots (evictions;
    // protect_from: see Evict). Under EXPCACHE_PARTITION_LAYER a layer holding its share
    // (layer_share) takes only the victim among its own slots. out->slot = -1 when none may be had.
    expcache_status_t acquire(const SlotRequest& req, Acquired* out);
    // The one way an expert enters a slot from acquire(): resident for `layer`, ranked by `how`,
    // used by call `call` (0 for a prefetch). A serving call's install (not a prefetch's) is
    // recorded on `path`: its bytes (bytes_h2d) and, into a slot no eviction freed, appends.
    void install(int32_t c, const Acquired& got, uint32_t layer, uint32_t expert, Insert how, uint64_t call,
                 uint32_t path);
    // A prefetch finished by a serving call enters the policy again as that call's miss, recorded
    // on `path` as a miss appended with the `sent` bytes the call sent (misses, appends, bytes_h2d).
    void reinstall(int32_t c, int32_t s, bool cold, uint64_t call, uint32_t path, uint64_t sent);
    // A slot whose bytes are not its expert's (a failed upload, a cancelled prefetch): free again.
    void uninstall(int32_t c, int32_t s);
    // A slot acquire() gave that never got its expert (its upload could not start): free again.
    void unacquire(int32_t c, int32_t s) { classes_[c].free_slots_.push_back(s); }

    // A batch holds slot s until it finishes (never evicted meanwhile; the class counts its held
    // slots); unhold: the batch finished, its slot read up to call `read_by` (protected from a
    // prefetch until the next call).
    void hold(int32_t c, int32_t s);
    void unhold(int32_t c, int32_t s, uint64_t read_by);
    // What a prefetch left in slot s (PrefetchState): loading, unused, partial, or none (used).
    void set_prefetch(int32_t c, int32_t s, PrefetchState state) { classes_[c].slots_[s].prefetch_ = state; }
    // A prefetch's bytes may cross on the copy stream into slot s: false if already marked.
    bool mark_copy_pending(int32_t c, int32_t s);
    // The copy stream was fenced: slot s (if the class still has it) is safe to read.
    void clear_copy_pending(int32_t c, int32_t s);
    // The policy of class c sees the engine's clock (a prefetch or a hint dates its work now).
    void set_policy_clock(int32_t c, const PolicyClock& clock) { classes_[c].policy_->set_clock(clock); }
    // A hint refreshes slot s in the policy (Policy::on_hint); no counter.
    void hint(int32_t c, int32_t s) { classes_[c].policy_->on_hint(s); }
    std::string name(const ClassState& cls) const;
    // What the budgets ask for this class (see expcache_config_t).
    uint64_t target(const ClassState& cls) const;

private:
    void choose(const LayerState& layer, int32_t* found, int32_t* empty, int32_t* lru) const;
    expcache_status_t activate(int32_t c, const LayerState& layer);
    expcache_status_t reserve_rows(int32_t c, uint64_t slots);
    expcache_status_t map_rows(ClassState& cls, uint64_t range_row, uint64_t to_row, uint64_t* end);
    // The class's rows laid out for its sizes and the config's arrangement (class_bank.cpp).
    void lay_out(ClassState& cls, const LayerState& layer) const;

    std::string zero_target_reason(const ClassState& cls) const;
    expcache_status_t refresh_cap(int32_t c, uint32_t path);
    void announce_cap(int32_t c, uint32_t path, const char* why, const char* fix = "");
    void warn_empty_shares(int32_t c) const;
    // EXPCACHE_PARTITION_LAYER: the layer's share of the class's cap.
    uint64_t layer_share(const ClassState& cls, uint32_t layer) const;
    expcache_status_t grow(int32_t c, uint32_t path);
    expcache_status_t reserve_bank(int32_t c, uint32_t path);
    void evict(int32_t c, int32_t s, uint32_t path, Acquired* out);
    // class_slots.cpp: the policy's next n victims (no call protects a slot now; held and loading
    // ones never) evicted and freed, unused prefetches among them listed in *dropped; how many went.
    uint64_t evict_victims(int32_t c, uint64_t n, uint32_t path, std::vector<int32_t>* dropped);
    // The expert of slot `from` moves to free slot `to` (its place in the policy kept; its bytes are
    // the caller's to copy).
    void move_slot(int32_t c, int32_t from, int32_t to);
    // class_resize.cpp
    expcache_status_t pack(int32_t c, uint64_t cap);
    void unmap_past(int32_t c, uint64_t cap);

    const expcache_config_t& config_;
    Backend& backend_;
    DeviceArena& arena_;
    LayerTable& layers_;
    Log& log_;
    Health& health_;
    const bool banked_;
    uint64_t reuses_ = 0;              // classes released for another size: the first one warns
    std::vector<ClassState> classes_;  // sized once: references to a class stay valid
};

}  // namespace expcache
