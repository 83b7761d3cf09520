// The prefetch thread: moves queued experts into their slots over the link's
// idle time. At most one piece's bytes are in flight, sent as kDepth smaller
// transfers so that the next is queued on the stream while one crosses (the
// link never idles while the thread wakes); a serving call that cancels the
// queue shares the link with at most those bytes.
//
// The cache decides what to prefetch and into which slot (under its mutex);
// this class only moves bytes. It never touches cache state: the cache takes
// the finished and cancelled jobs back with take(), under its own mutex, and
// lock order is always the cache's mutex, then this one's.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backend/source_file.hpp"
#include "backend/staging_ring.hpp"
#include "expcache.h"
#include "layers.hpp"

namespace expcache {

struct PrefetchJob {
    struct Part {
        unsigned char* dst;
        const unsigned char* src;  // a file offset for a file source
        uint64_t bytes;
        const SourceFile* file;  // a file source's file for this part (a checkpoint's shard)
    };
    int32_t cls = -1, slot = -1;  // the cache's tag: where the expert goes
    ExpertSource source;          // pinned: src may go to the link as it is
    Part parts[kMaxParts] = {};
    int num_parts = 0;
    // The source part p is read from: the job's, with that part's file.
    ExpertSource part_source(int p) const {
        ExpertSource s = source;
        s.file = parts[p].file;
        return s;
    }
    // Progress, the thread's: the part and the offset in it of the next piece.
    int part = 0;
    uint64_t offset = 0;
};

class Prefetcher {
public:
    // Transfers in flight at once, each of piece_bytes / kDepth.
    static constexpr int kDepth = 2;

    // `stream`: where pieces go (the cache's copy stream); the thread starts on the first submit.
    Prefetcher(StagingRing::Transport& link, void* stream, uint64_t piece_bytes);
    ~Prefetcher();
    Prefetcher(const Prefetcher&) = delete;
    Prefetcher& operator=(const Prefetcher&) = delete;

    // Queue a job at the back. A pinned job's first transfers go out from the calling thread
    // when the link is free (no wait for the thread to wake); the caller must be on the
    // stream's device. Throws std::bad_alloc or std::system_error (the thread).
    void submit(const PrefetchJob& job);

    struct Taken {
        std::vector<PrefetchJob> done;          // every byte sent: the slot holds its expert once what went
                                                // out has landed (ordered by the caller's fence on `stream`)
        std::vector<PrefetchJob> cancelled;     // taken off the queue by cancel, their progress in part/offset
        std::vector<PrefetchJob> failed;        // a piece failed: the slot's bytes are wrong
        expcache_status_t error = EXPCACHE_OK;  // the first piece failure since the last take()
        std::string message;
    };
    // What finished since the last take(); with cancel, every job still queued is cancelled
    // too, and no piece goes out after this returns until the next submit.
    void take(bool cancel, Taken* out);

    // Wait until the queue is empty and the last piece landed; while paused, only until the
    // pieces in flight landed. Returns the jobs still queued: 0 unless paused.
    size_t drain();
    // Testing: pause the thread between pieces.
    void pause(bool paused);

    uint64_t bytes_sent() const;
    uint64_t pieces() const;
    void reset_counters();

private:
    void run();
    // Under mu_: send transfers of the front jobs until kDepth are in flight or the queue is empty.
    void fill();
    // Under mu_: send the next transfer of the front job; false when it failed.
    bool send_next();

    StagingRing::Transport& link_;
    void* stream_;
    const uint64_t piece_bytes_;

    mutable std::mutex mu_;
    std::condition_variable wake_;    // the thread: work queued, pause lifted, stop
    std::condition_variable landed_;  // drain(): a piece landed
    std::deque<PrefetchJob> queue_;
    std::vector<PrefetchJob> done_, failed_;
    bool stop_ = false, paused_ = false;
    expcache_status_t error_ = EXPCACHE_OK;
    std::string message_;
    uint64_t bytes_sent_ = 0, pieces_ = 0;
    // The transfers in flight, oldest at head_: each with memory the link can read (for pageable
    // and file sources) and the marker recorded behind it.
    struct Transfer {
        void* bounce = nullptr;
        void* marker = nullptr;
    };
    Transfer ring_[kDepth];
    int head_ = 0, in_flight_ = 0;
    std::thread thread_;
};

}  // namespace expcache
