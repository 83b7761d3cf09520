/*
 * random.c — the seeded draws every choice of the driver goes through (splitmix64).
 */
#include "stress.h"

static uint64_t g_rng;

void rng_seed(uint64_t seed) {
    g_rng = mix64(seed ^ 0x5EEDull);
}

uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
uint64_t rnd(void) {
    return mix64(g_rng += 0x9E3779B97F4A7C15ull);
}
uint64_t below(uint64_t n) {
    return n ? rnd() % n : 0;
}
uint64_t between(uint64_t lo, uint64_t hi) {
    return lo + below(hi - lo + 1);
}
int pct(unsigned p) {
    return below(100) < p;
}
