/*
 * stress.h — what the files of the stress driver (tests/c/stress/) share: its limits and status
 * shorthands, the reference model of each cache (Model, Layer, Batch), and what each file defines
 * for the others, grouped under that file. main.c describes the driver and lists its files.
 */
#ifndef EXPCACHE_STRESS_H
#define EXPCACHE_STRESS_H

#define _POSIX_C_SOURCE 200809L /* before any system header: each file includes this one first */

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
#define MAX_EXPERTS 48       /* ordinary layers */
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

/* The unique ids of one serving call (g_u, g_pre). */
#define MAX_SERVE_IDS (EXPCACHE_MAX_SELECT > MAX_BATCH_IDS ? EXPCACHE_MAX_SELECT : MAX_BATCH_IDS)

/* random.c: the seeded draws. They never depend on heap addresses, so a seed replays the same
 * sequence under ASan, valgrind or neither. */
void rng_seed(uint64_t seed);
uint64_t mix64(uint64_t z);
uint64_t rnd(void);
uint64_t below(uint64_t n);
uint64_t between(uint64_t lo, uint64_t hi);
int pct(unsigned p);

/* report.c: the run's counters, divergences, the trace, and the status check of every call. */
extern uint64_t g_seed;
extern int g_trace;
extern uint64_t g_op, g_calls, g_bad, g_errors, g_faults_armed, g_faults_seen, g_ooms, g_verified_bytes;
extern uint64_t g_staging_faults_seen; /* calls failed by an injected staging fault */
extern uint64_t g_range_reports;       /* warnings of a device select's id out of range */
extern uint64_t g_creates, g_destroys, g_log_lines, g_selects, g_compacts, g_batches, g_finishes, g_releases;
extern uint64_t g_serial; /* cache serial numbers: source patterns and messages */
extern uint64_t g_cur;    /* serial of the cache the current op works on */
extern const char* g_cur_op;
void diverge(const char* fmt, ...);
void trace(const char* fmt, ...);
int check_status(const char* fn, expcache_status_t s, uint32_t allowed);
void expect_bad(const char* fn, expcache_status_t s, expcache_status_t expected, const char* what);
void* xmalloc(size_t n);
void* xcalloc(size_t n, size_t size);

static inline const char* sname(expcache_status_t s) {
    return expcache_status_string(s);
}
static inline uint64_t align_up(uint64_t v) {
    return (v + ALIGN - 1) & ~(uint64_t)(ALIGN - 1);
}

/* model.c: the reference model, one per live cache, and the read-back of device bytes against it. */
typedef struct {
    int registered;
    int key;
    uint32_t num_experts;
    uint64_t bytes[3], stride[3];
    const unsigned char* base[3];
    unsigned char* bufs[3];
    int nbufs;
    uint32_t pinned;
    int from_file; /* EXPCACHE_SOURCE_FILE: bufs[0] is the file's image, off[] the bases in the file */
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
    uint64_t staging; /* a batch by address: bytes of its own staging */
    uint32_t rows;    /* a batch by slot id: experts it staged in its class's batch rows */
} Batch;

typedef struct {
    uint32_t magic;
    uint32_t level; /* the library's current log level as we set it */
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
    uint64_t compact_cap;
    uint64_t copy_faults_left;    /* injected copy failures that may still fire */
    uint64_t staging_faults_left; /* injected staging failures that may still fire (at least) */
    uint32_t nfiles;              /* files opened: ids 0..nfiles-1 */
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

#define LOG_MAGIC 0x10C5100Cu /* LogSink.magic */

extern Model g_models[MAX_CACHES];

static inline uint64_t slot_bytes_of(const uint64_t k[3]) {
    return align_up(k[0]) + align_up(k[1]) + align_up(k[2]);
}
static inline uint64_t expert_bytes(const Layer* L) {
    return L->bytes[0] + L->bytes[1] + L->bytes[2];
}
static inline const unsigned char* source(const Layer* L, int p, uint32_t e) {
    return L->base[p] + L->stride[p] * e;
}
static inline int key_eq(const uint64_t a[3], uint64_t g, uint64_t u, uint64_t d) {
    return a[0] == g && a[1] == u && a[2] == d;
}

void fill_part(unsigned char* dst, uint64_t n, uint64_t serial, uint32_t layer, uint32_t e, int p);
int verify_range(Model* m, const void* dev, const unsigned char* want, uint64_t n, const char* what, uint32_t layer,
                 uint32_t e, int part);
int verify_expert(Model* m, uint32_t layer, uint32_t e, const expcache_expert_ptrs_t* p, const char* what);
int resident(Model* m, uint32_t layer, uint32_t e);
void mark_clear(Model* m);
void free_layer(Layer* L);
void drop_batch(Model* m, int b);
void forget_model(Model* m);
void free_scratch(void);

/* invariants.c: what holds after every operation. */
void check_invariants(Model* m, int deep, int exact_stats);
void check_batches(Model* m, int all);
int class_busy(const Model* m, uint32_t c);
int bind_fails(Model* m, uint32_t layer);

/* stats.c: counters against the model's snapshot. DELTA(f): how far counter f moved since the
 * snapshot, with `st` the stats read now and `o` the snapshot. */
#define DELTA(f) (st.f - o->f)
void check_stats(Model* m, int exact);
int get_stat(Model* m, uint32_t c, uint32_t path, expcache_stats_t* st);
void op_reset_stats(Model* m);

/* log.c: the log callback and levels. */
void log_cb(void* user, uint32_t level, const char* msg);
void install_log(Model* m, uint32_t level);
void op_log(Model* m);

/* lifetime.c: create, release_all, destroy. */
void op_create(void);
void op_release_all(Model* m);
void op_destroy(Model* m);

/* files.c: file sources opened through the library. */
int open_file(Model* m, const unsigned char* image, uint64_t bytes, uint32_t* out);
void bad_open_file(Model* m);
void op_file_limit(void);
int count_fds(void);

/* layers.c: layer sources and registration. */
void op_register(Model* m);
void fill_desc(const Layer* L, expcache_layer_desc_t* d);

/* serving.c: what select, compact and batch share. */
extern uint32_t g_u[MAX_SERVE_IDS];
extern signed char g_pre[MAX_SERVE_IDS];
void* rand_stream(void);
int pick_layer(Model* m);
void gen_ids(const Layer* L, uint32_t* ids, uint64_t n);
uint32_t uniq(Model* m, uint32_t layer, const uint32_t* ids, uint64_t n, uint32_t* out);
int layer_class_of(Model* m, uint32_t layer, uint32_t* out);
uint32_t serving_statuses(const Model* m);

/* select.c, compact.c, batch.c: the serving calls. */
void op_select(Model* m);
void op_compact(Model* m);
void op_batch_prepare(Model* m, int quiet, uint64_t max_n);
void op_batch_finish(Model* m);
void op_fill_batches(Model* m);

/* faults.c: injected allocation, copy and staging failures. */
void consumed_copy_fault(Model* m, expcache_status_t s);
void op_inject(Model* m);
void op_inject_copy(Model* m);
void op_inject_staging(Model* m);

/* inspect.c: inspection and test hooks. */
void op_layer_class(Model* m);
void op_read_resident(Model* m);
void op_read_device(Model* m);
void op_checksum(Model* m);
void op_misc(Model* m);

/* bad_serving.c: bad input to the serving calls. */
void op_bad_serving(Model* m);

/* handles.c: destroyed and foreign handles. */
extern unsigned char g_foreign[256]; /* a "handle" the library never made */
void add_stale(expcache_t* h);
void unstale(expcache_t* h);
void op_stale(void);

/* device.c: a device-lookup cache, made, driven and destroyed within one operation. */
void op_device_lookup(void);

#endif /* EXPCACHE_STRESS_H */
