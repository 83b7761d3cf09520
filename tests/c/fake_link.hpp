// What the C++ unit tests of the link's users share (tests/c/ring_test.cpp, tests/c/prefetch_test.cpp):
// CHECK, and a fake link that behaves like a DMA engine: a transfer is only recorded when it is
// sent, and its bytes are read out of the source later, when it is waited for (or at drain(), as
// a stream synchronization would). A source refilled before its transfer was waited for therefore
// corrupts the destination, and the link can refuse the Nth transfer.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <vector>

#include "backend/staging_ring.hpp"
#include "errors.hpp"

namespace expcache_test {

inline int checks = 0, failures = 0;

#define CHECK(cond, ...)                                                  \
    do {                                                                  \
        ++expcache_test::checks;                                          \
        if (!(cond)) {                                                    \
            ++expcache_test::failures;                                    \
            std::printf("FAILED %s:%d: %s: ", __FILE__, __LINE__, #cond); \
            std::printf(__VA_ARGS__);                                     \
            std::printf("\n");                                            \
        }                                                                 \
    } while (0)

// A transfer in flight: its bytes still sit in the chunk.
struct Marker {
    bool pending = false;
    void* dst = nullptr;
    const void* src = nullptr;
    uint64_t n = 0;
    uint64_t polls = 0;  // done() asked since it was sent
};

class FakeLink final : public expcache::StagingRing::Transport {
public:
    expcache_status_t alloc_chunk(uint64_t bytes, void** host, void** marker) override {
        *host = std::aligned_alloc(4096, (bytes + 4095) & ~uint64_t(4095));
        Marker* m = new Marker;
        *marker = m;
        std::lock_guard<std::mutex> lock(mu_);
        markers_.push_back(m);
        return EXPCACHE_OK;
    }
    void free_chunk(void* host, void* marker) override {
        std::lock_guard<std::mutex> lock(mu_);
        Marker* m = static_cast<Marker*>(marker);
        if (m->pending) ++freed_in_flight_;
        for (Marker*& k : markers_)
            if (k == m) k = nullptr;
        delete m;
        std::free(host);
    }
    expcache_status_t send(void* dst, const void* src, uint64_t n, void*, void* marker) override {
        std::lock_guard<std::mutex> lock(mu_);
        const uint64_t index = transfers_++;
        if (index >= fail_from_ && index < fail_until_)
            return expcache::fail(EXPCACHE_ERR_CUDA, "fake link refused transfer %llu", (unsigned long long)index);
        Marker* m = static_cast<Marker*>(marker);
        if (m->pending) ++resent_in_flight_;  // sent again before the ring waited for its last transfer
        *m = {true, dst, src, n, 0};
        ++sent_;
        largest_ = n > largest_ ? n : largest_;
        uint64_t pending = 0, bytes = 0;
        for (const Marker* k : markers_)
            if (k && k->pending) {
                ++pending;
                bytes += k->n;
            }
        max_pending_ = pending > max_pending_ ? pending : max_pending_;
        max_pending_bytes_ = bytes > max_pending_bytes_ ? bytes : max_pending_bytes_;
        return EXPCACHE_OK;
    }
    expcache_status_t send_batch(const Send* sends, size_t n, void* stream, size_t* sent) override {
        {
            std::lock_guard<std::mutex> lock(mu_);
            batches_.push_back(n);
        }
        return Transport::send_batch(sends, n, stream, sent);  // one send() each, in order
    }
    expcache_status_t wait(void* marker) override {
        std::lock_guard<std::mutex> lock(mu_);
        land(static_cast<Marker*>(marker));
        return EXPCACHE_OK;
    }
    // A transfer completes on its own after it has been asked about `busy_polls_` times.
    bool done(void* marker) override {
        std::lock_guard<std::mutex> lock(mu_);
        Marker* m = static_cast<Marker*>(marker);
        ++polls_;
        if (m->pending && ++m->polls > busy_polls_) land(m);
        return !m->pending;
    }

    // Every transfer still in flight lands, as a stream synchronization would make it.
    void drain() {
        std::lock_guard<std::mutex> lock(mu_);
        for (Marker* m : markers_)
            if (m) land(m);
    }
    // Transfers `from`.. `from + count - 1` counted from now are refused.
    void fail_transfers(uint64_t from, uint64_t count) {
        std::lock_guard<std::mutex> lock(mu_);
        fail_from_ = transfers_ + from;
        fail_until_ = fail_from_ + count;
    }

    // Read by the test between calls, when no thread of the ring sends or waits.
    uint64_t sent_ = 0, resent_in_flight_ = 0, freed_in_flight_ = 0, polls_ = 0, largest_ = 0;
    uint64_t max_pending_ = 0, max_pending_bytes_ = 0;  // the most transfers (bytes) in flight at once
    std::vector<size_t> batches_;
    uint64_t busy_polls_ = 0;  // set before the ring runs

private:
    static void land(Marker* m) {
        if (!m->pending) return;
        std::memcpy(m->dst, m->src, m->n);
        m->pending = false;
    }
    std::mutex mu_;
    std::vector<Marker*> markers_;
    uint64_t transfers_ = 0;
    uint64_t fail_from_ = UINT64_MAX, fail_until_ = UINT64_MAX;
};

inline std::vector<char> random_bytes(size_t n, unsigned seed) {
    std::vector<char> v(n);
    std::mt19937 rng(seed);
    for (char& c : v) c = static_cast<char>(rng());
    return v;
}

}  // namespace expcache_test
