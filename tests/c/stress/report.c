/*
 * report.c — the run's counters, divergences (each with its seed and operation number), the
 * trace (--trace: a line per operation), and the status check every library call goes through.
 */
#include "stress.h"

uint64_t g_seed;
int g_trace;

uint64_t g_op, g_calls, g_bad, g_errors, g_faults_armed, g_faults_seen, g_ooms, g_verified_bytes;
uint64_t g_staging_faults_seen; /* calls failed by an injected staging fault */
uint64_t g_range_reports;       /* warnings of a device select's id out of range */
uint64_t g_creates, g_destroys, g_log_lines, g_selects, g_compacts, g_batches, g_finishes, g_releases;
uint64_t g_serial; /* cache serial numbers: source patterns and messages */
uint64_t g_cur;    /* serial of the cache the current op works on */
const char* g_cur_op = "";

void diverge(const char* fmt, ...) {
    g_errors++;
    if (g_errors > 40) return;
    fprintf(stderr, "DIVERGENCE seed %" PRIu64 " op %" PRIu64 " (%s, cache #%" PRIu64 "): ", g_seed, g_op, g_cur_op,
            g_cur);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    if (g_errors == 40) fprintf(stderr, "(further divergences are counted, not printed)\n");
}

void trace(const char* fmt, ...) {
    if (!g_trace) return;
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "[%" PRIu64 " #%" PRIu64 "] ", g_op, g_cur);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

/* The status of a call: one of `allowed`; a failure names the function. */
int check_status(const char* fn, expcache_status_t s, uint32_t allowed) {
    g_calls++;
    if (s < 0 || s > 31 || !(allowed & ST(s))) {
        diverge("%s returned %d (%s), not a status it documents here; last error: %s", fn, s, sname(s),
                expcache_last_error());
        return 0;
    }
    if (s != OK) {
        const char* e = expcache_last_error();
        size_t n = strlen(fn);
        if (!e || strncmp(e, fn, n) != 0 || strncmp(e + n, ": ", 2) != 0 || strlen(e) <= n + 2)
            diverge("%s failed with %s but expcache_last_error() is \"%s\" (should name the function and reason)", fn,
                    sname(s), e ? e : "(null)");
        if (s == OOM) g_ooms++;
        if ((s == OOM || s == CUDA) && e && strstr(e, "injected")) g_faults_seen++;
    }
    return 1;
}

/* Bad input: exactly `expected`. */
void expect_bad(const char* fn, expcache_status_t s, expcache_status_t expected, const char* what) {
    g_bad++;
    check_status(fn, s, ST(expected));
    if (s != expected) diverge("%s(%s): expected %s, got %s", fn, what, sname(expected), sname(s));
}

void* xmalloc(size_t n) {
    void* p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "stress: out of host memory\n");
        exit(2);
    }
    return p;
}
void* xcalloc(size_t n, size_t size) {
    void* p = calloc(n ? n : 1, size ? size : 1);
    if (!p) {
        fprintf(stderr, "stress: out of host memory\n");
        exit(2);
    }
    return p;
}
