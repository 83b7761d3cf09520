/*
 * main.c — the driver of tests/c/stress/: a seeded, randomized stress driver for libexpcache,
 * written against the public headers (expcache.h and the test hooks of expcache_testing.h)
 * only, on the host backend. Built and run by tests/sanitize.mk under ASan + UBSan (make
 * asan-test), valgrind (make valgrind-test) and TSan (make tsan-test); tests/test_sanitizers.py
 * runs all three.
 *
 * It keeps up to MAX_CACHES caches alive at once (random configurations:
 * tight emulated device memory, small slabs, reserves, budgets, several size
 * classes and fewer class indices than classes, odd unaligned part sizes,
 * pageable host sources in two arrangements and file sources read through
 * expcache_file_open, now and then a layer of thousands of tiny experts) and
 * runs a long random sequence of every exported function, good and bad input
 * alike: NULL pointers, out-of-range layers and ids, wrong struct_size,
 * destroyed and foreign handles, unknown batch ids, injected allocation and
 * copy failures. After every call it checks what the header promises:
 *
 *   - the status is one the function documents; CUDA only while injected
 *     copy failures may fire (the host backend has no CUDA otherwise);
 *     failures leave the out-pointers untouched and expcache_last_error()
 *     names the function;
 *   - every device address handed out holds exactly the source bytes (read
 *     back with expcache_testing_read_device, and through
 *     expcache_testing_checksum), for as long as the header says it is
 *     valid: select's until the next select, compact_load, batch_prepare,
 *     release_all or layer_bind_class, the compact buffer's until the next
 *     compact_load or release_all, a batch's until its batch_finish; a
 *     batch's held experts stay resident while it is held;
 *   - every resident expert (expcache_testing_read_resident) holds its source bytes,
 *     also after failed calls; class infos agree with what is resident and
 *     held;
 *   - counters never decrease except after expcache_stats_reset, bad input
 *     changes none of them, and each serving call moves them consistently;
 *   - device_bytes_in_use equals the slots of every class plus the staging
 *     buffers the calls made (nothing leaks), never exceeds the emulated
 *     capacity, and is 0 after release_all when no batch is held; the
 *     expert caches never grow into reserve_bytes;
 *   - destroy closes every file the cache opened, and at the end every
 *     cache is destroyed (ASan's leak checker or valgrind then reports any
 *     byte the library did not free).
 *
 * The files, one concept each (stress.h declares what they share):
 *   main.c         options, the choice of operation per step, teardown, the counts printed
 *   random.c       the seeded draws
 *   report.c       counters, divergences, the trace, the status check of every call
 *   model.c        the reference model of each cache and the read-back against it
 *   invariants.c   what holds after every operation
 *   stats.c        counters against the model's snapshot; expcache_stats_reset
 *   lifetime.c     create (random and bad configurations, environment overrides), release_all, destroy
 *   layers.c       layer sources in memory or in a file; register with good and bad descriptors
 *   files.c        file sources opened through the library; bad paths; many files on one cache
 *   serving.c      what the serving calls share
 *   select.c       expcache_select_async
 *   compact.c      expcache_compact_load_async
 *   batch.c        expcache_batch_prepare_async, expcache_batch_finish
 *   faults.c       injected allocation, copy and staging failures
 *   inspect.c      layer_bind_class, read_resident, read_device, checksum, struct sizes, version
 *   log.c          the log callback and levels
 *   bad_serving.c  bad input to the serving calls
 *   handles.c      destroyed and foreign handles
 *   device.c       a device-lookup cache of its own: select_device among the host-side calls
 *
 * usage: stress [SEED [OPS]] [--trace]
 * A seed always replays the same sequence (the draws never depend on heap
 * addresses); --trace prints a line per operation. Prints the number of
 * operations, library calls, faults injected, bad inputs tried and errors
 * (divergences) found, each divergence with its seed and operation number;
 * exits 1 on any divergence.
 */
#include "stress.h"

static Model* pick_model(void) {
    int live[MAX_CACHES], n = 0;
    for (int i = 0; i < MAX_CACHES; ++i)
        if (g_models[i].live) live[n++] = i;
    return n ? &g_models[live[below((uint64_t)n)]] : NULL;
}

static void step(void) {
    Model* m = pick_model();
    if (!m || pct(2)) {
        op_create();
        return;
    }
    g_cur = m->serial;
    /* Keep the number of registered layers up so the serving paths get work. */
    int regs = 0;
    for (uint32_t l = 0; l < m->num_layers; ++l) regs += m->layers[l].registered;
    unsigned r = (unsigned)below(1000);
    if (regs == 0 || (regs < (int)m->num_layers && r < 60)) {
        op_register(m);
        return;
    }
    if (r < 300)
        op_select(m);
    else if (r < 400)
        op_compact(m);
    else if (r < 510)
        op_batch_prepare(m, 0, 0);
    else if (r < 600)
        op_batch_finish(m);
    else if (r < 625)
        op_release_all(m);
    else if (r < 660)
        op_inject(m);
    else if (r < 670)
        op_inject_copy(m);
    else if (r < 680)
        op_inject_staging(m);
    else if (r < 690)
        op_reset_stats(m);
    else if (r < 720)
        op_layer_class(m);
    else if (r < 760)
        op_read_resident(m);
    else if (r < 800)
        op_read_device(m);
    else if (r < 830)
        op_checksum(m);
    else if (r < 845)
        op_log(m);
    else if (r < 860)
        op_misc(m);
    else if (r < 920)
        op_bad_serving(m);
    else if (r < 935)
        op_register(m);
    else if (r < 945)
        op_stale();
    else if (r < 948)
        op_fill_batches(m);
    else if (r < 956) {
        /* Drain: finish every batch, release, and everything must be back to 0. */
        g_cur_op = "drain";
        for (int i = 0; m->nbatches && i < 4 * EXPCACHE_MAX_BATCHES; ++i) op_batch_finish(m);
        op_release_all(m);
    } else if (r < 960)
        op_destroy(m);
    else if (r < 964)
        op_device_lookup();
    else
        op_select(m);
}

int main(int argc, char** argv) {
    uint64_t ops = 20000;
    g_seed = 1;
    int pos = 0;
    for (int i = 1; i < argc; ++i) {
        if (strcmp(argv[i], "--trace") == 0) {
            g_trace = 1;
        } else if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
            printf("usage: %s [SEED [OPS]] [--trace]\n", argv[0]);
            return 0;
        } else {
            char* end = NULL;
            unsigned long long v = strtoull(argv[i], &end, 0);
            if (!end || *end) {
                fprintf(stderr, "usage: %s [SEED [OPS]] [--trace]\n", argv[0]);
                return 2;
            }
            if (pos == 0)
                g_seed = v;
            else
                ops = v;
            ++pos;
        }
    }
    rng_seed(g_seed);
    unsetenv("EXPCACHE_RESERVE_GB");
    unsetenv("EXPCACHE_VERBOSE");
    int fds_before = count_fds();
    const char* le = expcache_last_error();
    if (!le || le[0]) diverge("expcache_last_error() is \"%s\" before any failure", le ? le : "(null)");

    for (g_op = 1; g_op <= ops; ++g_op) {
        if (g_op == 200) op_file_limit();
        step();
    }

    g_cur_op = "teardown";
    for (int i = 0; i < MAX_CACHES; ++i) {
        Model* m = &g_models[i];
        if (!m->live) continue;
        g_cur = m->serial;
        while (m->nbatches && pct(50)) op_batch_finish(m);
        if (m->nbatches == 0) op_release_all(m);
        op_destroy(m);
    }
    free_scratch();
    int fds_after = count_fds();
    if (fds_after != fds_before)
        diverge("%d file descriptors open at the start, %d after every cache was destroyed", fds_before, fds_after);
    printf("stress: seed %" PRIu64 ", %" PRIu64 " operations, %" PRIu64 " library calls, %" PRIu64
           " caches created, %" PRIu64 " destroyed\n",
           g_seed, ops, g_calls, g_creates, g_destroys);
    printf("stress: %" PRIu64 " selects, %" PRIu64 " compacts, %" PRIu64 " batch prepares, %" PRIu64
           " finishes, %" PRIu64 " releases, %" PRIu64 " log lines, %" PRIu64 " MiB verified\n",
           g_selects, g_compacts, g_batches, g_finishes, g_releases, g_log_lines, g_verified_bytes >> 20);
    printf("stress: faults injected %" PRIu64 " (armed; %" PRIu64 " seen failing, %" PRIu64
           " of them on staging threads), %" PRIu64 " out-of-memory statuses, %" PRIu64 " bad inputs tried, %" PRIu64
           " errors found\n",
           g_faults_armed, g_faults_seen, g_staging_faults_seen, g_ooms, g_bad, g_errors);
    return g_errors ? 1 : 0;
}
