// Copy with non-temporal stores: the destination's lines go to memory without being read
// first or kept dirty in the copying core's caches. Used to fill staging chunks that a DMA
// engine reads next. A plain memcpy where the target has no such stores.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace expcache {

// dst must be 16-byte aligned for the streamed part; the bytes are visible to other threads
// (and to DMA once they learn of them through a release) when it returns.
inline void copy_nt(char* dst, const char* src, size_t n) {
#if defined(__x86_64__) || defined(__i386__)
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
        __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
        __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
        __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
    _mm_sfence();  // streamed stores are weakly ordered: make them visible before anything after
    std::memcpy(dst + i, src + i, n - i);
#else
    std::memcpy(dst, src, n);
#endif
}

// How far ahead copy_nt_wide asks for source lines (a prefetch), and into which cache. A core
// reading memory alone keeps only a few lines in flight; asking for lines ahead of the copy
// keeps more of them coming. The locality is __builtin_prefetch's: 3 = into L1 (PREFETCHT0),
// 1 = into L2, not L1 (PREFETCHT2 on current Intel cores), 0 = non-temporal (PREFETCHNTA).
struct Prefetch {
    size_t ahead = 0;  // bytes; 0: no prefetch
    int locality = 3;
};
// The staging ring's: 4 KiB ahead into L2. On an H200 host a decode layer's pieces filled in
// 80-85 us with it against 90-100 without (docs/transfers.md).
constexpr Prefetch kStagingPrefetch{4096, 1};

#if defined(__x86_64__) && defined(__GNUC__)
namespace detail {
template <int Locality>
__attribute__((target("avx512f"))) inline void copy_nt_wide_ahead(char* dst, const char* src, size_t n, size_t ahead) {
    // The first `ahead` bytes are asked for at once, then each line `ahead` bytes before its copy;
    // nothing past the source's end.
    for (size_t j = 0; j < ahead && j < n; j += 64) __builtin_prefetch(src + j, 0, Locality);
    size_t i = 0;
    for (; i + 256 <= n; i += 256) {
        if (ahead > 0 && i + ahead + 256 <= n) {
            __builtin_prefetch(src + i + ahead, 0, Locality);
            __builtin_prefetch(src + i + ahead + 64, 0, Locality);
            __builtin_prefetch(src + i + ahead + 128, 0, Locality);
            __builtin_prefetch(src + i + ahead + 192, 0, Locality);
        }
        __m512i a = _mm512_loadu_si512(src + i);
        __m512i b = _mm512_loadu_si512(src + i + 64);
        __m512i c = _mm512_loadu_si512(src + i + 128);
        __m512i d = _mm512_loadu_si512(src + i + 192);
        _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), a);
        _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 64), b);
        _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 128), c);
        _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 192), d);
    }
    copy_nt(dst + i, src + i, n - i);  // the rest, and the fence
}
}  // namespace detail

// The same with 64-byte stores, a whole line each (AVX-512F); dst 64-byte aligned. Call it only
// where copy_nt_wide_supported() says so.
inline void copy_nt_wide(char* dst, const char* src, size_t n, Prefetch pf = {}) {
    if (pf.ahead == 0) return detail::copy_nt_wide_ahead<3>(dst, src, n, 0);
    switch (pf.locality) {
        case 0:
            return detail::copy_nt_wide_ahead<0>(dst, src, n, pf.ahead);
        case 1:
            return detail::copy_nt_wide_ahead<1>(dst, src, n, pf.ahead);
        case 2:
            return detail::copy_nt_wide_ahead<2>(dst, src, n, pf.ahead);
        default:
            return detail::copy_nt_wide_ahead<3>(dst, src, n, pf.ahead);
    }
}
inline bool copy_nt_wide_supported() {
    return __builtin_cpu_supports("avx512f");
}
#else
inline void copy_nt_wide(char* dst, const char* src, size_t n, Prefetch = {}) {
    copy_nt(dst, src, n);
}
inline bool copy_nt_wide_supported() {
    return false;
}
#endif

}  // namespace expcache
