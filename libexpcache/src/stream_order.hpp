// The order of a cache's device work across streams: the caller's stream changing between calls,
// the cache's own copy stream (split selects' misses, prefetch pieces) against the streams that
// read the slots it writes, and the marks that prefetch pieces wait for (the start of the
// previous serving call, so no kernel still reading an older slot is overtaken).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "backend/backend.hpp"
#include "class_table.hpp"
#include "log.hpp"

namespace expcache {

class StreamOrder {
public:
    StreamOrder(Backend& backend, Health& health, ClassTable& classes)
        : backend_(backend), health_(health), classes_(classes) {}

    // The start of a call on `stream`: it waits for the previous call's stream when that differs,
    // and for the copy stream (split selects' misses always; prefetch pieces unless the call
    // orders each slot itself, per_slot). mark: record where the call begins (for prefetches).
    expcache_status_t begin(void* stream, bool per_slot, bool mark);
    // `stream` waits for everything the copy stream was given so far.
    expcache_status_t fence_copy(void* stream);
    // Before `stream` reads or writes slot s of class c: waits for the copy stream if a prefetch
    // sent bytes into the slot since the last fence_copy.
    expcache_status_t order_slot(int32_t c, int32_t s, void* stream);
    // A prefetch will send into slot s of class c.
    void copy_pending(int32_t c, int32_t s);
    // After the device or the copy stream was synchronized: nothing sent is still crossing.
    void forget_copy_pending();
    // A split select's misses went to the copy stream: the next call's stream waits for them.
    void copy_dirty() { copy_dirty_ = true; }
    // The first pieces of a prefetch call wait, on the copy stream, for the start of the previous
    // serving call, or, before two were marked (first: no prefetch yet), for `stream` so far.
    expcache_status_t order_prefetch(bool first, void* stream);

private:
    Backend& backend_;
    Health& health_;
    ClassTable& classes_;
    void* last_stream_ = nullptr;
    bool have_last_stream_ = false;
    bool copy_dirty_ = false;
    std::vector<std::pair<int32_t, int32_t>> copy_pending_;  // (class, slot) marked copy_pending
    int cur_mark_ = 0, prev_mark_ = 0, marks_ = 0;           // marks_: serving calls marked, up to 2
};

}  // namespace expcache
