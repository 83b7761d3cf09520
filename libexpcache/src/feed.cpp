#include "feed.hpp"

#include <algorithm>
#include <cstring>
#include <new>
#include <system_error>

#include "backend/copy_nt.hpp"
#include "errors.hpp"
#include "kernels/lookup_kernels.hpp"

namespace expcache {

namespace {

// The words the device shares with the host, read and written as the protocol says.
uint64_t load_acquire(const uint64_t* word) {
    return __atomic_load_n(word, __ATOMIC_ACQUIRE);
}
void store_release(uint64_t* word, uint64_t v) {
    __atomic_store_n(word, v, __ATOMIC_RELEASE);
}

uint64_t align_to(uint64_t n, uint64_t to) {
    return (n + to - 1) / to * to;
}

}  // namespace

uint64_t feed_piece(const uint64_t part_bytes[kMaxParts]) {
    uint64_t largest = 0;
    for (int p = 0; p < kMaxParts; ++p) largest = std::max(largest, part_bytes[p]);
    static_assert(kFeedChunk % kFeedAlign == 0, "a chunk is whole O_DIRECT blocks");
    return std::max(kFeedMinPiece, align_to((largest + kFeedPieces - 1) / kFeedPieces, kFeedChunk));
}

uint64_t feed_row_layout(const uint64_t part_bytes[kMaxParts], uint64_t piece, uint64_t part_at[kMaxParts]) {
    uint64_t at = 0;
    for (int p = 0; p < kMaxParts; ++p) {
        part_at[p] = at;
        at += feed_region_bytes(part_bytes[p], piece);
    }
    return at;
}

FeedThreads::~FeedThreads() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
    }
    jobs_cv_.notify_all();
    stop_cv_.notify_all();
    if (poller_.joinable()) poller_.join();
    for (std::thread& t : readers_) t.join();
}

expcache_status_t FeedThreads::watch(const FeedRing& ring) {
    std::unique_ptr<Watched> w(new Watched);
    w->ring = ring;
    std::lock_guard<std::mutex> lock(rings_mu_);
    rings_.push_back(std::move(w));
    if (poller_.joinable()) return EXPCACHE_OK;
    try {
        for (uint32_t i = 0; i < readers_wanted_; ++i) readers_.emplace_back(&FeedThreads::read_loop, this);
        poller_ = std::thread(&FeedThreads::poll, this);
    } catch (const std::system_error& e) {
        // The threads that started stop again (the destructor joins them); no select may be fed.
        rings_.clear();
        return fail(EXPCACHE_ERR_OUT_OF_HOST_MEMORY, "cannot start the feed threads: %s", e.what());
    }
    return EXPCACHE_OK;
}

// The poller holds the queue's lock only to hand over what it found, so the readers take their
// jobs while it spins.
void FeedThreads::poll() {
    using Clock = std::chrono::steady_clock;
    Clock::time_point active = Clock::now();
    std::vector<Job> found;
    for (;;) {
        bool busy = false;
        {
            std::lock_guard<std::mutex> lock(rings_mu_);
            for (const std::unique_ptr<Watched>& w : rings_) busy = issue(*w, &found) || busy;
        }
        {
            std::unique_lock<std::mutex> lock(mu_);
            if (stop_) return;
            if (!found.empty()) {
                jobs_.insert(jobs_.end(), found.begin(), found.end());
                queued_.store(jobs_.size(), std::memory_order_release);
                found.clear();
                jobs_cv_.notify_all();
            }
            const Clock::time_point now = Clock::now();
            if (busy) active = now;
            if (now - active >= kIdleSpin) {
                stop_cv_.wait_for(lock, kIdleSleep);
                continue;
            }
        }
        std::this_thread::yield();
    }
}

bool FeedThreads::issue(Watched& w, std::vector<Job>* out) {
    FeedBox* box = w.ring.box;
    const uint64_t listed = load_acquire(&box->listed);
    const uint64_t seq = listed >> kPublishShift;
    const uint32_t n = static_cast<uint32_t>(listed & kPublishCount);
    if (seq == 0) return false;  // nothing listed yet
    if (seq != w.seq) {
        w.seq = seq;
        w.issued = 0;
    }
    bool issued = false;
    while (w.issued < n) {
        const uint32_t m = w.issued, r = m % kFeedRows;
        // The row's last miss copied out by the device (its tag consumed): it may be filled again.
        if (w.row_used[r] && load_acquire(&box->consumed[r]) != w.row_tag[r]) break;
        const uint64_t tag = seq << kPublishShift | m;
        FeedEntry entry;
        std::memcpy(&entry, &box->entry[m], sizeof entry);  // written before `listed`, which was acquired
        w.row_tag[r] = tag;
        w.row_used[r] = true;
        // Every piece of every part, in the order the grid copies them.
        const bool known = entry.layer < layers_.size() && layers_[entry.layer].registered;
        const size_t first = out->size();
        for (int p = 0; p < kMaxParts; ++p) {
            const uint64_t bytes = known ? layers_[entry.layer].bytes[p] : (p == 0);  // unknown: one failing job
            for (uint32_t q = 0; uint64_t(q) * w.ring.piece < bytes; ++q) out->push_back(Job{&w, r, p, q, tag, entry});
        }
        // The row's readers are done with its last miss (consumed): its pool state is the poller's.
        RowPool& rp = w.pool[r];
        rp.lease = HostPool::Lease();
        rp.counted =
            pool_ && known && entry.expert < layers_[entry.layer].num_experts && !layers_[entry.layer].source.pinned();
        if (rp.counted) {
            const LayerState& l = layers_[entry.layer];
            pool_->set_clock(layers_.clock_at(entry.layer, entry.token));  // the select's time, as a host-side call's
            rp.lease = pool_->begin(entry.layer, entry.expert, l.key_base + entry.expert, l.bytes);
        }
        rp.failed.store(false, std::memory_order_relaxed);
        rp.left.store(static_cast<uint32_t>(out->size() - first), std::memory_order_relaxed);
        ++w.issued;
        issued = true;
    }
    return issued || w.issued < n;  // a miss waits for its row: poll again at once
}

// A reader that ran a job spins (yielding its core) for kIdleSpin before it sleeps, as the
// poller does, so the pieces of a select that comes while selects come start at once rather than
// after a wake-up (about 25 us on an H200 host, per miss).
void FeedThreads::read_loop() {
    using Clock = std::chrono::steady_clock;
    Clock::time_point active = Clock::now();
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
        if (stop_) return;
        if (jobs_.empty()) {
            if (Clock::now() - active < kIdleSpin) {
                lock.unlock();
                while (queued_.load(std::memory_order_acquire) == 0 && Clock::now() - active < kIdleSpin)
                    std::this_thread::yield();
                lock.lock();
                continue;
            }
            jobs_cv_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
            continue;
        }
        const Job job = jobs_.front();
        jobs_.pop_front();
        queued_.store(jobs_.size(), std::memory_order_release);
        lock.unlock();
        run(job);
        active = Clock::now();
        lock.lock();
    }
}

// Bytes [at, at + n) of part p of `expert` into dst. What the CPU copies goes with non-temporal
// stores (copy_nt.hpp), as the staging ring's chunks do: the row's lines reach memory without
// being read first or left dirty in a core's caches, where the GPU's reads across the link would
// have to fetch them. A buffered file read lands in the thread's bounce buffer first for that.
expcache_status_t FeedThreads::fill(unsigned char* dst, const LayerState& l, int p, uint32_t expert, uint64_t at,
                                    uint64_t n, uint64_t* delta) {
    const SourceFile* file = l.source_of(p, expert).file;
    const unsigned char* src = l.source_at(p, expert);
    if (file && file->direct()) return file->read_direct(dst, reinterpret_cast<uintptr_t>(src) + at, n, delta);
    const char* from = reinterpret_cast<const char*>(src + at);
    if (file) {
        thread_local std::unique_ptr<char[]> bounce;
        thread_local uint64_t bounce_bytes = 0;
        if (bounce_bytes < n) {
            bounce.reset(new (std::nothrow) char[n]);
            bounce_bytes = bounce ? n : 0;
        }
        if (!bounce) return file->read(dst, reinterpret_cast<uintptr_t>(src) + at, n);
        expcache_status_t s = file->read(bounce.get(), reinterpret_cast<uintptr_t>(src) + at, n);
        if (s != EXPCACHE_OK) return s;
        from = bounce.get();
    }
    stream_to(dst, from, n);
    return EXPCACHE_OK;
}

void FeedThreads::stream_to(unsigned char* dst, const char* from, uint64_t n) const {
    char* to = reinterpret_cast<char*>(dst);
    if (wide_ && reinterpret_cast<uintptr_t>(to) % 64 == 0)
        copy_nt_wide(to, from, n, kStagingPrefetch);
    else
        copy_nt(to, from, n);
}

// One piece of a miss read into its region of the row (at delta past its start, for O_DIRECT),
// or copied there from its host pool slot (a pool hit), copied on into the slot it fills (a pool
// miss), then its ready word, the failure flagged (and logged, once per miss) when the read failed.
void FeedThreads::run(const Job& job) {
    const FeedRing& ring = job.w->ring;
    RowPool& rp = job.w->pool[job.row];
    const FeedEntry e = job.entry;
    const int p = job.part;
    uint64_t delta = 0;
    expcache_status_t s = EXPCACHE_OK;
    if (e.layer >= layers_.size() || !layers_[e.layer].registered || e.expert >= layers_[e.layer].num_experts) {
        s = fail(EXPCACHE_ERR_INTERNAL, "a device select listed expert %u of layer %u, which no layer has", e.expert,
                 e.layer);
    } else {
        const LayerState& l = layers_[e.layer];
        const uint64_t at = uint64_t(job.piece) * ring.piece;
        const uint64_t n = std::min(ring.piece, l.bytes[p] - at);
        unsigned char* dst = ring.rows + uint64_t(job.row) * ring.row_bytes + ring.part_at[p] +
                             uint64_t(job.piece) * (ring.piece + 2 * kFeedAlign);
        if (rp.lease.hit) {
            stream_to(dst, reinterpret_cast<const char*>(rp.lease.at + rp.lease.part_at[p] + at), n);
        } else {
            s = fill(dst, l, p, e.expert, at, n, &delta);
            if (s == EXPCACHE_OK && rp.lease.slot >= 0)
                std::memcpy(rp.lease.at + rp.lease.part_at[p] + at, dst + delta, n);
        }
    }
    if (s != EXPCACHE_OK) rp.failed.store(true, std::memory_order_relaxed);
    // The miss's last piece ends its lease before its ready word: the row (and rp) may be reused after.
    if (rp.left.fetch_sub(1, std::memory_order_acq_rel) == 1 && pool_)
        pool_->end(rp.lease, !rp.failed.load(std::memory_order_relaxed));
    if (s != EXPCACHE_OK) {
        if (job.w->logged[job.row].exchange(job.tag) != job.tag)
            log_(EXPCACHE_LOG_WARNING,
                 "a device select's miss (expert %u of layer %u) could not be read: %s; the select gave it slot -1 "
                 "and the next select of it reads it again",
                 e.expert, e.layer, last_error());
        clear_last_error();
    }
    ring.box->delta[job.row][p][job.piece] = delta;
    store_release(&ring.box->ready[job.row][p][job.piece], job.tag | (s == EXPCACHE_OK ? 0 : kFeedFailed));
}

}  // namespace expcache
