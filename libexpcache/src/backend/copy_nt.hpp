// Copy with non-temporal stores: the destination's lines go to memory without being read
// first or kept dirty in the copying core's caches. Used to fill staging chunks that a DMA
// engine reads next. A plain memcpy where the target has no such stores.
#pragma once

#include <cstddef>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <emmintrin.h>
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

}  // namespace expcache
