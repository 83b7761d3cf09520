#include "prefetcher.hpp"

#include <algorithm>
#include <cstring>

#include "errors.hpp"

namespace expcache {

Prefetcher::Prefetcher(StagingRing::Transport& link, void* stream, uint64_t piece_bytes)
    : link_(link), stream_(stream), piece_bytes_(piece_bytes) {}

Prefetcher::~Prefetcher() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
        queue_.clear();
    }
    wake_.notify_all();
    if (thread_.joinable()) thread_.join();  // after the transfers in flight landed
    for (Transfer& t : ring_)
        if (t.marker) link_.free_chunk(t.bounce, t.marker);
}

void Prefetcher::submit(const PrefetchJob& job) {
    std::lock_guard<std::mutex> lock(mu_);
    // The thread first: when it cannot start, nothing is queued (the caller frees the slot, and
    // no later thread sends into it; drain() never waits for a queue no thread serves).
    if (!thread_.joinable()) thread_ = std::thread(&Prefetcher::run, this);
    queue_.push_back(job);
    // A pinned source costs the caller only the enqueue: start the link now rather than after
    // the thread wakes. Others (a memcpy or a read first) wait for the thread.
    if (job.source.pinned()) fill();
    wake_.notify_one();
}

void Prefetcher::run() {
    link_.thread_start();
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
        wake_.wait(lock, [&] { return stop_ || in_flight_ > 0 || (!paused_ && !queue_.empty()); });
        if (!stop_) fill();
        if (in_flight_ == 0) {
            landed_.notify_all();  // drain() may be waiting for a queue that failed empty
            if (stop_) return;
            continue;
        }
        // Wait for the oldest transfer; the next one is already queued behind it.
        void* marker = ring_[head_].marker;
        lock.unlock();
        expcache_status_t s = link_.wait(marker);
        std::string why = s == EXPCACHE_OK ? std::string() : last_error();
        lock.lock();
        head_ = (head_ + 1) % kDepth;
        --in_flight_;
        if (s != EXPCACHE_OK && error_ == EXPCACHE_OK) {
            error_ = s;
            message_ = "a prefetch piece failed: " + why;
        }
        landed_.notify_all();
    }
}

void Prefetcher::fill() {
    while (!paused_ && !queue_.empty() && in_flight_ < kDepth) send_next();
}

bool Prefetcher::send_next() {
    PrefetchJob& job = queue_.front();
    Transfer& t = ring_[(head_ + in_flight_) % kDepth];
    const uint64_t most = std::max<uint64_t>(piece_bytes_ / kDepth, 1);
    expcache_status_t s = EXPCACHE_OK;
    if (!t.marker) s = link_.alloc_chunk(most, &t.bounce, &t.marker);
    if (s == EXPCACHE_OK) {
        const PrefetchJob::Part& p = job.parts[job.part];
        const uint64_t n = std::min(most, p.bytes - job.offset);
        unsigned char* dst = p.dst + job.offset;
        if (job.source.pinned()) {
            s = link_.send(dst, p.src + job.offset, n, stream_, t.marker);
        } else {
            s = job.part_source(job.part).fill(static_cast<unsigned char*>(t.bounce), p.src, job.offset, n);
            if (s == EXPCACHE_OK) s = link_.send(dst, t.bounce, n, stream_, t.marker);
        }
        if (s == EXPCACHE_OK) {
            ++in_flight_;
            bytes_sent_ += n;
            ++pieces_;
            job.offset += n;
            if (job.offset == p.bytes) {
                job.offset = 0;
                if (++job.part == job.num_parts) {
                    done_.push_back(job);
                    queue_.pop_front();
                }
            }
            return true;
        }
    }
    if (error_ == EXPCACHE_OK) {
        error_ = s;
        message_ = std::string("a prefetch piece failed: ") + last_error();
    }
    failed_.push_back(job);
    queue_.pop_front();
    return false;
}

void Prefetcher::take(bool cancel, Taken* out) {
    std::lock_guard<std::mutex> lock(mu_);
    out->done.insert(out->done.end(), done_.begin(), done_.end());
    done_.clear();
    out->failed.insert(out->failed.end(), failed_.begin(), failed_.end());
    failed_.clear();
    if (cancel) {
        out->cancelled.insert(out->cancelled.end(), queue_.begin(), queue_.end());
        queue_.clear();
    }
    if (error_ != EXPCACHE_OK && out->error == EXPCACHE_OK) {
        out->error = error_;
        out->message = message_;
    }
    error_ = EXPCACHE_OK;
}

void Prefetcher::pause(bool paused) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        paused_ = paused;
    }
    wake_.notify_all();
    landed_.notify_all();
}

size_t Prefetcher::drain() {
    std::unique_lock<std::mutex> lock(mu_);
    landed_.wait(lock, [&] { return in_flight_ == 0 && (queue_.empty() || paused_); });
    return queue_.size();
}

uint64_t Prefetcher::bytes_sent() const {
    std::lock_guard<std::mutex> lock(mu_);
    return bytes_sent_;
}

uint64_t Prefetcher::pieces() const {
    std::lock_guard<std::mutex> lock(mu_);
    return pieces_;
}

void Prefetcher::reset_counters() {
    std::lock_guard<std::mutex> lock(mu_);
    bytes_sent_ = pieces_ = 0;
}

}  // namespace expcache
