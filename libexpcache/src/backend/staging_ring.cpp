#include "staging_ring.hpp"

#include <chrono>
#include <cstring>

#include "../errors.hpp"

namespace expcache {

namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
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

StagingRing::StagingRing(Transport& transport, unsigned copy_threads, uint64_t ring_bytes, uint64_t chunk_bytes)
    : transport_(transport), ring_bytes_(ring_bytes), chunk_(chunk_bytes),
      num_threads_(copy_threads > 0 ? copy_threads - 1 : 0) {
    // Poll 1 ms when every worker and the caller have a core of their own (0: unknown).
    unsigned cores = std::thread::hardware_concurrency();
    spin_us_ = cores > num_threads_ + 1 ? 1000 : 0;
    if (ring_bytes_ / chunk_ < 2) chunk_ = ring_bytes_ / 2 / SourceFile::kDirectAlign * SourceFile::kDirectAlign;
    if (chunk_ < SourceFile::kDirectAlign) chunk_ = SourceFile::kDirectAlign;
}

StagingRing::~StagingRing() {
    finish();
    {
        std::lock_guard<std::mutex> lock(mu_);
        stop_.store(true);
    }
    work_.notify_all();
    for (std::thread& t : threads_) t.join();
    for (Chunk& c : chunks_) {
        if (c.sent) transport_.wait(c.marker);
        transport_.free_chunk(c.host, c.marker);
    }
}

expcache_status_t StagingRing::allocate() {
    uint64_t n = ring_bytes_ / chunk_;
    if (n < 2) n = 2;
    chunks_.resize(n);
    for (uint64_t i = 0; i < n; ++i) {
        Chunk& c = chunks_[i];
        c.turn = i;
        // Room for a chunk plus the alignment slack of an O_DIRECT read around it.
        expcache_status_t s = transport_.alloc_chunk(chunk_ + 2 * SourceFile::kDirectAlign, &c.host, &c.marker);
        if (s != EXPCACHE_OK) {
            std::string why = last_error();
            for (uint64_t j = 0; j < i; ++j) transport_.free_chunk(chunks_[j].host, chunks_[j].marker);
            chunks_.clear();
            return fail(s, "staging ring of %llu x %llu bytes: %s", (unsigned long long)n, (unsigned long long)chunk_,
                        why.c_str());
        }
    }
    for (unsigned i = 0; i < num_threads_; ++i) threads_.emplace_back([this] { worker(); });
    return EXPCACHE_OK;
}

expcache_status_t StagingRing::queue(const Job& job) {
    if (chunks_.empty()) {
        expcache_status_t s = allocate();
        if (s != EXPCACHE_OK) return s;
    }
    // The first chunks of a batch are short, so the link starts early; later ones are full
    // size, so each transfer is large enough to run at the link's speed.
    Job part = job;
    uint64_t done = 0;
    while (done < job.n) {
        std::unique_lock<std::mutex> lock(mu_);
        uint64_t busy = unfinished_.load(std::memory_order_relaxed);
        uint64_t ramp = chunk_ >> (busy < 3 ? 3 - busy : 0);
        if (ramp < SourceFile::kDirectAlign) ramp = SourceFile::kDirectAlign;
        part.n = job.n - done < ramp ? job.n - done : ramp;
        part.dst = job.dst + done;
        part.src = job.src ? job.src + done : nullptr;
        part.offset = job.offset + done;
        part.seq = next_seq_++;
        queue_.push_back(part);
        queued_.fetch_add(1, std::memory_order_release);
        unfinished_.fetch_add(1, std::memory_order_release);
        lock.unlock();
        work_.notify_one();
        done += part.n;
    }
    return EXPCACHE_OK;
}

expcache_status_t StagingRing::copy(void* dst, const void* src, uint64_t n, void* stream) {
    return queue({static_cast<char*>(dst), static_cast<const char*>(src), nullptr, 0, n, stream, 0});
}

expcache_status_t StagingRing::read(void* dst, const SourceFile& file, uint64_t offset, uint64_t n, void* stream) {
    return queue({static_cast<char*>(dst), nullptr, &file, offset, n, stream, 0});
}

expcache_status_t StagingRing::finish() {
    std::unique_lock<std::mutex> lock(mu_);
    while (unfinished_.load(std::memory_order_acquire) > 0) {
        if (!queue_.empty()) {
            run_one(lock);
            continue;
        }
        // The last jobs are running on workers: they end within a chunk's time.
        lock.unlock();
        bool done = spin_until([this] { return unfinished_.load(std::memory_order_acquire) == 0; }, spin_us_);
        lock.lock();
        if (!done) done_.wait(lock, [this] { return unfinished_.load(std::memory_order_acquire) == 0; });
    }
    expcache_status_t s = status_;
    std::string message;
    message.swap(message_);
    status_ = EXPCACHE_OK;
    lock.unlock();
    return s == EXPCACHE_OK ? s : fail(s, "%s", message.c_str());  // a worker's detail, on this thread
}

void StagingRing::worker() {
    transport_.thread_start();
    for (;;) {
        spin_until([this] { return queued_.load(std::memory_order_acquire) > 0 || stop_.load(); }, spin_us_);
        std::unique_lock<std::mutex> lock(mu_);
        work_.wait(lock, [this] { return stop_.load() || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_, nothing left
        run_one(lock);
    }
}

void StagingRing::run_one(std::unique_lock<std::mutex>& lock) {
    Job job = queue_.front();
    queue_.pop_front();
    queued_.fetch_sub(1, std::memory_order_relaxed);
    Chunk& chunk = chunks_[job.seq % chunks_.size()];
    // The job before this one on the same chunk was popped earlier: it finishes with it.
    turn_.wait(lock, [&] { return chunk.turn == job.seq; });
    bool dropped = status_ != EXPCACHE_OK;
    lock.unlock();
    expcache_status_t s = dropped ? EXPCACHE_OK : fill_and_send(job, chunk);
    std::string message = s == EXPCACHE_OK ? std::string() : std::string(last_error());
    lock.lock();
    chunk.turn = job.seq + chunks_.size();
    turn_.notify_all();
    if (s != EXPCACHE_OK && status_ == EXPCACHE_OK) {
        status_ = s;
        message_ = message;
    }
    if (unfinished_.fetch_sub(1, std::memory_order_acq_rel) == 1) done_.notify_all();
}

expcache_status_t StagingRing::fill_and_send(const Job& job, Chunk& chunk) {
    expcache_status_t s;
    if (chunk.sent) {
        if ((s = transport_.wait(chunk.marker)) != EXPCACHE_OK) return s;
        chunk.sent = false;
    }
    char* host = static_cast<char*>(chunk.host);
    uint64_t delta = 0;
    if (job.src) {
        std::memcpy(host, job.src, job.n);
    } else if (job.file->direct()) {
        if ((s = job.file->read_direct(host, job.offset, job.n, &delta)) != EXPCACHE_OK) return s;
    } else if ((s = job.file->read(host, job.offset, job.n)) != EXPCACHE_OK) {
        return s;
    }
    if ((s = transport_.send(job.dst, host + delta, job.n, job.stream, chunk.marker)) != EXPCACHE_OK) return s;
    chunk.sent = true;
    return EXPCACHE_OK;
}

}  // namespace expcache
