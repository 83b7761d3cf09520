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

// One use of a key, counted: its count before and after, and its class after. Two orders that count
// the same uses of a key at the same time (duel.cpp's real order and its shadow) count it once: the
// second takes the first's result when its count before is the same, as the same double operations
// on the same inputs give the same result.
struct OppUse {
    KeyCount before, after;
    int cls;
};

class OppClassPolicy final : public Policy {
    using Count = KeyCount;  // decayed count (0: never used), time of the last use

public:
    static constexpr int kClasses = OppClassTables::kClasses;
    static constexpr double kHalfLife = OppClassTables::kHalfLife;
    static constexpr double kBase = OppClassTables::kBase;
    static constexpr int32_t kNever = OppClassTables::kNever;
    static constexpr int kDecayTokens = OppClassTables::kDecayTokens;

    OppClassPolicy();

    void resize(int32_t n) override;
    void set_clock(const PolicyClock& clock) override {
        clock_ = clock;
        now_ = oppclass_time(clock.token, clock.pos, clock.positions);
    }

    void on_insert(int32_t slot, bool cold, uint32_t key) override { insert(slot, cold, key, nullptr, nullptr); }
    void on_hit(int32_t slot) override { hit(slot, nullptr, nullptr); }
    // The same two hooks where a twin counts the same uses (OppUse): `use` receives this one's use
    // of the key, for the twin; `counted` is the twin's use of the key now, taken when it applies.
    void on_insert(int32_t slot, bool cold, uint32_t key, OppUse* use) { insert(slot, cold, key, nullptr, use); }
    void on_insert(int32_t slot, bool cold, uint32_t key, const OppUse& counted) {
        insert(slot, cold, key, &counted, nullptr);
    }
    void on_hit(int32_t slot, OppUse* use) { hit(slot, nullptr, use); }
    void on_hit(int32_t slot, const OppUse& counted) { hit(slot, &counted, nullptr); }
    // A hint refreshes recency only: counting it as a use would raise the count of every predicted
    // expert, right or wrong (measured: more demand misses, docs/engine.md).
    void on_hint(int32_t slot) override {
        lists_.unlink(slot);
        place(slot, entries_[slot].cls, clock_.token, clock_.pos, true);
    }
    // A prefetch is not a use either: class 0, the cold end, until a select uses it.
    void on_prefetch(int32_t slot, uint32_t key) override {
        if (key >= count_.size()) grow_counts(key);
        entries_[slot].key = key;
        place(slot, 0, kNever, 0, false);
    }
    void on_remove(int32_t slot) override { lists_.unlink(slot); }  // the key's count is kept
    void move(int32_t from, int32_t to) override {
        lists_.replace(from, to);
        entries_[to] = entries_[from];
    }
    int32_t victim(Evictable evictable, const void* ctx) const override;
    void clear() override;
    uint32_t key(int32_t slot) const { return entries_[slot].key; }

    // The class of a count d >= 1 (tried first at a guess, or not) and the decay of a count over dt
    // tokens (oppclass_count.hpp).
    int class_of(double d) const { return oppclass_class_of(tables_, d); }
    double decay(double dt) const { return oppclass_decay(tables_, dt); }
    int class_near(double d, int guess) const { return oppclass_class_near(tables_, d, guess); }

private:
    // Inline: a policy held by value has the branches on nullptr folded away.
    void insert(int32_t slot, bool cold, uint32_t key, const OppUse* counted, OppUse* use) {
        if (key >= count_.size()) grow_counts(key);
        Entry& e = entries_[slot];
        e.key = key;
        const int k = count(key, e.cls, counted, use);
        if (cold) {  // a prefill append: class 0, the cold end, as if never used
            place(slot, 0, kNever, 0, /*hot=*/false);
        } else {
            place(slot, k, clock_.token, clock_.pos, true);
        }
    }
    void hit(int32_t slot, const OppUse* counted, OppUse* use) {
        lists_.unlink(slot);
        const Entry& e = entries_[slot];
        place(slot, count(e.key, e.cls, counted, use), clock_.token, clock_.pos, true);
    }

    struct Entry {         // per slot
        uint32_t key;      // its expert
        int32_t tok, pos;  // the token and layer position of its last use
        int32_t cls;       // its list
    };

    // One more use of `key` now, whose class was `guess` at its last use; returns its class. The
    // count is there: a key is inserted or prefetched before its first hit.
    int count(uint32_t key, int guess, const OppUse* counted, OppUse* use) {
        Count& c = count_[key];
        if (counted && c.d == counted->before.d && c.t == counted->before.t) {
            c = counted->after;  // the same inputs at the same time: the same double operations gave this
            return counted->cls;
        }
        if (use) use->before = c;
        oppclass_count_use(tables_, c, now_);
        const int k = oppclass_class_near(tables_, c.d, guess);
        if (use) {
            use->after = c;
            use->cls = k;
        }
        return k;
    }
    void grow_counts(uint32_t key);  // room for keys 0..key (out of line: once per key at most)
    void place(int32_t slot, int k, int32_t token, int32_t pos, bool hot) {
        Entry& e = entries_[slot];
        e.tok = token;
        e.pos = pos;
        e.cls = k;
        if (hot)
            lists_.push_back(k, slot);
        else
            lists_.push_front(k, slot);
    }

    const OppClassTables& tables_;
    PolicyClock clock_;
    double now_ = 0.0;                // the clock's time: token + pos / positions
    std::vector<Count> count_;        // per key
    std::vector<Entry> entries_;      // per slot
    IntrusiveLists<kClasses> lists_;  // one list per class, cold end first
};

}  // namespace expcache
