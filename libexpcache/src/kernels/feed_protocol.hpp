// How a device select's misses come from a source the GPU cannot read (pageable memory, a
// memory-mapped file, a file read with pread or O_DIRECT): the select kernel and the library's
// feed threads (feed.hpp) hand them over through mapped pinned memory, with no host call between
// them, so the whole select, disk reads included, is one kernel node a graph replays.
//
//   1. The select's leader gives a miss its slot and writes (layer, expert) into the class's
//      FeedBox entry m, then `listed` = the select's number << kPublishShift | m + 1 (a
//      system-scope release: the host reads it).
//   2. A feed thread sees `listed` grow, waits until row r = m % kFeedRows is free (`consumed[r]`
//      holds the tag of the miss it last carried), reads the expert's parts from the source into
//      row r (each part in its own region, at `delta[r][p]` past the region's start: O_DIRECT
//      reads whole aligned blocks), then stores `ready[r]` = the miss's tag, kFeedFailed set when
//      the read failed (the thread logs why).
//   3. Every block of the select's grid copies 16 KiB chunks of miss m from row r into its slot,
//      each chunk claimed by one block (DeviceFeed::claim), so no block waits for one that has
//      not started. The first block at miss m polls `ready[r]` over the link; the others poll its
//      device-memory mirror (DeviceFeed::state). The block that completes the last chunk stores
//      `consumed[r]` = the tag: the row may be filled again.
//   4. A miss whose read failed (or that waited kFeedTimeoutNs) is not copied: the leader, once
//      every miss of the select is done, frees its slot (the next select reads it again) and
//      counts it (DeviceFeed::failures).
//
// A miss's tag is the select's number << kPublishShift | m: unique over the class's life, so a
// row's flags never confuse two of its uses. The feed threads and the kernel take the rows in
// the same order (m % kFeedRows within a select; a select's kernel ends only when all its rows
// are consumed, and the next is stream-ordered after it).
#pragma once

#include <cstdint>

#include "expcache.h"

namespace expcache {

// Rows of one class's ring, each an expert: the reads in flight at once.
constexpr uint32_t kFeedRows = 8;
// A ready word's flag: the read failed, the row holds nothing.
constexpr uint64_t kFeedFailed = uint64_t(1) << 63;
// How long a block waits for a row before it counts the miss failed (a feed thread that stopped,
// or a read that hangs): the select ends rather than the device.
constexpr uint64_t kFeedTimeoutNs = 60ull * 1000 * 1000 * 1000;
// O_DIRECT's alignment (SourceFile::kDirectAlign): each part's region starts at a multiple of it.
constexpr uint64_t kFeedAlign = 4096;

// One entry of a select's miss list, as the feed threads read it.
struct FeedEntry {
    uint32_t layer;
    uint32_t expert;
};

// One class's mailbox, in mapped pinned memory: the device writes `listed`, `entry` and
// `consumed`; the host writes `ready` and `delta`. Each written word on its own line.
struct FeedBox {
    alignas(64) uint64_t listed;
    alignas(64) uint64_t ready[kFeedRows];
    alignas(64) uint64_t consumed[kFeedRows];
    alignas(64) uint64_t delta[kFeedRows][3];
    alignas(64) FeedEntry entry[EXPCACHE_MAX_SELECT];
};

// A class's feed as the select kernel sees it (DeviceClass::feed; box nullptr: none).
struct DeviceFeed {
    FeedBox* box;               // the device's address of the mailbox
    const unsigned char* rows;  // the device's address of row 0
    uint64_t row_bytes;
    uint64_t part_at[3];  // each part's region within a row
    // Device memory, per miss of the current select (reset by the leader before it lists the
    // miss): the next chunk to claim, chunks done, whether a block polls the box for it, its
    // state (0 waiting, 1 ready, 2 failed).
    uint32_t* claim;
    uint32_t* completed;
    uint32_t* watch;
    uint32_t* state;
    uint32_t* done;       // misses of the current select done (copied or failed)
    uint32_t* failed_n;   // of them failed, their slots in failed[]
    int32_t* failed;      // [EXPCACHE_MAX_SELECT]
    uint64_t* failures;   // misses failed over the class's life
};

// A miss's copy is claimed in chunks of this many bytes (one block's pass: 256 threads, four
// 16-byte loads each).
constexpr uint64_t kFeedChunk = 16 * 1024;

}  // namespace expcache
