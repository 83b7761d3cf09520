// A class's feed (kernels/feed_protocol.hpp): the rows the feed threads read a device select's
// misses into, when a layer of the class reads a source the GPU cannot read.
#include <algorithm>
#include <cstring>

#include "device_lookup.hpp"
#include "errors.hpp"

namespace expcache {

bool DeviceLookup::needs_feed(int32_t c) const {
    const ClassState& cls = classes_[c];
    for (const LayerState& l : layers_)
        if (l.registered && l.fed() && std::equal(l.bytes, l.bytes + kMaxParts, cls.key_array())) return true;
    return false;
}

expcache_status_t DeviceLookup::make_feed(int32_t c) {
    ClassDevice& d = classes_state_[c];
    DeviceFeed& f = d.view.feed;
    const ClassState& cls = classes_[c];
    const uint64_t* part_bytes = cls.key_array();
    const uint64_t piece = feed_piece(part_bytes);
    uint64_t part_at[kMaxParts];
    const uint64_t row_bytes = feed_row_layout(part_bytes, piece, part_at);
    const uint64_t box_bytes = (sizeof(FeedBox) + kFeedAlign - 1) / kFeedAlign * kFeedAlign;
    // The mailbox and the rows: mapped pinned memory, both sides read and write it.
    void* host = nullptr;
    void* dev = nullptr;
    expcache_status_t s = kernels_->alloc_mapped(box_bytes + kFeedRows * row_bytes, &host, &dev);
    if (s != EXPCACHE_OK) return s;
    d.feed_host = host;  // freed with the lookup, made or not
    std::memset(host, 0, box_bytes);
    // The device's words, all zero: per piece of a row (watch, mirror, mirror_delta), per row (fail_tag), the
    // failure count; per miss of a select (claim, completed, failed); done and failed_n.
    constexpr uint64_t pieces = uint64_t(kFeedRows) * kMaxParts * kFeedPieces;
    constexpr uint64_t wide = (3 * pieces + kFeedRows + 1) * sizeof(uint64_t);
    constexpr uint64_t per_miss = EXPCACHE_MAX_SELECT * sizeof(uint32_t);
    constexpr uint64_t words = wide + 3 * per_miss + 2 * sizeof(uint32_t);
    void* state = nullptr;
    const std::vector<unsigned char> zeros(words, 0);
    if ((s = health_.check(arena_.alloc(words, &state))) != EXPCACHE_OK ||
        (s = health_.check(backend_.copy_h2d_sync(state, zeros.data(), words))) != EXPCACHE_OK)
        return s;
    uint64_t* w64 = static_cast<uint64_t*>(state);
    f.watch = w64;
    f.mirror = w64 + pieces;
    f.mirror_delta = w64 + 2 * pieces;
    f.fail_tag = w64 + 3 * pieces;
    f.failures = f.fail_tag + kFeedRows;
    unsigned char* w = static_cast<unsigned char*>(state) + wide;
    f.claim = reinterpret_cast<uint32_t*>(w);
    f.completed = reinterpret_cast<uint32_t*>(w + per_miss);
    f.failed = reinterpret_cast<int32_t*>(w + 2 * per_miss);
    f.done = reinterpret_cast<uint32_t*>(w + 3 * per_miss);
    f.failed_n = f.done + 1;
    f.row_bytes = row_bytes;
    f.piece = piece;
    for (int p = 0; p < kMaxParts; ++p) f.part_at[p] = part_at[p];
    if (!feed_) feed_.reset(new FeedThreads(layers_, log_, copy_threads_, pool_));
    FeedRing ring;
    ring.box = static_cast<FeedBox*>(host);
    ring.rows = static_cast<unsigned char*>(host) + box_bytes;
    ring.row_bytes = row_bytes;
    for (int p = 0; p < kMaxParts; ++p) ring.part_at[p] = part_at[p];
    ring.piece = piece;
    if ((s = feed_->watch(ring)) != EXPCACHE_OK) return s;
    // Set last: a class whose feed is half made has none (args_for refuses its fed layers).
    f.rows = static_cast<const unsigned char*>(dev) + box_bytes;
    f.box = static_cast<FeedBox*>(dev);
    log_(EXPCACHE_LOG_NOTICE,
         "class %s: a device select reads its misses from a source the GPU cannot read through %u rows of %.1f "
         "MiB of pinned memory (%u reads of %llu KiB pieces in flight)",
         classes_.name(cls).c_str(), kFeedRows, row_bytes / 1048576.0, feed_->readers(),
         (unsigned long long)(piece >> 10));
    return EXPCACHE_OK;
}

}  // namespace expcache
