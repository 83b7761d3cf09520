// Duel's saturating counter (duel.cpp describes the policy): one source for the host policy and
// the device lookup (kernels/lookup_policy.hpp).
#pragma once

#include <cstdint>

#include "host_device.hpp"

namespace expcache {

constexpr int32_t kDuelLimit = 64;  // the counter runs in [-kDuelLimit, kDuelLimit - 1]: its hysteresis

// A request both shadows saw: the one that hit alone moves the counter toward its policy.
EXPCACHE_HOST_DEVICE inline void duel_vote(int32_t& psel, bool lru_hit, bool opp_hit) {
    if (opp_hit && !lru_hit && psel < kDuelLimit - 1) ++psel;
    if (lru_hit && !opp_hit && psel > -kDuelLimit) --psel;
}

// Whose victims go: OppClassLRU's while the counter is >= 0 (from the start), LRU's below.
EXPCACHE_HOST_DEVICE inline bool duel_follows_oppclass(int32_t psel) {
    return psel >= 0;
}

}  // namespace expcache
