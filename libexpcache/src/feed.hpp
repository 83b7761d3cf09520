// The feed threads of a device-lookup cache: they read the misses a device select lists for a
// source the GPU cannot read (pageable memory, a memory-mapped file, a file read with pread or
// O_DIRECT) into the class's pinned rows, many reads in flight, and tell the select's kernel
// each row is ready, through mapped memory only (kernels/feed_protocol.hpp has the protocol).
//
// One thread polls every class's mailbox; config.copy_threads threads (the staging ring's count)
// read, each a piece of a miss at a time, so one expert is read by all of them at once. The
// poller spins while selects come (a miss is seen within a microsecond or so) and sleeps between
// polls after kIdleSpin without one: a select after a pause waits up to kIdleSleep for its first
// read to start. The readers spin (yielding) for kIdleSpin after their last piece, then sleep
// until the poller hands them more.
//
// With a host pool (host_pool.hpp), each miss of a pageable or file source asks the pool when it
// is issued: a pool hit's pieces are copied out of the pool's RAM into the row (no read of the
// source); a pool miss's pieces are read from the source into the row as before and copied on
// into the pool slot, which the miss's last piece enters only if every piece was read.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "backend/copy_nt.hpp"
#include "host_pool.hpp"
#include "kernels/feed_protocol.hpp"
#include "layers.hpp"
#include "log.hpp"

namespace expcache {

// Where one class's feed lives, as the host writes it (host addresses of mapped memory).
struct FeedRing {
    FeedBox* box = nullptr;
    unsigned char* rows = nullptr;
    uint64_t row_bytes = 0;
    uint64_t part_at[kMaxParts] = {};
    uint64_t piece = 0;
};

// The piece size of experts of `part_bytes`: kFeedMinPiece, or larger so that no part has more
// than kFeedPieces pieces; a multiple of kFeedChunk and kFeedAlign.
uint64_t feed_piece(const uint64_t part_bytes[kMaxParts]);
// A row of such experts: each part's region (feed_region_bytes) aligned for O_DIRECT; the row's bytes.
uint64_t feed_row_layout(const uint64_t part_bytes[kMaxParts], uint64_t piece, uint64_t part_at[kMaxParts]);

class FeedThreads {
public:
    static constexpr std::chrono::microseconds kIdleSpin{2000};
    static constexpr std::chrono::microseconds kIdleSleep{50};

    // readers: the threads that read (config.copy_threads, at least 1); pool: the host pool the
    // misses of pageable and file sources are read through (nullptr: none).
    FeedThreads(const LayerTable& layers, const Log& log, uint32_t readers, HostPool* pool)
        : layers_(layers), log_(log), readers_wanted_(readers ? readers : 1), pool_(pool) {}
    uint32_t readers() const { return readers_wanted_; }
    // Stops the threads; the device is done with the rows (the cache synchronized first).
    ~FeedThreads();
    FeedThreads(const FeedThreads&) = delete;
    FeedThreads& operator=(const FeedThreads&) = delete;

    // Feed one more class's ring (the threads start with the first). Status: OK, OUT_OF_HOST_MEMORY
    // (no thread could start).
    expcache_status_t watch(const FeedRing& ring);

private:
    // What the host pool gave a row's miss: its lease, the pieces still to read, whether one failed.
    // Written by the poller before the miss's jobs are queued; the last piece ends the lease.
    struct RowPool {
        HostPool::Lease lease;
        bool counted = false;  // a pageable or file source: the pool was asked
        std::atomic<uint32_t> left{0};
        std::atomic<bool> failed{false};
    };
    struct Watched {
        FeedRing ring;
        uint64_t seq = 0;  // the select being fed (its number), and its misses given to readers
        uint32_t issued = 0;
        uint64_t row_tag[kFeedRows] = {};  // the tag of the miss each row last carried
        bool row_used[kFeedRows] = {};
        std::atomic<uint64_t> logged[kFeedRows] = {};  // the last tag whose failure was logged
        RowPool pool[kFeedRows];
    };
    struct Job {
        Watched* w;
        uint32_t row;
        int part;
        uint32_t piece;
        uint64_t tag;
        FeedEntry entry;
    };

    void poll();
    // New misses of w, a job per piece, appended to *out; whether w has work left.
    bool issue(Watched& w, std::vector<Job>* out);
    void read_loop();
    void run(const Job& job);
    // n bytes from `from` into the row at dst, with non-temporal stores.
    void stream_to(unsigned char* dst, const char* from, uint64_t n) const;
    expcache_status_t fill(unsigned char* dst, const LayerState& l, int p, uint32_t expert, uint64_t at, uint64_t n,
                           uint64_t* delta);

    const LayerTable& layers_;
    const Log& log_;
    const uint32_t readers_wanted_;
    HostPool* const pool_;
    const bool wide_ = copy_nt_wide_supported();  // 64-byte non-temporal stores (AVX-512)
    std::mutex rings_mu_;                         // rings_
    std::vector<std::unique_ptr<Watched>> rings_;
    std::mutex mu_;  // jobs_, stop_
    std::condition_variable jobs_cv_, stop_cv_;
    std::deque<Job> jobs_;
    std::atomic<size_t> queued_{0};  // jobs_.size(), for readers spinning without the lock
    bool stop_ = false;
    std::thread poller_;
    std::vector<std::thread> readers_;
};

}  // namespace expcache
