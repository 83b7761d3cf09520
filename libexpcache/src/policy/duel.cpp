// Duel, the default: LRU and OppClassLRU both order the class's slots, and a saturating counter fed
// by two shadow caches (keys only, one per policy, as large as the most slots held at once) picks
// whose victim goes: set dueling, as CPU caches choose between replacement policies. OppClassLRU
// wins on the DeepSeek traces; LRU where popularity shifts (a new prompt, a new topic), where a
// decayed count keeps yesterday's experts. Measured in docs/policy.md. The decisions mirror
// expcache_bench/sim/duel.py, so the simulator and the library agree count for count.
// The four orders are held by value (final classes): a hit calls them without virtual dispatch. The
// shadows' slots are the keys, and OppClassLRU's count of a request is computed once, by its shadow.
#include <algorithm>
#include <memory>
#include <vector>

#include "duel_vote.hpp"
#include "lru.hpp"
#include "oppclass.hpp"
#include "policy.hpp"

namespace expcache {

namespace {

bool any_slot(const void*, int32_t) {
    return true;
}

// A cache of keys only, ordered by a policy P whose slots are the keys themselves (keys are dense,
// so a request finds its key without a map); it evicts when it holds `room` keys.
template <class P>
class Shadow {
public:
    void set_clock(const PolicyClock& clock) { policy_.set_clock(clock); }
    // Room for keys 0..key.
    void see(uint32_t key) {
        if (key >= held_.size()) grow(key);
    }
    // One request of `key`, seen: true for a hit. `use`: what P's hooks take besides (OppClassLRU's:
    // where its use of the key goes).
    template <class... Use>
    bool request(uint32_t key, int32_t room, Use... use) {
        const int32_t s = static_cast<int32_t>(key);
        if (held_[key]) {
            policy_.on_hit(s, use...);
            return true;
        }
        if (held_count_ < room) {
            ++held_count_;
        } else {
            const int32_t v = policy_.victim(any_slot, nullptr);
            policy_.on_remove(v);
            held_[v] = 0;
        }
        held_[key] = 1;
        policy_.on_insert(s, false, key, use...);
        return false;
    }

private:
    void grow(uint32_t key) {
        const size_t n = std::max<size_t>(key + 1, 2 * held_.size());
        held_.resize(n, 0);
        policy_.resize(static_cast<int32_t>(n));
    }

    P policy_;
    std::vector<uint8_t> held_;  // per key: held here
    int32_t held_count_ = 0;
};

class DuelPolicy final : public Policy {
public:
    void resize(int32_t n) override {
        lru_.resize(n);
        opp_.resize(n);
    }
    void set_clock(const PolicyClock& clock) override {
        lru_.set_clock(clock);
        opp_.set_clock(clock);
        shadow_lru_.set_clock(clock);
        shadow_opp_.set_clock(clock);
    }
    void on_insert(int32_t slot, bool cold, uint32_t key) override {
        grew(key);
        lru_.on_insert(slot, cold, key);
        if (cold)  // a prefill append: no request, OppClassLRU's count in the real order alone
            opp_.on_insert(slot, true, key);
        else
            opp_.on_insert(slot, false, key, request(key));
    }
    void on_hit(int32_t slot) override {
        const OppUse use = request(opp_.key(slot));
        lru_.on_hit(slot);
        opp_.on_hit(slot, use);
    }
    void on_hint(int32_t slot) override {
        lru_.on_hint(slot);
        opp_.on_hint(slot);
    }
    void on_prefetch(int32_t slot, uint32_t key) override {
        grew(key);
        lru_.on_prefetch(slot, key);
        opp_.on_prefetch(slot, key);
    }
    void on_remove(int32_t slot) override {
        --resident_;
        lru_.on_remove(slot);
        opp_.on_remove(slot);
    }
    // The shadows hold keys, not slots: a move leaves them and the counter as they are.
    void move(int32_t from, int32_t to) override {
        lru_.move(from, to);
        opp_.move(from, to);
    }
    int32_t victim(Evictable evictable, const void* ctx) const override {
        return duel_follows_oppclass(psel_) ? opp_.victim(evictable, ctx) : lru_.victim(evictable, ctx);
    }
    // The slots are forgotten; the shadows and the counter keep what they learned.
    void clear() override {
        lru_.clear();
        opp_.clear();
        resident_ = 0;
    }

private:
    // A slot more holds `key`: the shadows make room for the key here, as every key a request
    // names was inserted or prefetched first.
    void grew(uint32_t key) {
        if (++resident_ > room_) room_ = resident_;
        shadow_lru_.see(key);
        shadow_opp_.see(key);
    }
    // A request both shadows see; the one that hits alone moves the counter toward its policy.
    // Returns the OppClassLRU shadow's use of the key, which the real order takes when its count of
    // the key is the shadow's (a prefill append counts in the real order alone).
    OppUse request(uint32_t key) {
        OppUse use;
        const bool lru_hit = shadow_lru_.request(key, room_);
        const bool opp_hit = shadow_opp_.request(key, room_, &use);
        duel_vote(psel_, lru_hit, opp_hit);
        return use;
    }

    LruPolicy lru_;  // both order the real slots
    OppClassPolicy opp_;
    Shadow<LruPolicy> shadow_lru_;
    Shadow<OppClassPolicy> shadow_opp_;
    int32_t resident_ = 0, room_ = 0;  // slots held now, most held at once (the shadows' size)
    int32_t psel_ = 0;                 // duel_vote.hpp
};

}  // namespace

std::unique_ptr<Policy> make_duel_policy() {
    return std::unique_ptr<Policy>(new DuelPolicy());
}

}  // namespace expcache
