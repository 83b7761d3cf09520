/*
 * Host CPU time of an all-hit select of 6 experts, by address (expcache_select_async) and
 * by slot id (expcache_select_slots_async), measured from C (no Python in the loop).
 * Usage: select_overhead [host|cuda] [calls] [policy] (a name expcache_policy_name gives:
 * lru, the default here, oppclass, duel, ...). Prints one line: backend, calls, ns per call
 * of each (best of 5 runs, the two taking turns) and their ratio.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "expcache.h"

#define CHECK(call)                                                                         \
    do {                                                                                    \
        expcache_status_t s_ = (call);                                                      \
        if (s_ != EXPCACHE_OK) {                                                            \
            fprintf(stderr, "%s: %s\n", expcache_status_string(s_), expcache_last_error()); \
            return 1;                                                                       \
        }                                                                                   \
    } while (0)

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

int main(int argc, char** argv) {
    const char* backend = argc > 1 ? argv[1] : "host";
    long calls = argc > 2 ? atol(argv[2]) : 1000000;
    const char* policy = argc > 3 ? argv[3] : "lru";
    enum { LAYERS = 40, EXPERTS = 256, K = 6, PART = 4096 };
    static unsigned char source[EXPERTS * PART];
    memset(source, 7, sizeof source);

    expcache_config_t cfg;
    CHECK(expcache_config_init(&cfg));
    cfg.backend = strcmp(backend, "cuda") == 0 ? EXPCACHE_BACKEND_CUDA : EXPCACHE_BACKEND_HOST;
    cfg.num_layers = LAYERS;
    cfg.budget_experts = 1024;
    cfg.log_level = EXPCACHE_LOG_SILENT;
    cfg.policy = UINT32_MAX;
    for (uint32_t p = 0; expcache_policy_name(p); ++p)
        if (strcmp(policy, expcache_policy_name(p)) == 0) cfg.policy = p;
    if (cfg.policy == UINT32_MAX) {
        fprintf(stderr, "unknown policy %s; the library's:", policy);
        for (uint32_t p = 0; expcache_policy_name(p); ++p) fprintf(stderr, " %s", expcache_policy_name(p));
        fprintf(stderr, "\n");
        return 2;
    }
    expcache_t* cache = NULL;
    CHECK(expcache_create(&cfg, &cache));
    for (uint32_t l = 0; l < LAYERS; ++l) {
        expcache_layer_desc_t d;
        CHECK(expcache_layer_desc_init(&d));
        d.num_experts = EXPERTS;
        d.gate_bytes = d.up_bytes = d.down_bytes = PART / 4;
        d.gate_stride = d.up_stride = d.down_stride = PART;
        d.gate_base = source;
        d.up_base = source + PART / 4;
        d.down_base = source + PART / 2;
        CHECK(expcache_layer_register(cache, l, &d));
    }
    uint32_t ids[LAYERS][K];
    for (uint32_t l = 0; l < LAYERS; ++l)
        for (uint32_t j = 0; j < K; ++j) ids[l][j] = (l * 37 + j * 11) % EXPERTS;
    expcache_expert_ptrs_t out[K];
    for (uint32_t l = 0; l < LAYERS; ++l) CHECK(expcache_select_async(cache, l, ids[l], K, NULL, out));
    CHECK(expcache_synchronize(cache, NULL));

    /* The same all-hit calls by address (expcache_select_async) and by slot id
       (expcache_select_slots_async: the rows of the class's bank), taking turns. */
    int32_t slots[K];
    double best = 1e30, best_slots = 1e30;
    for (int run = 0; run < 10; ++run) {
        const int by_slots = run & 1;
        double t0 = now_ns();
        for (long i = 0; i < calls; ++i) {
            uint32_t l = (uint32_t)(i % LAYERS);
            expcache_status_t s = by_slots ? expcache_select_slots_async(cache, l, ids[l], 32, K, slots, NULL)
                                           : expcache_select_async(cache, l, ids[l], K, NULL, out);
            if (s != EXPCACHE_OK) {
                fprintf(stderr, "select failed: %s\n", expcache_last_error());
                return 1;
            }
        }
        double per = (now_ns() - t0) / (double)calls;
        double* into = by_slots ? &best_slots : &best;
        if (per < *into) *into = per;
    }
    expcache_stats_t st;
    st.struct_size = sizeof st;
    CHECK(expcache_stats_get(cache, 0, EXPCACHE_PATH_DECODE, &st));
    if (st.misses != (uint64_t)LAYERS * K) {
        fprintf(stderr, "expected only warm-up misses, got %llu\n", (unsigned long long)st.misses);
        return 1;
    }
    printf("backend=%s policy=%s calls=%ld all_hit_select_k6_ns=%.1f all_hit_select_slots_k6_ns=%.1f (%.2fx)\n",
           backend, policy, calls, best, best_slots, best_slots / best);
    expcache_destroy(cache);
    return 0;
}
