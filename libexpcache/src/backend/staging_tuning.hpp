// The staging ring's measurement knobs, one EXPCACHE_STAGING_* environment variable each. They
// exist to compare variants within one process (docs/transfers.md, "Why these defaults", says
// what each default was measured against); the defaults are what the library runs with.
//
// config.cpp reads the variables when a cache is created (resolve_config) and refuses a
// malformed value there: expcache_create fails with INVALID_ARGUMENT naming the variable, its
// value and what is accepted. Numbers are decimal digits only (no sign, space or suffix); words
// are taken in any case. The cache hands the result to its ring through StagingConfig
// (backend.hpp); a ring made directly (tests/c/ring_test.cpp) takes these defaults or its own.
#pragma once

#include <cstdint>
#include <string>

#include "copy_nt.hpp"

namespace expcache {

struct StagingTuning {
    // The largest values the variables take (config.cpp refuses more; a ring made directly clamps
    // short_pieces and trace_pieces to them).
    static constexpr uint64_t kMaxMinPieces = 1024;
    static constexpr uint64_t kMaxShortPieces = 16;
    static constexpr uint64_t kMaxPrefetchBytes = uint64_t(64) << 20;  // the largest staging_chunk_bytes
    static constexpr uint64_t kMaxTracePieces = uint64_t(1) << 24;

    // EXPCACHE_STAGING_NT_MAX, bytes (0..2^64-1): pageable pieces up to this size are filled with
    // non-temporal stores, larger ones with memcpy; 0: memcpy only. Default: every piece.
    uint64_t nt_max_bytes = UINT64_MAX;
    // EXPCACHE_STAGING_FILE_BOUNCE, 1|true|yes|on or 0|false|no|off: buffered file reads land in
    // the filling thread's bounce buffer and are streamed into the chunk with non-temporal stores
    // (on, the default), or are read into the chunk directly (off).
    bool file_bounce = true;
    // EXPCACHE_STAGING_COALESCE, bytes (0..2^64-1): while the link is busy the caller holds a
    // send until this many bytes are filled; 0: never holds. A ring holds a quarter of itself at
    // most. Default 4 MiB.
    uint64_t coalesce_bytes = uint64_t(4) << 20;
    // EXPCACHE_STAGING_MIN_PIECES, 0..1024: an upload is cut into this many pieces at least, of
    // 128 KiB at least, so that a call of a few experts spreads over the threads; 0 or 1: not
    // cut. Default 4.
    uint64_t min_pieces = 4;
    // EXPCACHE_STAGING_SHORT, 0..16: the first n pieces of a call are short (the first 1/2^n of a
    // chunk, then twice that, up to half), so the link starts early; 0: none. Default 3.
    uint64_t short_pieces = 3;
    // EXPCACHE_STAGING_COPY, wide or sse2: fill with 64-byte non-temporal stores where the CPU has
    // AVX-512, else 16-byte ones (wide, the default), or with 16-byte ones always (sse2).
    bool wide_stores = true;
    // EXPCACHE_STAGING_PREFETCH, bytes (0..64 MiB: no piece is longer): how far ahead of the
    // 64-byte copy it asks for source lines; 0: no prefetch. EXPCACHE_STAGING_PREFETCH_HINT, t0,
    // t2 or nta: into which caches (L1, L2 only, non-temporal: Prefetch's locality 3, 1 and 0 in
    // copy_nt.hpp). Default: kStagingPrefetch, 4 KiB ahead into L2 (t2).
    Prefetch prefetch = kStagingPrefetch;
    // EXPCACHE_STAGING_TRACE, a file path: the ring notes when each of its first trace_pieces
    // pieces was queued, taken by a filler, filled and sent, and when each call began, reached
    // finish() and returned, and appends them to the file as CSV when it is destroyed (a file
    // that cannot be written is skipped without a word; benchmarks/staging_trace.py reads it).
    // Empty (the default, the variable unset): nothing is noted.
    std::string trace_path;
    // EXPCACHE_STAGING_TRACE_PIECES, 0..2^24: how many pieces a trace notes (64 bytes each, taken
    // when the ring is made: 2^24 take 1 GiB); without the memory for them, no trace. Default 65536.
    uint64_t trace_pieces = 65536;
};

}  // namespace expcache
