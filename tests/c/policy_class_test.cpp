// Unit test of OppClassLRU's class of a count (libexpcache/src/policy/oppclass.hpp, class_of): the
// library finds it by comparisons, the simulator (expcache_bench/sim/oppclass.py, _use) computes
// min(int(log(d) / log(1.3) + 1e-9), 15); the two must agree on every count, or the library and
// the simulator part ways. Compared on every double within 2^16 steps of each class boundary and
// of the bounds class_of keeps around it, and on counts spread over [1, 10^6]. Built with ASan and
// UBSan by tests/sanitize.mk (`make policy-test`).
//
//   policy_class_test    prints "policy_class_test: N checks, F failed" and exits 1 on a failure
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
    std::printf("policy_class_test: %ld checks, %ld failed\n", checks, failed);
    return failed ? 1 : 0;
}
