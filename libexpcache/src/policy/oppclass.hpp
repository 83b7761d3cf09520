// OppClassLRU: ClassLRU (a decayed use count per expert, one LRU list per
// class of that count) with the age of an entry counted in the missed
// opportunities of its layer: how many times its layer ran without picking
// it. Layers run in a fixed order once per token, so a count of calls mixes
// up experts of layers ahead of and behind the current one. Tuned on two of
// the bundled traces and evaluated on the other five: docs/policy.md. The
// arithmetic mirrors expcache_bench/sim/oppclass.py (same double operations; the class found by
// comparisons and the decay over whole tokens read from a table, both giving the simulator's values:
// oppclass_count.hpp, which the device lookup shares), so the offline simulator and the library
// agree count for count.
// Declared here, with its per-request hooks inline, so that duel.cpp holds it
// by value and calls it without virtual dispatch; oppclass.cpp has the rest.
#pragma once

#include <vector>

#include "intrusive_lists.hpp"
#include "oppclass_count.hpp"
#include "policy.hpp"

namespace expcache {

class OppClassPolicy final : public Policy {
    using Count = KeyCount;  // decayed count (0: never used), time of the last use

public:
    // The last use counted, by its key and inputs (the key's count before, the time now) and its
    // result: two policies that count the same uses of a key (duel.cpp's real order and its shadow)
    // share one, and the second of them takes the result without computing it again. The inputs
    // decide the result; the key is there so that it does only that: another key of the same
    // history computes its own (in select_overhead.c's all-hit loop every expert of a layer has the
    // same history, and the six uses of a select would otherwise be computed once).
    struct UseMemo {
        uint32_t key = 0;
        Count before{-1.0, 0.0};  // no count matches: counts are >= 0
        double t = 0.0;
        Count after{0.0, 0.0};
        int k = 0;
    };

    static constexpr int kClasses = OppClassTables::kClasses;
    static constexpr double kHalfLife = OppClassTables::kHalfLife;
    static constexpr double kBase = OppClassTables::kBase;
    static constexpr int32_t kNever = OppClassTables::kNever;
    static constexpr int kDecayTokens = OppClassTables::kDecayTokens;

    explicit OppClassPolicy(UseMemo* memo = nullptr);

    void resize(int32_t n) override;
    void set_clock(const PolicyClock& clock) override {
        clock_ = clock;
        now_ = oppclass_time(clock.token, clock.pos, clock.positions);
    }

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
    void move(int32_t from, int32_t to) override {
        lists_.replace(from, to);
        key_[to] = key_[from];
        tok_[to] = tok_[from];
        pos_[to] = pos_[from];
        cls_[to] = cls_[from];
    }
    int32_t victim(Evictable evictable, const void* ctx) const override;
    void clear() override;

    // The class of a count d >= 1 and the decay of a count over dt tokens (oppclass_count.hpp).
    int class_of(double d) const { return oppclass_class_of(tables_, d); }
    double decay(double dt) const { return oppclass_decay(tables_, dt); }

private:
    // One more use of `key` now; returns its class.
    int use(uint32_t key) {
        if (key >= count_.size()) count_.resize(key + 1, Count{0.0, 0.0});
        Count& c = count_[key];
        const double t = now_;
        if (!memo_) return count(c, t);
        if (key == memo_->key && c.d == memo_->before.d && c.t == memo_->before.t && t == memo_->t) {
            c = memo_->after;  // the same inputs: the same double operations gave this
            return memo_->k;
        }
        memo_->key = key;
        memo_->before = c;
        memo_->t = t;
        memo_->k = count(c, t);
        memo_->after = c;
        return memo_->k;
    }
    // Count a use of c at time t; returns the class.
    int count(Count& c, double t) const { return oppclass_use(tables_, c, t); }
    void place(int32_t slot, int k, int32_t token, int32_t pos, bool hot) {
        tok_[slot] = token;
        pos_[slot] = pos;
        cls_[slot] = k;
        if (hot)
            lists_.push_back(k, slot);
        else
            lists_.push_front(k, slot);
    }

    UseMemo* memo_;  // or nullptr
    const OppClassTables& tables_;
    PolicyClock clock_;
    double now_ = 0.0;                // the clock's time: token + pos / positions
    std::vector<Count> count_;        // per key
    std::vector<uint32_t> key_;       // per slot
    std::vector<int32_t> tok_, pos_;  // per slot: token and layer position of last use
    std::vector<int> cls_;            // per slot: its list
    IntrusiveLists lists_{kClasses};  // one list per class, cold end first
};

}  // namespace expcache
