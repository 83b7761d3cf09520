// Unit test of the prefetch thread (libexpcache/src/prefetcher.cpp) over the fake link of
// tests/c/fake_link.hpp, whose transfers land only when waited for: at most one piece's bytes
// are ever in flight, as kDepth transfers; a cancelled job's progress (part, offset) says exactly
// which bytes were sent, so finishing the rest by hand gives the source's bytes; pageable jobs'
// bounce memory is never refilled under a transfer; a refused transfer fails its job; pause,
// drain (while paused: after the pieces in flight landed) and destruction with transfers in flight. Then a caller
// thread submitting and cancelling against the thread for a while (the case for ThreadSanitizer). Built with the
// sanitizers by tests/sanitize.mk (`make prefetch-test`, `make prefetch-tsan-test`).
//
//   prefetch_test        every case; prints "prefetch_test: N checks, F failed" and exits 1 on a failure
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "fake_link.hpp"
#include "prefetcher.hpp"

using expcache::Prefetcher;
using expcache::PrefetchJob;
using expcache_test::FakeLink;
using expcache_test::random_bytes;

namespace {

// One expert: three parts of `sizes` in `src`, copied to `dst` (contiguous, like a slot).
struct Expert {
    std::vector<char> src, dst;
    uint64_t sizes[3];
    Expert(uint64_t a, uint64_t b, uint64_t c, unsigned seed)
        : src(random_bytes(a + b + c, seed)), dst(a + b + c, 0), sizes{a, b, c} {}
    PrefetchJob job(int slot, bool pinned) {
        PrefetchJob j;
        j.cls = 0;
        j.slot = slot;
        j.source.kind = pinned ? EXPCACHE_SOURCE_PINNED : EXPCACHE_SOURCE_PAGEABLE;
        uint64_t off = 0;
        for (int p = 0; p < 3; ++p) {
            j.parts[p] = {reinterpret_cast<unsigned char*>(dst.data()) + off,
                          reinterpret_cast<const unsigned char*>(src.data()) + off, sizes[p]};
            off += sizes[p];
        }
        j.num_parts = 3;
        return j;
    }
    // What a select does with a cut-short prefetch: the bytes from (part, offset) on.
    void finish(const PrefetchJob& j) {
        for (int p = j.part; p < j.num_parts; ++p) {
            const uint64_t from = p == j.part ? j.offset : 0;
            std::memcpy(j.parts[p].dst + from, j.parts[p].src + from, j.parts[p].bytes - from);
        }
    }
    bool whole() const { return dst == src; }
};

void wait_for(Prefetcher& pf, size_t jobs, Prefetcher::Taken* got) {
    // Until `jobs` are done or failed (the thread sends while the test waits).
    for (int i = 0; i < 20000 && got->done.size() + got->failed.size() < jobs; ++i) {
        pf.take(false, got);
        std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
}

void test_every_byte_lands_with_one_piece_in_flight_at_most() {
    for (bool pinned : {true, false}) {
        FakeLink link;
        const uint64_t piece = 64 << 10;
        std::vector<Expert> experts;
        for (int i = 0; i < 6; ++i) experts.emplace_back(100000 + 4096 * i, 70001, 123457, 10 + i);
        {
            Prefetcher pf(link, nullptr, piece);
            for (int i = 0; i < 6; ++i) pf.submit(experts[i].job(i, pinned));
            pf.drain();
            Prefetcher::Taken got;
            pf.take(false, &got);
            CHECK(got.done.size() == 6 && got.failed.empty() && got.error == EXPCACHE_OK, "%zu done, %zu failed",
                  got.done.size(), got.failed.size());
            uint64_t total = 0;
            for (const Expert& e : experts) total += e.src.size();
            CHECK(pf.bytes_sent() == total, "%llu of %llu bytes sent", (unsigned long long)pf.bytes_sent(),
                  (unsigned long long)total);
        }
        link.drain();
        for (int i = 0; i < 6; ++i) CHECK(experts[i].whole(), "expert %d (pinned %d) differs", i, pinned);
        CHECK(link.max_pending_ <= Prefetcher::kDepth && link.max_pending_bytes_ <= piece,
              "%llu transfers, %llu bytes in flight at once (pinned %d)", (unsigned long long)link.max_pending_,
              (unsigned long long)link.max_pending_bytes_, pinned);
        CHECK(link.max_pending_ == Prefetcher::kDepth, "the next transfer is queued while one crosses (%llu)",
              (unsigned long long)link.max_pending_);
        CHECK(link.largest_ <= piece / Prefetcher::kDepth, "a transfer of %llu bytes",
              (unsigned long long)link.largest_);
        CHECK(link.resent_in_flight_ == 0 && link.freed_in_flight_ == 0, "resent %llu, freed %llu in flight",
              (unsigned long long)link.resent_in_flight_, (unsigned long long)link.freed_in_flight_);
    }
}

void test_a_cancelled_jobs_progress_is_exact() {
    for (bool pinned : {true, false}) {
        for (int wait_us : {0, 50, 300}) {
            FakeLink link;
            std::vector<Expert> experts;
            for (int i = 0; i < 4; ++i) experts.emplace_back(300000, 300000, 250001, 40 + i);
            Prefetcher::Taken got;
            {
                Prefetcher pf(link, nullptr, 32 << 10);
                for (int i = 0; i < 4; ++i) pf.submit(experts[i].job(i, pinned));
                std::this_thread::sleep_for(std::chrono::microseconds(wait_us));
                pf.take(true, &got);
                CHECK(got.done.size() + got.cancelled.size() == 4 && got.failed.empty(), "%zu + %zu of 4",
                      got.done.size(), got.cancelled.size());
                const uint64_t sent = pf.pieces();
                std::this_thread::sleep_for(std::chrono::microseconds(500));
                CHECK(pf.pieces() == sent, "%llu transfers after the cancel", (unsigned long long)(pf.pieces() - sent));
            }  // the destructor waits for the transfers in flight
            link.drain();
            for (const PrefetchJob& j : got.cancelled) experts[j.slot].finish(j);
            for (int i = 0; i < 4; ++i)
                CHECK(experts[i].whole(), "expert %d (pinned %d, cancel after %d us) differs", i, pinned, wait_us);
            CHECK(link.resent_in_flight_ == 0 && link.freed_in_flight_ == 0, "resent %llu, freed %llu in flight",
                  (unsigned long long)link.resent_in_flight_, (unsigned long long)link.freed_in_flight_);
        }
    }
}

void test_a_refused_transfer_fails_its_job() {
    FakeLink link;
    Expert a(50000, 50000, 50000, 1), b(50000, 50000, 50000, 2);
    link.fail_transfers(3, 1);
    Prefetcher pf(link, nullptr, 16 << 10);
    pf.submit(a.job(0, false));
    pf.submit(b.job(1, false));
    Prefetcher::Taken got;
    wait_for(pf, 2, &got);
    CHECK(got.failed.size() == 1 && got.failed[0].slot == 0, "%zu failed", got.failed.size());
    CHECK(got.done.size() == 1 && got.done[0].slot == 1, "%zu done", got.done.size());
    CHECK(got.error == EXPCACHE_ERR_CUDA && got.message.find("refused") != std::string::npos, "error %d: %s", got.error,
          got.message.c_str());
    Prefetcher::Taken again;
    pf.take(false, &again);
    CHECK(again.error == EXPCACHE_OK, "an error is reported once");
}

void test_pause_holds_the_queue_and_drain_waits() {
    FakeLink link;
    Expert a(200000, 1, 1, 3);
    Prefetcher pf(link, nullptr, 8 << 10);
    pf.pause(true);
    pf.submit(a.job(0, true));
    CHECK(pf.drain() == 1, "drain while paused returns, the job still queued");
    CHECK(pf.pieces() == 0, "%llu transfers while paused", (unsigned long long)pf.pieces());
    pf.pause(false);
    CHECK(pf.drain() == 0, "drain after the pause leaves nothing queued");
    Prefetcher::Taken got;
    pf.take(false, &got);
    CHECK(got.done.size() == 1, "%zu done after the pause", got.done.size());
    link.drain();
    CHECK(a.whole(), "the expert differs");
}

// Paused while pieces cross: drain waits for them to land before it says what stays queued.
void test_drain_while_paused_lands_the_pieces_in_flight() {
    FakeLink link;
    Expert a(1 << 20, 1, 1, 4);
    Prefetcher pf(link, nullptr, 8 << 10);
    pf.submit(a.job(0, true));  // pinned: the first transfers leave from this thread, in flight now
    pf.pause(true);
    const size_t left = pf.drain();
    const uint64_t sent = pf.bytes_sent();
    CHECK(sent > 0 && left == (sent < a.src.size() ? 1u : 0u), "%zu queued after %llu bytes sent", left,
          (unsigned long long)sent);
    CHECK(std::memcmp(a.dst.data(), a.src.data(), sent) == 0, "the %llu bytes sent have not all landed",
          (unsigned long long)sent);
    pf.pause(false);
    CHECK(pf.drain() == 0, "drain after the pause leaves nothing queued");
    link.drain();
    CHECK(a.whole(), "the expert differs");
}

// A caller thread submits and cancels while the thread sends, as serving calls do.
void test_submit_and_cancel_against_the_thread() {
    FakeLink link;
    std::mt19937 rng(5);
    std::vector<Expert> experts;
    for (int i = 0; i < 64; ++i) experts.emplace_back(20000 + rng() % 90000, 1 + rng() % 70000, 4096, 100 + i);
    std::vector<PrefetchJob> cancelled;
    size_t done = 0;
    {
        Prefetcher pf(link, nullptr, 16 << 10);
        for (int round = 0; round < 16; ++round) {
            for (int i = 0; i < 4; ++i) pf.submit(experts[round * 4 + i].job(round * 4 + i, (rng() & 1) != 0));
            std::this_thread::sleep_for(std::chrono::microseconds(rng() % 400));
            Prefetcher::Taken got;
            pf.take((rng() & 3) != 0, &got);
            done += got.done.size();
            cancelled.insert(cancelled.end(), got.cancelled.begin(), got.cancelled.end());
        }
        pf.drain();
        Prefetcher::Taken got;
        pf.take(true, &got);
        done += got.done.size();
        cancelled.insert(cancelled.end(), got.cancelled.begin(), got.cancelled.end());
    }
    link.drain();
    CHECK(done + cancelled.size() == 64, "%zu done + %zu cancelled of 64", done, cancelled.size());
    for (const PrefetchJob& j : cancelled) experts[j.slot].finish(j);
    for (int i = 0; i < 64; ++i) CHECK(experts[i].whole(), "expert %d differs", i);
    CHECK(link.max_pending_ <= Prefetcher::kDepth && link.resent_in_flight_ == 0 && link.freed_in_flight_ == 0,
          "%llu in flight at once, resent %llu, freed %llu", (unsigned long long)link.max_pending_,
          (unsigned long long)link.resent_in_flight_, (unsigned long long)link.freed_in_flight_);
}

}  // namespace

int main() {
    test_every_byte_lands_with_one_piece_in_flight_at_most();
    test_a_cancelled_jobs_progress_is_exact();
    test_a_refused_transfer_fails_its_job();
    test_pause_holds_the_queue_and_drain_waits();
    test_drain_while_paused_lands_the_pieces_in_flight();
    test_submit_and_cancel_against_the_thread();
    std::printf("prefetch_test: %d checks, %d failed\n", expcache_test::checks, expcache_test::failures);
    return expcache_test::failures ? 1 : 0;
}
