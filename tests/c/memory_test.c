/* Memory kept alive past the cache (expcache_memory_retain / _release / the dropped callback) and
 * a cache inherited by fork(), through the public API on the host backend. Built with ASan and
 * UBSan (make memory-test): reading kept memory after release_all or destroy would be a
 * use-after-free report if it had been freed, and memory never freed by its last reference a
 * leak report at exit. Exits 1 on the first failed check. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "expcache.h"
#include "expcache_testing.h"

static int checks, failures;

#define CHECK(cond)                                                                                        \
    do {                                                                                                   \
        ++checks;                                                                                          \
        if (!(cond)) {                                                                                     \
            fprintf(stderr, "memory_test: %s:%d: %s failed (last error: %s)\n", __FILE__, __LINE__, #cond, \
                    expcache_last_error());                                                                \
            ++failures;                                                                                    \
        }                                                                                                  \
    } while (0)

enum { kExperts = 16, kPart = 4096 };
static unsigned char source[3][kExperts][kPart];

static expcache_t* make_cache(void) {
    expcache_config_t cfg;
    expcache_config_init(&cfg);
    cfg.backend = EXPCACHE_BACKEND_HOST;
    cfg.num_layers = 1;
    cfg.budget_experts = 8;
    cfg.log_level = EXPCACHE_LOG_WARNING;
    expcache_t* cache = NULL;
    CHECK(expcache_create(&cfg, &cache) == EXPCACHE_OK);
    expcache_layer_desc_t d;
    expcache_layer_desc_init(&d);
    d.num_experts = kExperts;
    d.source_kind = EXPCACHE_SOURCE_PAGEABLE;
    d.gate_bytes = d.up_bytes = d.down_bytes = kPart;
    d.gate_stride = d.up_stride = d.down_stride = kPart;
    d.gate_base = source[0][0];
    d.up_base = source[1][0];
    d.down_base = source[2][0];
    CHECK(expcache_layer_register(cache, 0, &d) == EXPCACHE_OK);
    return cache;
}

static int dropped_calls;
static void on_dropped(void* user) {
    (void)user;
    ++dropped_calls;
}

static void kept_past_release_and_destroy(void) {
    expcache_t* cache = make_cache();
    CHECK(expcache_memory_set_dropped_callback(cache, on_dropped, NULL) == EXPCACHE_OK);
    uint32_t ids[3] = {1, 2, 3};
    expcache_expert_ptrs_t ptrs[3];
    CHECK(expcache_select_async(cache, 0, ids, 3, NULL, ptrs) == EXPCACHE_OK);

    expcache_memory_ref_t* ref = NULL;
    expcache_memory_ref_t* none = NULL;
    CHECK(expcache_memory_retain(cache, ptrs[0].up, &ref) == EXPCACHE_OK && ref != NULL);
    CHECK(expcache_memory_retain(cache, source[0][0], &none) == EXPCACHE_ERR_INVALID_ARGUMENT && none == NULL);
    CHECK(expcache_memory_retain(cache, ptrs[0].gate, NULL) == EXPCACHE_ERR_INVALID_ARGUMENT);
    CHECK(expcache_memory_retain(NULL, ptrs[0].gate, &none) == EXPCACHE_ERR_INVALID_ARGUMENT);

    /* A call that lets go of nothing kept does not call back. */
    CHECK(expcache_select_async(cache, 0, ids, 3, NULL, ptrs) == EXPCACHE_OK);
    CHECK(dropped_calls == 0);

    CHECK(expcache_release_all(cache) == EXPCACHE_OK);
    CHECK(dropped_calls == 1);
    CHECK(memcmp(ptrs[0].gate, source[0][1], kPart) == 0); /* stale but allocated */
    CHECK(memcmp(ptrs[0].down, source[2][1], kPart) == 0);

    /* The reference keeps the class's bank mapped (emptied, at its address): the next select
       fills it again, with no new memory. */
    uint64_t before = 0, after = 0;
    CHECK(expcache_testing_device_bytes_in_use(cache, &before) == EXPCACHE_OK && before > 0);
    expcache_expert_ptrs_t again[3];
    CHECK(expcache_select_async(cache, 0, ids, 3, NULL, again) == EXPCACHE_OK);
    CHECK(expcache_testing_device_bytes_in_use(cache, &after) == EXPCACHE_OK && after == before);
    CHECK(memcmp(again[0].gate, source[0][1], kPart) == 0);

    expcache_destroy(cache);
    CHECK(memcmp(ptrs[1].up, source[1][2], kPart) == 0); /* still allocated after destroy */
    expcache_memory_release(ref);                        /* the last reference: freed (ASan: no leak) */
    expcache_memory_release(NULL);
}

static void released_before_the_cache_frees(void) {
    expcache_t* cache = make_cache();
    uint32_t ids[1] = {5};
    expcache_expert_ptrs_t ptrs[1];
    CHECK(expcache_select_async(cache, 0, ids, 1, NULL, ptrs) == EXPCACHE_OK);
    expcache_memory_ref_t* a = NULL;
    expcache_memory_ref_t* b = NULL;
    CHECK(expcache_memory_retain(cache, ptrs[0].gate, &a) == EXPCACHE_OK);
    CHECK(expcache_memory_retain(cache, ptrs[0].down, &b) == EXPCACHE_OK);
    expcache_memory_release(a);
    expcache_memory_release(b);
    dropped_calls = 0;
    CHECK(expcache_memory_set_dropped_callback(cache, on_dropped, NULL) == EXPCACHE_OK);
    CHECK(expcache_release_all(cache) == EXPCACHE_OK); /* nothing kept: freed by the cache itself */
    CHECK(dropped_calls == 0);
    expcache_destroy(cache);
}

static void inherited_by_fork(void) {
    expcache_t* cache = make_cache();
    uint32_t ids[2] = {7, 8};
    expcache_expert_ptrs_t ptrs[2];
    CHECK(expcache_select_async(cache, 0, ids, 2, NULL, ptrs) == EXPCACHE_OK);
    expcache_memory_ref_t* ref = NULL;
    CHECK(expcache_memory_retain(cache, ptrs[0].gate, &ref) == EXPCACHE_OK);
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        int bad = 0;
        expcache_status_t s = expcache_select_async(cache, 0, ids, 2, NULL, ptrs);
        if (s != EXPCACHE_ERR_INVALID_STATE || !strstr(expcache_last_error(), "forked")) {
            fprintf(stderr, "memory_test: child: select gave %d (%s)\n", s, expcache_last_error());
            bad = 1;
        }
        expcache_memory_release(ref); /* the parent's: left alone */
        expcache_destroy(cache);      /* forgets the handle, touches nothing */
        if (expcache_release_all(cache) != EXPCACHE_ERR_INVALID_ARGUMENT) bad = 1;
        expcache_t* fresh = make_cache(); /* a cache made in the child works */
        if (expcache_select_async(fresh, 0, ids, 2, NULL, ptrs) != EXPCACHE_OK ||
            memcmp(ptrs[1].gate, source[0][8], kPart) != 0)
            bad = 1;
        expcache_destroy(fresh);
        _exit(bad || failures ? 1 : 0); /* no leak check in the child: the parent's copy is kept */
    }
    int status = 0;
    CHECK(pid > 0 && waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK(expcache_select_async(cache, 0, ids, 2, NULL, ptrs) == EXPCACHE_OK); /* the parent's is unaffected */
    expcache_destroy(cache);
    expcache_memory_release(ref);
}

int main(void) {
    for (int p = 0; p < 3; ++p)
        for (int e = 0; e < kExperts; ++e)
            for (int i = 0; i < kPart; ++i) source[p][e][i] = (unsigned char)(p * 71 + e * 13 + i * 7);
    kept_past_release_and_destroy();
    released_before_the_cache_frees();
    inherited_by_fork();
    printf("memory_test: %d checks, %d failed\n", checks, failures);
    return failures ? 1 : 0;
}
