// Least recently used: an intrusive doubly linked list over slot indices,
// O(1) per hit, insert and remove; the victim is the first evictable slot
// from the cold end.
#include <vector>

#include "policy.hpp"

namespace expcache {

namespace {

class LruPolicy final : public Policy {
public:
    LruPolicy() { clear(); }

    void resize(int32_t n) override {
        prev_.resize(static_cast<size_t>(n) + 1, kNone);
        next_.resize(static_cast<size_t>(n) + 1, kNone);
    }
    void on_insert(int32_t slot, bool cold, uint32_t) override {
        if (cold) link_after(head(), slot);   // next to the cold end
        else link_after(prev_[head()], slot); // at the hot end
    }
    void on_hit(int32_t slot) override {
        unlink(slot);
        link_after(prev_[head()], slot);
    }
    void on_remove(int32_t slot) override { unlink(slot); }
    int32_t victim(Evictable evictable, const void* ctx) const override {
        for (int32_t n = next_[head()]; n != head(); n = next_[n])
            if (evictable(ctx, n - 1)) return n - 1;
        return -1;
    }
    void clear() override {
        prev_.assign(1, 0);
        next_.assign(1, 0);
    }

private:
    // Node 0 is the sentinel; slot s is node s + 1. The list runs from the
    // cold end (next_[0]) to the hot end (prev_[0]).
    static constexpr int32_t kNone = -1;
    int32_t head() const { return 0; }
    void link_after(int32_t at, int32_t slot) {
        int32_t n = slot + 1;
        int32_t after = next_[at];
        prev_[n] = at;
        next_[n] = after;
        next_[at] = n;
        prev_[after] = n;
    }
    void unlink(int32_t slot) {
        int32_t n = slot + 1;
        next_[prev_[n]] = next_[n];
        prev_[next_[n]] = prev_[n];
        prev_[n] = next_[n] = kNone;
    }
    std::vector<int32_t> prev_, next_;
};

}  // namespace

std::unique_ptr<Policy> make_lru_policy() { return std::unique_ptr<Policy>(new LruPolicy()); }

}  // namespace expcache
