// Bytes that cannot be DMA'd as they are (pageable memory, a file) are staged
// through a ring of page-locked chunks. A call's uploads are cut into chunks
// and queued; worker threads each fill whole chunks (a copy with non-temporal
// stores, or pread) while the calling thread hands the filled ones to the link
// in order, several at a time while the link is busy, so chunk i crosses the
// link while chunks i+1.. are being filled, across every expert of the call. Only the calling thread talks to the link:
// worker threads never contend with it for the driver's locks. A chunk is refilled only after the transfer that read it
// has finished.
//
// The ring knows nothing of CUDA: a Transport allocates the chunks and moves
// them (cudaMemcpyAsync and an event on the CUDA backend, a memcpy on the host
// backend), so the same queue, threads and error handling run in every test.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "expcache.h"
#include "copy_nt.hpp"
#include "source_file.hpp"
#include "staging_tuning.hpp"

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
        struct Send {
            void* dst;
            const void* src;
            uint64_t n;
            void* marker;
        };
        // Enqueue n >= 1 transfers on `stream` (in any order among themselves: their
        // destinations never overlap), each marker set behind them; *sent: how many are
        // enqueued with their marker set (all of them on success; the chunks of the others
        // are no longer read by the link). By default one send() each.
        virtual expcache_status_t send_batch(const Send* sends, size_t n, void* stream, size_t* sent);
        // Block until the transfer behind `marker` has read its chunk.
        virtual expcache_status_t wait(void* marker) = 0;
        // Whether the transfer behind `marker` has finished (or failed: wait() says how),
        // without blocking. By default true: a transport whose sends complete as they are made.
        virtual bool done(void* marker) {
            (void)marker;
            return true;
        }
        // Run once on each worker thread before its first job.
        virtual void thread_start() {}
    };

    // `copy_threads` threads fill chunks: copy_threads - 1 workers, and the caller when
    // the next chunk to send is not taken yet (copy_threads <= 1: the caller alone);
    // `ring_bytes` of chunks of `chunk_bytes` (at least 2 chunks; allocated on first use).
    // An idle thread polls for a while before it sleeps: waking a sleeping thread costs
    // tens of microseconds (more in a VM), about the time a chunk takes to cross the
    // link, and decode calls come every few hundred microseconds. The polling is left
    // out when the threads would share cores. `tuning`: the measurement knobs (staging_tuning.hpp).
    StagingRing(Transport& transport, unsigned copy_threads, uint64_t ring_bytes, uint64_t chunk_bytes,
                const StagingTuning& tuning = StagingTuning());
    ~StagingRing();
    StagingRing(const StagingRing&) = delete;
    StagingRing& operator=(const StagingRing&) = delete;

    // Queue dst <- src[0, n) (src in pageable host memory).
    expcache_status_t copy(void* dst, const void* src, uint64_t n, void* stream);
    // Queue dst <- file[offset, offset + n).
    expcache_status_t read(void* dst, const SourceFile& file, uint64_t offset, uint64_t n, void* stream);
    // Send everything queued since the last finish(), in order, as it is filled: on
    // return every transfer has been enqueued on its stream. The pieces found filled
    // together go to the link in one send_batch (up to kMaxBatch). The first failure of those
    // jobs, or OK; after a failure the remaining jobs of the batch are dropped, not sent.
    // Called by the thread that queued them.
    expcache_status_t finish();

    uint64_t chunk_bytes() const { return chunk_; }
    static constexpr size_t kMaxBatch = 64;

    // Counters (expcache_staging_stats_t), added to *out; both only between batches.
    void stats(expcache_staging_stats_t* out) const;
    void reset_stats();
    // Fault injection (between batches): the pieces filled after the next `skip` fail, `count`
    // of them, in queue order.
    void inject_failures(uint64_t skip, uint64_t count);

    // What a trace notes (StagingTuning::trace_path), per piece and per call.
    struct TracePiece {
        uint64_t call, bytes, queued, taken, filled, sent, send;
        unsigned filler;  // 0: the calling thread, 1..: a worker
    };
    struct TraceCall {
        uint64_t begun, finishing, finished;
    };

private:
    struct Job {
        char* dst;
        const char* src;  // pageable source, or nullptr for a file
        const SourceFile* file;
        uint64_t offset;  // file offset
        uint64_t n;
        void* stream;
        uint64_t seq;  // this job uses chunk seq % chunks
    };
    struct Chunk {
        void* host = nullptr;
        void* marker = nullptr;
        bool sent = false;              // a transfer out of it may still be reading it
        std::atomic<uint64_t> turn{0};  // the seq of the job allowed to fill it next
        // Written by the job's filler before `filled` is released, read by the sender after.
        Job job{};
        uint64_t delta = 0;  // the job's bytes start at host + delta
        expcache_status_t status = EXPCACHE_OK;
        bool dropped = false;
        std::string message;
        uint64_t filled_ns = 0;           // when it was filled (now_ns), written before `filled`
        std::atomic<uint64_t> filled{0};  // seq + 1 of the last job done filling it
    };

    expcache_status_t queue(const Job& job);
    expcache_status_t allocate();
    void stream_copy(char* dst, const char* src, uint64_t n) const;
    void worker(unsigned index);
    // Take the oldest piece published and not taken (*seq), if there is one.
    bool claim(uint64_t* seq);
    // Fill the chunk of piece `seq`, taken by this thread.
    // `bounce`: the filling thread's own buffer for buffered file reads (allocated on first use);
    // `filler`: 0 for the calling thread, else the worker's number (for the trace).
    void fill_next(uint64_t seq, std::unique_ptr<char[]>& bounce, unsigned filler);
    // The caller's, before it writes piece `seq` into a slot still in use (see queue()).
    void make_room(uint64_t seq);
    // The caller's: deal with piece next_send_ (filled) and the filled pieces behind it (before
    // `end`): send them, or note the piece's failure, or drop it after one.
    void send_round(uint64_t end);
    TracePiece* traced(uint64_t seq) { return seq < trace_pieces_.size() ? &trace_pieces_[seq] : nullptr; }
    void write_trace() const;
    expcache_status_t fill(const Job& job, Chunk& chunk, std::unique_ptr<char[]>& bounce);
    // Add to batch_[*n..] the pieces from seq + *n on (before `end`) that are filled, in order,
    // on `stream`.
    void take_filled(uint64_t seq, uint64_t end, void* stream, uint64_t* n, uint64_t* bytes);
    // Wait until piece `seq` is filled, filling it on this thread if no worker took it.
    void await_filled(uint64_t seq);
    // Sleep on `cv` until ready(), counted in `sleepers`; wake the threads counted in `sleepers`
    // after making their condition true (see the .cpp for the ordering).
    template <typename Ready>
    void sleep_until(std::atomic<unsigned>& sleepers, std::condition_variable& cv, Ready&& ready);
    void wake(std::atomic<unsigned>& sleepers, std::condition_variable& cv);
    // Hand the chunks of pieces [seq, seq + n) back to the fillers, in order.
    void release_turns(uint64_t seq, uint64_t n);
    Chunk& chunk_of(uint64_t seq) { return chunks_[seq % num_chunks_]; }

    Transport& transport_;
    uint64_t ring_bytes_;
    uint64_t chunk_;
    unsigned num_threads_;
    unsigned spin_us_ = 0;
    // The knobs (StagingTuning says what each sets).
    uint64_t nt_max_;                        // see fill()
    bool bounce_;                            // see fill()
    uint64_t coalesce_;                      // a quarter of the ring at most (see send_round())
    uint64_t min_pieces_;                    // see queue()
    bool wide_;                              // and the CPU has AVX-512: copy_nt_wide, else copy_nt (see stream_copy())
    Prefetch prefetch_;                      // copy_nt_wide's (see stream_copy())
    uint64_t short_pieces_;                  // see queue()
    void* last_marker_ = nullptr;            // the caller's: the marker of the last piece sent
    std::unique_ptr<char[]> caller_bounce_;  // the caller's bounce buffer
    std::vector<std::thread> threads_;
    std::unique_ptr<Chunk[]> chunks_;
    uint64_t num_chunks_ = 0;
    std::mutex mu_;
    std::condition_variable work_, turn_, filled_;
    // Queued jobs, by seq in slot seq % kSlots: the caller writes a job, then publishes it
    // (published_); a filler takes the next one (taken_, a compare-and-swap), copies it out and
    // frees the slot for the job kSlots later (free_for).
    struct Slot {
        Job job{};
        std::atomic<uint64_t> free_for{0};
    };
    static constexpr uint64_t kSlots = 1024;
    std::unique_ptr<Slot[]> slots_;
    alignas(64) std::atomic<uint64_t> published_{0};
    alignas(64) std::atomic<uint64_t> taken_{0};
    alignas(64) uint64_t next_seq_ = 0;            // the caller's: seq of the next job queued
    uint64_t next_send_ = 0;                       // the caller's: seq of the next job to send
    bool in_call_ = false;                         // the caller's: pieces were queued since the last finish()
    uint64_t call_first_ = 0;                      // the caller's: the first piece of this call
    expcache_status_t call_status_ = EXPCACHE_OK;  // the caller's: this call's first failure
    std::string call_message_;
    // Threads sleeping on work_, turn_ and filled_; each counts itself before it checks under
    // mu_, and the thread that makes the condition true takes mu_ before it notifies.
    std::atomic<unsigned> sleepers_{0}, turn_waiters_{0}, filled_waiters_{0};
    std::atomic<bool> dropping_{false};  // a job of this batch failed: skip filling the rest
    std::atomic<bool> stop_{false};
    // Counters: the caller's, and (atomic) those any filling thread adds to.
    uint64_t calls_ = 0, pieces_ = 0, bytes_ = 0, sends_ = 0, caller_fills_ = 0, wait_ns_ = 0, send_ns_ = 0;
    uint64_t span_ns_ = 0, first_fill_ns_ = 0;
    uint64_t batch_start_ns_ = 0;       // the caller's: when the first piece of this batch was queued
    Transport::Send batch_[kMaxBatch];  // the caller's: the pieces of one send_batch
    std::atomic<uint64_t> fill_ns_{0}, chunk_waits_{0}, chunk_wait_ns_{0};
    uint64_t inject_from_ = 0, inject_until_ = 0;  // pieces that fail (set between batches)
    std::string trace_path_;                       // empty: no trace
    uint64_t trace_origin_ = 0;                    // now_ns() when the ring was made
    // By seq. call, bytes and queued are written by the caller before the piece is queued; taken,
    // filled and filler by its filler before `filled` is released; sent and send by the caller
    // after that.
    std::vector<TracePiece> trace_pieces_;
    std::vector<TraceCall> trace_calls_;  // the caller's
};

}  // namespace expcache
