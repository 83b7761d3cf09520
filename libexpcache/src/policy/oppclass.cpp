// OppClassLRU's set-up, victim and clear (oppclass.hpp declares the policy) and its factory for
// the registry.
#include "oppclass.hpp"

#include <array>
#include <memory>

namespace expcache {

namespace {

// 2^(-k / kHalfLife) for k = 0 .. kDecayTokens - 1, by the expression decay() evaluates otherwise.
const double* decay_table() {
    static const std::array<double, OppClassPolicy::kDecayTokens> table = [] {
        std::array<double, OppClassPolicy::kDecayTokens> t{};
        for (int k = 0; k < OppClassPolicy::kDecayTokens; ++k) {
            const double dt = k;
            t[k] = std::pow(2.0, -dt / OppClassPolicy::kHalfLife);
        }
        return t;
    }();
    return table.data();
}

}  // namespace

OppClassPolicy::OppClassPolicy(UseMemo* memo) : memo_(memo), log_base_(std::log(kBase)), decay_(decay_table()) {
    for (int k = 0; k < kClasses; ++k) scale_[k] = std::pow(kWeight, k);
    below_[0] = above_[0] = 0.0;
    for (int j = 1; j < kClasses; ++j) {
        double at = std::exp((j - 1e-9) * log_base_);  // log(at) / log_base_ + 1e-9 == j
        below_[j] = at * (1.0 - 1e-9);
        above_[j] = at * (1.0 + 1e-9);
    }
}

void OppClassPolicy::resize(int32_t n) {
    lists_.resize(n);
    key_.resize(n, 0);
    tok_.resize(n, 0);
    pos_.resize(n, 0);
    cls_.resize(n, 0);
}

// The largest (missed opportunities + offset) / weight^class among the first
// evictable entry of each list: within a list, last-use order makes that entry
// the list's largest score, so this is the best evictable entry overall.
int32_t OppClassPolicy::victim(Evictable evictable, const void* ctx) const {
    int32_t best = -1;
    double best_score = -1.0;
    for (int k = 0; k < kClasses; ++k) {
        for (int32_t s = lists_.first(k); s >= 0; s = lists_.next(s)) {
            if (!evictable(ctx, s)) continue;
            int32_t missed = clock_.token - tok_[s] - 1 + (pos_[s] <= clock_.pos ? 1 : 0);
            double score = (missed + kOffset) / scale_[k];
            if (score > best_score) {
                best = s;
                best_score = score;
            }
            break;
        }
    }
    return best;
}

void OppClassPolicy::clear() {
    lists_.clear();
    key_.clear();
    tok_.clear();
    pos_.clear();
    cls_.clear();
    // Counts survive: an expert's history outlives its eviction and a release.
}

std::unique_ptr<Policy> make_oppclass_policy() {
    return std::unique_ptr<Policy>(new OppClassPolicy());
}

}  // namespace expcache
