// Unit test of the staging ring (libexpcache/src/backend/staging_ring.cpp) over a fake link that
// behaves like a DMA engine: a transfer is only recorded when it is sent and its bytes are read
// out of the chunk later, when the ring waits for it (or at the end, as a stream sync would).
// A chunk refilled before its transfer was waited for therefore corrupts the destination, and
// the fake link can fail the Nth transfer, alone or in the middle of a batch. Built with the
// sanitizers by tests/sanitize.mk (`make ring-test`, `make ring-tsan-test`).
//
//   ring_test            every case; prints "ring_test: N checks, F failed" and exits 1 on a failure
//                        (the file cases write, then remove, a 3 MiB file in /tmp)
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "backend/copy_nt.hpp"
#include "backend/source_file.hpp"
#include "backend/staging_ring.hpp"
#include "errors.hpp"
#include "fake_link.hpp"

using expcache::StagingRing;
using expcache::StagingTuning;
using expcache_test::checks;
using expcache_test::failures;
using expcache_test::FakeLink;
using expcache_test::random_bytes;

namespace {

// Uploads of `sizes` bytes each, back to back in one source and one destination.
struct Call {
    std::vector<uint64_t> sizes;
    uint64_t total() const {
        uint64_t t = 0;
        for (uint64_t s : sizes) t += s;
        return t;
    }
};

expcache_status_t stage(StagingRing& ring, const Call& call, const std::vector<char>& src, std::vector<char>& dst) {
    uint64_t off = 0;
    for (uint64_t n : call.sizes) {
        expcache_status_t s = ring.copy(dst.data() + off, src.data() + off, n, nullptr);
        if (s != EXPCACHE_OK) return s;
        off += n;
    }
    return ring.finish();
}

// Many calls through a ring of few chunks: every chunk is reused many times within a call, so a
// refill that did not wait for the chunk's transfer would corrupt what lands.
void test_bytes_arrive_and_chunks_wait(unsigned threads) {
    FakeLink t;
    std::mt19937 rng(threads);
    uint64_t staged = 0, pieces_min = 0;
    {
        StagingRing ring(t, threads, 4 * 8192, 8192);  // 4 chunks of 8 KiB
        for (int call_no = 0; call_no < 40; ++call_no) {
            Call call;
            for (int i = 0, k = 1 + rng() % 6; i < k; ++i) call.sizes.push_back(1 + rng() % 40000);
            const std::vector<char> src = random_bytes(call.total(), call_no);
            std::vector<char> dst(call.total(), 0);
            expcache_status_t s = stage(ring, call, src, dst);
            CHECK(s == EXPCACHE_OK, "call %d: %s", call_no, expcache::last_error());
            t.drain();
            CHECK(dst == src, "call %d (%u threads): bytes differ", call_no, threads);
            staged += call.total();
            for (uint64_t n : call.sizes) pieces_min += (n + 8191) / 8192;
        }
        expcache_staging_stats_t st{};
        ring.stats(&st);
        CHECK(st.calls == 40 && st.bytes == staged, "calls %llu bytes %llu of %llu", (unsigned long long)st.calls,
              (unsigned long long)st.bytes, (unsigned long long)staged);
        CHECK(st.pieces >= pieces_min && st.pieces == t.sent_, "pieces %llu, sent %llu", (unsigned long long)st.pieces,
              (unsigned long long)t.sent_);
        CHECK(st.sends == t.batches_.size() && st.sends >= 1 && st.sends <= st.pieces, "sends %llu",
              (unsigned long long)st.sends);
        CHECK(st.span_ns >= st.first_fill_ns, "span %llu first fill %llu", (unsigned long long)st.span_ns,
              (unsigned long long)st.first_fill_ns);
        if (threads <= 1)  // the caller fills each piece just before it sends it: one a send
            CHECK(st.sends == st.pieces && st.caller_fills == st.pieces, "sends %llu pieces %llu",
                  (unsigned long long)st.sends, (unsigned long long)st.pieces);
    }
    CHECK(t.resent_in_flight_ == 0, "%llu chunks sent again before their transfer landed",
          (unsigned long long)t.resent_in_flight_);
    CHECK(t.freed_in_flight_ == 0, "%llu chunks freed with a transfer in flight",
          (unsigned long long)t.freed_in_flight_);
}

// A call of more pieces than the ring has job slots (1024): the caller sends the oldest ones
// while it still queues, and every byte arrives.
void test_more_pieces_than_slots(unsigned threads) {
    FakeLink t;
    {
        StagingRing ring(t, threads, 4 * 8192, 8192);
        Call call;
        for (int i = 0; i < 5; ++i) call.sizes.push_back(2 << 20);  // 10 MiB: ~1,280 pieces
        const std::vector<char> src = random_bytes(call.total(), 21);
        std::vector<char> dst(call.total(), 0);
        CHECK(stage(ring, call, src, dst) == EXPCACHE_OK, "%u threads: %s", threads, expcache::last_error());
        t.drain();
        CHECK(dst == src, "%u threads: bytes differ", threads);
        expcache_staging_stats_t st{};
        ring.stats(&st);
        CHECK(st.calls == 1 && st.pieces > 1024 && st.bytes == call.total(), "%u threads: %llu pieces, %llu bytes",
              threads, (unsigned long long)st.pieces, (unsigned long long)st.bytes);
    }
    CHECK(t.resent_in_flight_ == 0 && t.freed_in_flight_ == 0, "in flight: resent %llu freed %llu",
          (unsigned long long)t.resent_in_flight_, (unsigned long long)t.freed_in_flight_);
}

// Pieces the workers have filled by the time the caller sends go in one batch, in order.
void test_filled_pieces_go_together() {
    FakeLink t;
    StagingRing ring(t, 4, 64 * 8192, 8192);
    Call call{{10 * 8192}};
    const std::vector<char> src = random_bytes(call.total(), 7);
    std::vector<char> dst(call.total(), 0);
    CHECK(ring.copy(dst.data(), src.data(), call.total(), nullptr) == EXPCACHE_OK, "copy");
    // The workers fill 12 small pieces long before this: finish() finds them all filled.
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    CHECK(ring.finish() == EXPCACHE_OK, "finish: %s", expcache::last_error());
    t.drain();
    CHECK(dst == src, "bytes differ");
    size_t largest = 0;
    for (size_t b : t.batches_) largest = b > largest ? b : largest;
    CHECK(largest > 1, "%zu sends, none of more than one piece", t.batches_.size());
}

// The link refuses transfer `fail_at` of a call (alone, first, inside or last of a batch): the
// call fails with the link's message, nothing after it is sent, and the ring serves the next
// call byte for byte, without sending a chunk whose transfer is in flight.
void test_refused_transfer(unsigned threads, uint64_t fail_at) {
    FakeLink t;
    {
        StagingRing ring(t, threads, 16 * 8192, 8192);
        Call call{{30000, 50000, 20000}};  // 16 pieces of at most 8 KiB
        const std::vector<char> src = random_bytes(call.total(), 11);
        std::vector<char> dst(call.total(), 0);
        expcache_staging_stats_t before{};
        ring.stats(&before);
        t.fail_transfers(fail_at, 1);
        expcache_status_t s = stage(ring, call, src, dst);
        CHECK(s == EXPCACHE_ERR_CUDA, "fail_at %llu: status %d", (unsigned long long)fail_at, (int)s);
        CHECK(std::strstr(expcache::last_error(), "fake link refused") != nullptr, "message: %s",
              expcache::last_error());
        expcache_staging_stats_t after{};
        ring.stats(&after);
        CHECK(after.pieces - before.pieces == fail_at, "fail_at %llu: %llu pieces counted as sent",
              (unsigned long long)fail_at, (unsigned long long)(after.pieces - before.pieces));
        CHECK(t.sent_ == fail_at, "fail_at %llu: %llu transfers sent", (unsigned long long)fail_at,
              (unsigned long long)t.sent_);
        t.drain();
        // The call that follows is served in full.
        std::vector<char> dst2(call.total(), 0);
        s = stage(ring, call, src, dst2);
        CHECK(s == EXPCACHE_OK, "after the failure: %s", expcache::last_error());
        t.drain();
        CHECK(dst2 == src, "after the failure (fail_at %llu, %u threads): bytes differ", (unsigned long long)fail_at,
              threads);
    }
    CHECK(t.resent_in_flight_ == 0 && t.freed_in_flight_ == 0, "in flight: resent %llu freed %llu",
          (unsigned long long)t.resent_in_flight_, (unsigned long long)t.freed_in_flight_);
}

// A piece that fails to fill (injected) fails its call; the pieces after it are not sent.
void test_failed_fill(unsigned threads) {
    FakeLink t;
    StagingRing ring(t, threads, 16 * 8192, 8192);
    Call call{{60000}};
    const std::vector<char> src = random_bytes(call.total(), 3);
    std::vector<char> dst(call.total(), 0);
    ring.inject_failures(4, 1);
    expcache_status_t s = stage(ring, call, src, dst);
    CHECK(s == EXPCACHE_ERR_CUDA && std::strstr(expcache::last_error(), "injected staging failure"), "status %d: %s",
          (int)s, expcache::last_error());
    CHECK(t.sent_ <= 4, "%llu pieces sent past the failed one", (unsigned long long)t.sent_);
    t.drain();
    std::vector<char> dst2(call.total(), 0);
    CHECK(stage(ring, call, src, dst2) == EXPCACHE_OK, "after: %s", expcache::last_error());
    t.drain();
    CHECK(dst2 == src, "bytes differ after a failed fill");
}

// StagingTuning::coalesce_bytes: while the link is busy the caller holds a send until more pieces
// are filled. The bytes still arrive whole, no chunk is refilled under its transfer, and with
// workers some sends carry several pieces; with the caller alone it waits for the link, then sends one.
void test_coalescing(unsigned threads) {
    StagingTuning tuning;
    tuning.coalesce_bytes = 65536;  // a quarter of this ring at most: 32 KiB
    FakeLink t;
    t.busy_polls_ = 2000;
    {
        StagingRing ring(t, threads, 16 * 8192, 8192, tuning);
        for (int call_no = 0; call_no < 10; ++call_no) {
            Call call{{30000, 50000, 20000 + 4096u * call_no}};
            const std::vector<char> src = random_bytes(call.total(), 100 + call_no);
            std::vector<char> dst(call.total(), 0);
            CHECK(stage(ring, call, src, dst) == EXPCACHE_OK, "call %d: %s", call_no, expcache::last_error());
            t.drain();
            CHECK(dst == src, "coalescing, call %d (%u threads): bytes differ", call_no, threads);
        }
        expcache_staging_stats_t st{};
        ring.stats(&st);
        // The caller alone always finds the link busy behind its last send and asks. With workers,
        // whether it asks is timing: where they fill a whole hold before the caller looks (slow
        // sanitizer builds on a loaded machine), it sends without asking, and the coalescing shows
        // as pieces > sends below instead.
        if (threads == 1) CHECK(t.polls_ > 0, "the caller alone: the link was never asked whether it is busy");
        if (threads > 1)
            CHECK(st.pieces > st.sends, "%u threads: %llu pieces in %llu sends", threads, (unsigned long long)st.pieces,
                  (unsigned long long)st.sends);
        else
            CHECK(st.pieces == st.sends, "the caller alone: %llu pieces in %llu sends", (unsigned long long)st.pieces,
                  (unsigned long long)st.sends);
    }
    CHECK(t.resent_in_flight_ == 0 && t.freed_in_flight_ == 0, "in flight: resent %llu freed %llu",
          (unsigned long long)t.resent_in_flight_, (unsigned long long)t.freed_in_flight_);
}

// An upload is cut into 4 pieces at least (of 128 KiB at least), so that a call of a few small
// experts spreads over the threads: 1 MiB through 512 KiB chunks goes as 64, 128, 256, 256, 256 and
// 64 KiB (the first three pieces of a call are short anyway), never in a 512 KiB piece.
void test_small_uploads_spread() {
    FakeLink t;
    StagingRing ring(t, 4, 8 << 20, 512 << 10);
    Call call{{1 << 20}};
    const std::vector<char> src = random_bytes(call.total(), 5);
    std::vector<char> dst(call.total(), 0);
    CHECK(stage(ring, call, src, dst) == EXPCACHE_OK, "%s", expcache::last_error());
    t.drain();
    CHECK(dst == src, "bytes differ");
    CHECK(t.sent_ == 6 && t.largest_ == 256 << 10, "%llu pieces, the largest %llu bytes", (unsigned long long)t.sent_,
          (unsigned long long)t.largest_);
}

// The same upload with StagingTuning's min_pieces 1 and short_pieces 0: whole chunks, 2 of them.
void test_tuned_pieces() {
    StagingTuning tuning;
    tuning.min_pieces = 1;
    tuning.short_pieces = 0;
    FakeLink t;
    StagingRing ring(t, 4, 8 << 20, 512 << 10, tuning);
    Call call{{1 << 20}};
    const std::vector<char> src = random_bytes(call.total(), 6);
    std::vector<char> dst(call.total(), 0);
    CHECK(stage(ring, call, src, dst) == EXPCACHE_OK, "%s", expcache::last_error());
    t.drain();
    CHECK(dst == src, "bytes differ");
    CHECK(t.sent_ == 2 && t.largest_ == 512 << 10, "tuned: %llu pieces, the largest %llu bytes",
          (unsigned long long)t.sent_, (unsigned long long)t.largest_);
}

// File pieces: buffered reads through the thread's bounce buffer (the default), straight into
// the chunk (StagingTuning::file_bounce off), and O_DIRECT where the file system allows it;
// uploads at odd offsets and sizes, several calls, so chunks and bounce buffers are reused.
void test_file_pieces(unsigned threads, bool bounce, bool direct) {
    char path[] = "/tmp/expcache_ring_test_XXXXXX";
    const int fd = mkstemp(path);
    CHECK(fd >= 0, "mkstemp failed");
    if (fd < 0) return;
    const std::vector<char> bytes = random_bytes(3 << 20, 77);
    const bool written = write(fd, bytes.data(), bytes.size()) == ssize_t(bytes.size());
    close(fd);
    CHECK(written, "writing %s failed", path);
    expcache::SourceFile file;
    CHECK(file.open(path, direct) == EXPCACHE_OK, "open: %s", expcache::last_error());
    StagingTuning tuning;
    tuning.file_bounce = bounce;
    FakeLink t;
    {
        StagingRing ring(t, threads, 8 * 65536, 65536, tuning);
        std::mt19937 rng(threads);
        for (int call_no = 0; call_no < 12; ++call_no) {
            std::vector<std::pair<uint64_t, uint64_t>> uploads;  // offset, bytes
            uint64_t total = 0;
            for (int i = 0, k = 1 + rng() % 4; i < k; ++i) {
                const uint64_t n = 1 + rng() % 300000;
                uploads.push_back({rng() % (bytes.size() - n), n});
                total += n;
            }
            std::vector<char> dst(total, 0), want;
            uint64_t off = 0;
            expcache_status_t s = EXPCACHE_OK;
            for (const auto& u : uploads) {
                want.insert(want.end(), bytes.begin() + u.first, bytes.begin() + u.first + u.second);
                if (s == EXPCACHE_OK) s = ring.read(dst.data() + off, file, u.first, u.second, nullptr);
                off += u.second;
            }
            if (s == EXPCACHE_OK) s = ring.finish();
            CHECK(s == EXPCACHE_OK, "call %d: %s", call_no, expcache::last_error());
            t.drain();
            CHECK(dst == want, "file call %d (%u threads, bounce %d, direct %d): bytes differ", call_no, threads,
                  int(bounce), int(direct));
        }
    }
    CHECK(t.resent_in_flight_ == 0 && t.freed_in_flight_ == 0, "in flight: resent %llu freed %llu",
          (unsigned long long)t.resent_in_flight_, (unsigned long long)t.freed_in_flight_);
    unlink(path);
}

// The chunk fillers (copy_nt.hpp) copy every byte, whatever the size and the source's alignment:
// the 16-byte copy, and where the CPU has AVX-512 the 64-byte one (its tail goes through the other),
// without and with prefetches (their distance shorter and longer than the copy, each locality).
void test_copies() {
    using expcache::Prefetch;
    const std::vector<char> src = random_bytes(70000, 9);
    struct Copy {
        const char* name;
        bool wide;
        Prefetch pf;
    };
    const Copy copies[] = {{"copy_nt", false, {}},
                           {"copy_nt_wide", true, {}},
                           {"copy_nt_wide, 1 KiB ahead, T0", true, {1024, 3}},
                           {"copy_nt_wide, 4 KiB ahead, T2", true, {4096, 1}},
                           {"copy_nt_wide, 64 KiB ahead, NTA", true, {65536, 0}}};
    char* dst = static_cast<char*>(std::aligned_alloc(64, 70016));
    for (const Copy& copy : copies) {
        if (copy.wide && !expcache::copy_nt_wide_supported()) continue;
        for (size_t n : {size_t(0), size_t(1), size_t(63), size_t(64), size_t(255), size_t(256), size_t(1000),
                         size_t(4096 * 4 + 64 * 3 + 7), size_t(65536), size_t(69990)})
            for (size_t from : {size_t(0), size_t(3), size_t(8)}) {
                std::memset(dst, 0x5a, 70016);
                if (copy.wide)
                    expcache::copy_nt_wide(dst, src.data() + from, n, copy.pf);
                else
                    expcache::copy_nt(dst, src.data() + from, n);
                CHECK(std::memcmp(dst, src.data() + from, n) == 0, "%s of %zu bytes from offset %zu: bytes differ",
                      copy.name, n, from);
                CHECK(static_cast<unsigned char>(dst[n]) == 0x5a, "%s of %zu bytes wrote past the end", copy.name, n);
            }
    }
    std::free(dst);
}

}  // namespace

int main() {
    test_copies();
    for (unsigned threads : {1u, 2u, 4u, 8u}) test_bytes_arrive_and_chunks_wait(threads);
    test_filled_pieces_go_together();
    for (unsigned threads : {1u, 2u, 4u}) test_more_pieces_than_slots(threads);
    for (unsigned threads : {1u, 4u})
        for (uint64_t fail_at : {0u, 1u, 3u, 7u, 13u}) test_refused_transfer(threads, fail_at);
    for (unsigned threads : {1u, 4u}) test_failed_fill(threads);
    for (unsigned threads : {1u, 2u, 4u}) test_coalescing(threads);
    test_small_uploads_spread();
    test_tuned_pieces();
    for (unsigned threads : {1u, 4u})
        for (bool bounce : {true, false}) test_file_pieces(threads, bounce, false);
    test_file_pieces(4, true, true);
    std::printf("ring_test: %d checks, %d failed\n", checks, failures);
    return failures ? 1 : 0;
}
