// A class's feed (kernels/feed_protocol.hpp): the rows the feed threads read a device select's
// misses into, when a layer of the class reads a source the GPU cannot read.
#include <cstring>

#include "device_lookup.hpp"
#include "errors.hpp"

namespace expcache {

bool DeviceLookup::needs_feed(int32_t c) const {
    const ClassState& cls = classes_[c];
    for (const LayerState& l : layers_)
        if (l.registered && !l.source.pinned() && l.bytes[kGate] == cls.key(kGate) && l.bytes[kUp] == cls.key(kUp) &&
            l.bytes[kDown] == cls.key(kDown))
            return true;
    return false;
}

expcache_status_t DeviceLookup::make_feed(int32_t c) {
    ClassDevice& d = classes_state_[c];
    DeviceFeed& f = d.view.feed;
    const ClassState& cls = classes_[c];
    const uint64_t part_bytes[3] = {cls.key(kGate), cls.key(kUp), cls.key(kDown)};
    uint64_t part_at[3];
    const uint64_t row_bytes = feed_row_layout(part_bytes, part_at);
    const uint64_t box_bytes = (sizeof(FeedBox) + kFeedAlign - 1) / kFeedAlign * kFeedAlign;
    // The mailbox and the rows: mapped pinned memory, both sides read and write it.
    void* host = nullptr;
    void* dev = nullptr;
    expcache_status_t s = kernels_->alloc_mapped(box_bytes + kFeedRows * row_bytes, &host, &dev);
    if (s != EXPCACHE_OK) return s;
    d.feed_host = host;  // freed with the lookup, made or not
    std::memset(host, 0, box_bytes);
    // The device's words: per miss of a select (claim, completed, watch, state, failed), then done,
    // failed_n and the failure count; all zero.
    constexpr uint64_t per_miss = EXPCACHE_MAX_SELECT * sizeof(uint32_t);
    const uint64_t words = 5 * per_miss + 2 * sizeof(uint32_t) + sizeof(uint64_t);
    void* state = nullptr;
    const std::vector<unsigned char> zeros(words, 0);
    if ((s = health_.check(arena_.alloc(words, &state))) != EXPCACHE_OK ||
        (s = health_.check(backend_.copy_h2d_sync(state, zeros.data(), words))) != EXPCACHE_OK)
        return s;
    unsigned char* w = static_cast<unsigned char*>(state);
    f.claim = reinterpret_cast<uint32_t*>(w);
    f.completed = reinterpret_cast<uint32_t*>(w + per_miss);
    f.watch = reinterpret_cast<uint32_t*>(w + 2 * per_miss);
    f.state = reinterpret_cast<uint32_t*>(w + 3 * per_miss);
    f.failed = reinterpret_cast<int32_t*>(w + 4 * per_miss);
    f.failures = reinterpret_cast<uint64_t*>(w + 5 * per_miss);
    f.done = reinterpret_cast<uint32_t*>(w + 5 * per_miss + sizeof(uint64_t));
    f.failed_n = f.done + 1;
    f.row_bytes = row_bytes;
    for (int p = 0; p < 3; ++p) f.part_at[p] = part_at[p];
    if (!feed_) feed_.reset(new FeedThreads(layers_, log_));
    FeedRing ring;
    ring.box = static_cast<FeedBox*>(host);
    ring.rows = static_cast<unsigned char*>(host) + box_bytes;
    ring.row_bytes = row_bytes;
    for (int p = 0; p < 3; ++p) ring.part_at[p] = part_at[p];
    if ((s = feed_->watch(ring)) != EXPCACHE_OK) return s;
    // Set last: a class whose feed is half made has none (args_for refuses its fed layers).
    f.rows = static_cast<const unsigned char*>(dev) + box_bytes;
    f.box = static_cast<FeedBox*>(dev);
    log_(EXPCACHE_LOG_NOTICE,
         "class %s: a device select reads its misses from a source the GPU cannot read through %u rows of %.1f "
         "MiB of pinned memory (%u reads in flight)",
         classes_.name(cls).c_str(), kFeedRows, row_bytes / 1048576.0, kFeedRows);
    return EXPCACHE_OK;
}

}  // namespace expcache
