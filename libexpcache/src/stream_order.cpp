#include "stream_order.hpp"

namespace expcache {

expcache_status_t StreamOrder::begin(void* stream, bool per_slot, bool mark) {
    expcache_status_t s;
    if (have_last_stream_ && last_stream_ != stream &&
        (s = health_.check(backend_.fence(last_stream_, stream))) != EXPCACHE_OK)
        return s;
    if ((copy_dirty_ || (!per_slot && !copy_pending_.empty())) && (s = fence_copy(stream)) != EXPCACHE_OK) return s;
    if (mark) {
        // Where this call begins on its stream: the next prefetch but one waits for it.
        if ((s = health_.check(backend_.mark(cur_mark_ ^ 1, stream))) != EXPCACHE_OK) return s;
        prev_mark_ = cur_mark_;
        cur_mark_ ^= 1;
        if (marks_ < 2) ++marks_;
    }
    last_stream_ = stream;
    have_last_stream_ = true;
    return EXPCACHE_OK;
}

expcache_status_t StreamOrder::fence_copy(void* stream) {
    expcache_status_t s = health_.check(backend_.fence(backend_.copy_stream(), stream));
    if (s != EXPCACHE_OK) return s;
    copy_dirty_ = false;
    forget_copy_pending();
    return EXPCACHE_OK;
}

expcache_status_t StreamOrder::order_slot(int32_t c, int32_t s, void* stream) {
    if (!classes_[c].slots()[s].copy_pending() || stream == backend_.copy_stream()) return EXPCACHE_OK;
    return fence_copy(stream);
}

void StreamOrder::copy_pending(int32_t c, int32_t s) {
    if (classes_.mark_copy_pending(c, s)) copy_pending_.emplace_back(c, s);
}

void StreamOrder::forget_copy_pending() {
    for (const auto& cs : copy_pending_) classes_.clear_copy_pending(cs.first, cs.second);
    copy_pending_.clear();
}

expcache_status_t StreamOrder::order_prefetch(bool first, void* stream) {
    void* copy = backend_.copy_stream();
    return health_.check(!first && marks_ >= 2 ? backend_.wait_mark(prev_mark_, copy) : backend_.fence(stream, copy));
}

}  // namespace expcache
