// Least recently used: one intrusive list over slot indices, O(1) per hit,
// insert and remove; the victim is the first evictable slot from the cold end.
#include "intrusive_lists.hpp"
#include "policy.hpp"

namespace expcache {

namespace {

class LruPolicy final : public Policy {
public:
    void resize(int32_t n) override { list_.resize(n); }
    void on_insert(int32_t slot, bool cold, uint32_t) override {
        if (cold)
            list_.push_front(0, slot);  // prefill appends go first
        else
            list_.push_back(0, slot);
    }
    void on_hit(int32_t slot) override {
        list_.unlink(slot);
        list_.push_back(0, slot);
    }
    void on_remove(int32_t slot) override { list_.unlink(slot); }
    int32_t victim(Evictable evictable, const void* ctx) const override {
        for (int32_t s = list_.first(0); s >= 0; s = list_.next(s))
            if (evictable(ctx, s)) return s;
        return -1;
    }
    void clear() override { list_.clear(); }
    void order(std::vector<int32_t>* out) const override {
        for (int32_t s = list_.first(0); s >= 0; s = list_.next(s)) out->push_back(s);
    }

private:
    IntrusiveLists list_{1};
};

}  // namespace

std::unique_ptr<Policy> make_lru_policy() {
    return std::unique_ptr<Policy>(new LruPolicy());
}

}  // namespace expcache
