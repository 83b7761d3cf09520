// Doubly linked lists over slot indices, kept in two arrays: nodes
// 0..lists-1 are the lists' sentinels and slot s is node lists + s. Each list
// runs from its cold end (first) to its hot end. O(1) push, unlink and step;
// no allocation once sized.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace expcache {

class IntrusiveLists {
public:
    explicit IntrusiveLists(int32_t lists) : lists_(lists), prev_(lists), next_(lists) { clear(); }

    // Empty every list and forget the slots; the room for them stays (push takes any slot resized for).
    void clear() {
        std::fill(prev_.begin(), prev_.end(), -1);
        std::fill(next_.begin(), next_.end(), -1);
        for (int32_t l = 0; l < lists_; ++l) prev_[l] = next_[l] = l;
    }
    // Room for slots 0..slots-1.
    void resize(int32_t slots) {
        prev_.resize(static_cast<size_t>(lists_) + slots, -1);
        next_.resize(static_cast<size_t>(lists_) + slots, -1);
    }
    void push_back(int32_t list, int32_t slot) { link_after(prev_[list], slot); }  // the hot end
    void push_front(int32_t list, int32_t slot) { link_after(list, slot); }        // the cold end
    void unlink(int32_t slot) {
        int32_t n = lists_ + slot;
        next_[prev_[n]] = next_[n];
        prev_[next_[n]] = prev_[n];
    }
    // Slot `to` (unlinked) takes linked slot `from`'s place in its list; `from` leaves it.
    void replace(int32_t from, int32_t to) {
        const int32_t f = lists_ + from, t = lists_ + to;
        prev_[t] = prev_[f];
        next_[t] = next_[f];
        next_[prev_[f]] = t;
        prev_[next_[f]] = t;
    }
    // Cold to hot: for (int32_t s = first(l); s >= 0; s = next(s)).
    int32_t first(int32_t list) const { return slot_at(next_[list]); }
    int32_t next(int32_t slot) const { return slot_at(next_[lists_ + slot]); }

private:
    int32_t slot_at(int32_t node) const { return node < lists_ ? -1 : node - lists_; }
    void link_after(int32_t at, int32_t slot) {
        int32_t n = lists_ + slot;
        int32_t after = next_[at];
        prev_[n] = at;
        next_[n] = after;
        next_[at] = n;
        prev_[after] = n;
    }

    int32_t lists_;
    std::vector<int32_t> prev_, next_;
};

}  // namespace expcache
