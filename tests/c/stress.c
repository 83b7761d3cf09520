/*
 * stress.c — a seeded, randomized stress driver for libexpcache, written
 * against the public headers (expcache.h and the test hooks of
 * expcache_testing.h) only, on the host backend. Built and
 * run by tests/sanitize.mk under ASan + UBSan (make asan-test) and valgrind
 * (make valgrind-test); tests/test_sanitizers.py runs both.
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
 * usage: stress [SEED [OPS]] [--trace]
 * A seed always replays the same sequence (the draws never depend on heap
 * addresses); --trace prints a line per operation. Prints the number of
 * operations, library calls, faults injected, bad inputs tried and errors
 * (divergences) found, each divergence with its seed and operation number;
 * exits 1 on any divergence.
 */
#define _POSIX_C_SOURCE 200809L

#include <dirent.h>
#include <sys/resource.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "expcache_testing.h" /* includes expcache.h */

#define MAX_CACHES 3
#define MAX_LAYERS 8
#define MAX_KEYS 6
#define MAX_EXPERTS 48      /* ordinary layers */
#define BIG_EXPERTS_MAX 8192 /* the occasional layer with thousands of tiny experts */
#define MAX_BATCH_IDS 256
#define MAX_COMPACT_IDS 48
#define MAX_STALE 16
#define MAX_FINISHED 16
#define ALIGN 256u

#define OK EXPCACHE_OK
#define IA EXPCACHE_ERR_INVALID_ARGUMENT
#define OOM EXPCACHE_ERR_OUT_OF_DEVICE_MEMORY
#define IS EXPCACHE_ERR_INVALID_STATE
#define UNSUP EXPCACHE_ERR_UNSUPPORTED
#define CUDA EXPCACHE_ERR_CUDA
#define IO EXPCACHE_ERR_IO
#define ST(s) (1u << (s))

/* ------------------------------------------------------------------------ */
/* Randomness, reporting                                                     */
/* ------------------------------------------------------------------------ */

static uint64_t g_rng;
static uint64_t g_seed;
static int g_trace;

static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static uint64_t rnd(void) { return mix64(g_rng += 0x9E3779B97F4A7C15ull); }
static uint64_t below(uint64_t n) { return n ? rnd() % n : 0; }
static uint64_t between(uint64_t lo, uint64_t hi) { return lo + below(hi - lo + 1); }
static int pct(unsigned p) { return below(100) < p; }

static uint64_t g_op, g_calls, g_bad, g_errors, g_faults_armed, g_faults_seen, g_ooms, g_verified_bytes;
static uint64_t g_staging_faults_seen; /* calls failed by an injected staging fault */
static uint64_t g_creates, g_destroys, g_log_lines, g_selects, g_compacts, g_batches, g_finishes, g_releases;
static uint64_t g_serial; /* cache serial numbers: source patterns and messages */
static uint64_t g_cur;    /* serial of the cache the current op works on */
static const char* g_cur_op = "";

static void diverge(const char* fmt, ...) {
    g_errors++;
    if (g_errors > 40) return;
    fprintf(stderr, "DIVERGENCE seed %" PRIu64 " op %" PRIu64 " (%s, cache #%" PRIu64 "): ", g_seed, g_op,
            g_cur_op, g_cur);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    if (g_errors == 40) fprintf(stderr, "(further divergences are counted, not printed)\n");
}

static void trace(const char* fmt, ...) {
    if (!g_trace) return;
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "[%" PRIu64 " #%" PRIu64 "] ", g_op, g_cur);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

static const char* sname(expcache_status_t s) { return expcache_status_string(s); }

/* The status of a call: one of `allowed`; a failure names the function. */
static int check_status(const char* fn, expcache_status_t s, uint32_t allowed) {
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
            diverge("%s failed with %s but expcache_last_error() is \"%s\" (should name the function and reason)",
                    fn, sname(s), e ? e : "(null)");
        if (s == OOM) g_ooms++;
        if ((s == OOM || s == CUDA) && e && strstr(e, "injected")) g_faults_seen++;
    }
    return 1;
}

/* Bad input: exactly `expected`. */
static void expect_bad(const char* fn, expcache_status_t s, expcache_status_t expected, const char* what) {
    g_bad++;
    check_status(fn, s, ST(expected));
    if (s != expected) diverge("%s(%s): expected %s, got %s", fn, what, sname(expected), sname(s));
}

static void* xmalloc(size_t n) {
    void* p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "stress: out of host memory\n");
        exit(2);
    }
    return p;
}
static void* xcalloc(size_t n, size_t size) {
    void* p = calloc(n ? n : 1, size ? size : 1);
    if (!p) {
        fprintf(stderr, "stress: out of host memory\n");
        exit(2);
    }
    return p;
}

static uint64_t align_up(uint64_t v) { return (v + ALIGN - 1) & ~(uint64_t)(ALIGN - 1); }

/* ------------------------------------------------------------------------ */
/* Model                                                                     */
/* ------------------------------------------------------------------------ */

typedef struct {
    int registered;
    int key;
    uint32_t num_experts;
    uint64_t bytes[3], stride[3];
    const unsigned char* base[3];
    unsigned char* bufs[3];
    int nbufs;
    uint32_t pinned;
    int from_file;      /* EXPCACHE_SOURCE_FILE: bufs[0] is the file's image, off[] the bases in the file */
    uint32_t file_id;
    uint64_t off[3], file_bytes;
    uint32_t* mark; /* per expert, stamp for set computations */
} Layer;

typedef struct {
    uint64_t id;
    uint32_t layer, count, cls;
    uint32_t* ids;
    expcache_expert_ptrs_t* ptrs;
    unsigned char* held;
    uint64_t staging;
} Batch;

typedef struct {
    uint32_t magic;
    uint32_t level;     /* the library's current log level as we set it */
    int installed;
    uint64_t lines;
} LogSink;

typedef struct {
    int live;
    expcache_t* h;
    uint64_t serial;
    uint32_t num_layers, max_classes;
    uint64_t capacity, reserve, budget_experts;
    uint64_t keys[MAX_KEYS + 1][3];
    int nkeys;
    Layer layers[MAX_LAYERS];
    Batch batches[EXPCACHE_MAX_BATCHES];
    int nbatches;
    uint64_t finished[MAX_FINISHED];
    int nfinished;
    expcache_stats_t snap[EXPCACHE_MAX_CLASSES_LIMIT][EXPCACHE_NUM_PATHS];
    expcache_class_info_t info[EXPCACHE_MAX_CLASSES_LIMIT];
    uint64_t compact_cap, overflow_cap;
    uint64_t copy_faults_left; /* injected copy failures that may still fire */
    uint64_t staging_faults_left; /* injected staging failures that may still fire (at least) */
    uint32_t nfiles;           /* files opened: ids 0..nfiles-1 */
    int sel_valid;
    uint32_t sel_layer, sel_k;
    uint32_t sel_ids[EXPCACHE_MAX_SELECT];
    expcache_expert_ptrs_t sel_ptrs[EXPCACHE_MAX_SELECT];
    int cmp_valid;
    uint32_t cmp_layer, cmp_n;
    uint32_t cmp_ids[MAX_COMPACT_IDS];
    expcache_compact_t cmp;
    LogSink log;
    uint32_t stamp;
} Model;

static Model g_models[MAX_CACHES];
static expcache_t* g_stale[MAX_STALE];
static int g_nstale;
static unsigned char g_foreign[256]; /* a "handle" the library never made */
static unsigned char* g_scratch;     /* read-back buffer */
static uint64_t g_scratch_bytes;

static const char* kPart[3] = {"gate", "up", "down"};

static uint64_t slot_bytes_of(const uint64_t k[3]) { return align_up(k[0]) + align_up(k[1]) + align_up(k[2]); }
static uint64_t expert_bytes(const Layer* L) { return L->bytes[0] + L->bytes[1] + L->bytes[2]; }
static const unsigned char* source(const Layer* L, int p, uint32_t e) { return L->base[p] + L->stride[p] * e; }

static void fill_part(unsigned char* dst, uint64_t n, uint64_t serial, uint32_t layer, uint32_t e, int p) {
    uint64_t s = mix64(serial * 0x100000001B3ull ^ ((uint64_t)layer << 48) ^ ((uint64_t)e << 8) ^ (uint64_t)p);
    for (uint64_t i = 0; i < n; ++i) {
        if ((i & 7) == 0) s = mix64(s + i + 1);
        dst[i] = (unsigned char)(s >> ((i & 7) * 8));
    }
}

static unsigned char* scratch(uint64_t n) {
    if (n > g_scratch_bytes) {
        free(g_scratch);
        g_scratch_bytes = n * 2;
        g_scratch = (unsigned char*)xmalloc(g_scratch_bytes);
    }
    return g_scratch;
}

/* Read `n` bytes at device address `dev` and compare them with `want`. */
static int verify_range(Model* m, const void* dev, const unsigned char* want, uint64_t n, const char* what,
                        uint32_t layer, uint32_t e, int part) {
    unsigned char* buf = scratch(n);
    expcache_status_t s = expcache_testing_read_device(m->h, dev, buf, n);
    check_status("expcache_testing_read_device", s, ST(OK) | ST(IA));
    if (s != OK) {
        diverge("%s: layer %u expert %u %s at %p (+%" PRIu64 " B) is not readable: %s", what, layer, e,
                kPart[part], dev, n, expcache_last_error());
        return 0;
    }
    if (memcmp(buf, want, n) != 0) {
        uint64_t i = 0;
        while (i < n && buf[i] == want[i]) ++i;
        diverge("%s: layer %u expert %u %s at %p holds wrong bytes (first at offset %" PRIu64 " of %" PRIu64
                ": 0x%02x, want 0x%02x)",
                what, layer, e, kPart[part], dev, i, n, buf[i], want[i]);
        return 0;
    }
    g_verified_bytes += n;
    return 1;
}

static int verify_expert(Model* m, uint32_t layer, uint32_t e, const expcache_expert_ptrs_t* p, const char* what) {
    const Layer* L = &m->layers[layer];
    void* parts[3] = {p->gate, p->up, p->down};
    for (int q = 0; q < 3; ++q)
        if (!verify_range(m, parts[q], source(L, q, e), L->bytes[q], what, layer, e, q)) return 0;
    return 1;
}

/* read_resident: 1 resident (bytes checked), 0 not, -1 error. */
static int resident(Model* m, uint32_t layer, uint32_t e) {
    const Layer* L = &m->layers[layer];
    uint64_t eb = expert_bytes(L);
    unsigned char* dst = (unsigned char*)xmalloc(eb); /* exact size: ASan catches an overrun */
    uint32_t r = 0xA5A5A5A5u;
    expcache_status_t s = expcache_testing_read_resident(m->h, layer, e, dst, eb, &r);
    check_status("expcache_testing_read_resident", s, ST(OK));
    int out = -1;
    if (s != OK) {
        diverge("read_resident(layer %u, expert %u) failed: %s", layer, e, expcache_last_error());
    } else if (r == 1) {
        const unsigned char* d = dst;
        out = 1;
        for (int q = 0; q < 3; ++q) {
            if (memcmp(d, source(L, q, e), L->bytes[q]) != 0) {
                diverge("resident expert (layer %u, expert %u) %s holds wrong bytes", layer, e, kPart[q]);
                out = -1;
                break;
            }
            d += L->bytes[q];
        }
        if (out == 1) g_verified_bytes += eb;
    } else if (r == 0) {
        out = 0;
    } else {
        diverge("read_resident(layer %u, expert %u) set *out_resident to %u", layer, e, r);
    }
    free(dst);
    return out;
}

static int is_stale_live(const expcache_t* h) {
    for (int i = 0; i < MAX_CACHES; ++i)
        if (g_models[i].live && g_models[i].h == h) return 1;
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Logging                                                                   */
/* ------------------------------------------------------------------------ */

#define LOG_MAGIC 0x10C5100Cu

static void log_cb(void* user, uint32_t level, const char* msg) {
    LogSink* sink = (LogSink*)user;
    g_log_lines++;
    if (!sink || sink->magic != LOG_MAGIC) {
        diverge("log callback got user %p, not the pointer it was registered with", user);
        return;
    }
    sink->lines++;
    if (!msg) {
        diverge("log callback got a NULL message");
        return;
    }
    if (level < EXPCACHE_LOG_WARNING || level > sink->level)
        diverge("log line at level %u while the level is %u: %s", level, sink->level, msg);
    size_t n = strlen(msg);
    if (n == 0 || msg[n - 1] == '\n') diverge("log line empty or ends in a newline: \"%s\"", msg);
    if (strstr(msg, "injected")) g_faults_seen++;
    if (g_trace) fprintf(stderr, "    log[%u]: %s\n", level, msg);
}

static void install_log(Model* m, uint32_t level) {
    expcache_status_t s = expcache_log_set_callback(m->h, log_cb, &m->log);
    check_status("expcache_log_set_callback", s, ST(OK));
    s = expcache_log_set_level(m->h, level);
    check_status("expcache_log_set_level", s, ST(OK));
    if (s == OK) m->log.level = level;
    m->log.installed = 1;
}

/* ------------------------------------------------------------------------ */
/* Invariants                                                                */
/* ------------------------------------------------------------------------ */

static void mark_clear(Model* m) {
    if (++m->stamp == 0) {
        for (uint32_t l = 0; l < m->num_layers; ++l)
            if (m->layers[l].mark) memset(m->layers[l].mark, 0, m->layers[l].num_experts * sizeof(uint32_t));
        m->stamp = 1;
    }
}

static int key_eq(const uint64_t a[3], uint64_t g, uint64_t u, uint64_t d) { return a[0] == g && a[1] == u && a[2] == d; }

/* Compare stats with the snapshot: equal (exact) or never smaller; then take it as the new snapshot. */
#define STAT_FIELDS(X) X(calls) X(hits) X(misses) X(evictions) X(appends) X(direct_loads) X(bytes_h2d) \
    X(bytes_d2d) X(releases) X(alloc_retries) X(cap_notices) X(class_reuses)

static void check_stats(Model* m, int exact) {
    for (uint32_t c = 0; c < m->max_classes; ++c)
        for (uint32_t p = 0; p < EXPCACHE_NUM_PATHS; ++p) {
            expcache_stats_t st;
            memset(&st, 0xA5, sizeof st);
            st.struct_size = sizeof st;
            expcache_status_t s = expcache_stats_get(m->h, c, p, &st);
            check_status("expcache_stats_get", s, ST(OK));
            if (s != OK) continue;
            if (st.struct_size != sizeof st) diverge("get_stats wrote struct_size %u", st.struct_size);
            const expcache_stats_t* o = &m->snap[c][p];
#define CMP(f)                                                                                               \
    if (exact ? st.f != o->f : st.f < o->f)                                                                  \
        diverge("class %u path %u counter " #f " went from %" PRIu64 " to %" PRIu64 "%s", c, p, o->f, st.f, \
                exact ? " on a call that should change nothing" : " (counters never decrease)");
            STAT_FIELDS(CMP)
#undef CMP
            m->snap[c][p] = st;
        }
}

static void check_batches(Model* m, int all);

/* Light invariants after every op; `deep` adds a residency sweep of every layer. */
static void check_invariants(Model* m, int deep, int exact_stats) {
    if (!m->live) return;
    uint64_t db = 0xA5A5A5A5A5A5A5A5ull;
    expcache_status_t s = expcache_testing_device_bytes_in_use(m->h, &db);
    check_status("expcache_testing_device_bytes_in_use", s, ST(OK));
    uint32_t cc = 0xA5A5u;
    s = expcache_class_count_get(m->h, &cc);
    check_status("expcache_class_count_get", s, ST(OK));
    uint32_t in_use = 0;
    uint64_t slots_bytes = 0, resident_total = 0;
    for (uint32_t c = 0; c < m->max_classes; ++c) {
        expcache_class_info_t ci;
        memset(&ci, 0xA5, sizeof ci);
        ci.struct_size = sizeof ci;
        s = expcache_class_info_get(m->h, c, &ci);
        check_status("expcache_class_info_get", s, ST(OK));
        if (s != OK) continue;
        m->info[c] = ci;
        if (ci.struct_size != sizeof ci) diverge("class_info wrote struct_size %u", ci.struct_size);
        if (ci.in_use > 1) diverge("class %u in_use is %u", c, ci.in_use);
        if (!ci.in_use) {
            if (ci.allocated_experts || ci.resident_experts || ci.held_experts)
                diverge("empty class index %u reports %" PRIu64 " allocated, %" PRIu64 " resident, %" PRIu64 " held",
                        c, ci.allocated_experts, ci.resident_experts, ci.held_experts);
            continue;
        }
        in_use++;
        uint64_t key[3] = {ci.gate_bytes, ci.up_bytes, ci.down_bytes};
        uint64_t experts = 0, layers = 0;
        for (uint32_t l = 0; l < m->num_layers; ++l) {
            const Layer* L = &m->layers[l];
            if (L->registered && key_eq(key, L->bytes[0], L->bytes[1], L->bytes[2])) {
                experts += L->num_experts;
                layers++;
            }
        }
        if (!layers) diverge("class %u has key (%" PRIu64 ", %" PRIu64 ", %" PRIu64 ") of no registered layer", c, key[0], key[1], key[2]);
        if (ci.slot_bytes != slot_bytes_of(key))
            diverge("class %u slot_bytes %" PRIu64 ", want %" PRIu64, c, ci.slot_bytes, slot_bytes_of(key));
        if (!(ci.held_experts <= ci.resident_experts && ci.resident_experts <= ci.allocated_experts))
            diverge("class %u: held %" PRIu64 " <= resident %" PRIu64 " <= allocated %" PRIu64 " does not hold", c,
                    ci.held_experts, ci.resident_experts, ci.allocated_experts);
        if (ci.allocated_experts > experts)
            diverge("class %u allocated %" PRIu64 " slots for %" PRIu64 " experts", c, ci.allocated_experts, experts);
        if (m->budget_experts && ci.allocated_experts > m->budget_experts)
            diverge("class %u allocated %" PRIu64 " slots, budget_experts is %" PRIu64, c, ci.allocated_experts,
                    m->budget_experts);
        if (ci.num_layers > layers)
            diverge("class %u reports %" PRIu64 " layers bound, only %" PRIu64 " registered layers have its key", c,
                    ci.num_layers, layers);
        for (uint32_t o = 0; o < c; ++o)
            if (m->info[o].in_use && key_eq(key, m->info[o].gate_bytes, m->info[o].up_bytes, m->info[o].down_bytes))
                diverge("class indices %u and %u have the same key", o, c);
        slots_bytes += ci.allocated_experts * ci.slot_bytes;
        resident_total += ci.resident_experts;
    }
    if (in_use != cc) diverge("class_count %u, but %u class infos are in use", cc, in_use);

    /* Device memory: the slots plus the staging the calls made; never over capacity; reserve untouched. */
    uint64_t staging = m->compact_cap + m->overflow_cap;
    for (int b = 0; b < m->nbatches; ++b) staging += m->batches[b].staging;
    if (db != slots_bytes + staging)
        diverge("device_bytes_in_use %" PRIu64 " != slots %" PRIu64 " + compact %" PRIu64 " + overflow %" PRIu64
                " + batch staging %" PRIu64 " (a leak or lost accounting)",
                db, slots_bytes, m->compact_cap, m->overflow_cap, staging - m->compact_cap - m->overflow_cap);
    if (db > m->capacity) diverge("device_bytes_in_use %" PRIu64 " > capacity %" PRIu64, db, m->capacity);
    uint64_t growable = m->capacity > m->reserve ? m->capacity - m->reserve : 0;
    if (slots_bytes > growable)
        diverge("expert caches hold %" PRIu64 " B, more than capacity %" PRIu64 " - reserve %" PRIu64, slots_bytes,
                m->capacity, m->reserve);

    /* Held slots: per class, the distinct experts held by outstanding batches. */
    for (uint32_t c = 0; c < m->max_classes; ++c) {
        if (!m->info[c].in_use) continue;
        mark_clear(m);
        uint64_t held = 0;
        for (int b = 0; b < m->nbatches; ++b) {
            Batch* B = &m->batches[b];
            if (B->cls != c) continue;
            Layer* L = &m->layers[B->layer];
            for (uint32_t j = 0; j < B->count; ++j)
                if (B->held[j] && L->mark[B->ids[j]] != m->stamp) {
                    L->mark[B->ids[j]] = m->stamp;
                    held++;
                }
        }
        if (held != m->info[c].held_experts)
            diverge("class %u reports %" PRIu64 " held experts, outstanding batches hold %" PRIu64, c,
                    m->info[c].held_experts, held);
    }
    if (m->nbatches == 0)
        for (uint32_t c = 0; c < m->max_classes; ++c)
            if (m->info[c].held_experts) diverge("class %u holds experts with no batch outstanding", c);

    check_stats(m, exact_stats);

    /* Addresses still valid. */
    if (m->sel_valid) {
        uint32_t n = m->sel_k, step = n > 32 ? n / 16 : 1;
        for (uint32_t i = (uint32_t)below(step); i < n; i += step)
            if (!verify_expert(m, m->sel_layer, m->sel_ids[i], &m->sel_ptrs[i], "select address (still valid)")) {
                m->sel_valid = 0; /* reported once */
                break;
            }
    }
    if (m->cmp_valid) {
        const expcache_compact_t* c = &m->cmp;
        uint32_t i = (uint32_t)below(m->cmp_n);
        unsigned char* b = (unsigned char*)c->base;
        expcache_expert_ptrs_t p = {b + c->gate_offset + i * c->gate_bytes, b + c->up_offset + i * c->up_bytes,
                                    b + c->down_offset + i * c->down_bytes};
        verify_expert(m, m->cmp_layer, m->cmp_ids[i], &p, "compact buffer (still valid)");
    }
    check_batches(m, deep);

    if (deep) {
        uint64_t total = 0;
        for (uint32_t l = 0; l < m->num_layers; ++l) {
            Layer* L = &m->layers[l];
            if (!L->registered) continue;
            for (uint32_t e = 0; e < L->num_experts; ++e) total += resident(m, l, e) == 1;
        }
        if (total != resident_total)
            diverge("read_resident finds %" PRIu64 " resident experts, class infos say %" PRIu64, total, resident_total);
    }
}

/* Outstanding batches: addresses hold their bytes; held experts stay resident. */
static void check_batches(Model* m, int all) {
    if (m->nbatches == 0) return;
    int from = all ? 0 : (int)below((uint64_t)m->nbatches), to = all ? m->nbatches : from + 1;
    for (int b = from; b < to; ++b) {
        Batch* B = &m->batches[b];
        for (uint32_t j = 0; j < B->count; ++j) {
            if (!verify_expert(m, B->layer, B->ids[j], &B->ptrs[j], "batch address (batch outstanding)")) break;
            if (B->held[j] && resident(m, B->layer, B->ids[j]) != 1)
                diverge("batch %" PRIu64 " holds (layer %u, expert %u), which is no longer resident", B->id, B->layer,
                        B->ids[j]);
        }
    }
}

/* Would binding `layer` to a class fail (every index in use by another key, all holding batch slots)? */
static int bind_fails(Model* m, uint32_t layer) {
    const Layer* L = &m->layers[layer];
    for (uint32_t c = 0; c < m->max_classes; ++c) {
        const expcache_class_info_t* ci = &m->info[c];
        if (!ci->in_use) return 0;
        if (key_eq(L->bytes, ci->gate_bytes, ci->up_bytes, ci->down_bytes)) return 0;
        if (ci->held_experts == 0) return 0;
    }
    return 1;
}

/* ------------------------------------------------------------------------ */
/* Cache lifetime                                                            */
/* ------------------------------------------------------------------------ */

static void free_layer(Layer* L) {
    for (int i = 0; i < L->nbufs; ++i) free(L->bufs[i]);
    free(L->mark);
    memset(L, 0, sizeof *L);
}

static void drop_batch(Model* m, int b) {
    Batch* B = &m->batches[b];
    free(B->ids);
    free(B->ptrs);
    free(B->held);
    m->batches[b] = m->batches[--m->nbatches];
}

static void forget_model(Model* m) {
    while (m->nbatches) drop_batch(m, m->nbatches - 1);
    for (int l = 0; l < MAX_LAYERS; ++l) free_layer(&m->layers[l]);
    m->live = 0;
}

/* The random draws never depend on heap addresses (a new cache may reuse a destroyed one's
 * address): a seed replays the same sequence under ASan, valgrind or neither. */
static void add_stale(expcache_t* h) {
    uint64_t r = rnd();
    if (g_nstale < MAX_STALE) g_stale[g_nstale++] = h;
    else g_stale[r % MAX_STALE] = h;
}

static void op_destroy(Model* m) {
    g_cur_op = "destroy";
    trace("destroy cache #%" PRIu64 " (%d batches outstanding)", m->serial, m->nbatches);
    expcache_destroy(m->h);
    g_calls++;
    g_destroys++;
    add_stale(m->h);
    forget_model(m);
}

static const uint64_t kSizes[] = {1, 2, 3, 7, 8, 9, 63, 64, 100, 255, 256, 257, 511, 512, 513, 1000, 1728, 3000};

static void pick_key(uint64_t k[3], int tiny) {
    for (int p = 0; p < 3; ++p)
        k[p] = tiny ? between(1, 4)
                    : pct(70) ? kSizes[below(sizeof kSizes / sizeof kSizes[0])] : between(1, 2500);
}

static void bad_configs(void) {
    expcache_config_t cfg;
    expcache_t* h = (expcache_t*)(uintptr_t)0xDEAD0;
    int which = (int)below(15);
    expcache_config_init(&cfg);
    cfg.budget_experts = 4;
    cfg.backend = EXPCACHE_BACKEND_HOST;
    cfg.num_layers = 2;
    const char* what = "";
    expcache_status_t want = IA;
    switch (which) {
        case 0: cfg.struct_size = sizeof cfg - 8; what = "struct_size too small"; break;
        case 1: cfg.num_layers = 0; what = "num_layers 0"; break;
        case 2: cfg.num_layers = EXPCACHE_MAX_LAYERS_LIMIT + 1; what = "num_layers over the limit"; break;
        case 3: cfg.max_classes = pct(50) ? 0 : EXPCACHE_MAX_CLASSES_LIMIT + 1; what = "max_classes"; break;
        case 4: cfg.backend = 3 + (uint32_t)below(100); what = "backend"; break;
        case 5: cfg.log_level = EXPCACHE_LOG_DEBUG + 1; what = "log_level"; break;
        case 6: cfg.budget_experts = cfg.budget_bytes = 0; what = "no budget"; break;
        case 7: cfg.device_capacity_bytes = 0; what = "device_capacity_bytes 0"; break;
        case 8: cfg.slab_bytes = 0; what = "slab_bytes 0"; break;
        case 9: cfg.copy_threads = 65; what = "copy_threads"; break;
        case 10: cfg.policy = 2 + (uint32_t)below(100); what = "policy"; break;
        case 11: cfg.staging_bytes = pct(50) ? 1000 : (uint64_t)17 << 30; what = "staging_bytes"; break;
        case 12: cfg.backend = EXPCACHE_BACKEND_CUDA; want = UNSUP; what = "CUDA backend in a host-only build"; break;
        case 13: {
            static const uint64_t bad[] = {0, 4096, (64u << 10) - 4096, (64u << 10) + 1, (uint64_t)65 << 20};
            cfg.staging_chunk_bytes = bad[below(5)];
            what = "staging_chunk_bytes";
            break;
        }
        case 14: cfg.file_reads = 2 + (uint32_t)below(100); what = "file_reads"; break;
    }
    expcache_status_t s = expcache_create(&cfg, &h);
    expect_bad("expcache_create", s, want, what);
    if (s == OK) { /* would leak otherwise */
        expcache_destroy(h);
        return;
    }
    if (h != (expcache_t*)(uintptr_t)0xDEAD0) diverge("failed expcache_create wrote *out_cache");
    if (pct(30)) {
        s = expcache_create(NULL, &h);
        expect_bad("expcache_create", s, IA, "config NULL");
        expcache_config_init(&cfg);
        cfg.budget_experts = 1;
        s = expcache_create(&cfg, NULL);
        expect_bad("expcache_create", s, IA, "out_cache NULL");
    }
}

static void op_create(void) {
    g_cur_op = "create";
    Model* m = NULL;
    for (int i = 0; i < MAX_CACHES; ++i)
        if (!g_models[i].live) {
            m = &g_models[i];
            break;
        }
    if (!m) return;
    if (pct(25)) bad_configs();
    memset(m, 0, sizeof *m);
    m->serial = ++g_serial;
    g_cur = m->serial;

    expcache_config_t cfg;
    memset(&cfg, 0x5A, sizeof cfg);
    expcache_status_t s = expcache_config_init(&cfg);
    check_status("expcache_config_init", s, ST(OK));
    if (cfg.struct_size != sizeof cfg || cfg.max_classes != 4 || cfg.reserve_bytes != ((uint64_t)1 << 30) ||
        cfg.budget_bytes || cfg.budget_experts || cfg.policy != EXPCACHE_POLICY_OPPCLASS || cfg.backend != EXPCACHE_BACKEND_AUTO)
        diverge("expcache_config_init defaults are not the documented ones");

    /* The layout is planned now so that capacity and budgets are tight against it. */
    m->num_layers = (uint32_t)between(1, MAX_LAYERS);
    m->nkeys = (int)between(1, MAX_KEYS - 1);
    for (int k = 0; k < m->nkeys; ++k) pick_key(m->keys[k], 0);
    pick_key(m->keys[m->nkeys], 1); /* tiny parts, for the big layers */
    uint64_t model_bytes = 0;
    for (uint32_t l = 0; l < m->num_layers; ++l) {
        Layer* L = &m->layers[l];
        if (pct(4)) {
            L->key = m->nkeys;
            L->num_experts = (uint32_t)between(1024, BIG_EXPERTS_MAX);
        } else {
            L->key = (int)below((uint64_t)m->nkeys);
            L->num_experts = (uint32_t)(pct(10) ? between(1, 3) : between(4, MAX_EXPERTS));
        }
        model_bytes += slot_bytes_of(m->keys[L->key]) * L->num_experts;
    }
    m->max_classes = (uint32_t)(pct(10) ? between(5, 8) : between(1, 4));

    cfg.backend = pct(80) ? EXPCACHE_BACKEND_HOST : EXPCACHE_BACKEND_AUTO;
    cfg.num_layers = m->num_layers;
    cfg.max_classes = m->max_classes;
    uint32_t level = (uint32_t)below(EXPCACHE_LOG_DEBUG + 1);
    cfg.log_level = level;
    cfg.budget_experts = pct(50) ? between(1, 64) : 0;
    cfg.budget_bytes = (pct(50) || !cfg.budget_experts) ? between(1, model_bytes + model_bytes / 2) : 0;
    int r = (int)below(10);
    cfg.reserve_bytes = r < 2   ? 0
                        : r < 8 ? between(0, 8 * slot_bytes_of(m->keys[below((uint64_t)m->nkeys)]))
                        : r < 9 ? ((uint64_t)1 << 30)
                                : model_bytes;
    int c = (int)below(10);
    cfg.device_capacity_bytes = c < 1 ? ((uint64_t)64 << 30)
                                : c < 2 ? slot_bytes_of(m->keys[0]) + between(0, 4096)
                                : c < 6 ? between(256, model_bytes / 2 + 256)
                                        : between(model_bytes / 2, 2 * model_bytes + 4096);
    cfg.slab_bytes = pct(20) ? ((uint64_t)512 << 20) : between(1, 32768);
    cfg.copy_threads = (uint32_t)below(9);
    cfg.staging_chunk_bytes = (uint64_t)(64 << 10) << below(6); /* 64 KiB..2 MiB */
    /* Sometimes a ring of only a few chunks, so that pieces wait for their chunk's turn and
       chunks are reused within one call. */
    if (pct(30)) cfg.staging_bytes = (uint64_t)1 << 20;
    cfg.file_reads = pct(50) ? EXPCACHE_FILE_READS_DIRECT : EXPCACHE_FILE_READS_BUFFERED;
    /* Nothing below predicts victims, so every check holds for any policy. */
    cfg.policy = (uint32_t)below(EXPCACHE_POLICY_COUNT);
    m->capacity = cfg.device_capacity_bytes;
    m->reserve = cfg.reserve_bytes;
    m->budget_experts = cfg.budget_experts;

    /* The environment overrides, sometimes. */
    int env = (int)below(20);
    expcache_status_t want_env = OK;
    if (env == 0) {
        setenv("EXPCACHE_RESERVE_GB", "0", 1);
        m->reserve = 0;
    } else if (env == 1) {
        setenv("EXPCACHE_RESERVE_GB", "0.000001", 1);
        m->reserve = (uint64_t)(0.000001 * (double)((uint64_t)1 << 30));
    } else if (env == 2) {
        setenv("EXPCACHE_RESERVE_GB", pct(50) ? "lots" : "-1", 1);
        want_env = IA;
    } else if (env == 3) {
        static const char* const on[] = {"1", "true", "YES", "On"};
        setenv("EXPCACHE_VERBOSE", on[below(4)], 1);
    } else if (env == 4) {
        static const char* const off[] = {"0", "false", "No", "OFF"};
        setenv("EXPCACHE_VERBOSE", off[below(4)], 1);
    } else if (env == 5) {
        setenv("EXPCACHE_VERBOSE", pct(50) ? "2" : "verbose", 1);
        want_env = IA;
    }

    expcache_t* h = (expcache_t*)(uintptr_t)0xDEAD0;
    s = expcache_create(&cfg, &h);
    unsetenv("EXPCACHE_RESERVE_GB");
    unsetenv("EXPCACHE_VERBOSE");
    g_creates += s == OK;
    check_status("expcache_create", s, ST(want_env));
    trace("create cache #%" PRIu64 ": %s, %u layers, %u class slots, %d keys, capacity %" PRIu64 ", reserve %" PRIu64
          ", budget %" PRIu64 " experts / %" PRIu64 " B, slab %" PRIu64 ", model %" PRIu64 " B",
          m->serial, sname(s), m->num_layers, m->max_classes, m->nkeys, m->capacity, m->reserve, cfg.budget_experts,
          cfg.budget_bytes, cfg.slab_bytes, model_bytes);
    if (s != OK) {
        if (want_env == IA) g_bad++;
        if (h != (expcache_t*)(uintptr_t)0xDEAD0) diverge("failed expcache_create wrote *out_cache");
        return;
    }
    if (want_env != OK) diverge("expcache_create accepted a bad EXPCACHE_RESERVE_GB");
    m->h = h;
    m->live = 1;
    for (int i = 0; i < g_nstale; ++i) /* a new cache may reuse a destroyed one's address */
        if (g_stale[i] == h) g_stale[i--] = g_stale[--g_nstale];
    uint32_t backend = 0;
    s = expcache_backend_get(h, &backend);
    check_status("expcache_backend_get", s, ST(OK));
    if (backend != EXPCACHE_BACKEND_HOST) diverge("backend %u, want host", backend);
    m->log.magic = LOG_MAGIC;
    m->log.level = env == 3 ? EXPCACHE_LOG_DEBUG : level;
    install_log(m, pct(70) ? level : (uint32_t)below(EXPCACHE_LOG_DEBUG + 1));
    check_invariants(m, 1, 1);
}

/* ------------------------------------------------------------------------ */
/* Layers                                                                    */
/* ------------------------------------------------------------------------ */

static const char* tmp_dir(void) {
    const char* d = getenv("STRESS_TMPDIR");
    if (!d || !d[0]) d = getenv("TMPDIR");
    return d && d[0] ? d : "/tmp";
}

/* Open a file through the library: OK (id in *out), or a divergence. The file is unlinked at
 * once (the library holds its descriptors; nothing is left behind if the run dies). */
static int open_file(Model* m, const unsigned char* image, uint64_t bytes, uint32_t* out) {
    char path[4096];
    snprintf(path, sizeof path, "%s/expcache-stress-XXXXXX", tmp_dir());
    int fd = mkstemp(path);
    if (fd < 0) {
        fprintf(stderr, "stress: cannot create a temporary file in %s (set STRESS_TMPDIR)\n", tmp_dir());
        exit(2);
    }
    for (uint64_t done = 0; done < bytes;) {
        ssize_t w = write(fd, image + done, bytes - done);
        if (w <= 0) {
            fprintf(stderr, "stress: cannot write %s\n", path);
            unlink(path);
            exit(2);
        }
        done += (uint64_t)w;
    }
    close(fd);
    uint32_t id = 0xA5A5A5A5u;
    expcache_status_t s = expcache_file_open(m->h, path, &id);
    unlink(path);
    check_status("expcache_file_open", s, ST(OK));
    if (s != OK) return 0;
    if (id != m->nfiles) diverge("open_file gave id %u, want %u (ids count up from 0)", id, m->nfiles);
    m->nfiles++;
    *out = id;
    return 1;
}

/* Fill a region of junk (bytes that must never be served). */
static void fill_junk(unsigned char* p, uint64_t n) {
    for (uint64_t i = 0; i < n; ++i) p[i] = (unsigned char)(0xE0 | (i & 0xF));
}

/* Allocate and fill the host bytes of layer l (tensor or expert-major arrangement), in memory
 * (exactly sized buffers) or in a file (one image: junk, then the parts, then junk). */
static void build_sources(Model* m, uint32_t l, int as_file) {
    Layer* L = &m->layers[l];
    const uint64_t* k = m->keys[L->key];
    uint32_t n = L->num_experts;
    for (int p = 0; p < 3; ++p) L->bytes[p] = k[p];
    L->pinned = pct(20) ? EXPCACHE_SOURCE_PINNED : EXPCACHE_SOURCE_PAGEABLE; /* host backend: pinned is a plain memcpy, pageable goes through the staging ring */
    L->from_file = as_file;
    uint64_t region[3], start[3];
    if (pct(50)) {
        /* Tensor: one region per part, [experts][stride], sized exactly to the last byte used. */
        for (int p = 0; p < 3; ++p) {
            L->stride[p] = L->bytes[p] + (pct(50) ? 0 : between(1, 40));
            region[p] = L->stride[p] * (n - 1) + L->bytes[p];
            start[p] = 0;
        }
        if (as_file) { /* one after the other, in a random order, with gaps; sometimes gate at offset 0 */
            uint64_t pos = pct(20) ? 0 : between(1, 5000);
            int first = (int)below(3);
            for (int i = 0; i < 3; ++i) {
                int p = (first + i) % 3;
                start[p] = pos;
                pos += region[p] + (pct(50) ? 0 : between(1, 300));
            }
            L->file_bytes = pos + below(100);
        }
    } else {
        /* Expert-major: one region, the parts of an expert in a random order with random gaps. */
        int order[3] = {0, 1, 2};
        for (int i = 2; i > 0; --i) {
            int j = (int)below((uint64_t)i + 1), t = order[i];
            order[i] = order[j];
            order[j] = t;
        }
        uint64_t off[3], pos = 0;
        for (int i = 0; i < 3; ++i) {
            off[order[i]] = pos;
            pos += L->bytes[order[i]] + (pct(60) ? 0 : between(1, 17));
        }
        uint64_t stride = pos + (pct(50) ? 0 : between(1, 33));
        uint64_t last = 0;
        for (int p = 0; p < 3; ++p)
            if (off[p] + L->bytes[p] > last) last = off[p] + L->bytes[p];
        uint64_t size = stride * (n - 1) + last;
        uint64_t lead = as_file && pct(80) ? between(1, 5000) : 0;
        for (int p = 0; p < 3; ++p) {
            L->stride[p] = stride;
            start[p] = lead + off[p];
            region[p] = 0; /* one buffer, below */
        }
        if (as_file) L->file_bytes = lead + size + below(100);
        else {
            L->nbufs = 1;
            L->bufs[0] = (unsigned char*)xmalloc(size);
            fill_junk(L->bufs[0], size);
            for (int p = 0; p < 3; ++p) L->base[p] = L->bufs[0] + off[p];
        }
    }
    if (as_file) {
        L->nbufs = 1;
        L->bufs[0] = (unsigned char*)xmalloc(L->file_bytes);
        fill_junk(L->bufs[0], L->file_bytes);
        for (int p = 0; p < 3; ++p) {
            L->off[p] = start[p];
            L->base[p] = L->bufs[0] + start[p];
        }
    } else if (region[0]) {
        L->nbufs = 3;
        for (int p = 0; p < 3; ++p) {
            L->bufs[p] = (unsigned char*)xmalloc(region[p]);
            fill_junk(L->bufs[p], region[p]);
            L->base[p] = L->bufs[p];
        }
    }
    for (uint32_t e = 0; e < n; ++e)
        for (int p = 0; p < 3; ++p) fill_part((unsigned char*)source(L, p, e), L->bytes[p], m->serial, l, e, p);
    L->mark = (uint32_t*)xcalloc(n, sizeof(uint32_t));
}

static void fill_desc(const Layer* L, expcache_layer_desc_t* d) {
    expcache_layer_desc_init(d);
    d->num_experts = L->num_experts;
    d->source_kind = L->from_file ? EXPCACHE_SOURCE_FILE : L->pinned;
    d->file = L->from_file ? L->file_id : 0;
    d->gate_bytes = L->bytes[0];
    d->up_bytes = L->bytes[1];
    d->down_bytes = L->bytes[2];
    d->gate_stride = L->stride[0];
    d->up_stride = L->stride[1];
    d->down_stride = L->stride[2];
    if (L->from_file) {
        d->gate_base = (const void*)(uintptr_t)L->off[0];
        d->up_base = (const void*)(uintptr_t)L->off[1];
        d->down_base = (const void*)(uintptr_t)L->off[2];
    } else {
        d->gate_base = L->base[0];
        d->up_base = L->base[1];
        d->down_base = L->base[2];
    }
}

/* expcache_file_open with bad input: none may open anything. */
static void bad_open_file(Model* m) {
    uint32_t id = 0xA5A5A5A5u;
    expcache_status_t s;
    switch (below(5)) {
        case 0: s = expcache_file_open(m->h, NULL, &id); expect_bad("expcache_file_open", s, IA, "path NULL"); break;
        case 1: s = expcache_file_open(m->h, "", &id); expect_bad("expcache_file_open", s, IA, "path empty"); break;
        case 2: s = expcache_file_open(m->h, tmp_dir(), NULL); expect_bad("expcache_file_open", s, IA, "out_file NULL"); break;
        case 3: s = expcache_file_open(m->h, tmp_dir(), &id); expect_bad("expcache_file_open", s, IO, "a directory"); break;
        default: {
            char path[4200];
            snprintf(path, sizeof path, "%s/expcache-stress-missing-%" PRIu64, tmp_dir(), rnd());
            s = expcache_file_open(m->h, path, &id);
            expect_bad("expcache_file_open", s, IO, "no such file");
            break;
        }
    }
    if (id != 0xA5A5A5A5u) diverge("failed open_file wrote *out_file");
}

static void op_register(Model* m) {
    g_cur_op = "register_layer";
    uint32_t l = (uint32_t)below(m->num_layers);
    Layer* L = &m->layers[l];
    expcache_layer_desc_t d;
    expcache_status_t s;
    if (L->registered) {
        fill_desc(L, &d);
        s = expcache_layer_register(m->h, l, &d);
        expect_bad("expcache_layer_register", s, IS, "layer already registered");
        if (pct(30)) bad_open_file(m);
        check_invariants(m, 0, 1);
        return;
    }
    int key = L->key;
    uint32_t n = L->num_experts;
    memset(L, 0, sizeof *L);
    L->key = key;
    L->num_experts = n;
    int as_file = pct(30);
    build_sources(m, l, as_file);
    if (as_file && !open_file(m, L->bufs[0], L->file_bytes, &L->file_id)) {
        free_layer(L), L->key = key, L->num_experts = n;
        return;
    }
    fill_desc(L, &d);
    if (pct(25)) {
        /* Bad descriptors: each must be refused and leave the layer unregistered. */
        uint32_t layer = l;
        const expcache_layer_desc_t* dp = &d;
        const char* what = "";
        int p = (int)below(3);
        uint64_t* bytes[3] = {&d.gate_bytes, &d.up_bytes, &d.down_bytes};
        uint64_t* stride[3] = {&d.gate_stride, &d.up_stride, &d.down_stride};
        const void** base[3] = {&d.gate_base, &d.up_base, &d.down_base};
        switch (below(13)) {
            case 0: dp = NULL; what = "desc NULL"; break;
            case 1: d.struct_size = pct(50) ? 0 : (uint32_t)sizeof d + 8; what = "struct_size"; break;
            case 2: d.num_experts = pct(50) ? 0 : EXPCACHE_MAX_EXPERTS_LIMIT + 1; what = "num_experts"; break;
            case 3: d.source_kind = EXPCACHE_SOURCE_FILE + 1 + (uint32_t)below(5); what = "source_kind"; break;
            case 4:
                if (L->from_file) d.file = m->nfiles + (uint32_t)below(3), what = "file not opened";
                else d.file = 1 + (uint32_t)below(3), what = "file not 0 for a memory source";
                break;
            case 5: *bytes[p] = pct(50) ? 0 : ((uint64_t)1 << 40) + 1; what = "part bytes"; break;
            case 6: *stride[p] = *bytes[p] - 1; what = "stride < bytes"; break;
            case 7:
                if (L->from_file) { /* offset 0 is valid in a file: make the last expert end past the file */
                    *base[p] = (const void*)(uintptr_t)(L->file_bytes - *bytes[p] + 1);
                    what = "part past the end of the file";
                } else {
                    *base[p] = NULL;
                    what = "base NULL";
                }
                break;
            case 8:
                *base[p] = (const void*)(UINTPTR_MAX - 64);
                *stride[p] = ((uint64_t)1 << 40);
                if (*bytes[p] < 65) *bytes[p] = 65;
                d.num_experts = 2;
                what = "address overflow";
                break;
            case 9: layer = m->num_layers + (uint32_t)below(5); what = "layer out of range"; break;
            case 10:
                if (L->from_file) {
                    d.num_experts = n + 1 + (uint32_t)below(4);
                    *stride[p] = L->file_bytes; /* the extra experts cannot fit */
                    what = "more experts than the file holds";
                } else {
                    d.source_kind = EXPCACHE_SOURCE_FILE;
                    d.file = m->nfiles;
                    what = "file source with a file never opened";
                }
                break;
            case 11: layer = UINT32_MAX; what = "layer UINT32_MAX"; break;
            default:
                d.source_kind = EXPCACHE_SOURCE_FILE;
                d.file = m->nfiles + (uint32_t)below(1000);
                what = "file id never opened";
                break;
        }
        s = expcache_layer_register(m->h, layer, dp);
        expect_bad("expcache_layer_register", s, IA, what);
        trace("register_layer %u bad (%s): %s", layer, what, sname(s));
        if (s == OK && layer == l) L->registered = 1; /* refused nothing: keep the model in step */
        else free_layer(L), L->key = key, L->num_experts = n;
        check_invariants(m, 0, 1);
        return;
    }
    if (pct(5)) {
        s = expcache_layer_register((expcache_t*)g_foreign, l, &d);
        expect_bad("expcache_layer_register", s, IA, "foreign handle");
    }
    s = expcache_layer_register(m->h, l, &d);
    check_status("expcache_layer_register", s, ST(OK));
    trace("register_layer %u: %u experts, parts %" PRIu64 "/%" PRIu64 "/%" PRIu64 ", strides %" PRIu64 "/%" PRIu64
          "/%" PRIu64 "%s: %s",
          l, n, L->bytes[0], L->bytes[1], L->bytes[2], L->stride[0], L->stride[1], L->stride[2],
          L->from_file ? " (file)" : "", sname(s));
    if (s == OK) L->registered = 1;
    else free_layer(L), L->key = key, L->num_experts = n;
    check_invariants(m, 0, 0);
}

/* ------------------------------------------------------------------------ */
/* Serving                                                                   */
/* ------------------------------------------------------------------------ */

static void* rand_stream(void) {
    static const uintptr_t streams[] = {0, 0, 0, 0x1000, 0x2000};
    return (void*)streams[below(5)];
}

/* A registered layer, or -1. */
static int pick_layer(Model* m) {
    uint32_t regs[MAX_LAYERS], n = 0;
    for (uint32_t l = 0; l < m->num_layers; ++l)
        if (m->layers[l].registered) regs[n++] = l;
    return n ? (int)regs[below(n)] : -1;
}

static void gen_ids(const Layer* L, uint32_t* ids, uint64_t n) {
    uint32_t ne = L->num_experts;
    uint32_t hot = ne < 8 ? ne : (uint32_t)between(2, ne / 2 + 1);
    uint32_t off = (uint32_t)below(ne);
    for (uint64_t i = 0; i < n; ++i)
        ids[i] = pct(70) ? (off + (uint32_t)below(hot)) % ne : (uint32_t)below(ne);
}

/* Unique ids in first-appearance order; returns the count. */
static uint32_t uniq(Model* m, uint32_t layer, const uint32_t* ids, uint64_t n, uint32_t* out) {
    Layer* L = &m->layers[layer];
    mark_clear(m);
    uint32_t u = 0;
    for (uint64_t i = 0; i < n; ++i)
        if (L->mark[ids[i]] != m->stamp) {
            L->mark[ids[i]] = m->stamp;
            out[u++] = ids[i];
        }
    return u;
}

static int layer_class_of(Model* m, uint32_t layer, uint32_t* out) {
    uint32_t c = 0xA5A5u;
    expcache_status_t s = expcache_layer_bind_class(m->h, layer, &c);
    check_status("expcache_layer_bind_class", s, ST(OK));
    if (s != OK) return 0;
    if (c >= m->max_classes) {
        diverge("layer_class(%u) = %u, max_classes %u", layer, c, m->max_classes);
        return 0;
    }
    *out = c;
    return 1;
}

static int get_stat(Model* m, uint32_t c, uint32_t path, expcache_stats_t* st) {
    st->struct_size = sizeof *st;
    expcache_status_t s = expcache_stats_get(m->h, c, path, st);
    check_status("expcache_stats_get", s, ST(OK));
    return s == OK;
}

#define DELTA(f) (st.f - o->f)

/* Statuses a valid serving call may return: OK, INVALID_STATE (no class index free), OUT_OF_DEVICE_MEMORY,
 * and CUDA only while injected copy or staging failures may still fire (the host backend has no CUDA
 * otherwise). */
static uint32_t serving_statuses(const Model* m) {
    return ST(OK) | ST(IS) | ST(OOM) | (m->copy_faults_left || m->staging_faults_left ? ST(CUDA) : 0);
}

/* A CUDA status consumed an injected fault; the message says which (both, when a staged piece had
 * failed too before the call's own copy did). A failing call may consume several staging faults
 * (pieces on other threads): the count left is an upper bound, which only makes the check laxer. */
static void consumed_copy_fault(Model* m, expcache_status_t s) {
    if (s != CUDA) return;
    const char* msg = expcache_last_error();
    int staged = strstr(msg, "injected staging failure") != NULL;
    int copied = strstr(msg, "injected copy failure") != NULL;
    if (!staged && !copied) diverge("a CUDA status with no injected fault behind it: %s", msg);
    if (staged) g_staging_faults_seen++;
    if (staged && m->staging_faults_left) m->staging_faults_left--;
    if (copied && m->copy_faults_left) m->copy_faults_left--;
}

/* The device bytes the model does not attribute to the staging buffer `cap`. */
static uint64_t bytes_besides(Model* m, const uint64_t* cap, uint64_t* db) {
    uint64_t slots = 0, batch = 0;
    expcache_testing_device_bytes_in_use(m->h, db);
    for (uint32_t c = 0; c < m->max_classes; ++c) {
        expcache_class_info_t ci;
        ci.struct_size = sizeof ci;
        if (expcache_class_info_get(m->h, c, &ci) == OK) slots += ci.allocated_experts * ci.slot_bytes;
    }
    for (int b = 0; b < m->nbatches; ++b) batch += m->batches[b].staging;
    return slots + batch + m->compact_cap + m->overflow_cap - *cap;
}

/* Adopt `alt` as the staging buffer's size if the device bytes say so. */
static void resolve_staging_if(Model* m, uint64_t* cap, uint64_t alt) {
    uint64_t db = 0;
    uint64_t other = bytes_besides(m, cap, &db);
    if (other + alt == db) *cap = alt;
}

/* After a failed call, the device bytes the staging holds are one of two values: adopt the one that matches. */
static void resolve_staging(Model* m, uint64_t* cap, uint64_t alt, const char* what) {
    uint64_t db = 0;
    uint64_t other = bytes_besides(m, cap, &db);
    if (db == other + alt) *cap = alt;
    else if (db != other + *cap)
        diverge("after a failed call device_bytes_in_use is %" PRIu64 "; with the %s buffer at %" PRIu64 " or %" PRIu64
                " B it would be %" PRIu64 " or %" PRIu64,
                db, what, *cap, alt, other + *cap, other + alt);
}

static uint32_t g_u[EXPCACHE_MAX_SELECT > MAX_BATCH_IDS ? EXPCACHE_MAX_SELECT : MAX_BATCH_IDS];
static signed char g_pre[EXPCACHE_MAX_SELECT > MAX_BATCH_IDS ? EXPCACHE_MAX_SELECT : MAX_BATCH_IDS];

static void op_select(Model* m) {
    g_cur_op = "select";
    int li = pick_layer(m);
    if (li < 0) return;
    uint32_t layer = (uint32_t)li;
    Layer* L = &m->layers[layer];
    uint32_t k = (uint32_t)(pct(90) ? between(1, 16) : pct(70) ? between(17, 200) : between(201, EXPCACHE_MAX_SELECT));
    /* Exact sizes: ASan and valgrind catch a read or write past k. */
    uint32_t* ids = (uint32_t*)xmalloc(sizeof(uint32_t) * k);
    expcache_expert_ptrs_t* out = (expcache_expert_ptrs_t*)xmalloc(sizeof(expcache_expert_ptrs_t) * k);
    gen_ids(L, ids, k);
    uint32_t u = uniq(m, layer, ids, k, g_u);
    uint32_t pre_res = 0;
    for (uint32_t j = 0; j < u; ++j) pre_res += (g_pre[j] = (signed char)resident(m, layer, g_u[j])) == 1;
    int want_is = bind_fails(m, layer);
    memset(out, 0xA5, sizeof(out[0]) * k);
    m->sel_valid = 0;
    g_selects++;
    void* stream = rand_stream();
    expcache_status_t s = expcache_select_async(m->h, layer, ids, k, stream, out);
    check_status("expcache_select_async", s, serving_statuses(m));
    consumed_copy_fault(m, s);
    trace("select layer %u k %u (%u unique, %u resident) stream %p: %s", layer, k, u, pre_res, stream, sname(s));
    if (want_is != (s == IS))
        diverge("select on layer %u returned %s; the class infos say binding %s", layer, sname(s),
                want_is ? "must fail (INVALID_STATE)" : "is possible");
    if (s != OK) {
        for (uint32_t i = 0; i < k; ++i) {
            const unsigned char* b = (const unsigned char*)&out[i];
            for (size_t z = 0; z < sizeof out[i]; ++z)
                if (b[z] != 0xA5) {
                    diverge("failed select wrote out_ptrs[%u]", i);
                    i = k;
                    break;
                }
        }
        if (s == OOM) m->overflow_cap = 0; /* the overflow buffer was being replaced */
        if (s == CUDA) {                    /* a copy failed: the overflow buffer may have been replaced first */
            uint64_t slot = slot_bytes_of(L->bytes);
            if (strstr(expcache_last_error(), "injected staging failure")) {
                /* A staged piece failed: the call's new experts are all gone, so the overflow's size
                   (the misses that found no slot) cannot be read from residency. Any count up to the
                   call's misses may have been asked for. */
                uint64_t before = m->overflow_cap;
                for (uint32_t n = u - pre_res; n > 0 && m->overflow_cap == before; --n)
                    if ((uint64_t)n * slot > before) resolve_staging_if(m, &m->overflow_cap, (uint64_t)n * slot);
                resolve_staging(m, &m->overflow_cap, m->overflow_cap, "overflow");
            } else {
                uint32_t post = 0;
                for (uint32_t j = 0; j < u; ++j) post += resident(m, layer, g_u[j]) == 1;
                uint64_t need = (uint64_t)(u - post) * slot;
                if (need > m->overflow_cap) resolve_staging(m, &m->overflow_cap, need, "overflow");
            }
        }
        /* Hits of a failed call stay resident (a consistent cache): checked by the deep sweep. */
        for (uint32_t j = 0; j < u; ++j)
            if (g_pre[j] == 1 && resident(m, layer, g_u[j]) != 1)
                diverge("failed select evicted expert %u it was serving as a hit", g_u[j]);
        free(ids);
        free(out);
        check_invariants(m, 1, 0);
        return;
    }
    /* Addresses: duplicates share them, every expert holds its bytes. */
    mark_clear(m);
    for (uint32_t i = 0; i < k; ++i) {
        uint32_t e = ids[i];
        if (L->mark[e] != m->stamp) {
            L->mark[e] = m->stamp;
            verify_expert(m, layer, e, &out[i], "select");
        } else {
            uint32_t f = 0;
            while (ids[f] != e) ++f;
            if (memcmp(&out[i], &out[f], sizeof out[i]) != 0)
                diverge("select gave duplicate id %u two different addresses", e);
        }
    }
    uint32_t post_res = 0;
    for (uint32_t j = 0; j < u; ++j) {
        int r = resident(m, layer, g_u[j]);
        post_res += r == 1;
        if (g_pre[j] == 1 && r != 1) diverge("select evicted expert %u it was serving as a hit", g_u[j]);
    }
    uint32_t c;
    if (layer_class_of(m, layer, &c)) {
        expcache_stats_t st;
        if (get_stat(m, c, EXPCACHE_PATH_DECODE, &st)) {
            const expcache_stats_t* o = &m->snap[c][EXPCACHE_PATH_DECODE];
            uint64_t direct = u - post_res, eb = expert_bytes(L);
            if (DELTA(calls) != 1 || DELTA(hits) != pre_res || DELTA(misses) != u - pre_res ||
                DELTA(misses) != DELTA(appends) + DELTA(evictions) + DELTA(direct_loads) ||
                DELTA(direct_loads) != direct || DELTA(bytes_h2d) != DELTA(misses) * eb || DELTA(bytes_d2d) != 0)
                diverge("select stats of class %u moved by calls %" PRIu64 " hits %" PRIu64 " misses %" PRIu64
                        " appends %" PRIu64 " evictions %" PRIu64 " direct %" PRIu64 " h2d %" PRIu64 " d2d %" PRIu64
                        "; want 1 call, %u hits, %u misses, %" PRIu64 " direct, %" PRIu64 " B h2d",
                        c, DELTA(calls), DELTA(hits), DELTA(misses), DELTA(appends), DELTA(evictions),
                        DELTA(direct_loads), DELTA(bytes_h2d), DELTA(bytes_d2d), pre_res, u - pre_res, direct,
                        (uint64_t)(u - pre_res) * eb);
        }
        uint64_t need = (uint64_t)(u - post_res) * slot_bytes_of(L->bytes);
        if (need > m->overflow_cap) m->overflow_cap = need;
    }
    m->sel_valid = 1;
    m->sel_layer = layer;
    m->sel_k = k;
    memcpy(m->sel_ids, ids, sizeof(ids[0]) * k);
    memcpy(m->sel_ptrs, out, sizeof(out[0]) * k);
    free(ids);
    free(out);
    check_invariants(m, pct(10), 0);
}

static void op_compact(Model* m) {
    g_cur_op = "load_compact";
    int li = pick_layer(m);
    if (li < 0) return;
    uint32_t layer = (uint32_t)li;
    Layer* L = &m->layers[layer];
    uint32_t n = (uint32_t)between(1, MAX_COMPACT_IDS);
    uint32_t* ids = (uint32_t*)xmalloc(sizeof(uint32_t) * n);
    gen_ids(L, ids, n);
    uint32_t u = uniq(m, layer, ids, n, g_u);
    uint32_t pre_res = 0, occ_res = 0;
    for (uint32_t j = 0; j < u; ++j) pre_res += (g_pre[j] = (signed char)resident(m, layer, g_u[j])) == 1;
    for (uint32_t i = 0; i < n; ++i)
        for (uint32_t j = 0; j < u; ++j)
            if (g_u[j] == ids[i]) {
                occ_res += g_pre[j] == 1;
                break;
            }
    int want_is = bind_fails(m, layer);
    expcache_compact_t out;
    memset(&out, 0xA5, sizeof out);
    out.struct_size = sizeof out;
    expcache_compact_t before = out;
    m->cmp_valid = 0;
    m->sel_valid = 0;
    g_compacts++;
    expcache_status_t s = expcache_compact_load_async(m->h, layer, ids, n, rand_stream(), &out);
    check_status("expcache_compact_load_async", s, serving_statuses(m));
    consumed_copy_fault(m, s);
    trace("load_compact layer %u n %u (%u unique, %u resident): %s", layer, n, u, pre_res, sname(s));
    if (want_is != (s == IS))
        diverge("load_compact on layer %u returned %s; the class infos say binding %s", layer, sname(s),
                want_is ? "must fail (INVALID_STATE)" : "is possible");
    const uint64_t* b = L->bytes;
    uint64_t off_up = align_up(b[0] * n), off_down = align_up(off_up + b[1] * n), total = off_down + b[2] * n;
    if (s != OK) {
        if (memcmp(&out, &before, sizeof out) != 0) diverge("failed load_compact wrote *out");
        if (s == CUDA && total > m->compact_cap) m->compact_cap = total; /* allocated before the copies */
        if (s == OOM) {
            if (total <= m->compact_cap) diverge("load_compact ran out of memory with a large enough buffer");
            m->compact_cap = 0;
            /* It failed after the retry: every class holding no batch slot was released. */
            check_invariants(m, 1, 0);
            for (uint32_t c = 0; c < m->max_classes; ++c)
                if (m->info[c].in_use && m->info[c].held_experts == 0 && m->info[c].allocated_experts)
                    diverge("load_compact failed for memory without releasing class %u (%" PRIu64 " slots)", c,
                            m->info[c].allocated_experts);
            free(ids);
            return;
        }
        free(ids);
        check_invariants(m, 1, 0);
        return;
    }
    if (out.struct_size != sizeof out || out.num_experts != n || out.gate_bytes != b[0] || out.up_bytes != b[1] ||
        out.down_bytes != b[2] || out.gate_offset + n * b[0] > out.up_offset ||
        out.up_offset + n * b[1] > out.down_offset || out.down_offset + n * b[2] > out.bytes)
        diverge("load_compact layout: n %u bytes %" PRIu64 " offsets %" PRIu64 "/%" PRIu64 "/%" PRIu64
                " part bytes %" PRIu64 "/%" PRIu64 "/%" PRIu64 " (layer parts %" PRIu64 "/%" PRIu64 "/%" PRIu64 ")",
                out.num_experts, out.bytes, out.gate_offset, out.up_offset, out.down_offset, out.gate_bytes,
                out.up_bytes, out.down_bytes, b[0], b[1], b[2]);
    unsigned char* base = (unsigned char*)out.base;
    for (uint32_t i = 0; i < n; ++i) {
        expcache_expert_ptrs_t p = {base + out.gate_offset + i * b[0], base + out.up_offset + i * b[1],
                                    base + out.down_offset + i * b[2]};
        verify_expert(m, layer, ids[i], &p, "load_compact");
    }
    if (out.bytes > m->compact_cap) m->compact_cap = out.bytes;
    if (out.bytes != total) diverge("load_compact buffer of %" PRIu64 " B, want %" PRIu64, out.bytes, total);
    uint32_t c;
    int retried = 0;
    if (layer_class_of(m, layer, &c)) {
        expcache_stats_t st;
        if (get_stat(m, c, EXPCACHE_PATH_COMPACT, &st)) {
            const expcache_stats_t* o = &m->snap[c][EXPCACHE_PATH_COMPACT];
            uint64_t eb = expert_bytes(L);
            retried = DELTA(alloc_retries) != 0;
            if (DELTA(calls) != 1 || DELTA(hits) + DELTA(misses) != u || DELTA(direct_loads) != DELTA(misses) ||
                DELTA(appends) || DELTA(evictions) || DELTA(bytes_h2d) + DELTA(bytes_d2d) != n * eb ||
                DELTA(alloc_retries) > 1 || (!retried && (DELTA(hits) != pre_res || DELTA(bytes_d2d) != occ_res * eb)))
                diverge("load_compact stats of class %u moved by calls %" PRIu64 " hits %" PRIu64 " misses %" PRIu64
                        " direct %" PRIu64 " h2d %" PRIu64 " d2d %" PRIu64 " retries %" PRIu64
                        "; want 1 call, %u unique, %u resident",
                        c, DELTA(calls), DELTA(hits), DELTA(misses), DELTA(direct_loads), DELTA(bytes_h2d),
                        DELTA(bytes_d2d), DELTA(alloc_retries), u, pre_res);
        }
    }
    /* Residency does not change (but for the release before a retry). */
    if (!retried)
        for (uint32_t j = 0; j < u; ++j)
            if (resident(m, layer, g_u[j]) != g_pre[j])
                diverge("load_compact changed the residency of expert %u (layer %u)", g_u[j], layer);
    m->cmp_valid = 1;
    m->cmp_layer = layer;
    m->cmp_n = n;
    memcpy(m->cmp_ids, ids, sizeof(ids[0]) * n);
    m->cmp = out;
    free(ids);
    check_invariants(m, pct(10), 0);
}

static void op_batch_prepare(Model* m, int quiet, uint64_t max_n) {
    g_cur_op = "batch_prepare";
    int li = pick_layer(m);
    if (li < 0) return;
    uint32_t layer = (uint32_t)li;
    Layer* L = &m->layers[layer];
    uint64_t n = max_n ? between(1, max_n) : pct(80) ? between(1, 32) : between(33, MAX_BATCH_IDS);
    /* Exact sizes (n entries, as the header asks): ASan and valgrind catch a write past them. */
    uint32_t* ids = (uint32_t*)xmalloc(sizeof(uint32_t) * n);
    uint32_t* out_ids = (uint32_t*)xmalloc(sizeof(uint32_t) * n);
    expcache_expert_ptrs_t* out_ptrs = (expcache_expert_ptrs_t*)xmalloc(sizeof(expcache_expert_ptrs_t) * n);
    gen_ids(L, ids, n);
    uint32_t u = uniq(m, layer, ids, n, g_u);
    uint32_t pre_res = 0;
    for (uint32_t j = 0; j < u; ++j) pre_res += (g_pre[j] = (signed char)resident(m, layer, g_u[j])) == 1;
    int want_is = m->nbatches >= EXPCACHE_MAX_BATCHES || bind_fails(m, layer);
    memset(out_ids, 0xA5, sizeof(uint32_t) * n);
    memset(out_ptrs, 0xA5, sizeof(expcache_expert_ptrs_t) * n);
    uint32_t count = 0xA5A5A5A5u;
    uint64_t id = 0xA5A5A5A5A5A5A5A5ull;
    m->sel_valid = 0;
    g_batches++;
    expcache_status_t s =
        expcache_batch_prepare_async(m->h, layer, ids, n, rand_stream(), out_ids, out_ptrs, &count, &id);
    check_status("expcache_batch_prepare_async", s, serving_statuses(m));
    consumed_copy_fault(m, s);
    if (!quiet || s != OK)
        trace("batch_prepare layer %u n %" PRIu64 " (%u unique, %u resident; %d outstanding): %s id %" PRIu64, layer,
              n, u, pre_res, m->nbatches, sname(s), s == OK ? id : 0);
    if (want_is != (s == IS))
        diverge("batch_prepare on layer %u returned %s with %d batches outstanding; the class infos say binding %s",
                layer, sname(s), m->nbatches, bind_fails(m, layer) ? "must fail" : "is possible");
    if (s != OK) {
        for (uint64_t i = 0; i < n; ++i)
            if (out_ids[i] != 0xA5A5A5A5u) {
                diverge("failed batch_prepare wrote out_ids[%" PRIu64 "]", i);
                break;
            }
        if (count != 0xA5A5A5A5u || id != 0xA5A5A5A5A5A5A5A5ull) diverge("failed batch_prepare wrote out_count/out_batch");
        /* A batch never evicts: what was resident stays so (the layer's class was bound already). */
        for (uint32_t j = 0; j < u; ++j)
            if (g_pre[j] == 1 && resident(m, layer, g_u[j]) != 1)
                diverge("failed batch_prepare evicted expert %u (layer %u)", g_u[j], layer);
        free(ids);
        free(out_ids);
        free(out_ptrs);
        check_invariants(m, 1, 0);
        return;
    }
    if (count != u) diverge("batch_prepare out_count %u, want %u unique", count, u);
    if (count > u) count = u;
    for (uint32_t j = 0; j < count; ++j)
        if (out_ids[j] != g_u[j]) {
            diverge("batch_prepare out_ids[%u] = %u, want %u (first-appearance order)", j, out_ids[j], g_u[j]);
            break;
        }
    for (int b = 0; b < m->nbatches; ++b)
        if (m->batches[b].id == id) diverge("batch_prepare returned id %" PRIu64 ", already outstanding", id);
    uint32_t held = 0;
    unsigned char* heldv = (unsigned char*)xcalloc(count, 1);
    for (uint32_t j = 0; j < count; ++j) {
        verify_expert(m, layer, g_u[j], &out_ptrs[j], "batch_prepare");
        int r = resident(m, layer, g_u[j]);
        if (g_pre[j] == 1 && r != 1) diverge("batch_prepare evicted expert %u it was serving", g_u[j]);
        heldv[j] = r == 1;
        held += r == 1;
    }
    uint32_t c = 0;
    if (layer_class_of(m, layer, &c)) {
        expcache_stats_t st;
        if (get_stat(m, c, EXPCACHE_PATH_BATCH, &st)) {
            const expcache_stats_t* o = &m->snap[c][EXPCACHE_PATH_BATCH];
            uint64_t eb = expert_bytes(L);
            if (DELTA(calls) != 1 || DELTA(hits) != pre_res || DELTA(misses) != u - pre_res || DELTA(evictions) ||
                DELTA(appends) != held - pre_res || DELTA(direct_loads) != u - held ||
                DELTA(bytes_h2d) != DELTA(misses) * eb || DELTA(bytes_d2d))
                diverge("batch stats of class %u moved by calls %" PRIu64 " hits %" PRIu64 " misses %" PRIu64
                        " appends %" PRIu64 " evictions %" PRIu64 " direct %" PRIu64 " h2d %" PRIu64
                        "; want 1 call, %u hits, %u misses, %u appends, %u direct",
                        c, DELTA(calls), DELTA(hits), DELTA(misses), DELTA(appends), DELTA(evictions),
                        DELTA(direct_loads), DELTA(bytes_h2d), pre_res, u - pre_res, held - pre_res, u - held);
        }
    }
    if (m->nbatches < EXPCACHE_MAX_BATCHES) {
        Batch* B = &m->batches[m->nbatches++];
        B->id = id;
        B->layer = layer;
        B->count = count;
        B->cls = c;
        B->ids = (uint32_t*)xmalloc(sizeof(uint32_t) * count);
        B->ptrs = (expcache_expert_ptrs_t*)xmalloc(sizeof(expcache_expert_ptrs_t) * count);
        memcpy(B->ids, out_ids, sizeof(uint32_t) * count);
        memcpy(B->ptrs, out_ptrs, sizeof(expcache_expert_ptrs_t) * count);
        B->held = heldv;
        B->staging = (uint64_t)(count - held) * slot_bytes_of(L->bytes);
    } else {
        diverge("batch_prepare succeeded with %d batches outstanding", m->nbatches);
        free(heldv);
    }
    free(ids);
    free(out_ids);
    free(out_ptrs);
    check_invariants(m, pct(10), 0);
}

static void op_batch_finish(Model* m) {
    g_cur_op = "batch_finish";
    expcache_status_t s;
    if (m->nbatches == 0 || pct(10)) {
        uint64_t id = pct(50) && m->nfinished ? m->finished[below((uint64_t)m->nfinished)]
                                              : pct(50) ? 0 : rnd() | ((uint64_t)1 << 62);
        s = expcache_batch_finish(m->h, id, rand_stream());
        expect_bad("expcache_batch_finish", s, IA, "unknown or finished batch");
        trace("batch_finish unknown %" PRIu64 ": %s", id, sname(s));
        check_invariants(m, 0, 1);
        return;
    }
    int b = (int)below((uint64_t)m->nbatches);
    uint64_t id = m->batches[b].id;
    check_batches(m, 0);
    s = expcache_batch_finish(m->h, id, rand_stream());
    check_status("expcache_batch_finish", s, ST(OK));
    trace("batch_finish %" PRIu64 ": %s", id, sname(s));
    g_finishes++;
    if (s != OK) return;
    drop_batch(m, b);
    if (m->nfinished < MAX_FINISHED) m->finished[m->nfinished++] = id;
    else m->finished[below(MAX_FINISHED)] = id;
    check_invariants(m, pct(5), 0);
}

/* Fill up to EXPCACHE_MAX_BATCHES outstanding batches, then one more must be refused. */
static void op_fill_batches(Model* m) {
    int li = pick_layer(m);
    if (li < 0) return;
    trace("fill batches from %d", m->nbatches);
    int fails = 0;
    while (m->nbatches < EXPCACHE_MAX_BATCHES && fails < 3 && m->live) {
        int before = m->nbatches;
        op_batch_prepare(m, 1, 2);
        fails += m->nbatches == before;
    }
    if (m->nbatches == EXPCACHE_MAX_BATCHES) op_batch_prepare(m, 0, 2); /* expects INVALID_STATE */
}

static void op_release_all(Model* m) {
    g_cur_op = "release_all";
    m->sel_valid = m->cmp_valid = 0;
    expcache_status_t s = expcache_release_all(m->h);
    check_status("expcache_release_all", s, ST(OK));
    g_releases++;
    trace("release_all (%d batches outstanding): %s", m->nbatches, sname(s));
    if (s != OK) return;
    m->compact_cap = m->overflow_cap = 0;
    check_invariants(m, pct(30), 0);
    for (uint32_t c = 0; c < m->max_classes; ++c)
        if (m->info[c].held_experts == 0 && (m->info[c].allocated_experts || m->info[c].resident_experts))
            diverge("release_all left class %u with %" PRIu64 " slots and no batch holding them", c,
                    m->info[c].allocated_experts);
    if (m->nbatches == 0) {
        uint64_t db = 1;
        s = expcache_testing_device_bytes_in_use(m->h, &db);
        check_status("expcache_testing_device_bytes_in_use", s, ST(OK));
        if (db != 0) diverge("device_bytes_in_use is %" PRIu64 " after release_all with no batch held", db);
    }
}

/* ------------------------------------------------------------------------ */
/* Inspection, control, bad input                                            */
/* ------------------------------------------------------------------------ */

/* Arm `count` injected faults after `skip` through `inject` (named `fn`); `left`, when given,
   tracks the ones that may still fire. */
static void arm_faults(Model* m, const char* fn, expcache_status_t (*inject)(expcache_t*, uint64_t, uint64_t),
                       uint64_t skip, uint64_t count, uint64_t* left) {
    g_cur_op = fn + strlen("expcache_");
    expcache_status_t s = inject(m->h, skip, count);
    check_status(fn, s, ST(OK));
    trace("%s skip %" PRIu64 " count %" PRIu64 ": %s", g_cur_op, skip, count, sname(s));
    if (s == OK && left) *left = count;
    g_faults_armed += count;
    check_invariants(m, 0, 1);
}

static void op_inject(Model* m) {
    uint64_t skip = below(5), count = pct(30) ? 0 : between(1, 3);
    arm_faults(m, "expcache_testing_inject_alloc_failures", expcache_testing_inject_alloc_failures, skip, count, NULL);
}

static void op_inject_copy(Model* m) {
    uint64_t skip = below(40), count = pct(20) ? 0 : between(1, 2);
    arm_faults(m, "expcache_testing_inject_copy_failures", expcache_testing_inject_copy_failures, skip, count, &m->copy_faults_left);
}

static void op_inject_staging(Model* m) {
    uint64_t skip = below(60), count = pct(20) ? 0 : between(1, 2);
    arm_faults(m, "expcache_testing_inject_staging_failures", expcache_testing_inject_staging_failures, skip, count,
               &m->staging_faults_left);
}

static void op_reset_stats(Model* m) {
    g_cur_op = "reset_stats";
    check_invariants(m, 0, 1);
    expcache_status_t s = expcache_stats_reset(m->h);
    check_status("expcache_stats_reset", s, ST(OK));
    trace("reset_stats: %s", sname(s));
    memset(m->snap, 0, sizeof m->snap);
    for (uint32_t c = 0; c < m->max_classes; ++c)
        for (uint32_t p = 0; p < EXPCACHE_NUM_PATHS; ++p) m->snap[c][p].struct_size = sizeof(expcache_stats_t);
    check_invariants(m, 0, 1); /* every counter is exactly 0 */
}

static void op_layer_class(Model* m) {
    g_cur_op = "layer_class";
    m->sel_valid = 0; /* binding may reuse a class: addresses handed out before are invalid (header) */
    uint32_t layer = (uint32_t)below(m->num_layers + 1);
    uint32_t c = 0xA5A5u;
    int bad = layer >= m->num_layers || !m->layers[layer].registered;
    int want_is = !bad && bind_fails(m, layer);
    expcache_status_t s = expcache_layer_bind_class(m->h, layer, &c);
    trace("layer_class %u: %s %u", layer, sname(s), c);
    if (bad) {
        expect_bad("expcache_layer_bind_class", s, layer >= m->num_layers ? IA : IS,
                   layer >= m->num_layers ? "layer out of range" : "layer not registered");
    } else {
        check_status("expcache_layer_bind_class", s, ST(OK) | ST(IS));
        if (want_is != (s == IS)) diverge("layer_class(%u) returned %s, predicted %s", layer, sname(s), want_is ? "INVALID_STATE" : "OK");
    }
    if (s != OK) {
        if (c != 0xA5A5u) diverge("failed layer_class wrote *out_class");
        check_invariants(m, 0, 1);
        return;
    }
    check_invariants(m, pct(10), 0);
    const Layer* L = &m->layers[layer];
    if (c >= m->max_classes || !m->info[c].in_use ||
        !key_eq(L->bytes, m->info[c].gate_bytes, m->info[c].up_bytes, m->info[c].down_bytes))
        diverge("layer_class(%u) = %u, which is not a class of the layer's key", layer, c);
}

static void op_read_resident(Model* m) {
    g_cur_op = "read_resident";
    int li = pick_layer(m);
    if (li < 0) return;
    uint32_t layer = (uint32_t)li;
    const Layer* L = &m->layers[layer];
    if (pct(80)) {
        for (int i = 0; i < 4; ++i) resident(m, layer, (uint32_t)below(L->num_experts));
        check_invariants(m, 0, 1);
        return;
    }
    uint64_t eb = expert_bytes(L);
    unsigned char* dst = (unsigned char*)xmalloc(eb);
    memset(dst, 0x3C, eb);
    uint32_t r = 0xA5u;
    expcache_status_t s;
    switch (below(5)) {
        case 0:
            s = expcache_testing_read_resident(m->h, layer, L->num_experts + (uint32_t)below(3), dst, eb, &r);
            expect_bad("expcache_testing_read_resident", s, IA, "expert out of range");
            break;
        case 1:
            s = expcache_testing_read_resident(m->h, layer, 0, dst, eb - 1, &r);
            expect_bad("expcache_testing_read_resident", s, IA, "dst_bytes too small");
            break;
        case 2:
            s = expcache_testing_read_resident(m->h, layer, 0, NULL, eb, &r);
            expect_bad("expcache_testing_read_resident", s, IA, "dst NULL");
            break;
        case 3:
            s = expcache_testing_read_resident(m->h, layer, 0, dst, eb, NULL);
            expect_bad("expcache_testing_read_resident", s, IA, "out_resident NULL");
            break;
        default:
            s = expcache_testing_read_resident(m->h, m->num_layers + (uint32_t)below(9), 0, dst, eb, &r);
            expect_bad("expcache_testing_read_resident", s, IA, "layer out of range");
            break;
    }
    for (uint64_t i = 0; i < eb; ++i)
        if (dst[i] != 0x3C) {
            diverge("failed read_resident wrote dst");
            break;
        }
    if (r != 0xA5u) diverge("failed read_resident wrote *out_resident");
    free(dst);
    check_invariants(m, 0, 1);
}

/* A valid handed-out range: select, compact or batch address of some part. */
static int pick_handed_out(Model* m, const void** dev, const unsigned char** src, uint64_t* n) {
    const Layer* L;
    int which = (int)below(3);
    for (int t = 0; t < 3; ++t, which = (which + 1) % 3) {
        if (which == 0 && m->sel_valid) {
            uint32_t i = (uint32_t)below(m->sel_k);
            int p = (int)below(3);
            L = &m->layers[m->sel_layer];
            void* parts[3] = {m->sel_ptrs[i].gate, m->sel_ptrs[i].up, m->sel_ptrs[i].down};
            *dev = parts[p];
            *src = source(L, p, m->sel_ids[i]);
            *n = L->bytes[p];
            return 1;
        }
        if (which == 1 && m->cmp_valid) {
            uint32_t i = (uint32_t)below(m->cmp_n);
            int p = (int)below(3);
            L = &m->layers[m->cmp_layer];
            uint64_t off[3] = {m->cmp.gate_offset, m->cmp.up_offset, m->cmp.down_offset};
            *dev = (unsigned char*)m->cmp.base + off[p] + i * L->bytes[p];
            *src = source(L, p, m->cmp_ids[i]);
            *n = L->bytes[p];
            return 1;
        }
        if (which == 2 && m->nbatches) {
            Batch* B = &m->batches[below((uint64_t)m->nbatches)];
            uint32_t j = (uint32_t)below(B->count);
            int p = (int)below(3);
            L = &m->layers[B->layer];
            void* parts[3] = {B->ptrs[j].gate, B->ptrs[j].up, B->ptrs[j].down};
            *dev = parts[p];
            *src = source(L, p, B->ids[j]);
            *n = L->bytes[p];
            return 1;
        }
    }
    return 0;
}

static void op_read_device(Model* m) {
    g_cur_op = "read_device";
    const void* dev;
    const unsigned char* src;
    uint64_t n;
    unsigned char host[64];
    memset(host, 0x3C, sizeof host);
    expcache_status_t s;
    if (!pick_handed_out(m, &dev, &src, &n) || pct(30)) {
        switch (below(4)) {
            case 0:
                s = expcache_testing_read_device(m->h, host + 8, host, 8);
                expect_bad("expcache_testing_read_device", s, IA, "host address");
                break;
            case 1:
                s = expcache_testing_read_device(m->h, NULL, host, 8);
                expect_bad("expcache_testing_read_device", s, IA, "src NULL");
                break;
            case 2: {
                /* Any address of a live model, read far past its allocation. */
                if (m->sel_valid) {
                    s = expcache_testing_read_device(m->h, m->sel_ptrs[0].gate, host, (uint64_t)1 << 40);
                    expect_bad("expcache_testing_read_device", s, IA, "range past the allocation");
                }
                break;
            }
            default:
                if (m->sel_valid) {
                    s = expcache_testing_read_device(m->h, m->sel_ptrs[0].gate, host, 0);
                    expect_bad("expcache_testing_read_device", s, IA, "n 0");
                    s = expcache_testing_read_device(m->h, m->sel_ptrs[0].gate, NULL, 1);
                    expect_bad("expcache_testing_read_device", s, IA, "dst NULL");
                }
                break;
        }
        for (size_t i = 0; i < sizeof host; ++i)
            if (host[i] != 0x3C) {
                diverge("failed read_device wrote dst");
                break;
            }
        check_invariants(m, 0, 1);
        return;
    }
    uint64_t a = below(n), len = between(1, n - a);
    verify_range(m, (const unsigned char*)dev + a, src + a, len, "read_device sub-range", 0, 0, 0);
    check_invariants(m, 0, 1);
}

static uint64_t ref_checksum(const Layer* L, uint32_t e) {
    uint64_t sum = 0;
    for (int p = 0; p < 3; ++p) {
        const unsigned char* b = source(L, p, e);
        uint64_t n = L->bytes[p];
        for (uint64_t j = 0; j * 8 < n; ++j) {
            uint64_t w = 0;
            for (uint64_t z = 0; z < 8 && j * 8 + z < n; ++z) w |= (uint64_t)b[j * 8 + z] << (8 * z);
            sum += w * (2 * j + 1);
        }
    }
    return sum;
}

static void op_checksum(Model* m) {
    g_cur_op = "checksum";
    uint32_t layer, n = 0;
    static expcache_expert_ptrs_t ptrs[EXPCACHE_MAX_SELECT];
    static uint32_t ids[EXPCACHE_MAX_SELECT];
    static uint64_t sums[1];
    int which = (int)below(3);
    if (which == 0 && m->sel_valid) {
        layer = m->sel_layer;
        n = m->sel_k;
        memcpy(ptrs, m->sel_ptrs, n * sizeof ptrs[0]);
        memcpy(ids, m->sel_ids, n * sizeof ids[0]);
    } else if (which == 1 && m->cmp_valid) {
        layer = m->cmp_layer;
        n = m->cmp_n;
        const Layer* L = &m->layers[layer];
        unsigned char* b = (unsigned char*)m->cmp.base;
        for (uint32_t i = 0; i < n; ++i) {
            ptrs[i].gate = b + m->cmp.gate_offset + i * L->bytes[0];
            ptrs[i].up = b + m->cmp.up_offset + i * L->bytes[1];
            ptrs[i].down = b + m->cmp.down_offset + i * L->bytes[2];
            ids[i] = m->cmp_ids[i];
        }
    } else if (m->nbatches) {
        Batch* B = &m->batches[below((uint64_t)m->nbatches)];
        layer = B->layer;
        n = B->count;
        memcpy(ptrs, B->ptrs, n * sizeof ptrs[0]);
        memcpy(ids, B->ids, n * sizeof ids[0]);
    } else {
        return;
    }
    const Layer* L = &m->layers[layer];
    expcache_status_t s;
    if (pct(20)) {
        sums[0] = 0x3C3C;
        expcache_expert_ptrs_t bad = ptrs[0];
        uint64_t hostbuf[4];
        switch (below(4)) {
            case 0: s = expcache_testing_checksum(m->h, layer, ptrs, 0, NULL, sums); expect_bad("expcache_testing_checksum", s, IA, "n 0"); break;
            case 1: s = expcache_testing_checksum(m->h, layer, NULL, 1, NULL, sums); expect_bad("expcache_testing_checksum", s, IA, "ptrs NULL"); break;
            case 2: s = expcache_testing_checksum(m->h, layer, ptrs, 1, NULL, NULL); expect_bad("expcache_testing_checksum", s, IA, "out_sums NULL"); break;
            default:
                bad.up = hostbuf;
                s = expcache_testing_checksum(m->h, layer, &bad, 1, NULL, sums);
                expect_bad("expcache_testing_checksum", s, IA, "host address");
                break;
        }
        if (sums[0] != 0x3C3C) diverge("failed checksum wrote out_sums");
        check_invariants(m, 0, 1);
        return;
    }
    /* Exact sizes: ASan and valgrind catch a read or write past n. */
    expcache_expert_ptrs_t* p = (expcache_expert_ptrs_t*)xmalloc(sizeof(expcache_expert_ptrs_t) * n);
    uint64_t* out = (uint64_t*)xmalloc(sizeof(uint64_t) * n);
    memcpy(p, ptrs, sizeof(expcache_expert_ptrs_t) * n);
    s = expcache_testing_checksum(m->h, layer, p, n, rand_stream(), out);
    check_status("expcache_testing_checksum", s, ST(OK));
    trace("checksum layer %u n %u: %s", layer, n, sname(s));
    if (s == OK) {
        for (uint32_t i = 0; i < n; ++i)
            if (out[i] != ref_checksum(L, ids[i])) {
                diverge("checksum of expert %u (layer %u, index %u) is %016" PRIx64 ", want %016" PRIx64, ids[i], layer,
                        i, out[i], ref_checksum(L, ids[i]));
                break;
            }
    }
    free(p);
    free(out);
    check_invariants(m, 0, 1);
}

static void op_log(Model* m) {
    g_cur_op = "log";
    expcache_status_t s;
    switch (below(4)) {
        case 0: {
            uint32_t bad = EXPCACHE_LOG_DEBUG + 1 + (uint32_t)below(1000);
            s = expcache_log_set_level(m->h, bad);
            expect_bad("expcache_log_set_level", s, IA, "level out of range");
            break;
        }
        case 1:
            /* stderr again, silenced first so the run's output stays clean; then back. */
            s = expcache_log_set_level(m->h, EXPCACHE_LOG_SILENT);
            check_status("expcache_log_set_level", s, ST(OK));
            if (s == OK) m->log.level = 0;
            s = expcache_log_set_callback(m->h, NULL, NULL);
            check_status("expcache_log_set_callback", s, ST(OK));
            m->log.installed = 0;
            if (pct(50)) op_select(m); /* nothing may reach the callback now */
            install_log(m, (uint32_t)below(3));
            break;
        default: {
            uint32_t level = (uint32_t)below(3);
            s = expcache_log_set_level(m->h, level);
            check_status("expcache_log_set_level", s, ST(OK));
            if (s == OK) m->log.level = level;
            break;
        }
    }
    g_cur_op = "log";
    check_invariants(m, 0, 1);
}

static void op_misc(Model* m) {
    g_cur_op = "misc";
    static const uint32_t sizes[EXPCACHE_STRUCT_COUNT] = {
        [EXPCACHE_STRUCT_CONFIG] = sizeof(expcache_config_t),
        [EXPCACHE_STRUCT_LAYER_DESC] = sizeof(expcache_layer_desc_t),
        [EXPCACHE_STRUCT_EXPERT_PTRS] = sizeof(expcache_expert_ptrs_t),
        [EXPCACHE_STRUCT_COMPACT] = sizeof(expcache_compact_t),
        [EXPCACHE_STRUCT_CLASS_INFO] = sizeof(expcache_class_info_t),
        [EXPCACHE_STRUCT_STATS] = sizeof(expcache_stats_t),
        [EXPCACHE_STRUCT_STAGING_STATS] = sizeof(expcache_staging_stats_t),
        [EXPCACHE_STRUCT_PREFETCH_STATS] = sizeof(expcache_prefetch_stats_t),
    };
    for (uint32_t w = 0; w < EXPCACHE_STRUCT_COUNT; ++w) {
        g_calls++;
        if (expcache_testing_struct_size(w) != sizes[w])
            diverge("struct_size(%u) = %u, the header's is %u", w, expcache_testing_struct_size(w), sizes[w]);
    }
    const uint32_t unknown = (uint32_t)(pct(50) ? EXPCACHE_STRUCT_COUNT + below(1000) : UINT32_MAX - below(1000));
    g_calls++;
    if (expcache_testing_struct_size(unknown) != 0)
        diverge("struct_size(%u) = %u for an unknown struct, not 0", unknown, expcache_testing_struct_size(unknown));
    for (uint32_t p = 0; p < EXPCACHE_POLICY_COUNT; ++p) {
        g_calls++;
        const char* name = expcache_policy_name(p);
        if (!name || !name[0]) diverge("policy_name(%u) = %s", p, name ? "\"\"" : "NULL");
    }
    const uint32_t no_policy = (uint32_t)(pct(50) ? EXPCACHE_POLICY_COUNT + below(1000) : UINT32_MAX - below(1000));
    g_calls++;
    if (expcache_policy_name(no_policy) != NULL)
        diverge("policy_name(%u) = %s for an unknown policy, not NULL", no_policy, expcache_policy_name(no_policy));
    expcache_status_t s;
    if (expcache_version() != EXPCACHE_VERSION_MAJOR * 10000 + EXPCACHE_VERSION_MINOR * 100 + EXPCACHE_VERSION_PATCH)
        diverge("expcache_version %u", expcache_version());
    for (int st = -2; st < 12; ++st) {
        const char* name = expcache_status_string(st);
        if (!name || strncmp(name, "EXPCACHE_", 9) != 0) diverge("status_string(%d) = %s", st, name ? name : "NULL");
    }
    s = expcache_config_init(NULL);
    expect_bad("expcache_config_init", s, IA, "NULL");
    s = expcache_layer_desc_init(NULL);
    expect_bad("expcache_layer_desc_init", s, IA, "NULL");
    expcache_destroy(NULL);
    s = expcache_backend_get(m->h, NULL);
    expect_bad("expcache_backend_get", s, IA, "out NULL");
    s = expcache_class_count_get(m->h, NULL);
    expect_bad("expcache_class_count_get", s, IA, "out NULL");
    s = expcache_testing_device_bytes_in_use(m->h, NULL);
    expect_bad("expcache_testing_device_bytes_in_use", s, IA, "out NULL");
    s = expcache_synchronize(m->h, rand_stream());
    check_status("expcache_synchronize", s, ST(OK));

    expcache_class_info_t ci;
    memset(&ci, 0x3C, sizeof ci);
    ci.struct_size = sizeof ci;
    s = expcache_class_info_get(m->h, m->max_classes + (uint32_t)below(100), &ci);
    expect_bad("expcache_class_info_get", s, IA, "class index out of range");
    ci.struct_size = sizeof ci - 8;
    s = expcache_class_info_get(m->h, 0, &ci);
    expect_bad("expcache_class_info_get", s, IA, "struct_size");
    s = expcache_class_info_get(m->h, 0, NULL);
    expect_bad("expcache_class_info_get", s, IA, "out NULL");
    if (ci.in_use != 0x3C3C3C3Cu) diverge("failed class_info wrote *out");

    expcache_stats_t st;
    memset(&st, 0x3C, sizeof st);
    st.struct_size = sizeof st;
    s = expcache_stats_get(m->h, m->max_classes, 0, &st);
    expect_bad("expcache_stats_get", s, IA, "class index out of range");
    s = expcache_stats_get(m->h, 0, EXPCACHE_NUM_PATHS + (uint32_t)below(5), &st);
    expect_bad("expcache_stats_get", s, IA, "path out of range");
    st.struct_size = 0;
    s = expcache_stats_get(m->h, 0, 0, &st);
    expect_bad("expcache_stats_get", s, IA, "struct_size");
    if (st.calls != 0x3C3C3C3C3C3C3C3Cull) diverge("failed get_stats wrote *out");
    check_invariants(m, 0, 1);
}

/* Bad input to the serving calls: none may change anything. */
static void op_bad_serving(Model* m) {
    g_cur_op = "bad serving input";
    int li = pick_layer(m);
    if (li < 0) return;
    uint32_t unreg = UINT32_MAX;
    for (uint32_t l = 0; l < m->num_layers; ++l)
        if (!m->layers[l].registered) unreg = l;
    static uint32_t ids[EXPCACHE_MAX_SELECT + 1];
    static expcache_expert_ptrs_t out[EXPCACHE_MAX_SELECT + 1];
    uint32_t out_ids[8], count = 7;
    uint64_t batch = 7;
    expcache_compact_t cmp;
    memset(&cmp, 0, sizeof cmp);
    cmp.struct_size = sizeof cmp;
    memset(ids, 0, sizeof ids);
    uint32_t layer = (uint32_t)li;
    uint32_t ne = m->layers[layer].num_experts;
    int kind = (int)below(16);
    expcache_status_t s;
    if (kind < 14) m->sel_valid = 0;
    if (kind == 3 || kind == 4) m->cmp_valid = 0;
    switch (kind) {
        case 0: s = expcache_select_async(m->h, layer, ids, 0, NULL, out); expect_bad("expcache_select_async", s, IA, "k 0"); break;
        case 1:
            s = expcache_select_async(m->h, layer, ids, EXPCACHE_MAX_SELECT + 1, NULL, out);
            expect_bad("expcache_select_async", s, IA, "k > EXPCACHE_MAX_SELECT");
            break;
        case 2:
            ids[below(4)] = ne + (uint32_t)below(3);
            s = expcache_select_async(m->h, layer, ids, 4, NULL, out);
            expect_bad("expcache_select_async", s, IA, "expert id out of range");
            break;
        case 3:
            cmp.struct_size = sizeof cmp + 8;
            s = expcache_compact_load_async(m->h, layer, ids, 2, NULL, &cmp);
            expect_bad("expcache_compact_load_async", s, IA, "struct_size");
            break;
        case 4:
            if (pct(50)) {
                s = expcache_compact_load_async(m->h, layer, ids, 0, NULL, &cmp);
                expect_bad("expcache_compact_load_async", s, IA, "n 0");
            } else {
                s = expcache_compact_load_async(m->h, layer, ids, 1, NULL, NULL);
                expect_bad("expcache_compact_load_async", s, IA, "out NULL");
            }
            break;
        case 5:
            ids[0] = ne;
            s = expcache_compact_load_async(m->h, layer, ids, 3, NULL, &cmp);
            expect_bad("expcache_compact_load_async", s, IA, "expert id out of range");
            break;
        case 6:
            s = expcache_batch_prepare_async(m->h, layer, ids, 0, NULL, out_ids, out, &count, &batch);
            expect_bad("expcache_batch_prepare_async", s, IA, "n 0");
            break;
        case 7:
            ids[1] = ne + 100;
            s = expcache_batch_prepare_async(m->h, layer, ids, 2, NULL, out_ids, out, &count, &batch);
            expect_bad("expcache_batch_prepare_async", s, IA, "expert id out of range");
            break;
        case 8:
            s = expcache_batch_prepare_async(m->h, layer, ids, 2, NULL, out_ids, out, NULL, &batch);
            expect_bad("expcache_batch_prepare_async", s, IA, "out_count NULL");
            break;
        case 9:
            s = expcache_select_async(m->h, layer, NULL, 2, NULL, out);
            expect_bad("expcache_select_async", s, IA, "ids NULL");
            s = expcache_select_async(m->h, layer, ids, 2, NULL, NULL);
            expect_bad("expcache_select_async", s, IA, "out NULL");
            break;
        case 10:
            s = expcache_select_async(m->h, m->num_layers + (uint32_t)below(4), ids, 1, NULL, out);
            expect_bad("expcache_select_async", s, IA, "layer out of range");
            break;
        case 11:
            if (unreg == UINT32_MAX) break;
            s = expcache_select_async(m->h, unreg, ids, 1, NULL, out);
            expect_bad("expcache_select_async", s, IS, "layer not registered");
            s = expcache_compact_load_async(m->h, unreg, ids, 1, NULL, &cmp);
            expect_bad("expcache_compact_load_async", s, IS, "layer not registered");
            s = expcache_batch_prepare_async(m->h, unreg, ids, 1, NULL, out_ids, out, &count, &batch);
            expect_bad("expcache_batch_prepare_async", s, IS, "layer not registered");
            break;
        case 12:
            s = expcache_batch_prepare_async(m->h, UINT32_MAX, ids, 1, NULL, out_ids, out, &count, &batch);
            expect_bad("expcache_batch_prepare_async", s, IA, "layer UINT32_MAX");
            break;
        case 13:
            s = expcache_batch_prepare_async(m->h, layer, NULL, 1, NULL, out_ids, out, &count, &batch);
            expect_bad("expcache_batch_prepare_async", s, IA, "ids NULL");
            break;
        case 14:
            if (unreg == UINT32_MAX) break;
            {
                uint64_t sum = 0;
                expcache_expert_ptrs_t p = {ids, ids, ids};
                s = expcache_testing_checksum(m->h, unreg, &p, 1, NULL, &sum);
                expect_bad("expcache_testing_checksum", s, IS, "layer not registered");
                uint32_t r = 0;
                s = expcache_testing_read_resident(m->h, unreg, 0, ids, sizeof ids, &r);
                expect_bad("expcache_testing_read_resident", s, IS, "layer not registered");
            }
            break;
        default:
            s = expcache_testing_inject_alloc_failures(m->h, 0, 0); /* count 0 disables injection */
            check_status("expcache_testing_inject_alloc_failures", s, ST(OK));
            break;
    }
    if (count != 7 || batch != 7) diverge("failed batch_prepare wrote out_count/out_batch");
    trace("bad serving input kind %d", kind);
    check_invariants(m, 0, 1);
}

/* Destroyed and foreign handles: INVALID_ARGUMENT from everything, destroy ignores them. */
static void op_stale(void) {
    g_cur_op = "stale handle";
    g_cur = 0;
    expcache_t* h = (expcache_t*)g_foreign;
    int use_stale = pct(80);
    uint64_t r = rnd();
    if (g_nstale && use_stale) {
        h = g_stale[r % (uint64_t)g_nstale];
        if (is_stale_live(h)) h = (expcache_t*)g_foreign;
    }
    uint32_t ids[1] = {0}, u = 0, cnt = 0;
    uint64_t u64 = 0, sum = 0;
    expcache_expert_ptrs_t p[1];
    expcache_compact_t cmp;
    memset(&cmp, 0, sizeof cmp);
    cmp.struct_size = sizeof cmp;
    expcache_class_info_t ci;
    ci.struct_size = sizeof ci;
    expcache_stats_t st;
    st.struct_size = sizeof st;
    expcache_layer_desc_t d;
    expcache_layer_desc_init(&d);
    unsigned char buf[16];
    expcache_status_t s;
    const char* fn = "";
    switch (below(21)) {
        case 0: s = expcache_backend_get(h, &u); fn = "expcache_backend_get"; break;
        case 1: s = expcache_layer_register(h, 0, &d); fn = "expcache_layer_register"; break;
        case 2: s = expcache_select_async(h, 0, ids, 1, NULL, p); fn = "expcache_select_async"; break;
        case 3: s = expcache_compact_load_async(h, 0, ids, 1, NULL, &cmp); fn = "expcache_compact_load_async"; break;
        case 4: s = expcache_batch_prepare_async(h, 0, ids, 1, NULL, &u, p, &cnt, &u64); fn = "expcache_batch_prepare_async"; break;
        case 5: s = expcache_batch_finish(h, 1, NULL); fn = "expcache_batch_finish"; break;
        case 6: s = expcache_release_all(h); fn = "expcache_release_all"; break;
        case 7: s = expcache_synchronize(h, NULL); fn = "expcache_synchronize"; break;
        case 8: s = expcache_testing_read_resident(h, 0, 0, buf, sizeof buf, &u); fn = "expcache_testing_read_resident"; break;
        case 9: s = expcache_testing_read_device(h, buf, buf + 8, 8); fn = "expcache_testing_read_device"; break;
        case 10: p[0].gate = p[0].up = p[0].down = buf; s = expcache_testing_checksum(h, 0, p, 1, NULL, &sum); fn = "expcache_testing_checksum"; break;
        case 11: s = expcache_class_count_get(h, &u); fn = "expcache_class_count_get"; break;
        case 12: s = expcache_class_info_get(h, 0, &ci); fn = "expcache_class_info_get"; break;
        case 13: s = expcache_layer_bind_class(h, 0, &u); fn = "expcache_layer_bind_class"; break;
        case 14: s = expcache_stats_get(h, 0, 0, &st); fn = "expcache_stats_get"; break;
        case 15: s = expcache_stats_reset(h); fn = "expcache_stats_reset"; break;
        case 16: s = expcache_log_set_callback(h, log_cb, NULL); fn = "expcache_log_set_callback"; break;
        case 17: s = expcache_log_set_level(h, 0); fn = "expcache_log_set_level"; break;
        case 18:
            if (pct(50)) s = expcache_testing_inject_alloc_failures(h, 0, 1), fn = "expcache_testing_inject_alloc_failures";
            else s = expcache_testing_inject_copy_failures(h, 0, 1), fn = "expcache_testing_inject_copy_failures";
            break;
        case 19: s = expcache_testing_device_bytes_in_use(h, &u64); fn = "expcache_testing_device_bytes_in_use"; break;
        default: s = expcache_file_open(h, "/dev/null", &u); fn = "expcache_file_open"; break;
    }
    trace("%s on %s handle %p: %s", fn, h == (expcache_t*)g_foreign ? "foreign" : "destroyed", (void*)h, sname(s));
    expect_bad(fn, s, IA, h == (expcache_t*)g_foreign ? "foreign handle" : "destroyed handle");
    expcache_destroy(h); /* ignored */
    g_calls++;
}

/* ------------------------------------------------------------------------ */
/* Main loop                                                                 */
/* ------------------------------------------------------------------------ */

static int count_fds(void);

/* Many files on one (throwaway) cache: ids count up, whatever limit there is fails with a
 * documented status, and destroy closes every descriptor. Once per run. */
static void op_file_limit(void) {
    g_cur_op = "open_file limit";
    g_cur = 0;
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return;
    rlim_t want = 2 * 1100 + 64; /* two descriptors a file where O_DIRECT is allowed */
    if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < want) {
        if (rl.rlim_max != RLIM_INFINITY && rl.rlim_max < want) {
            printf("stress: open_file limit test skipped (RLIMIT_NOFILE hard limit %llu)\n", (unsigned long long)rl.rlim_max);
            return;
        }
        struct rlimit more = rl;
        more.rlim_cur = want;
        if (setrlimit(RLIMIT_NOFILE, &more) != 0) {
            printf("stress: open_file limit test skipped (cannot raise RLIMIT_NOFILE)\n");
            return;
        }
    }
    int fds = count_fds();
    expcache_config_t cfg;
    expcache_config_init(&cfg);
    cfg.backend = EXPCACHE_BACKEND_HOST;
    cfg.num_layers = 1;
    cfg.budget_experts = 1;
    cfg.log_level = EXPCACHE_LOG_SILENT;
    expcache_t* h = NULL;
    expcache_status_t s = expcache_create(&cfg, &h);
    check_status("expcache_create", s, ST(OK));
    if (s != OK) return;
    char path[4096];
    snprintf(path, sizeof path, "%s/expcache-stress-XXXXXX", tmp_dir());
    int fd = mkstemp(path);
    if (fd < 0 || write(fd, "0123456789abcdef", 16) != 16) {
        fprintf(stderr, "stress: cannot create a temporary file in %s (set STRESS_TMPDIR)\n", tmp_dir());
        exit(2);
    }
    close(fd);
    uint32_t n = 0;
    for (; n < 1100; ++n) {
        uint32_t id = 0xA5A5A5A5u;
        s = expcache_file_open(h, path, &id);
        g_calls++;
        if (s != OK) break;
        if (id != n) diverge("open_file gave id %u, want %u", id, n);
    }
    unlink(path);
    if (s != OK) {
        trace("open_file failed after %u files: %s (%s)", n, sname(s), expcache_last_error());
        check_status("expcache_file_open", s, ST(IA) | ST(IS) | ST(IO));
        if (s == IO && n < 1000) diverge("open_file failed after only %u files: %s", n, expcache_last_error());
    }
    /* A layer from the last file opened still works. */
    static const unsigned char bytes[16] = "0123456789abcdef";
    if (n > 0) {
        expcache_layer_desc_t d;
        expcache_layer_desc_init(&d);
        d.num_experts = 1;
        d.source_kind = EXPCACHE_SOURCE_FILE;
        d.file = n - 1;
        d.gate_bytes = d.up_bytes = d.down_bytes = d.gate_stride = d.up_stride = d.down_stride = 5;
        d.up_base = (const void*)(uintptr_t)5;
        d.down_base = (const void*)(uintptr_t)10;
        s = expcache_layer_register(h, 0, &d);
        check_status("expcache_layer_register", s, ST(OK));
        uint32_t e = 0;
        expcache_expert_ptrs_t p;
        s = expcache_select_async(h, 0, &e, 1, NULL, &p);
        check_status("expcache_select_async", s, ST(OK));
        unsigned char got[5];
        if (s == OK && (expcache_testing_read_device(h, p.down, got, 5) != OK || memcmp(got, bytes + 10, 5) != 0))
            diverge("a layer read from file %u holds wrong bytes", n - 1);
    }
    expcache_destroy(h);
    g_calls += 4;
    if (count_fds() != fds) diverge("destroying a cache with %u files open left %d descriptors open", n, count_fds() - fds);
}

/* Open file descriptors of this process (-1 where /proc is not there). */
static int count_fds(void) {
    DIR* d = opendir("/proc/self/fd");
    if (!d) return -1;
    int n = 0;
    for (struct dirent* e; (e = readdir(d));) n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

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
    if (r < 300) op_select(m);
    else if (r < 400) op_compact(m);
    else if (r < 510) op_batch_prepare(m, 0, 0);
    else if (r < 600) op_batch_finish(m);
    else if (r < 625) op_release_all(m);
    else if (r < 660) op_inject(m);
    else if (r < 670) op_inject_copy(m);
    else if (r < 680) op_inject_staging(m);
    else if (r < 690) op_reset_stats(m);
    else if (r < 720) op_layer_class(m);
    else if (r < 760) op_read_resident(m);
    else if (r < 800) op_read_device(m);
    else if (r < 830) op_checksum(m);
    else if (r < 845) op_log(m);
    else if (r < 860) op_misc(m);
    else if (r < 920) op_bad_serving(m);
    else if (r < 935) op_register(m);
    else if (r < 945) op_stale();
    else if (r < 948) op_fill_batches(m);
    else if (r < 956) {
        /* Drain: finish every batch, release, and everything must be back to 0. */
        g_cur_op = "drain";
        for (int i = 0; m->nbatches && i < 4 * EXPCACHE_MAX_BATCHES; ++i) op_batch_finish(m);
        op_release_all(m);
    } else if (r < 960) op_destroy(m);
    else op_select(m);
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
            if (pos == 0) g_seed = v;
            else ops = v;
            ++pos;
        }
    }
    g_rng = mix64(g_seed ^ 0x5EEDull);
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
    free(g_scratch);
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
