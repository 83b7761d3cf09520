// The device-side lookup of a cache made with lookup = EXPCACHE_LOOKUP_DEVICE: the one copy of
// its residency, on the device (which slot of each class's bank holds which expert, the slots'
// recency and pins, the counters, the policy's state: kernels/lookup_policy.hpp), and the host
// operations over it. The select kernel serves select_device and, in a mode of its own, each
// host-side serving call (serve: select, select_slots, compact loads, prefill batches); the
// other host operations are one copy to or from the device, or one kernel (snapshot: every
// class's counters and residents; clear: a release, by a kernel; slot_of: a read). The host's class table keeps the
// banks' geometry and the batches' holds only.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "class_table.hpp"
#include "device_arena.hpp"
#include "feed.hpp"
#include "kernels/lookup_kernels.hpp"
#include "layers.hpp"
#include "log.hpp"

namespace expcache {

// What a host-side call's selects did (DeviceLookup::serve).
struct ServeTally {
    uint64_t hits = 0, fills = 0, evictions = 0;  // fills: misses given a slot
    bool host_copies = false;  // the layer's source is not the GPU's to read: the host copies the fills
    int32_t token = 0;         // the device's policy clock token the call ran at (0 under LRU, which keeps none)
};

// Every class's device counters and residents, read with one copy (DeviceLookup::snapshot).
struct DeviceSnapshot {
    std::vector<DeviceCounters> counters;
    std::vector<uint64_t> resident;
};

class DeviceLookup {
public:
    DeviceLookup(const expcache_config_t& config, Backend& backend, DeviceArena& arena, LayerTable& layers,
                 ClassTable& classes, const Log& log, Health& health, std::unique_ptr<LookupKernels> kernels);
    ~DeviceLookup();
    DeviceLookup(const DeviceLookup&) = delete;
    DeviceLookup& operator=(const DeviceLookup&) = delete;

    bool enabled() const { return enabled_; }
    // The host pool the feed reads through (the cache's; it outlives this lookup).
    void use_pool(HostPool* pool) { pool_ = pool; }
    // Whether the device state exists: the layout is then fixed (its size depends on it).
    bool frozen() const { return table_ != nullptr; }
    // Whether class c's device state exists (made by prepare() once the class is bound).
    bool ready(int32_t c) const {
        return enabled_ && static_cast<size_t>(c) < classes_state_.size() && classes_state_[c].base != nullptr;
    }
    bool capturing(void* stream) { return kernels_->capturing(stream); }

    // Class c was bound (its bank mapped): its device state made, empty (the table too, at the
    // first class); nothing when the class has no slot. When it exists: the cap raised to the
    // class's slots (they grew), and the class's feed made if a layer of it now needs one.
    expcache_status_t prepare(int32_t c);
    // device_resize.cpp. Before class c's slots past `cap` are unmapped (ClassTable::resize): the
    // policy's victims, in the order a select ranks them, leave until `cap` slots hold every
    // resident, the residents past it move below it (their bytes copied on the device), and the
    // rows past it are pinned, so a graph captured under the larger cap never takes one; *evicted:
    // how many left. No batch holds the class; the device is synchronized before and after.
    expcache_status_t shrink(int32_t c, uint64_t cap, uint64_t* evicted);
    // Layer `layer` leaves (bound to class c, or -1): its experts leave the slot map and their
    // slots, its keys' use counts and duel's shadow entries go (a layer registered again at this
    // index reuses its keys: the table is sized once), and its source is forgotten. The device is
    // synchronized first.
    expcache_status_t forget_layer(uint32_t layer, int32_t c);
    // Every class's device-path counters and residents, the device synchronized first, with one
    // copy. A select's id out of range since the last read is logged here (a warning), once.
    expcache_status_t snapshot(DeviceSnapshot* out);
    // The device-path counters zeroed (one copy).
    expcache_status_t reset_counters();
    // Class c forgets every expert it holds (a release: its bank stays mapped), by one kernel; its
    // policy's counts and duel's shadows stay. The device synchronized before and after.
    expcache_status_t clear(int32_t c);
    // The slot holding `expert` of `layer` (bound to class c), -1 none; the device synchronized first.
    expcache_status_t slot_of(uint32_t layer, int32_t c, uint32_t expert, int32_t* out);
    // At destroy: an out-of-range id no call has read back yet is logged.
    void report_pending();
    // Enqueue one device select of `count` ids of `layer` (bound to class c, whose state is
    // ready) on `stream`; out_counts (nullptr: not wanted) gets the distinct experts and misses.
    expcache_status_t select(uint32_t layer, int32_t c, const void* ids, uint32_t id_bits, uint32_t count,
                             int32_t* out_slots, uint32_t* out_counts, void* stream);
    // A host-side serving call of `layer` (class c, ready): its `n` distinct ids, in order of first
    // occurrence, selected in `mode` (SelectMode) on `stream`, which is synchronized; out_slots[n]
    // (host memory) their slots, -1 for those the call must serve otherwise (a compact load's
    // misses, a batch's without a free slot, a decode's with every slot pinned or used);
    // out_filled[n] 1 where the select filled the slot (copied already unless tally->host_copies).
    expcache_status_t serve(uint32_t layer, int32_t c, const uint32_t* ids, uint32_t n, uint32_t mode, void* stream,
                            int32_t* out_slots, uint8_t* out_filled, ServeTally* tally);
    // Slots of class c whose bytes are not their experts' (a failed upload): free again. The device
    // synchronized first.
    expcache_status_t forget(int32_t c, const std::vector<int32_t>& slots);
    // A batch of class c ends: its slots (the ones no other batch holds) unpinned on `stream`.
    expcache_status_t unpin(int32_t c, const std::vector<int32_t>& slots, void* stream);
    // The device selects of class c served by their table read (every id in range resident:
    // no victim search, nothing copied) since its state was made, the device synchronized
    // first; 0 when it has none.
    expcache_status_t table_reads(int32_t c, uint64_t* out);

private:
    struct ClassDevice {
        void* base = nullptr;  // one allocation: the arrays of DeviceClass
        DeviceClass view = {};
        uint64_t rows = 0;          // the rows its arrays cover: the bank's slot rows (view.cap: those in use)
        void* feed_host = nullptr;  // the feed's mailbox and rows (mapped pinned memory), or nullptr
    };
    struct LayerMap {
        bool resolved = false;
        expcache_status_t status = EXPCACHE_OK;
        std::string why;
        const unsigned char* src[kMaxParts] = {};
        bool aligned = false;
        bool fed = false;  // the GPU cannot read the source: a device select's misses come through the feed
    };
    expcache_status_t make_table();
    expcache_status_t make_class(int32_t c);
    // device_resize.cpp: prepare() of a class whose state exists.
    expcache_status_t refresh(int32_t c);
    // device_feed.cpp: class c's feed (its rows, mailbox and device words; the feed threads
    // watching it), made when the class is prepared if a layer of its size reads a source the
    // GPU cannot read.
    bool needs_feed(int32_t c) const;
    expcache_status_t make_feed(int32_t c);
    expcache_status_t resolve(uint32_t layer, LayerMap* out);
    // The arguments of a select of `count` ids of `layer` (class c) every call sets the same way.
    expcache_status_t args_for(uint32_t layer, int32_t c, uint32_t count, bool host_call, DeviceSelectArgs* out);
    void report(const DeviceError& error);

    const bool enabled_;
    const uint32_t policy_id_;     // EXPCACHE_POLICY_*
    const uint32_t copy_threads_;  // the feed's readers
    Backend& backend_;
    DeviceArena& arena_;
    LayerTable& layers_;
    ClassTable& classes_;
    const Log& log_;
    Health& health_;
    std::unique_ptr<LookupKernels> kernels_;

    // One allocation: the clocks, then what snapshot() reads with one copy (the error, every
    // class's counters and residents), then slot_of_key[keys] and the policy's tables.
    void* table_ = nullptr;
    uint64_t* cold_clock_dev_ = nullptr;
    DeviceError* error_dev_ = nullptr;
    DeviceCounters* counters_dev_ = nullptr;  // [classes]
    uint64_t* resident_dev_ = nullptr;        // [classes]
    uint64_t read_bytes_ = 0;                 // from error_dev_ through resident_dev_[classes)
    int32_t* slot_of_key_dev_ = nullptr;
    uint32_t keys_ = 0;
    DevicePolicyArgs policy_ = {};  // the policy's table state (kernels/lookup_policy.hpp); pos set per select
    bool selected_ = false;         // a device select was enqueued: an error may wait to be read
    std::vector<ClassDevice> classes_state_;
    std::vector<LayerMap> maps_;
    // The host-side calls' ids and results, in mapped pinned memory (made at the first call).
    struct Mapped {
        void* host = nullptr;
        void* device = nullptr;
    } mapped_;
    std::vector<unsigned char> read_buf_;  // snapshot's copy
    HostPool* pool_ = nullptr;
    std::unique_ptr<FeedThreads> feed_;  // made with the first class that needs a feed
};

}  // namespace expcache
