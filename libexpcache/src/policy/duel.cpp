// Duel, the default: LRU and OppClassLRU both order the class's slots, and a saturating counter fed
// by two shadow caches (keys only, one per policy, as large as the most slots held at once) picks
// whose victim goes: set dueling, as CPU caches choose between replacement policies. OppClassLRU
// wins on the DeepSeek traces; LRU where popularity shifts (a new prompt, a new topic), where a
// decayed count keeps yesterday's experts. Measured in docs/policy.md. The decisions mirror
// expcache_bench/sim/duel.py, so the simulator and the library agree count for count.
// The four orders are held by value (final classes): a hit calls them without virtual dispatch.
#include <memory>
#include <utility>
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

// A cache of keys only, ordered by a policy P over slots of its own; it evicts when it holds `room`.
template <class P>
class Shadow {
public:
    template <class... Args>
    explicit Shadow(Args&&... args) : policy_(std::forward<Args>(args)...) {}

    void set_clock(const PolicyClock& clock) { policy_.set_clock(clock); }
    // One request of `key`: true for a hit.
    bool request(uint32_t key, int32_t room) {
        if (key >= slot_of_.size()) slot_of_.resize(key + 1, -1);
        int32_t s = slot_of_[key];
        if (s >= 0) {
            policy_.on_hit(s);
            return true;
        }
        if (static_cast<int32_t>(key_of_.size()) < room) {
            s = static_cast<int32_t>(key_of_.size());
            key_of_.push_back(key);
            policy_.resize(s + 1);
        } else {
            s = policy_.victim(any_slot, nullptr);
            policy_.on_remove(s);
            slot_of_[key_of_[s]] = -1;
            key_of_[s] = key;
        }
        slot_of_[key] = s;
        policy_.on_insert(s, false, key);
        return false;
    }

private:
    P policy_;
    std::vector<int32_t> slot_of_;  // per key: its shadow slot, or -1
    std::vector<uint32_t> key_of_;  // per shadow slot
};

class DuelPolicy final : public Policy {
public:
    DuelPolicy() : opp_(&memo_), shadow_opp_(&memo_) {}

    void resize(int32_t n) override {
        lru_.resize(n);
        opp_.resize(n);
        key_.resize(n, 0);
    }
    void set_clock(const PolicyClock& clock) override {
        lru_.set_clock(clock);
        opp_.set_clock(clock);
        shadow_lru_.set_clock(clock);
        shadow_opp_.set_clock(clock);
    }
    void on_insert(int32_t slot, bool cold, uint32_t key) override {
        grew();
        key_[slot] = key;
        if (!cold) request(key);
        lru_.on_insert(slot, cold, key);
        opp_.on_insert(slot, cold, key);
    }
    void on_hit(int32_t slot) override {
        request(key_[slot]);
        lru_.on_hit(slot);
        opp_.on_hit(slot);
    }
    void on_hint(int32_t slot) override {
        lru_.on_hint(slot);
        opp_.on_hint(slot);
    }
    void on_prefetch(int32_t slot, uint32_t key) override {
        grew();
        key_[slot] = key;
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
        key_[to] = key_[from];
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
    void grew() {
        if (++resident_ > room_) room_ = resident_;
    }
    // A request both shadows see; the one that hits alone moves the counter toward its policy.
    void request(uint32_t key) {
        const bool lru_hit = shadow_lru_.request(key, room_);
        const bool opp_hit = shadow_opp_.request(key, room_);
        duel_vote(psel_, lru_hit, opp_hit);
    }

    // OppClassLRU's counts: the shadow counts a request first, the real order takes the result when
    // its count of the key is the shadow's (a prefill append counts in the real order alone).
    OppClassPolicy::UseMemo memo_;
    LruPolicy lru_;  // both order the real slots
    OppClassPolicy opp_;
    Shadow<LruPolicy> shadow_lru_;
    Shadow<OppClassPolicy> shadow_opp_;
    std::vector<uint32_t> key_;        // per slot
    int32_t resident_ = 0, room_ = 0;  // slots held now, most held at once (the shadows' size)
    int32_t psel_ = 0;                 // duel_vote.hpp
};

}  // namespace

std::unique_ptr<Policy> make_duel_policy() {
    return std::unique_ptr<Policy>(new DuelPolicy());
}

}  // namespace expcache
