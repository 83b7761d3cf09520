// Least recently used: one intrusive list over slot indices, O(1) per hit,
// insert and remove; the victim is the first evictable slot from the cold end.
// Declared here, with its per-request hooks inline, so that duel.cpp holds it
// by value and calls it without virtual dispatch; lru.cpp has the rest.
#pragma once

#include "intrusive_lists.hpp"
#include "policy.hpp"

namespace expcache {

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
    void move(int32_t from, int32_t to) override { list_.replace(from, to); }
    int32_t victim(Evictable evictable, const void* ctx) const override;
    void clear() override { list_.clear(); }

private:
    IntrusiveLists<1> list_;
};

}  // namespace expcache
