// The device-side select (expcache_select_device_async): what its kernel reads and writes, and
// the kernel itself, one implementation per backend (the host runs the same steps in order, on
// host memory). The state it works on belongs to DeviceLookup (device_lookup.hpp), which lays
// it out; its one copy of the residency is there.
//
// One select is one grid on the stream (one block per SM; lookup_kernels_cuda.cu says why):
//   1. the table read: the ids to keys and the slots the slot map gives them;
//   2. the first block to arrive (the leader) either serves the select from that read, when
//      every id in range is resident (the hits' bookkeeping only, the policy's included: the
//      policy clock, each hit's count and refresh, duel's shadow requests and vote; no victim
//      search in the bank, nothing to copy; a class whose bank holds every expert of its
//      layers is always served so), or runs the lookup (the same hits' bookkeeping, then each
//      distinct miss given the policy's victim among the slots neither used by this call nor
//      pinned: lookup_rules.hpp, LRU, OppClassLRU or duel as the host's policy would choose;
//      the slot map updated, the misses listed); either way the counters are added and the
//      call's own counts written when asked for;
//   3. the leader publishes each miss as soon as it has its slot, then that it has listed all;
//      every block copies the listed misses' bytes from mapped pinned memory into their slots
//      as they come (the other blocks while the leader looks up the next), or ends at once when
//      nothing missed.
//
// Recency is a stamp per slot: a select takes the stamps [base, base + 2048) (select_base: from
// the select's number among its class's, so no clock is read), its hits base + i and its misses
// base + 1024 + i for i the position of
// the id's first occurrence, so the order it leaves is the host LRU list's after the same
// select (hits refreshed in order, then misses inserted in order); a slot stamped >= base is
// this call's and never its victim. A batch's append goes to the cold end: its stamps count
// down from kStampStart (the cold clock), below every select's.
//
// The host-side serving calls of a device-lookup cache run this same grid (DeviceLookup::serve):
// their ids are the call's distinct experts in order of first occurrence, in mapped pinned
// memory, and a mode says what the call may do (SelectMode). The residency has one copy, here.
#pragma once

#include <cstdint>
#include <memory>

#include "expcache.h"
#include "feed_protocol.hpp"
#include "host_device.hpp"
#include "lookup_policy.hpp"

namespace expcache {

// Counters of one class's device selects (EXPCACHE_PATH_DEVICE's fields of expcache_stats_t).
struct DeviceCounters {
    uint64_t calls, hits, misses, evictions, appends, bytes_h2d;
};

// What a select may do (DeviceSelectArgs::mode).
enum SelectMode : uint32_t {
    // A decode select (select_device, and the host's select and select_slots): hits refreshed,
    // each miss given the policy's victim, evicting.
    kModeDecode = 0,
    // A compact load: hits refreshed as a decode's are (the policy sees them), misses left alone
    // (slot -1: the host copies them from the source); nothing inserted.
    kModeLend = 1,
    // A prefill batch: hits pinned, their recency left alone; misses take free slots only, at the
    // cold end, pinned (slot -1 where none is free: the host stages them); nothing evicted.
    kModeAppend = 2,
};

// What a host-side call's select writes for it beside the slots (DeviceSelectArgs::out_counts):
// its hits, its evictions, and the token of the policy clock it ran at (0 under LRU).
constexpr int kTallyHits = 2;
constexpr int kTallyEvictions = 3;
constexpr int kTallyToken = 4;
constexpr int kTallyWords = 5;

// The first id out of range since the host last looked (set != 0).
struct DeviceError {
    uint32_t set;
    uint32_t layer;
    uint32_t index;  // its position in the call's ids
    uint32_t pad;
    int64_t id;
};

// One miss of the latest select of a class: expert `expert` of the select's layer goes to `slot`.
struct DeviceMiss {
    uint32_t expert;
    int32_t slot;
};

// How the blocks of one select's grid hand the lookup's result to each other (zero when the
// class's state is made; never written by the host after that).
struct DeviceHandoff {
    uint64_t ticket;       // blocks arrived, over every select of the class: a select's first is its leader
    uint64_t published;    // the latest select's (number + 1) << kPublishShift | kPublishFinal | misses listed
    uint64_t table_reads;  // device selects served by the table read (expcache_testing_table_reads)
    uint64_t selects;      // the host backend's selects of the class (the CUDA grid numbers them by ticket)
};

// A class's state on the device, laid out by DeviceLookup.
struct DeviceClass {
    int32_t* key_of_slot;      // [cap] the key the slot holds, -1 free
    uint64_t* stamp;           // [cap] its stamp: the order of its last use (LRU; OppClassLRU's within a list)
    uint8_t* pin;              // [cap] 1: a batch holds it, never evicted
    DeviceCounters* counters;  // EXPCACHE_PATH_DEVICE's (a host-side call counts on the host)
    uint64_t* resident;        // slots holding an expert
    DeviceMiss* misses;        // [EXPCACHE_MAX_SELECT] the latest select's misses, for the copy
    uint32_t* miss_count;
    DeviceHandoff* handoff;
    uint32_t cap;  // < 2^31
    unsigned char* bank;
    uint64_t part_at[EXPCACHE_MAX_PARTS];  // part p of slot s at bank + part_at[p] + s * part_stride[p]
    uint64_t part_stride[EXPCACHE_MAX_PARTS];
    DevicePolicyClass policy;
    DeviceFeed feed;  // the rows misses of a source the GPU cannot read come through (box nullptr: none)
};

// Every argument of one select. Pointers are device addresses (host addresses on the host backend).
struct DeviceSelectArgs {
    const void* ids;
    uint32_t id_bits;  // 32 or 64
    uint32_t count;    // n * k, 1..EXPCACHE_MAX_SELECT
    int32_t* out_slots;
    // nullptr, or [kCountDistinct] and [kCountMisses] of this call; a host-side call's (host_call)
    // also [kTallyHits], [kTallyEvictions] and [kTallyToken], and the call's counters are not added
    // on the device.
    uint32_t* out_counts;
    uint32_t mode;        // SelectMode
    uint32_t host_call;   // 1: a host-side serving call (DeviceLookup::serve)
    uint8_t* out_filled;  // a host-side call's, or nullptr: per id, 1 when this select filled its slot
    uint32_t
        copy;  // 0: the select fills slots without copying (a host-side call's copy of a source the GPU cannot read)
    uint32_t fed;         // 1 (with copy): the misses come through the class's feed (feed_protocol.hpp), not src
    uint32_t open_clock;  // 0: a later piece of one host-side call, whose first opened the policy clock
    uint32_t layer;
    uint32_t key_base;
    uint32_t num_experts;
    uint32_t aligned;  // 1: every source part address and size is a multiple of 16
    const unsigned char*
        src[EXPCACHE_MAX_PARTS];  // the layer's parts, as the GPU reads them (mapped pinned memory; fed: none)
    uint64_t src_stride[EXPCACHE_MAX_PARTS];
    uint64_t part_bytes[EXPCACHE_MAX_PARTS];  // 0 past the layer's parts
    DeviceClass cls;
    EXPCACHE_HOST_DEVICE uint64_t expert_bytes() const {
        uint64_t n = 0;
        for (int p = 0; p < EXPCACHE_MAX_PARTS; ++p) n += part_bytes[p];
        return n;
    }
    uint64_t* cold_clock;  // the cold end's, counting down: each append takes one
    int32_t* slot_of_key;  // [keys] the slot holding each key, -1 none
    DeviceError* error;
    DevicePolicyArgs policy;
};

class LookupKernels {
public:
    virtual ~LookupKernels() = default;
    // Enqueue one select (the table read or the lookup, then the copy) on `stream`.
    virtual expcache_status_t select(const DeviceSelectArgs& args, void* stream) = 0;
    // The address at which the device reads pinned host memory `host`, or UNSUPPORTED with the
    // reason (pageable memory, a driver without mapped memory).
    virtual expcache_status_t mapped(const void* host, const unsigned char** out) = 0;
    // Whether `stream` is being captured into a graph (nothing may allocate or synchronize).
    virtual bool capturing(void* stream) = 0;
    // Pinned host memory the device reads and writes at *out_device (host: the same address):
    // the host-side calls' ids and results. free_mapped(nullptr) does nothing.
    virtual expcache_status_t alloc_mapped(uint64_t bytes, void** out_host, void** out_device) = 0;
    virtual void free_mapped(void* host) = 0;
    // pin[slots[i]] = 0 for i < n (slots in mapped memory), enqueued on `stream`: a batch ends.
    virtual expcache_status_t unpin(uint8_t* pin, const int32_t* slots, uint32_t n, void* stream) = 0;
    // Class `c` forgets every expert it holds (clear_class), enqueued on `stream`: a release.
    virtual expcache_status_t clear(const DeviceClass& c, int32_t* slot_of_key, void* stream) = 0;
};

std::unique_ptr<LookupKernels> make_host_lookup_kernels();
// The CUDA build's, for `device` (the stub build: never called, the CUDA backend is refused first).
std::unique_ptr<LookupKernels> make_cuda_lookup_kernels(int device);

constexpr uint64_t kStampsPerSelect = 2 * EXPCACHE_MAX_SELECT;
// Where stamps start: selects' above, appends' below (the cold clock counts down from here: 2^40
// appends before they meet stamp 0, a free slot's).
constexpr uint64_t kStampStart = uint64_t(1) << 40;

// The first stamp of select `index` (0, 1, ... over its class's life: stamps order the slots of one
// class only, and a class's selects are ordered on their streams).
EXPCACHE_HOST_DEVICE inline uint64_t select_base(uint64_t index) {
    return kStampStart + index * kStampsPerSelect + 1;
}

// DeviceHandoff::published: the misses a select's lookup has listed so far (at most
// EXPCACHE_MAX_SELECT) in the low bits, and kPublishFinal once it has listed them all.
constexpr int kPublishShift = 12;
constexpr uint64_t kPublishFinal = uint64_t(1) << 11;
constexpr uint64_t kPublishCount = kPublishFinal - 1;
static_assert(EXPCACHE_MAX_SELECT <= kPublishCount, "a select's misses fit below kPublishFinal");

// DeviceSelectArgs::out_counts: the distinct experts among the call's ids in range (its union
// of rows), and how many of them missed (were given a slot and copied).
constexpr int kCountDistinct = 0;
constexpr int kCountMisses = 1;

}  // namespace expcache
