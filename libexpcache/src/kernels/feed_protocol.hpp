// How a device select's misses come from a source the GPU cannot read (pageable memory, a
// memory-mapped file, a file read with pread or O_DIRECT): the select kernel and the library's
// feed threads (feed.hpp) hand them over through mapped pinned memory, with no host call between
// them, so the whole select, disk reads included, is one kernel node a graph replays.
//
//   1. The select's leader gives a miss its slot and writes (layer, expert, the select's policy
//      token) into the class's FeedBox entry m, then `listed` = the select's number <<
//      kPublishShift | m + 1 (a system-scope release: the host reads it).
//   2. The feed's poller sees `listed` grow and, once row r = m % kFeedRows is free (`consumed[r]`
//      holds the tag of the miss it last carried), sets the host pool's clock to the entry's time
//      (host_pool.hpp: that of a host-side call of the layer at the token) before it asks the pool
//      about the miss, and hands each piece of the expert (each part cut
//      into pieces of DeviceFeed::piece bytes) to the reader threads, which read the pieces in
//      parallel into the row, each piece in its own region, at `delta` past the region's start
//      (an O_DIRECT read lands whole aligned blocks), and store the piece's `ready` word = the
//      miss's tag, kFeedFailed set when its read failed (the thread logs why).
//   3. Every block of the select's grid copies 16 KiB chunks of miss m from row r into its slot,
//      each chunk claimed by one block (DeviceFeed::claim), so no block waits for one that has
//      not started; a chunk is copied as soon as its piece is ready, so the copy across the link
//      runs while later pieces are read. The first block at a piece polls its `ready` word over
//      the link and mirrors it, with the piece's `delta`, in device memory, where the others poll
//      (a read across the link per chunk made the copy of a ready row three times slower). The
//      block that completes the last chunk of the miss stores `consumed[r]` = the tag: the row
//      may be filled again.
//   4. A miss with a failed piece (or one that waited kFeedTimeoutNs) is not all copied: the
//      leader, once every miss of the select is done, frees its slot (the next select reads it
//      again), gives its ids slot -1 and counts it (DeviceFeed::failures).
//
// A miss's tag is the select's number << kPublishShift | m: unique and growing over each row's
// life, so a row's words never confuse two of its uses and need no reset. The threads and the
// kernel take the rows in the same order (m % kFeedRows within a select; a select's kernel ends
// only when all its rows are consumed, and the next is stream-ordered after it).
#pragma once

#include <cstdint>

#include "expcache.h"

namespace expcache {

// Rows of one class's ring, each an expert: the misses in flight at once.
constexpr uint32_t kFeedRows = 8;
// Pieces a part is cut into, at most: with kFeedRows x 3 x kFeedPieces words per ready array.
constexpr uint32_t kFeedPieces = 16;
// A piece's bytes, at least (a multiple of kFeedChunk; larger parts get larger pieces).
constexpr uint64_t kFeedMinPiece = 256 * 1024;
// A ready word's flag: the read failed, the piece holds nothing.
constexpr uint64_t kFeedFailed = uint64_t(1) << 63;
// How long a block waits for a piece before it counts the miss failed (a feed thread that
// stopped, or a read that hangs): the select ends rather than the device.
constexpr uint64_t kFeedTimeoutNs = 60ull * 1000 * 1000 * 1000;
// O_DIRECT's alignment (SourceFile::kDirectAlign): each piece's region starts at a multiple of
// it and has room for the aligned blocks around the piece.
constexpr uint64_t kFeedAlign = 4096;
// A miss's copy is claimed in chunks of this many bytes (one block's pass: 256 threads, four
// 16-byte loads each); pieces are whole chunks.
constexpr uint64_t kFeedChunk = 16 * 1024;

// One entry of a select's miss list, as the feed threads read it.
struct FeedEntry {
    uint32_t layer;
    uint32_t expert;
    int32_t token;  // the select's policy clock token (DevicePolicyClock; 0 under LRU, which keeps none)
};

// One class's mailbox, in mapped pinned memory: the device writes `listed`, `entry` and
// `consumed`; the host writes `ready` and `delta` (per row, part and piece).
struct FeedBox {
    alignas(64) uint64_t listed;
    alignas(64) uint64_t consumed[kFeedRows];
    alignas(64) uint64_t ready[kFeedRows][EXPCACHE_MAX_PARTS][kFeedPieces];
    alignas(64) uint64_t delta[kFeedRows][EXPCACHE_MAX_PARTS][kFeedPieces];
    alignas(64) FeedEntry entry[EXPCACHE_MAX_SELECT];
};

// The bytes of part region p of a row: its pieces, each with room for O_DIRECT's alignment.
inline uint64_t feed_region_bytes(uint64_t part_bytes, uint64_t piece) {
    return (part_bytes + piece - 1) / piece * (piece + 2 * kFeedAlign);
}

// A class's feed as the select kernel sees it (DeviceClass::feed; box nullptr: none).
struct DeviceFeed {
    FeedBox* box;               // the device's address of the mailbox
    const unsigned char* rows;  // the device's address of row 0
    uint64_t row_bytes;
    uint64_t part_at[EXPCACHE_MAX_PARTS];  // each part's region within a row
    uint64_t piece;                        // a piece's bytes (its region: piece + 2 * kFeedAlign)
    // Device memory. Per miss of the current select (reset by the leader before it lists the
    // miss): the next chunk to claim, the chunks done.
    uint32_t* claim;
    uint32_t* completed;
    // Per row, part and piece (tags, never reset): the latest tag a block polls the box for, and
    // the ready word it found (the mirror the other blocks poll), with the piece's delta.
    uint64_t* watch;
    uint64_t* mirror;
    uint64_t* mirror_delta;
    uint64_t* fail_tag;  // per row: the latest tag of a miss with a failed piece
    uint32_t* done;      // misses of the current select done (copied or failed)
    uint32_t* failed_n;  // of them failed, their slots in failed[]
    int32_t* failed;     // [EXPCACHE_MAX_SELECT]
    uint64_t* failures;  // misses failed over the class's life
};

}  // namespace expcache
