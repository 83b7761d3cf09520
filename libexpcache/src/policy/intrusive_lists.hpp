// Doubly linked lists over slot indices, kept in one array of links: nodes
// 0..Lists-1 are the lists' sentinels and slot s is node Lists + s. Each list
// runs from its cold end (first) to its hot end. O(1) push, unlink and step;
// no allocation once sized. The number of lists is a constant, so a node's
// index is one addition the compiler need not reload after every store.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace expcache {

template <int32_t Lists>
class IntrusiveLists {
public:
    IntrusiveLists() : links_(Lists) { clear(); }

    // Empty every list and forget the slots; the room for them stays (push takes any slot resized for).
    void clear() {
        std::fill(links_.begin(), links_.end(), Link{-1, -1});
        for (int32_t l = 0; l < Lists; ++l) links_[l] = Link{l, l};
    }
    // Room for slots 0..slots-1.
    void resize(int32_t slots) { links_.resize(static_cast<size_t>(Lists) + slots, Link{-1, -1}); }
    // The hot end: after the list's last node, whose next is the sentinel (no load to learn it).
    void push_back(int32_t list, int32_t slot) {
        const int32_t n = Lists + slot;
        const int32_t last = links_[list].prev;
        links_[n].prev = last;
        links_[n].next = list;
        links_[last].next = n;
        links_[list].prev = n;
    }
    void push_front(int32_t list, int32_t slot) {  // the cold end
        const int32_t n = Lists + slot;
        const int32_t first = links_[list].next;
        links_[n].prev = list;
        links_[n].next = first;
        links_[first].prev = n;
        links_[list].next = n;
    }
    void unlink(int32_t slot) {
        const Link n = links_[Lists + slot];
        links_[n.prev].next = n.next;
        links_[n.next].prev = n.prev;
    }
    // Slot `to` (unlinked) takes linked slot `from`'s place in its list; `from` leaves it.
    void replace(int32_t from, int32_t to) {
        const int32_t t = Lists + to;
        const Link f = links_[Lists + from];
        links_[t] = f;
        links_[f.prev].next = t;
        links_[f.next].prev = t;
    }
    // Cold to hot: for (int32_t s = first(l); s >= 0; s = next(s)).
    int32_t first(int32_t list) const { return slot_at(links_[list].next); }
    int32_t next(int32_t slot) const { return slot_at(links_[Lists + slot].next); }

private:
    struct Link {
        int32_t prev, next;
    };

    static int32_t slot_at(int32_t node) { return node < Lists ? -1 : node - Lists; }

    std::vector<Link> links_;
};

}  // namespace expcache
