// OppClassLRU: ClassLRU (a decayed use count per expert, one LRU list per
// class of that count) with the age of an entry counted in the missed
// opportunities of its layer: how many times its layer ran without picking
// it. Layers run in a fixed order once per token, so a count of calls mixes
// up experts of layers ahead of and behind the current one. Tuned on two of
// the bundled traces and evaluated on the other five: docs/policy.md. The
// arithmetic mirrors expcache_bench/sim/oppclass.py (same double operations), so the
// offline simulator and the library agree count for count.
// Declared here, with its per-request hooks inline, so that duel.cpp holds it
// by value and calls it without virtual dispatch; oppclass.cpp has the rest.
#pragma once

#include <cmath>
#include <vector>

#include "intrusive_lists.hpp"
#include "policy.hpp"

namespace expcache {

class OppClassPolicy final : public Policy {
public:
    static constexpr int kClasses = 16;            // counts >= 1.3^15 share the last class
    static constexpr double kHalfLife = 64.0;      // tokens
    static constexpr double kBase = 1.3;           // class k holds counts in [1.3^k, 1.3^(k+1))
    static constexpr double kWeight = 1.6;         // one class is worth a factor 1.6 of age
    static constexpr double kOffset = 1.0;         // added to the age
    static constexpr int32_t kNever = -(1 << 30);  // last-use token of a cold (prefill) insert

    OppClassPolicy();

    void resize(int32_t n) override;
    void set_clock(const PolicyClock& clock) override { clock_ = clock; }

    void on_insert(int32_t slot, bool cold, uint32_t key) override {
        key_[slot] = key;
        int k = use(key);
        if (cold) {  // a prefill append: class 0, the cold end, as if never used
            place(slot, 0, kNever, 0, /*hot=*/false);
        } else {
            place(slot, k, clock_.token, clock_.pos, true);
        }
    }
    void on_hit(int32_t slot) override {
        lists_.unlink(slot);
        place(slot, use(key_[slot]), clock_.token, clock_.pos, true);
    }
    // A hint refreshes recency only: counting it as a use would raise the count of every predicted
    // expert, right or wrong (measured: more demand misses, docs/engine.md).
    void on_hint(int32_t slot) override {
        lists_.unlink(slot);
        place(slot, cls_[slot], clock_.token, clock_.pos, true);
    }
    // A prefetch is not a use either: class 0, the cold end, until a select uses it.
    void on_prefetch(int32_t slot, uint32_t key) override {
        key_[slot] = key;
        place(slot, 0, kNever, 0, false);
    }
    void on_remove(int32_t slot) override { lists_.unlink(slot); }  // the key's count is kept
    int32_t victim(Evictable evictable, const void* ctx) const override;
    void clear() override;

private:
    // One more use of `key` now; returns its class.
    int use(uint32_t key) {
        if (key >= count_.size()) {
            count_.resize(key + 1, 0.0);
            time_.resize(key + 1, 0.0);
        }
        double t = double(clock_.token) + double(clock_.pos) / double(clock_.positions);
        double d = count_[key] == 0.0 ? 1.0 : count_[key] * std::pow(2.0, -(t - time_[key]) / kHalfLife) + 1.0;
        count_[key] = d;
        time_[key] = t;
        int k = static_cast<int>(std::log(d) / log_base_ + 1e-9);
        return k < kClasses - 1 ? k : kClasses - 1;
    }
    void place(int32_t slot, int k, int32_t token, int32_t pos, bool hot) {
        tok_[slot] = token;
        pos_[slot] = pos;
        cls_[slot] = k;
        if (hot)
            lists_.push_back(k, slot);
        else
            lists_.push_front(k, slot);
    }

    double log_base_;
    double scale_[kClasses];
    PolicyClock clock_;
    std::vector<double> count_, time_;  // per key: decayed count, time of last use
    std::vector<uint32_t> key_;         // per slot
    std::vector<int32_t> tok_, pos_;    // per slot: token and layer position of last use
    std::vector<int> cls_;              // per slot: its list
    IntrusiveLists lists_{kClasses};    // one list per class, cold end first
};

}  // namespace expcache
