// Unit test of OppClassLRU's arithmetic of a count (libexpcache/src/policy/oppclass.hpp), which
// must give the simulator's (expcache_bench/sim/oppclass.py, _use) double for double, or the library
// and the simulator part ways:
// - class_of: the library finds the class by comparisons, the simulator computes
//   min(int(log(d) / log(1.3) + 1e-9), 15); compared on every double within 2^16 steps of each class
//   boundary and of the bounds class_of keeps around it, and on counts spread over [1, 10^6];
//   class_near (class_of tried first at a guessed class) on the same counts, from guesses next to
//   the class and from the first and the last;
// - decay: the library takes whole numbers of tokens from a table, the simulator computes
//   2.0 ** (-dt / 64); compared bit for bit on every whole number of the table and past it, and on
//   times between.
// Built with ASan and UBSan by tests/sanitize.mk (`make oppclass-test`).
//
//   oppclass_count_test    prints "oppclass_count_test: N checks, F failed" and exits 1 on a failure
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>

#include "policy/oppclass.hpp"

using expcache::OppClassPolicy;

namespace {

long checks = 0, failed = 0;

// The simulator's expression, as OppClassLRU._use writes it.
int simulator_class(double d) {
    int k = static_cast<int>(std::log(d) / std::log(OppClassPolicy::kBase) + 1e-9);
    return k < OppClassPolicy::kClasses - 1 ? k : OppClassPolicy::kClasses - 1;
}

void check(const OppClassPolicy& p, double d) {
    ++checks;
    int got = p.class_of(d), want = simulator_class(d);
    if (got != want && ++failed <= 10) std::printf("FAILED count %.17g: class_of %d, simulator %d\n", d, got, want);
    // class_near from a guess next to the class (where its shortcut decides) and from the ends.
    for (int g : {want - 1, want, want + 1, 0, OppClassPolicy::kClasses - 1}) {
        if (g < 0 || g >= OppClassPolicy::kClasses) continue;
        ++checks;
        got = p.class_near(d, g);
        if (got != want && ++failed <= 10)
            std::printf("FAILED count %.17g: class_near from %d %d, simulator %d\n", d, g, got, want);
    }
}

// The simulator's decay, 2.0 ** (-(t - prev) / half_life), against decay(), bit for bit.
void check_decay(const OppClassPolicy& p, double dt) {
    ++checks;
    const double got = p.decay(dt), want = std::pow(2.0, -dt / OppClassPolicy::kHalfLife);
    if (std::memcmp(&got, &want, sizeof got) != 0 && ++failed <= 10)
        std::printf("FAILED decay over %.17g tokens: %.17g, simulator %.17g\n", dt, got, want);
}

// The double `steps` representable values above (below, if negative) d > 0.
double step(double d, int64_t steps) {
    int64_t bits;
    std::memcpy(&bits, &d, sizeof bits);
    bits += steps;
    std::memcpy(&d, &bits, sizeof d);
    return d;
}

}  // namespace

int main() {
    const OppClassPolicy p;
    const double log_base = std::log(OppClassPolicy::kBase);
    for (int j = 1; j < OppClassPolicy::kClasses; ++j) {
        const double at = std::exp((j - 1e-9) * log_base);  // where the simulator's expression reaches j
        for (double around : {at, at * (1.0 - 1e-9), at * (1.0 + 1e-9)})
            for (int64_t s = -(1 << 16); s <= (1 << 16); ++s) check(p, step(around, s));
    }
    std::mt19937_64 rng(37);
    std::uniform_real_distribution<double> log_count(0.0, std::log(1e6));
    for (int i = 0; i < 1000000; ++i) check(p, std::exp(log_count(rng)));
    for (int i = 0; i <= 100000; ++i) check(p, 1.0 + i * 1e-5);  // the first classes, densely
    for (int k = 0; k <= OppClassPolicy::kDecayTokens + 64; ++k) {
        check_decay(p, k);
        check_decay(p, k + 0.5);
        if (k > 0) check_decay(p, step(k, -1));  // times of two powers of two apart: not whole
        check_decay(p, step(k, 1));
    }
    for (int token = 1; token < (1 << 20); token = token * 3 / 2 + 1)  // as use() subtracts its times
        for (double q : {0.0, 1.0 / 3.0, 7.0 / 40.0, 39.0 / 40.0})
            for (int back : {1, 2, 5, 64, 511})
                if (back <= token) check_decay(p, (token + q) - ((token - back) + q));
    std::printf("oppclass_count_test: %ld checks, %ld failed\n", checks, failed);
    return failed ? 1 : 0;
}
