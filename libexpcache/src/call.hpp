// What one call carries: the clock of calls (ids that date slots, the policy's token and
// position), the per-call lists (kept between calls so the hot path allocates nothing), and a
// serving call's context, opened by Cache::open_call.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "expcache.h"
#include "layers.hpp"
#include "policy/policy.hpp"

namespace expcache {

struct ClassState;

struct CallClock {
    uint64_t call = 0;           // the newest call's id (every call that lists ids takes one)
    uint64_t cur = 0, prev = 0;  // the current and the previous serving call
    PolicyClock policy;          // the token (a call whose layer is not after the last one's starts one)
    int64_t last_layer = -1;

    // A serving call of `layer` (registered in `layers`).
    void open_serving(uint32_t layer, const LayerTable& layers) {
        ++call;
        prev = cur;
        cur = call;
        if (last_layer < 0 || static_cast<int64_t>(layer) <= last_layer) ++policy.token;
        last_layer = layer;
        policy = layers.clock_at(layer, policy.token);
    }
};

struct CallScratch {
    std::vector<uint32_t> unique;                       // the call's distinct ids, in first-appearance order
    std::vector<expcache_expert_ptrs_t> ptrs;           // per unique id: where it is served from
    std::vector<uint32_t> pending;                      // indices into unique: misses (then those left to staging)
    std::vector<uint8_t> resident;                      // select_split: per unique id, resident when the call began
    std::vector<int32_t> slots;                         // a device-lookup cache: per unique id, its slot (-1 none)
    std::vector<uint8_t> filled;                        // ... and 1 where the call's select filled that slot
    std::vector<std::pair<int32_t, int32_t>> inserted;  // (class, slot) filled by the call

    // Lists ids[0..n)'s distinct experts; layer.seen marks them with call id `call`.
    void dedupe(LayerState& layer, const uint32_t* ids, uint64_t n, uint64_t call) {
        unique.clear();
        for (uint64_t i = 0; i < n; ++i) {
            uint32_t e = ids[i];
            if (layer.seen[e] != call) {
                layer.seen[e] = call;
                layer.seen_pos[e] = static_cast<uint32_t>(unique.size());
                unique.push_back(e);
            }
        }
        ptrs.resize(unique.size());
    }
};

}  // namespace expcache
