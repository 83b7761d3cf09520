// Bytes that cannot be DMA'd as they are (pageable memory, a file) are staged
// through a ring of page-locked chunks. A call's uploads are cut into chunks
// and queued; worker threads each fill a whole chunk (memcpy or pread) and
// hand it to the link at once, so chunk i crosses the link while chunks
// i+1.. are being filled, across every expert of the call. A chunk is refilled
// only after the transfer that read it has finished.
//
// The ring knows nothing of CUDA: a Transport allocates the chunks and moves
// them (cudaMemcpyAsync and an event on the CUDA backend, a memcpy on the host
// backend), so the same queue, threads and error handling run in every test.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "expcache.h"
#include "source_file.hpp"

namespace expcache {

class StagingRing {
public:
    class Transport {
    public:
        virtual ~Transport() = default;
        // One chunk of host memory the link can read, and a marker to wait on.
        virtual expcache_status_t alloc_chunk(uint64_t bytes, void** host, void** marker) = 0;
        virtual void free_chunk(void* host, void* marker) = 0;
        // Enqueue dst <- src (n bytes out of a chunk) on `stream`, then set `marker` behind it.
        virtual expcache_status_t send(void* dst, const void* src, uint64_t n, void* stream, void* marker) = 0;
        // Block until the transfer behind `marker` has read its chunk.
        virtual expcache_status_t wait(void* marker) = 0;
        // Run once on each worker thread before its first job.
        virtual void thread_start() {}
    };

    // `copy_threads` threads fill chunks: the caller (while it waits in finish()) and
    // copy_threads - 1 workers; `ring_bytes` of chunks of `chunk_bytes` (at least 2
    // chunks; allocated on first use). An idle worker polls for a while before it sleeps
    // (spin_us): waking a sleeping thread costs tens of microseconds (more in a VM), about
    // the time a chunk takes to cross the link, and decode calls come every few hundred
    // microseconds. The polling is left out when the threads would share cores.
    StagingRing(Transport& transport, unsigned copy_threads, uint64_t ring_bytes, uint64_t chunk_bytes);
    ~StagingRing();
    StagingRing(const StagingRing&) = delete;
    StagingRing& operator=(const StagingRing&) = delete;

    // Queue dst <- src[0, n) (src in pageable host memory).
    expcache_status_t copy(void* dst, const void* src, uint64_t n, void* stream);
    // Queue dst <- file[offset, offset + n).
    expcache_status_t read(void* dst, const SourceFile& file, uint64_t offset, uint64_t n, void* stream);
    // Run and wait for everything queued since the last finish(): on return every
    // transfer has been enqueued on its stream. The first failure of those jobs, or OK;
    // after a failure the remaining jobs of the batch are dropped, not transferred.
    expcache_status_t finish();

    uint64_t chunk_bytes() const { return chunk_; }

private:
    struct Job {
        char* dst;
        const char* src;          // pageable source, or nullptr for a file
        const SourceFile* file;
        uint64_t offset;          // file offset
        uint64_t n;
        void* stream;
        uint64_t seq;             // this job uses chunk seq % chunks
    };
    struct Chunk {
        void* host = nullptr;
        void* marker = nullptr;
        bool sent = false;        // a transfer out of it may still be reading it
        uint64_t turn = 0;        // the seq of the job allowed to use it next
    };

    expcache_status_t queue(const Job& job);
    expcache_status_t allocate();
    void worker();
    // Pop the oldest job and run it; the lock is dropped while it runs.
    void run_one(std::unique_lock<std::mutex>& lock);
    expcache_status_t fill_and_send(const Job& job, Chunk& chunk);

    Transport& transport_;
    uint64_t ring_bytes_;
    uint64_t chunk_;
    unsigned num_threads_;
    unsigned spin_us_;
    std::vector<std::thread> threads_;
    std::vector<Chunk> chunks_;
    std::mutex mu_;
    std::condition_variable work_, done_, turn_;
    std::deque<Job> queue_;
    uint64_t next_seq_ = 0;
    // Written under mu_; read without it by spinning threads.
    std::atomic<uint64_t> queued_{0};      // in queue_
    std::atomic<uint64_t> unfinished_{0};  // queued or running
    std::atomic<bool> stop_{false};
    expcache_status_t status_ = EXPCACHE_OK;  // first failure since the last finish()
    std::string message_;
};

}  // namespace expcache
