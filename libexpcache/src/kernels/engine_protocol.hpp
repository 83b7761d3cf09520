// How a device select's misses from pinned host memory are moved by a copy engine rather than by
// the select's grid (expcache_config_t.miss_copy): the select kernel and the library's poller
// thread (feed.hpp) hand them over through memory only, with no host call between them, so the
// select stays one kernel node a graph replays.
//
// Why. The grid's SMs pull a miss across the link at about 94 % of a copy engine's rate, whatever
// issues the loads (docs/device_lookup.md, "The miss copy"); a copy engine cannot be driven from
// a graph with addresses only the device knows. A host thread can drive it: measured side by side
// in one graph (benchmarks/c/copy_handoff.cu, H200), the handoff below runs 1.040x the SM copy for
// 13.5 MiB experts and 1.014x for 6.75 MiB, but 0.985x for 4.5 MiB, whose copies are too short to
// pay for the round trip (about 10 us).
//
//   1. The select's leader gives a miss its slot and writes (layer, expert, slot) into the class's
//      EngineBox entry m, then `listed` = the select's number << kPublishShift | m + 1 (a
//      system-scope release: the host reads it). The grid's other blocks end after their table
//      read: they copy nothing.
//   2. The poller sees `listed` grow and enqueues every miss listed since it last looked, each
//      part's bytes from the layer's source into its slot, on the copier's stream (one
//      cudaMemcpyBatchAsync), then a stream write of `done` = the select's number <<
//      kPublishShift | the misses enqueued so far (cuStreamWriteValue64, ordered after the
//      copies, whose writes it makes visible first), kEngineFailed set when an enqueue failed.
//   3. Once it has listed every miss, the leader waits until `done` reaches its last one (a load
//      of device memory), then ends: the slots hold their bytes for every kernel after the select.
//      A failed enqueue, or no word within kFeedTimeoutNs (a poller that stopped), fails every
//      miss of the select: their slots are freed (the next select reads them again), their ids
//      get slot -1, and DeviceEngine::failures counts them.
//
// The numbers only grow (a class's selects are ordered on their streams), so a word of an earlier
// select is never taken for this one's and nothing is reset between selects.
#pragma once

#include <cstdint>

#include "expcache.h"

namespace expcache {

// DeviceEngine::done's flag: an enqueue failed; the select's misses have no bytes.
constexpr uint64_t kEngineFailed = uint64_t(1) << 11;  // kPublishFinal's bit: above every count

// One entry of a select's miss list, as the poller reads it.
struct EngineEntry {
    uint32_t layer;
    uint32_t expert;
    int32_t slot;
};

// One class's mailbox, in mapped pinned memory, written by the device only.
struct EngineBox {
    alignas(64) uint64_t listed;
    alignas(64) EngineEntry entry[EXPCACHE_MAX_SELECT];
};

// A class's copy-engine path as the select kernel sees it (DeviceClass::engine; box nullptr: the
// grid copies the misses).
struct DeviceEngine {
    EngineBox* box;      // the device's address of the mailbox
    uint64_t* done;      // device memory: written by the copier's stream
    uint64_t* failures;  // device memory: misses failed over the class's life
};

}  // namespace expcache
