// OppClassLRU's arithmetic (oppclass.hpp describes the policy): a key's decayed use count and its
// class, an entry's missed opportunities and its score. One source for the host policy
// (OppClassPolicy) and the device lookup (kernels/lookup_policy.hpp), which must agree double for
// double with each other and with expcache_bench/sim/oppclass.py. Each operation is one IEEE
// operation rounded to nearest (spelled out on the device, where nvcc would otherwise fuse a
// multiply and an add), a comparison or a read of the tables below, made once on the host and
// copied to the device; a logarithm and a power only where the host takes them too (glibc's on the
// host, CUDA's on the device, which may differ in the last place: docs/device_lookup.md says when
// that can matter).
#pragma once

#include <math.h>

#include <cstdint>

#include "host_device.hpp"

namespace expcache {

struct OppClassTables {
    static constexpr int kClasses = 16;            // counts >= 1.3^15 share the last class
    static constexpr double kHalfLife = 64.0;      // tokens
    static constexpr double kBase = 1.3;           // class k holds counts in [1.3^k, 1.3^(k+1))
    static constexpr double kWeight = 1.6;         // one class is worth a factor 1.6 of age
    static constexpr double kOffset = 1.0;         // added to the age
    static constexpr int32_t kNever = -(1 << 30);  // last-use token of a cold (prefill) insert
    static constexpr int kDecayTokens = 512;       // decay's table: 16 half-lives

    double log_base;                          // log(kBase)
    double scale[kClasses];                   // kWeight^k
    double below[kClasses], above[kClasses];  // class_of's bounds; [0] unused
    double decay[kDecayTokens];               // 2^(-k / kHalfLife)
};

// Made once, by glibc's log, exp and pow (oppclass.cpp).
const OppClassTables& oppclass_tables();

// A key's count: its decayed number of uses (0: never used) and the time of its last use.
struct KeyCount {
    double d;
    double t;
};

namespace rn {  // one rounding each, never fused
EXPCACHE_HOST_DEVICE inline double add(double a, double b) {
#ifdef __CUDA_ARCH__
    return __dadd_rn(a, b);
#else
    return a + b;
#endif
}
EXPCACHE_HOST_DEVICE inline double sub(double a, double b) {
#ifdef __CUDA_ARCH__
    return __dsub_rn(a, b);
#else
    return a - b;
#endif
}
EXPCACHE_HOST_DEVICE inline double mul(double a, double b) {
#ifdef __CUDA_ARCH__
    return __dmul_rn(a, b);
#else
    return a * b;
#endif
}
EXPCACHE_HOST_DEVICE inline double div(double a, double b) {
#ifdef __CUDA_ARCH__
    return __ddiv_rn(a, b);
#else
    return a / b;
#endif
}
}  // namespace rn

// The policy clock's time: token + pos / positions.
EXPCACHE_HOST_DEVICE inline double oppclass_time(int32_t token, int32_t pos, int32_t positions) {
    return rn::add(double(token), rn::div(double(pos), double(positions)));
}

// min(int(log(d) / log(kBase) + 1e-9), kClasses - 1), the simulator's class of a count d >= 1, by
// comparisons: below[j] and above[j] bound, a relative 1e-9 below and above, the count where that
// expression reaches j. A count between the two takes the logarithm; anywhere else the expression,
// whose rounding errors are below 1e-13, lands on the same side of j as the exact one, whose
// distance from j is at least 3.8e-9 there (tests/c/oppclass_count_test.cpp compares the two
// around every boundary).
EXPCACHE_HOST_DEVICE inline int oppclass_class_of(const OppClassTables& t, double d) {
    constexpr int kClasses = OppClassTables::kClasses;
    static_assert((kClasses & (kClasses - 1)) == 0, "the bisection halves a power of two of classes");
    int j = 0;  // the last boundary at or below d, by bisection (below grows with j)
    for (int step = kClasses / 2; step > 0; step /= 2) j += d >= t.below[j + step] ? step : 0;
    if (j > 0 && d < t.above[j]) {
        const int k = static_cast<int>(rn::add(rn::div(::log(d), t.log_base), 1e-9));
        return k < kClasses - 1 ? k : kClasses - 1;
    }
    return j;
}

// oppclass_class_of(t, d), tried first at a guess g in [0, kClasses) (a key's class at its last use,
// most often its class now): from above[g] up to below[g + 1] the bisection would end at g and take
// no logarithm, so the class is g; anywhere else the bisection decides.
EXPCACHE_HOST_DEVICE inline int oppclass_class_near(const OppClassTables& t, double d, int g) {
    constexpr int kLast = OppClassTables::kClasses - 1;
    if (d >= t.above[g] && (g == kLast || d < t.below[g + 1])) return g;
    return oppclass_class_of(t, d);
}

// 2^(-dt / kHalfLife), the decay of a count over dt tokens, as pow gives it. Whole numbers of
// tokens below kDecayTokens come from the table of those very values: a key's uses are all in its
// layer, at times token + pos / positions that differ by whole tokens while the token count stays
// within one power of two (tests/c/oppclass_count_test.cpp checks the table).
EXPCACHE_HOST_DEVICE inline double oppclass_decay(const OppClassTables& t, double dt) {
    if (dt >= 0.0 && dt < OppClassTables::kDecayTokens) {
        const int k = static_cast<int>(dt);
        if (k == dt) return t.decay[k];
    }
    return ::pow(2.0, rn::div(-dt, OppClassTables::kHalfLife));
}

// One more use of a key whose count is c, at time `now`.
EXPCACHE_HOST_DEVICE inline void oppclass_count_use(const OppClassTables& t, KeyCount& c, double now) {
    c.d = c.d == 0.0 ? 1.0 : rn::add(rn::mul(c.d, oppclass_decay(t, rn::sub(now, c.t))), 1.0);
    c.t = now;
}

// One more use of a key whose count is c, at time `now`; returns its class.
EXPCACHE_HOST_DEVICE inline int oppclass_use(const OppClassTables& t, KeyCount& c, double now) {
    oppclass_count_use(t, c, now);
    return oppclass_class_of(t, c.d);
}

// How many times the layer of an entry last used at (token tok, layer position p) has run without
// it by (token, pos): the tokens strictly between, and this one if its layer has run already.
EXPCACHE_HOST_DEVICE inline int32_t oppclass_missed(int32_t token, int32_t pos, int32_t tok, int32_t p) {
    return token - tok - 1 + (p <= pos ? 1 : 0);
}

// An entry's score in list k: the larger goes first.
EXPCACHE_HOST_DEVICE inline double oppclass_score(const OppClassTables& t, int32_t missed, int k) {
    return rn::div(rn::add(double(missed), OppClassTables::kOffset), t.scale[k]);
}

}  // namespace expcache
