// The prefetch thread: moves queued experts into their slots over the link's
// idle time, one piece at a time, so that a serving call that cancels the
// queue waits for at most the piece in flight.
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

namespace expcache {

struct PrefetchJob {
    struct Part {
        unsigned char* dst;
        const unsigned char* src;  // a file offset when file != nullptr
        uint64_t bytes;
    };
    int32_t cls = -1, slot = -1;  // the cache's tag: where the expert goes
    const SourceFile* file = nullptr;
    bool pinned = false;  // src may go to the link as it is
    Part parts[3] = {};
    int num_parts = 0;
    // Progress, the thread's: the part and the offset in it of the next piece.
    int part = 0;
    uint64_t offset = 0;
};

class Prefetcher {
public:
    // `stream`: where pieces go (the cache's copy stream); the thread starts on the first submit.
    Prefetcher(StagingRing::Transport& link, void* stream, uint64_t piece_bytes);
    ~Prefetcher();
    Prefetcher(const Prefetcher&) = delete;
    Prefetcher& operator=(const Prefetcher&) = delete;

    // Queue a job at the back. Throws std::bad_alloc or std::system_error (the thread).
    void submit(const PrefetchJob& job);

    struct Taken {
        std::vector<PrefetchJob> done;       // every byte sent: the slot holds its expert once what went
                                             // out has landed (ordered by the caller's fence on `stream`)
        std::vector<PrefetchJob> cancelled;  // taken off the queue by cancel, their progress in part/offset
        std::vector<PrefetchJob> failed;     // a piece failed: the slot's bytes are wrong
        bool sent = false;                   // a piece went out since the last take()
        expcache_status_t error = EXPCACHE_OK;  // the first piece failure since the last take()
        std::string message;
    };
    // What finished since the last take(); with cancel, every job still queued is cancelled
    // too, and no piece goes out after this returns until the next submit.
    void take(bool cancel, Taken* out);

    // Testing: pause the thread between pieces; wait until the queue is empty and the last
    // piece landed (at once while paused).
    void pause(bool paused);
    expcache_status_t drain();

    uint64_t bytes_sent() const;
    uint64_t pieces() const;
    void reset_counters();

private:
    void run();
    // Under mu_: send the next piece of the front job; false when a piece failed.
    bool send_next(std::unique_lock<std::mutex>& lock);

    StagingRing::Transport& link_;
    void* stream_;
    const uint64_t piece_bytes_;

    mutable std::mutex mu_;
    std::condition_variable wake_;   // the thread: work queued, pause lifted, stop
    std::condition_variable landed_; // drain(): a piece landed
    std::deque<PrefetchJob> queue_;
    std::vector<PrefetchJob> done_, failed_;
    bool sent_ = false, stop_ = false, paused_ = false, in_flight_ = false;
    expcache_status_t error_ = EXPCACHE_OK;
    std::string message_;
    uint64_t bytes_sent_ = 0, pieces_ = 0;
    void* bounce_ = nullptr;  // one piece of memory the link can read, for pageable and file sources
    void* marker_ = nullptr;
    std::thread thread_;
};

}  // namespace expcache
