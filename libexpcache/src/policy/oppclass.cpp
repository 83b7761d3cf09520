// OppClassLRU's set-up, victim and clear (oppclass.hpp declares the policy), the tables of its
// arithmetic (oppclass_count.hpp) and its factory for the registry.
#include "oppclass.hpp"

#include <cmath>
#include <memory>

namespace expcache {

const OppClassTables& oppclass_tables() {
    static const OppClassTables tables = [] {
        using T = OppClassTables;
        T t{};
        t.log_base = std::log(T::kBase);
        for (int k = 0; k < T::kClasses; ++k) t.scale[k] = std::pow(T::kWeight, k);
        t.below[0] = t.above[0] = 0.0;
        for (int j = 1; j < T::kClasses; ++j) {
            double at = std::exp((j - 1e-9) * t.log_base);  // log(at) / log_base + 1e-9 == j
            t.below[j] = at * (1.0 - 1e-9);
            t.above[j] = at * (1.0 + 1e-9);
        }
        // 2^(-k / kHalfLife) by the expression decay() evaluates otherwise.
        for (int k = 0; k < T::kDecayTokens; ++k) {
            const double dt = k;
            t.decay[k] = std::pow(2.0, -dt / T::kHalfLife);
        }
        return t;
    }();
    return tables;
}

OppClassPolicy::OppClassPolicy() : tables_(oppclass_tables()) {}

void OppClassPolicy::resize(int32_t n) {
    lists_.resize(n);
    entries_.resize(n, Entry{0, 0, 0, 0});
}

void OppClassPolicy::grow_counts(uint32_t key) {
    count_.resize(static_cast<size_t>(key) + 1, Count{0.0, 0.0});
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
            const Entry& e = entries_[s];
            const double score = oppclass_score(tables_, oppclass_missed(clock_.token, clock_.pos, e.tok, e.pos), k);
            if (score > best_score) {
                best = s;
                best_score = score;
            }
            break;
        }
    }
    return best;
}

// The slots are forgotten (their room kept); counts survive: an expert's history outlives its
// eviction and a release.
void OppClassPolicy::clear() {
    lists_.clear();
}

std::unique_ptr<Policy> make_oppclass_policy() {
    return std::unique_ptr<Policy>(new OppClassPolicy());
}

}  // namespace expcache
