// The eviction policy's state on the device, beside the slots' keys and stamps (lookup_kernels.hpp):
// what OppClassLRU and duel (policy/oppclass.hpp, policy/duel.cpp) keep on the host, laid out as
// arrays the lookup kernel reads and writes. DeviceLookup (device_lookup.cpp) allocates and
// initializes it; the rules that use it are lookup_rules.hpp.
//
// The host keeps a list per class of count (OppClassLRU) and one list (LRU); the device keeps per
// slot its stamp (lookup_kernels.hpp: the select's hits and misses, in the order the host's
// lists take them) and its class, token and layer position of last use. A select's hits and
// demand inserts all go to their list's hot end in stamp order, so OppClassLRU's list k in the
// host's order is list k's slots by stamp, and its victim (the best score among the lists'
// first evictable entries, ties to the lower list) is the least of (score descending, list,
// stamp) over every evictable slot: within a list the score never grows from the cold end on
// (the entries' last uses are in time order), so the first entry of the winning list has it.
#pragma once

#include <cstdint>

#include "policy/oppclass_count.hpp"

namespace expcache {

// The policy clock of device selects (CallClock::open_serving's rule): a select whose layer is not
// after the previous select's starts a token.
struct DevicePolicyClock {
    int64_t last_layer;  // -1 before the first select
    int32_t token;
    int32_t pad;
};

// Per slot (of a class's bank, or of a shadow): OppClassLRU's list and last use.
struct DeviceOppSlots {
    uint8_t* cls;  // the list: the key's class of count at its last use
    int32_t* tok;  // the token and layer position of its last use
    int32_t* pos;
};

constexpr int kShadowLru = 0;
constexpr int kShadowOpp = 1;

// duel's scalars of one class (DuelPolicy's).
struct DeviceDuel {
    int32_t psel;      // policy/duel_vote.hpp
    int32_t resident;  // slots held now
    int32_t room;      // the most held at once: each shadow's size
    int32_t held[2];   // keys each shadow holds (its slots [0, held) are used)
};

// One of duel's shadows: keys only, a slot per row of the bank's slots (room never exceeds the
// largest cap the bank had, nor its rows), ordered by LRU (kShadowLru: stamps) or OppClassLRU
// (kShadowOpp: stamps and opp).
struct DeviceShadow {
    int32_t* key;  // -1: never used
    uint64_t* stamp;
    DeviceOppSlots opp;
};

// A class's policy state (DeviceClass::policy); unused parts null (LRU: all of it).
struct DevicePolicyClass {
    DeviceOppSlots opp;  // the bank's slots (oppclass, duel)
    DeviceDuel* duel;
    DeviceShadow shadow[2];
};

// What a select's policy reads beside its class (DeviceSelectArgs::policy).
struct DevicePolicyArgs {
    uint32_t id;        // EXPCACHE_POLICY_*
    int32_t pos;        // the layer's rank among the registered layers
    int32_t positions;  // their number
    DevicePolicyClock* clock;
    KeyCount* counts;         // [keys] OppClassLRU's count of each key (oppclass, duel)
    KeyCount* shadow_counts;  // [keys] duel: its OppClassLRU shadow's own count (requests only)
    int32_t* shadow_slot[2];  // [keys] duel: each key's slot in each shadow, -1 none
    const OppClassTables* tables;
};

}  // namespace expcache
