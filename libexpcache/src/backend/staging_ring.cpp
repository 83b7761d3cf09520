#include "staging_ring.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>

#include "../cores.hpp"
#include "../errors.hpp"
#include "copy_nt.hpp"

namespace expcache {

namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
}

uint64_t now_ns() {
    return static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
            .count());
}

// Poll `ready` for up to `us` microseconds; true as soon as it holds.
template <typename Ready>
bool spin_until(Ready&& ready, unsigned us) {
    if (us == 0) return ready();
    const auto end = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
    for (unsigned i = 1;; ++i) {
        if (ready()) return true;
        cpu_relax();
        if (i % 64 == 0 && std::chrono::steady_clock::now() > end) return ready();
    }
}

}  // namespace

// The three sleeps (no work, a chunk's turn, the caller's wait for a piece) and their wake-ups.
// The conditions are published without mu_. A sleeper counts itself in `sleepers` before it
// checks its condition under mu_; the thread that makes a condition true reads the count after
// that: either it sees the sleeper (and takes mu_, which waits until the sleeper is asleep,
// before it notifies), or the sleeper's check sees the change. Both the change and the check
// are sequentially consistent atomics, as are the count's updates and reads.
template <typename Ready>
void StagingRing::sleep_until(std::atomic<unsigned>& sleepers, std::condition_variable& cv, Ready&& ready) {
    std::unique_lock<std::mutex> lock(mu_);
    sleepers.fetch_add(1);
    cv.wait(lock, ready);
    sleepers.fetch_sub(1);
}

void StagingRing::wake(std::atomic<unsigned>& sleepers, std::condition_variable& cv) {
    if (sleepers.load() == 0) return;
    {
        std::lock_guard<std::mutex> lock(mu_);
    }
    cv.notify_all();
}

StagingRing::StagingRing(Transport& transport, unsigned copy_threads, uint64_t ring_bytes, uint64_t chunk_bytes,
                         const StagingTuning& tuning)
    : transport_(transport),
      ring_bytes_(ring_bytes),
      chunk_(chunk_bytes),
      num_threads_(copy_threads > 0 ? copy_threads - 1 : 0),
      nt_max_(tuning.nt_max_bytes),
      bounce_(tuning.file_bounce),
      coalesce_(tuning.coalesce_bytes),
      min_pieces_(tuning.min_pieces),
      wide_(tuning.wide_stores && copy_nt_wide_supported()),
      prefetch_(tuning.prefetch),
      short_pieces_(tuning.short_pieces) {
    // Poll 1 ms when every worker and the caller have a core of their own (0: unknown).
    unsigned cores = usable_cores();
    spin_us_ = cores > num_threads_ + 1 ? 1000 : 0;
    if (short_pieces_ > StagingTuning::kMaxShortPieces) short_pieces_ = StagingTuning::kMaxShortPieces;
    if (!tuning.trace_path.empty()) {
        const uint64_t pieces = std::min(tuning.trace_pieces, StagingTuning::kMaxTracePieces);
        try {
            trace_pieces_.resize(pieces);
            trace_path_ = tuning.trace_path;
        } catch (const std::exception&) {
            trace_pieces_.clear();  // without the memory for them, no trace
        }
        trace_origin_ = now_ns();
    }
    if (ring_bytes_ / chunk_ < 2) chunk_ = ring_bytes_ / 2 / SourceFile::kDirectAlign * SourceFile::kDirectAlign;
    if (chunk_ < SourceFile::kDirectAlign) chunk_ = SourceFile::kDirectAlign;
    if (coalesce_ > ring_bytes_ / 4) coalesce_ = ring_bytes_ / 4;  // a quarter of the ring at most
}

StagingRing::~StagingRing() {
    finish();
    {
        std::lock_guard<std::mutex> lock(mu_);
        stop_.store(true);
    }
    work_.notify_all();
    for (std::thread& t : threads_) t.join();
    for (uint64_t i = 0; i < num_chunks_; ++i) {
        Chunk& c = chunks_[i];
        if (c.sent) transport_.wait(c.marker);
        transport_.free_chunk(c.host, c.marker);
    }
    if (!trace_path_.empty()) write_trace();
}

// Appends this ring's trace: one line per call, then one per piece; times in ns from the ring's
// making. A measurement aid: a file that cannot be written is skipped without a word.
void StagingRing::write_trace() const {
    FILE* f = std::fopen(trace_path_.c_str(), "a");
    if (!f) return;
    std::fprintf(f, "# ring %p: %u copy threads, %llu-byte chunks\n", static_cast<const void*>(this), num_threads_ + 1,
                 (unsigned long long)chunk_);
    std::fprintf(f, "call,index,begun,finishing,finished\n");
    for (size_t i = 0; i < trace_calls_.size(); ++i)
        std::fprintf(f, "call,%zu,%llu,%llu,%llu\n", i, (unsigned long long)trace_calls_[i].begun,
                     (unsigned long long)trace_calls_[i].finishing, (unsigned long long)trace_calls_[i].finished);
    std::fprintf(f, "piece,seq,call,bytes,queued,taken,filled,sent,send,filler\n");
    const uint64_t pieces = next_seq_ < trace_pieces_.size() ? next_seq_ : trace_pieces_.size();
    for (uint64_t i = 0; i < pieces; ++i) {
        const TracePiece& p = trace_pieces_[i];
        std::fprintf(f, "piece,%llu,%llu,%llu,%llu,%llu,%llu,%llu,%llu,%u\n", (unsigned long long)i,
                     (unsigned long long)p.call, (unsigned long long)p.bytes, (unsigned long long)p.queued,
                     (unsigned long long)p.taken, (unsigned long long)p.filled, (unsigned long long)p.sent,
                     (unsigned long long)p.send, p.filler);
    }
    std::fclose(f);
}

expcache_status_t StagingRing::allocate() {
    uint64_t n = ring_bytes_ / chunk_;
    if (n < 2) n = 2;
    // The queue's slots first: if they cannot be had (bad_alloc, which Cache::upload reports),
    // no pinned chunk has been taken yet, so none is left behind.
    if (!slots_) {
        slots_.reset(new Slot[kSlots]);
        for (uint64_t i = 0; i < kSlots; ++i) slots_[i].free_for.store(i, std::memory_order_relaxed);
    }
    chunks_.reset(new Chunk[n]);
    for (uint64_t i = 0; i < n; ++i) {
        Chunk& c = chunks_[i];
        c.turn.store(i, std::memory_order_relaxed);
        // Room for a chunk plus the alignment slack of an O_DIRECT read around it.
        expcache_status_t s = transport_.alloc_chunk(chunk_ + 2 * SourceFile::kDirectAlign, &c.host, &c.marker);
        if (s != EXPCACHE_OK) {
            std::string why = last_error();
            for (uint64_t j = 0; j < i; ++j) transport_.free_chunk(chunks_[j].host, chunks_[j].marker);
            chunks_.reset();
            return fail(s, "staging ring of %llu x %llu bytes: %s", (unsigned long long)n, (unsigned long long)chunk_,
                        why.c_str());
        }
    }
    num_chunks_ = n;
    for (unsigned i = 0; i < num_threads_; ++i) threads_.emplace_back([this, i] { worker(i + 1); });
    return EXPCACHE_OK;
}

expcache_status_t StagingRing::queue(const Job& job) {
    if (num_chunks_ == 0) {
        expcache_status_t s = allocate();
        if (s != EXPCACHE_OK) return s;
    }
    if (!in_call_) {
        in_call_ = true;
        call_first_ = next_seq_;
        batch_start_ns_ = now_ns();
        if (!trace_path_.empty()) trace_calls_.push_back({batch_start_ns_ - trace_origin_, 0, 0});
    }
    Job part = job;
    uint64_t done = 0;
    // Pieces of this upload: min_pieces_, fewer when they would be under 128 KiB each.
    const uint64_t align = SourceFile::kDirectAlign;
    uint64_t parts = job.n / (128 << 10);
    if (parts > min_pieces_) parts = min_pieces_;
    if (parts < 1) parts = 1;
    const uint64_t spread = (job.n / parts + align - 1) / align * align;
    while (done < job.n) {
        // The first chunks of a batch are short, so the link starts early; later ones are
        // full size, so each transfer is large enough to run at the link's speed.
        uint64_t in_batch = next_seq_ - call_first_;
        uint64_t piece = chunk_ >> (in_batch < short_pieces_ ? short_pieces_ - in_batch : 0);
        // And an upload is cut into min_pieces_ pieces at least (of 128 KiB at least), so that
        // a call of a few small experts still keeps the threads busy.
        if (piece > spread) piece = spread;
        if (piece < SourceFile::kDirectAlign) piece = SourceFile::kDirectAlign;
        part.n = job.n - done < piece ? job.n - done : piece;
        part.dst = job.dst + done;
        part.src = job.src ? job.src + done : nullptr;
        part.offset = job.offset + done;
        part.seq = next_seq_;
        Slot& slot = slots_[part.seq % kSlots];
        if (slot.free_for.load(std::memory_order_acquire) != part.seq) make_room(part.seq);
        if (TracePiece* t = traced(part.seq))
            *t = {trace_calls_.size() - 1, part.n, now_ns() - trace_origin_, 0, 0, 0, 0, 0};
        slot.job = part;
        // Each piece is published as soon as it is written, for a worker to claim (claim()).
        published_.store(++next_seq_);
        done += part.n;
    }
    wake(sleepers_, work_);
    return EXPCACHE_OK;
}

// The slot for piece `seq` still holds piece seq - kSlots, not copied out yet, so not filled
// and not sent: the caller sends the oldest pieces (filling them itself if no worker has) until
// it has sent that one, whose filler freed the slot before it filled the chunk.
void StagingRing::make_room(uint64_t seq) {
    while (slots_[seq % kSlots].free_for.load(std::memory_order_acquire) != seq) {
        await_filled(next_send_);
        send_round(next_seq_);
    }
}

expcache_status_t StagingRing::copy(void* dst, const void* src, uint64_t n, void* stream) {
    return queue({static_cast<char*>(dst), static_cast<const char*>(src), nullptr, 0, n, stream, 0});
}

expcache_status_t StagingRing::read(void* dst, const SourceFile& file, uint64_t offset, uint64_t n, void* stream) {
    return queue({static_cast<char*>(dst), nullptr, &file, offset, n, stream, 0});
}

expcache_status_t StagingRing::Transport::send_batch(const Send* sends, size_t n, void* stream, size_t* sent) {
    *sent = 0;
    for (size_t i = 0; i < n; ++i) {
        expcache_status_t s = send(sends[i].dst, sends[i].src, sends[i].n, stream, sends[i].marker);
        if (s != EXPCACHE_OK) return s;
        ++*sent;
    }
    return EXPCACHE_OK;
}

void StagingRing::await_filled(uint64_t seq) {
    Chunk& c = chunk_of(seq);
    auto ready = [&c, seq] { return c.filled.load(std::memory_order_acquire) == seq + 1; };
    if (ready()) return;
    uint64_t next = seq;
    if (taken_.compare_exchange_strong(next, seq + 1)) {
        ++caller_fills_;
        fill_next(seq, caller_bounce_, 0);  // nobody has taken it: fill it here
        return;
    }
    const uint64_t t0 = now_ns();
    // The check under the lock is sequentially consistent, as wake() needs.
    if (!spin_until(ready, spin_us_))
        sleep_until(filled_waiters_, filled_, [&c, seq] { return c.filled.load() == seq + 1; });
    wait_ns_ += now_ns() - t0;
}

void StagingRing::take_filled(uint64_t seq, uint64_t end, void* stream, uint64_t* n, uint64_t* bytes) {
    while (*n < kMaxBatch && seq + *n < end) {
        Chunk& b = chunk_of(seq + *n);
        if (b.filled.load(std::memory_order_acquire) != seq + *n + 1 || b.status != EXPCACHE_OK || b.dropped ||
            b.job.stream != stream)
            break;
        batch_[(*n)++] = {b.job.dst, static_cast<char*>(b.host) + b.delta, b.job.n, b.marker};
        *bytes += b.job.n;
    }
}

void StagingRing::release_turns(uint64_t seq, uint64_t n) {
    for (uint64_t i = 0; i < n; ++i) chunk_of(seq + i).turn.store(seq + i + num_chunks_);
    wake(turn_waiters_, turn_);
}

expcache_status_t StagingRing::finish() {
    if (!in_call_) return EXPCACHE_OK;
    ++calls_;
    if (!trace_calls_.empty()) trace_calls_.back().finishing = now_ns() - trace_origin_;
    while (next_send_ < next_seq_) {
        await_filled(next_send_);
        send_round(next_seq_);
    }
    const expcache_status_t status = call_status_;
    const std::string message = std::move(call_message_);
    call_status_ = EXPCACHE_OK;
    call_message_.clear();
    dropping_.store(false);
    in_call_ = false;
    span_ns_ += now_ns() - batch_start_ns_;
    if (!trace_calls_.empty()) trace_calls_.back().finished = now_ns() - trace_origin_;
    if (status == EXPCACHE_OK) return status;
    // A worker's detail, on this thread (empty only when formatting it ran out of memory).
    return fail(status, "%s", message.empty() ? "a staging thread ran out of host memory" : message.c_str());
}

void StagingRing::send_round(uint64_t end) {
    const uint64_t seq = next_send_;
    Chunk& c = chunk_of(seq);
    if (seq == call_first_) first_fill_ns_ += c.filled_ns - batch_start_ns_;
    uint64_t n = 1;  // pieces dealt with in this round
    if (call_status_ == EXPCACHE_OK && c.status != EXPCACHE_OK) {
        call_status_ = c.status;
        call_message_ = c.message;
    } else if (call_status_ == EXPCACHE_OK && !c.dropped) {
        // This piece and those behind it that are already filled, on the same stream, go
        // together: a copy engine pays microseconds per transfer, the caller too.
        void* stream = c.job.stream;
        uint64_t bytes = 0;
        n = 0;
        take_filled(seq, end, stream, &n, &bytes);
        // While the link still moves earlier pieces, a short send can wait for the pieces
        // behind it (each send is a gap on the link), up to coalesce_ bytes.
        if (coalesce_ > 0 && last_marker_)
            while (bytes < coalesce_ && n < kMaxBatch && seq + n < end && !transport_.done(last_marker_))
                take_filled(seq, end, stream, &n, &bytes);
        const uint64_t t0 = now_ns();
        size_t sent = 0;
        expcache_status_t s = transport_.send_batch(batch_, n, stream, &sent);
        const uint64_t t1 = now_ns();
        send_ns_ += t1 - t0;
        if (sent > 0) {
            ++sends_;
            last_marker_ = batch_[sent - 1].marker;
        }
        for (size_t i = 0; i < sent; ++i) {
            if (TracePiece* t = traced(seq + i)) {
                t->sent = t1 - trace_origin_;
                t->send = sends_;
            }
            chunk_of(seq + i).sent = true;
            ++pieces_;
            bytes_ += batch_[i].n;
        }
        if (s != EXPCACHE_OK) {
            call_status_ = s;
            call_message_ = last_error();
        }
    }
    if (call_status_ != EXPCACHE_OK) dropping_.store(true);
    next_send_ += n;
    release_turns(seq, n);
}

void StagingRing::worker(unsigned index) {
    transport_.thread_start();
    std::unique_ptr<char[]> bounce;
    for (;;) {
        // Poll for a piece and claim it (claim()): idle workers read two counters, and the
        // caller publishes pieces without a lock.
        uint64_t seq = 0;
        bool claimed = false;
        spin_until([&] { return stop_.load() || (claimed = claim(&seq)); }, spin_us_);
        if (!claimed) {
            sleep_until(sleepers_, work_, [&] { return stop_.load() || (claimed = claim(&seq)); });
            if (!claimed) return;  // stop_: the destructor finished every call, nothing is queued
        }
        fill_next(seq, bounce, index);
    }
}

bool StagingRing::claim(uint64_t* seq) {
    uint64_t t = taken_.load(std::memory_order_acquire);
    while (t < published_.load())
        if (taken_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) {
            *seq = t;
            return true;
        }
    return false;
}

void StagingRing::fill_next(uint64_t seq, std::unique_ptr<char[]>& bounce, unsigned filler) {
    Slot& slot = slots_[seq % kSlots];
    const Job job = slot.job;
    slot.free_for.store(seq + kSlots, std::memory_order_release);  // the caller may reuse the slot
    Chunk& c = chunk_of(seq);
    // The chunk's previous job was queued earlier: the caller sends it in order.
    if (c.turn.load(std::memory_order_acquire) != seq)
        sleep_until(turn_waiters_, turn_, [&c, seq] { return c.turn.load() == seq; });
    const bool drop = dropping_.load();
    // The pieces in [inject_from_, inject_until_) fail, unless their call has failed already.
    const bool injected = !drop && seq >= inject_from_ && seq < inject_until_;
    TracePiece* trace = traced(job.seq);
    if (trace) {
        trace->taken = now_ns() - trace_origin_;
        trace->filler = filler;
    }
    c.job = job;
    c.delta = 0;
    c.dropped = drop;
    // Nothing may escape a worker thread (std::terminate): an allocation failure while
    // formatting an error message becomes a status too.
    try {
        c.status = drop ? EXPCACHE_OK
                   : injected
                       ? fail(EXPCACHE_ERR_CUDA, "injected staging failure (piece %llu)", (unsigned long long)job.seq)
                       : fill(job, c, bounce);
        c.message = c.status == EXPCACHE_OK ? std::string() : std::string(last_error());
    } catch (...) {
        c.status = EXPCACHE_ERR_OUT_OF_HOST_MEMORY;
        c.message.clear();
    }
    c.filled_ns = now_ns();
    if (trace) trace->filled = c.filled_ns - trace_origin_;
    c.filled.store(job.seq + 1);  // published without the lock (see wake())
    wake(filled_waiters_, filled_);
}

expcache_status_t StagingRing::fill(const Job& job, Chunk& c, std::unique_ptr<char[]>& bounce) {
    expcache_status_t s;
    uint64_t t0 = now_ns();
    if (c.sent) {
        s = transport_.wait(c.marker);
        const uint64_t t1 = now_ns();
        chunk_waits_.fetch_add(1, std::memory_order_relaxed);
        chunk_wait_ns_.fetch_add(t1 - t0, std::memory_order_relaxed);
        t0 = t1;
        if (s != EXPCACHE_OK) return s;
        c.sent = false;
    }
    // The link reads a chunk at half its speed while the chunk's lines sit dirty in the
    // private cache of the core that filled it (21-28 GB/s against 40-46 on an H200 host,
    // `make copy-methods`, docs/transfers.md), and the caller sends each piece as soon as it is
    // filled. So chunks are written with non-temporal stores, which send the lines to memory
    // without reading them first: pageable pieces directly, buffered file pieces through a
    // bounce buffer of the thread's own that pread fills (it stays in that core's cache).
    char* host = static_cast<char*>(c.host);
    if (job.src) {
        if (job.n <= nt_max_)
            stream_copy(host, job.src, job.n);
        else
            std::memcpy(host, job.src, job.n);
        s = EXPCACHE_OK;
    } else if (job.file->direct()) {
        s = job.file->read_direct(host, job.offset, job.n, &c.delta);
    } else {
        if (bounce_ && !bounce) bounce.reset(new (std::nothrow) char[chunk_]);  // pieces are <= chunk_
        if (bounce) {
            s = job.file->read(bounce.get(), job.offset, job.n);
            if (s == EXPCACHE_OK) stream_copy(host, bounce.get(), job.n);
        } else {
            s = job.file->read(host, job.offset, job.n);  // without one (none wanted, or no memory)
        }
    }
    fill_ns_.fetch_add(now_ns() - t0, std::memory_order_relaxed);
    return s;
}

void StagingRing::stream_copy(char* dst, const char* src, uint64_t n) const {
    if (wide_ && reinterpret_cast<uintptr_t>(dst) % 64 == 0)
        copy_nt_wide(dst, src, n, prefetch_);
    else
        copy_nt(dst, src, n);
}

void StagingRing::stats(expcache_staging_stats_t* out) const {
    out->calls += calls_;
    out->pieces += pieces_;
    out->bytes += bytes_;
    out->sends += sends_;
    out->span_ns += span_ns_;
    out->first_fill_ns += first_fill_ns_;
    out->caller_fills += caller_fills_;
    out->fill_ns += fill_ns_.load(std::memory_order_relaxed);
    out->chunk_waits += chunk_waits_.load(std::memory_order_relaxed);
    out->chunk_wait_ns += chunk_wait_ns_.load(std::memory_order_relaxed);
    out->wait_ns += wait_ns_;
    out->send_ns += send_ns_;
}

void StagingRing::inject_failures(uint64_t skip, uint64_t count) {
    inject_from_ = next_seq_ + skip;
    inject_until_ = inject_from_ + count;
}

void StagingRing::reset_stats() {
    calls_ = pieces_ = bytes_ = sends_ = caller_fills_ = wait_ns_ = send_ns_ = span_ns_ = first_fill_ns_ = 0;
    fill_ns_.store(0);
    chunk_waits_.store(0);
    chunk_wait_ns_.store(0);
}

}  // namespace expcache
