// Seeding: experts put into the cache ahead of their use (an engine's hot list), in the order of
// their priorities, counted on the control path so the decode counters stay the decode's.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "cache.hpp"
#include "errors.hpp"

namespace expcache {

expcache_status_t Cache::insert(uint32_t layer_index, const uint32_t* ids, const float* priorities, uint32_t n,
                                void* stream) {
    expcache_status_t s = EXPCACHE_OK;
    {
        CallScope scope(*this);
        s = validate_request(layer_index, ids, n, kMaxInsert, "n");
    }
    if (s != EXPCACHE_OK) return s;
    // Each id once, at its highest priority; then lowest first, ties in the given order.
    std::vector<float> best(n);
    std::vector<uint32_t> order;
    order.reserve(n);
    for (uint32_t i = 0; i < n; ++i) {
        const float p = priorities ? priorities[i] : static_cast<float>(i);
        if (std::isnan(p))
            return fail(EXPCACHE_ERR_INVALID_ARGUMENT, "priorities[%u] is NaN (expert %u of layer %u)", i, ids[i],
                        layer_index);
        best[i] = p;
    }
    std::vector<uint32_t> first_at(n);
    {
        std::vector<uint32_t> idx(n);
        std::iota(idx.begin(), idx.end(), 0u);
        std::stable_sort(idx.begin(), idx.end(), [&](uint32_t a, uint32_t b) { return ids[a] < ids[b]; });
        for (uint32_t j = 0; j < n;) {  // one entry per id: its highest priority, at its first index
            uint32_t k = j, keep = idx[j];
            for (; k < n && ids[idx[k]] == ids[idx[j]]; ++k) best[keep] = std::max(best[keep], best[idx[k]]);
            order.push_back(keep);
            j = k;
        }
    }
    std::stable_sort(order.begin(), order.end(),
                     [&](uint32_t a, uint32_t b) { return best[a] < best[b] || (best[a] == best[b] && a < b); });
    // One expert per call: each takes the policy's victim if the class is full, so the highest
    // priorities are what stays (a call of several would stage what its class cannot hold at once).
    for (uint32_t i : order) {
        ServeCall call(*this, EXPCACHE_PATH_CONTROL, layer_index, stream);
        if ((s = open_call(call, ids + i, 1, 1, "n")) != EXPCACHE_OK || (s = serve_decode(call, 1)) != EXPCACHE_OK)
            return s;
    }
    log_(EXPCACHE_LOG_DEBUG, "insert layer %u: %u ids, %zu experts", layer_index, n, order.size());
    return EXPCACHE_OK;
}

}  // namespace expcache
