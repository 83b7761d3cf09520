// The device-side lookup of a cache made with lookup = EXPCACHE_LOOKUP_DEVICE: the residency
// state the select kernels read and write on the device (which slot of each class's bank holds
// which expert, the slots' recency, the batches' pins, the counters, the policy's state:
// kernels/lookup_policy.hpp), and the host's mirror of it in the class table. Device selects
// change only the device's copy; every host-side call reads it back first (pull: the class
// table, the layers' slot maps and, under LRU, the LRU order made equal to it) and writes the
// result back at its end (push), so both kinds of call see one cache in any order. OppClassLRU's
// and duel's state (counts, lists, shadows, counter) lives on the device alone: their caches
// refuse the host-side serving calls, which would need it on the host (admit_host_serving).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "backend/backend.hpp"
#include "class_table.hpp"
#include "device_arena.hpp"
#include "kernels/lookup_kernels.hpp"
#include "layers.hpp"
#include "log.hpp"

namespace expcache {

class DeviceLookup {
public:
    DeviceLookup(const expcache_config_t& config, Backend& backend, DeviceArena& arena, LayerTable& layers,
                 ClassTable& classes, const Log& log, Health& health, std::unique_ptr<LookupKernels> kernels);

    bool enabled() const { return enabled_; }
    // Whether the device state exists: the layout is then fixed (its size depends on it).
    bool frozen() const { return table_ != nullptr; }
    // Whether class c's device state exists (made by push() once the class is bound).
    bool ready(int32_t c) const {
        return enabled_ && static_cast<size_t>(c) < classes_state_.size() && classes_state_[c].base != nullptr;
    }
    bool capturing(void* stream) { return kernels_->capturing(stream); }
    // A host-side serving call on `path` (select, select_split, compact_load, batch_prepare):
    // UNSUPPORTED, with the reason and the fix, when the policy's state lives on the device alone.
    expcache_status_t admit_host_serving(uint32_t path) const;

    // Device to mirror; the device synchronized first. A select's id out of range since the
    // last pull is logged here (a warning), once; the calling call goes on.
    expcache_status_t pull();
    // At destroy: an out-of-range id no call has read back yet is logged.
    void report_pending();
    // Mirror to device, the device synchronized first (the calling call's copies have landed);
    // makes the state of classes bound since.
    expcache_status_t push();
    // Enqueue one device select of `count` ids of `layer` (bound to class c, whose state is
    // ready) on `stream`; out_counts (nullptr: not wanted) gets the distinct experts and misses.
    expcache_status_t select(uint32_t layer, int32_t c, const void* ids, uint32_t id_bits, uint32_t count,
                             int32_t* out_slots, uint32_t* out_counts, void* stream);
    // The device selects of class c served by their table read (every id in range resident:
    // no victim search, nothing copied) since its state was made, the device synchronized
    // first; 0 when it has none.
    expcache_status_t table_reads(int32_t c, uint64_t* out);

private:
    struct ClassDevice {
        void* base = nullptr;  // one allocation: the arrays of DeviceClass
        DeviceClass view = {};
    };
    struct LayerMap {
        bool resolved = false;
        expcache_status_t status = EXPCACHE_OK;
        std::string why;
        const unsigned char* src[kParts] = {};
        bool aligned = false;
    };
    expcache_status_t make_table();
    expcache_status_t make_class(int32_t c);
    expcache_status_t resolve(uint32_t layer, LayerMap* out);
    void report(const DeviceError& error);

    const bool enabled_;
    const uint32_t
        policy_id_;  // EXPCACHE_POLICY_*: LRU's order is mirrored on the host, the others' live on the device
    Backend& backend_;
    DeviceArena& arena_;
    LayerTable& layers_;
    ClassTable& classes_;
    const Log& log_;
    Health& health_;
    std::unique_ptr<LookupKernels> kernels_;

    void* table_ = nullptr;  // the stamp clock, the error, slot_of_key[keys]
    uint64_t* clock_dev_ = nullptr;
    DeviceError* error_dev_ = nullptr;
    int32_t* slot_of_key_dev_ = nullptr;
    uint32_t keys_ = 0;
    std::vector<uint32_t> key_layer_;  // per key, its layer
    uint64_t clock_ = 0;               // the stamp clock (kernels/lookup_kernels.hpp): the device's when pulled
    DevicePolicyArgs policy_ = {};     // the policy's table state (kernels/lookup_policy.hpp); pos set per select
    bool selected_ = false;            // a device select was enqueued once: graphs may replay it, so pull always
    std::vector<ClassDevice> classes_state_;
    std::vector<LayerMap> maps_;
};

}  // namespace expcache
