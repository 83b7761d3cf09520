/*
 * The benchmark's replay loop, in C so that what is timed is the library and
 * the GPU, not the Python interpreter: for each call of a workload, serve
 * the experts (select, batch or compact load), run the checksum kernel over
 * every byte of them — the per-layer synchronization point — and compare
 * with the expected sums.
 *
 * With options, a decode call models an engine's layer: the advice for the
 * layer (a prefetch or a hint of predicted experts, made from the previous
 * layer), then `compute_ns` of non-expert work on the stream and a wait for
 * it (the router's result reaches the host), then the select (split: the hits'
 * checksum runs while the misses cross) and the experts' checksum.
 *
 * Experts of other than three parts (a quantized checkpoint's weights and
 * scales) are served by slot id (the mode's REPLAY_BY_SLOT flag): select_slots (decode) and
 * batch_prepare_slots (prefill) write each expert's row in its class's bank to
 * host memory, and the bank's checksum reads every part of the experts in those
 * rows (expcache_testing_bank_checksum_host_slots_async), checked as the
 * three-part path's sums are.
 *
 * Built as libexpcache_replay.so without linking libexpcache, and loaded
 * with RTLD_LOCAL: the caller passes the library's functions in a
 * replay_api_t (expcache_bench/replay.py fills it from the libexpcache it
 * loaded), so the loop always calls the same library as the cache it is given.
 */
#define _POSIX_C_SOURCE 199309L
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "expcache_testing.h" /* the checksum hooks; includes expcache.h */

#define REPLAY_DECODE 0
#define REPLAY_BATCH 1

#define REPLAY_MODE_CACHE 0   /* select / batch_prepare */
#define REPLAY_MODE_NOCACHE 1 /* compact loads only: every expert uploaded every time */
#define REPLAY_MODE_SLAB 2    /* select; release_all before every batch (the old ds4 design) */
/* A flag of the mode (CACHE or SLAB): serve by slot id, select_slots and batch_prepare_slots, and checksum
   the bank's rows (experts of any number of parts). */
#define REPLAY_BY_SLOT 0x100

/* The libexpcache functions the loop calls, from the library that made the cache. */
typedef struct replay_api_t {
    uint32_t struct_size;
    uint32_t reserved;
    expcache_status_t (*select_async)(expcache_t*, uint32_t, const uint32_t*, uint32_t, void*, expcache_expert_ptrs_t*);
    expcache_status_t (*compact_load_async)(expcache_t*, uint32_t, const uint32_t*, uint32_t, void*,
                                            expcache_compact_t*);
    expcache_status_t (*batch_prepare_async)(expcache_t*, uint32_t, const uint32_t*, uint64_t, void*, uint32_t*,
                                             expcache_expert_ptrs_t*, uint32_t*, uint64_t*);
    expcache_status_t (*batch_finish)(expcache_t*, uint64_t, void*);
    expcache_status_t (*release_all)(expcache_t*);
    expcache_status_t (*synchronize)(expcache_t*, void*);
    expcache_status_t (*stats_get)(const expcache_t*, uint32_t, uint32_t, expcache_stats_t*);
    expcache_status_t (*checksum)(expcache_t*, uint32_t, const expcache_expert_ptrs_t*, uint32_t, void*, uint64_t*);
    expcache_status_t (*checksum_async)(expcache_t*, uint32_t, const expcache_expert_ptrs_t*, uint32_t, void*,
                                        uint32_t);
    expcache_status_t (*checksum_results)(expcache_t*, uint32_t, uint32_t, uint64_t*);
    expcache_status_t (*select_split_async)(expcache_t*, uint32_t, const uint32_t*, uint32_t, void*,
                                            expcache_expert_ptrs_t*, uint8_t*, void**);
    expcache_status_t (*ready_wait_async)(expcache_t*, void*, void*);
    expcache_status_t (*prefetch_async)(expcache_t*, uint32_t, const uint32_t*, uint32_t, void*, uint32_t*);
    expcache_status_t (*hint)(expcache_t*, uint32_t, const uint32_t*, uint32_t);
    expcache_status_t (*spin_async)(expcache_t*, void*, uint64_t);
    expcache_status_t (*select_slots_async)(expcache_t*, uint32_t, const void*, uint32_t, uint32_t, int32_t*, void*);
    expcache_status_t (*batch_prepare_slots_async)(expcache_t*, uint32_t, const void*, uint32_t, uint64_t, void*,
                                                   uint32_t*, int32_t*, uint32_t*, uint64_t*);
    expcache_status_t (*bank_checksum_host_slots_async)(expcache_t*, uint32_t, const int32_t*, uint32_t, void*,
                                                        uint32_t);
} replay_api_t;

#define REPLAY_ADVICE_NONE 0
#define REPLAY_ADVICE_PREFETCH 1
#define REPLAY_ADVICE_HINT 2

/* The engine a decode call models (NULL: none of it). */
typedef struct replay_options_t {
    uint32_t struct_size;
    uint32_t advice;     /* REPLAY_ADVICE_*: what is done with each call's advice ids */
    uint64_t compute_ns; /* non-expert work per layer, before its select */
    uint32_t split;      /* 1: select_split_async, the hits checksummed before waiting for the misses
                            (not with REPLAY_BY_SLOT) */
    uint32_t reserved;
    const uint64_t* advice_offset; /* per call: its advice ids in advice_ids (count 0: none) */
    const uint32_t* advice_count;
    const uint32_t* advice_ids;
} replay_options_t;

typedef struct replay_call_t {
    uint32_t kind;
    uint32_t layer;
    uint64_t offset; /* first id in the ids array */
    uint32_t count;  /* ids of this call (k for decode, tokens*k for a batch) */
    uint32_t reserved;
} replay_call_t;

typedef struct replay_result_t {
    double decode_seconds;
    double prefill_seconds;
    uint64_t checksum_errors;
    uint64_t experts_checked;
    uint64_t first_bad_call; /* UINT64_MAX when none */
    uint64_t calls_done;
    uint64_t decode_bytes_h2d;   /* host-to-device bytes moved by decode calls */
    uint64_t prefill_bytes_h2d;  /* ... and by prefill batches */
    uint64_t decode_calls;       /* decode calls done */
    double decode_serve_seconds; /* of decode_seconds, in the serving call (select or compact load); the
                                    rest is the checksum: its kernel, the wait for the transfers still
                                    crossing and the sums' readback (with layer_sync; without it, the
                                    per-token wait) */
    uint64_t stopped;            /* 1 when the progress callback asked to stop (Ctrl-C) */
} replay_result_t;

/* Called every 512 calls and after the last; a nonzero return stops the replay after the
   call just done (out->stopped = 1, status OK): how Ctrl-C reaches a loop that runs in C. */
typedef int (*replay_progress_fn)(uint64_t done, uint64_t total);

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Host-to-device bytes over every class and path (read outside the timed region). */
static uint64_t bytes_h2d(const replay_api_t* api, expcache_t* cache, uint32_t max_classes) {
    uint64_t total = 0;
    for (uint32_t c = 0; c < max_classes; ++c)
        for (uint32_t p = 0; p < EXPCACHE_NUM_PATHS; ++p) {
            expcache_stats_t st;
            st.struct_size = sizeof st;
            if (api->stats_get(cache, c, p, &st) == EXPCACHE_OK) total += st.bytes_h2d;
        }
    return total;
}

/* Load ids into the compact buffer and point ptrs at each expert's parts in it. */
static expcache_status_t load_compact(const replay_api_t* api, expcache_t* cache, uint32_t layer, const uint32_t* ids,
                                      uint32_t n, void* stream, expcache_expert_ptrs_t* ptrs) {
    expcache_compact_t buf;
    buf.struct_size = sizeof buf;
    expcache_status_t s = api->compact_load_async(cache, layer, ids, n, stream, &buf);
    for (uint32_t i = 0; s == EXPCACHE_OK && i < n; ++i) {
        ptrs[i].gate = (char*)buf.base + buf.gate_offset + buf.gate_bytes * i;
        ptrs[i].up = (char*)buf.base + buf.up_offset + buf.up_bytes * i;
        ptrs[i].down = (char*)buf.base + buf.down_offset + buf.down_bytes * i;
    }
    return s;
}

/* The bank checksum of host slots[0..n) into result slots [first, first + n), in calls of at most
   EXPCACHE_MAX_SELECT (a batch's experts may be more). */
static expcache_status_t checksum_slots_async(const replay_api_t* api, expcache_t* cache, uint32_t layer,
                                              const int32_t* slots, uint32_t n, void* stream, uint32_t first) {
    expcache_status_t s = EXPCACHE_OK;
    for (uint32_t at = 0; s == EXPCACHE_OK && at < n; at += EXPCACHE_MAX_SELECT) {
        uint32_t m = n - at < EXPCACHE_MAX_SELECT ? n - at : EXPCACHE_MAX_SELECT;
        s = api->bank_checksum_host_slots_async(cache, layer, slots + at, m, stream, first + at);
    }
    return s;
}

/* checksum_slots_async into result slots [0, n), waited for and read into sums (as api->checksum). */
static expcache_status_t checksum_slots(const replay_api_t* api, expcache_t* cache, uint32_t layer,
                                        const int32_t* slots, uint32_t n, void* stream, uint64_t* sums) {
    if (n > EXPCACHE_CHECKSUM_RESULTS) return EXPCACHE_ERR_INVALID_ARGUMENT;
    expcache_status_t s = checksum_slots_async(api, cache, layer, slots, n, stream, 0);
    if (s == EXPCACHE_OK) s = api->synchronize(cache, stream);
    if (s == EXPCACHE_OK) s = api->checksum_results(cache, 0, n, sums);
    return s;
}

static uint32_t dedupe(const uint32_t* ids, uint32_t n, uint8_t* seen, uint32_t* out) {
    uint32_t m = 0;
    for (uint32_t i = 0; i < n; ++i)
        if (!seen[ids[i]]) {
            seen[ids[i]] = 1;
            out[m++] = ids[i];
        }
    for (uint32_t i = 0; i < m; ++i) seen[out[i]] = 0;
    return m;
}

/* A decode call whose checksum is in flight (the layer-sync-free mode). */
typedef struct pending_t {
    uint64_t call;
    uint32_t layer, first, n;
    const uint32_t* served;
} pending_t;

#define MAX_PENDING 4096

static void verify(replay_result_t* out, uint64_t call, const uint64_t* want, const uint32_t* served,
                   const uint64_t* sums, uint32_t n) {
    for (uint32_t i = 0; i < n; ++i) {
        if (sums[i] != want[served[i]]) {
            out->checksum_errors++;
            if (out->first_bad_call == UINT64_MAX) out->first_bad_call = call;
        }
    }
    out->experts_checked += n;
}

/*
 * expected[layer * experts_per_layer + id] is the checksum of (layer, id).
 * layer_sync 1: wait for every layer's kernel before the next layer (as an engine
 * must when the next layer's ids come from this layer's output); 0: enqueue a
 * token's layers back to back and wait once per token (decode calls only).
 * mode: REPLAY_MODE_*, CACHE or SLAB with REPLAY_BY_SLOT for layers of any number of
 * parts (options then without split). Returns EXPCACHE_OK, or the first failing call's status (result
 * filled up to it).
 */
__attribute__((visibility("default"))) expcache_status_t expcache_replay(
    const replay_api_t* api, expcache_t* cache, const replay_call_t* calls, uint64_t num_calls, const uint32_t* ids,
    uint32_t mode, void* stream, const uint64_t* expected, uint32_t experts_per_layer, uint32_t max_classes,
    uint32_t layer_sync, const replay_options_t* options, replay_progress_fn progress, replay_result_t* out) {
    if (!api || api->struct_size != sizeof *api || !cache || !calls || !ids || !expected || !out)
        return EXPCACHE_ERR_INVALID_ARGUMENT;
    const int by_slot = (mode & REPLAY_BY_SLOT) != 0;
    mode &= ~(uint32_t)REPLAY_BY_SLOT;
    if (mode > REPLAY_MODE_SLAB || (by_slot && mode == REPLAY_MODE_NOCACHE)) return EXPCACHE_ERR_INVALID_ARGUMENT;
    if (options && (options->struct_size != sizeof *options || !layer_sync || mode != REPLAY_MODE_CACHE ||
                    (by_slot && options->split) ||
                    (options->advice != REPLAY_ADVICE_NONE &&
                     (!options->advice_offset || !options->advice_count || !options->advice_ids))))
        return EXPCACHE_ERR_INVALID_ARGUMENT;
    memset(out, 0, sizeof *out);
    out->first_bad_call = UINT64_MAX;
    uint32_t max_count = 1;
    for (uint64_t c = 0; c < num_calls; ++c)
        if (calls[c].count > max_count) max_count = calls[c].count;
    uint32_t* uniq = malloc(sizeof(uint32_t) * max_count);
    expcache_expert_ptrs_t* ptrs = malloc(sizeof(expcache_expert_ptrs_t) * 2 * max_count); /* 2x: split order */
    uint64_t* sums =
        malloc(sizeof(uint64_t) * (max_count > EXPCACHE_CHECKSUM_RESULTS ? max_count : EXPCACHE_CHECKSUM_RESULTS));
    uint8_t* seen = calloc(experts_per_layer, 1);
    pending_t* pending = malloc(sizeof(pending_t) * MAX_PENDING);
    int32_t* rows = malloc(sizeof(int32_t) * max_count); /* REPLAY_BY_SLOT: the served experts' bank rows */
    uint32_t num_pending = 0, slots = 0;
    double token_t0 = 0;
    expcache_status_t s = EXPCACHE_OK;
    uint64_t moved = bytes_h2d(api, cache, max_classes);
    if (!uniq || !ptrs || !sums || !seen || !pending || !rows) {
        s = EXPCACHE_ERR_OUT_OF_HOST_MEMORY;
        goto done;
    }
    for (uint64_t c = 0; c < num_calls; ++c) {
        const replay_call_t* call = &calls[c];
        const uint32_t* cid = ids + call->offset;
        const uint32_t* served = cid;
        uint32_t n = call->count;
        uint64_t batch = 0;
        int have_batch = 0;
        double t0 = now_s();
        if (call->kind == REPLAY_DECODE && !layer_sync) {
            /* Enqueue: serve, checksum into the next result slots; wait once at the token's end. */
            if (num_pending == 0) token_t0 = t0;
            if (by_slot)
                s = api->select_slots_async(cache, call->layer, cid, 32, n, rows, stream);
            else if (mode == REPLAY_MODE_NOCACHE)
                s = load_compact(api, cache, call->layer, cid, n, stream, ptrs);
            else
                s = api->select_async(cache, call->layer, cid, n, stream, ptrs);
            out->decode_serve_seconds += now_s() - t0;
            out->decode_calls++;
            if (s == EXPCACHE_OK)
                s = by_slot ? checksum_slots_async(api, cache, call->layer, rows, n, stream, slots)
                            : api->checksum_async(cache, call->layer, ptrs, n, stream, slots);
            if (s != EXPCACHE_OK) goto done;
            pending[num_pending++] = (pending_t){c, call->layer, slots, n, cid};
            slots += n;
            const replay_call_t* next = c + 1 < num_calls ? &calls[c + 1] : NULL;
            int token_ends = !next || next->kind != REPLAY_DECODE || next->layer <= call->layer ||
                             num_pending == MAX_PENDING || slots + next->count > EXPCACHE_CHECKSUM_RESULTS;
            if (token_ends) {
                if ((s = api->synchronize(cache, stream)) != EXPCACHE_OK) goto done;
                out->decode_seconds += now_s() - token_t0;
                if ((s = api->checksum_results(cache, 0, slots, sums)) != EXPCACHE_OK) goto done;
                for (uint32_t p = 0; p < num_pending; ++p)
                    verify(out, pending[p].call, expected + (uint64_t)pending[p].layer * experts_per_layer,
                           pending[p].served, sums + pending[p].first, pending[p].n);
                uint64_t now_moved = bytes_h2d(api, cache, max_classes);
                out->decode_bytes_h2d += now_moved - moved;
                moved = now_moved;
                num_pending = slots = 0;
            }
            out->calls_done = c + 1;
            if (progress && ((c + 1) % 512 == 0 || c + 1 == num_calls) && progress(c + 1, num_calls)) {
                out->stopped = 1;
                goto done;
            }
            continue;
        }
        double served_s = 0;
        if (call->kind == REPLAY_DECODE && options) {
            /* One engine layer: advice, non-expert work, select, the experts' work. */
            uint32_t na = options->advice == REPLAY_ADVICE_NONE ? 0 : options->advice_count[c];
            const uint32_t* advice = na ? options->advice_ids + options->advice_offset[c] : NULL;
            if (na && options->advice == REPLAY_ADVICE_PREFETCH)
                s = api->prefetch_async(cache, call->layer, advice, na, stream, NULL);
            else if (na)
                s = api->hint(cache, call->layer, advice, na);
            if (s == EXPCACHE_OK && options->compute_ns) {
                s = api->spin_async(cache, stream, options->compute_ns);
                if (s == EXPCACHE_OK) s = api->synchronize(cache, stream);
            }
            const double ts = now_s();
            if (s == EXPCACHE_OK && options->split) {
                /* The hits' checksum into the first result slots at once, the misses' after their event:
                   ordered[] lists the ids' pointers hits first, served[] their ids in that order. */
                uint8_t resident[EXPCACHE_MAX_SELECT];
                void* ready = NULL;
                expcache_expert_ptrs_t* ordered = ptrs + n;
                s = api->select_split_async(cache, call->layer, cid, n, stream, ptrs, resident, &ready);
                served_s = now_s() - ts;
                uint32_t nh = 0;
                for (int pass = 1; s == EXPCACHE_OK && pass >= 0; --pass)
                    for (uint32_t i = 0; i < n; ++i)
                        if (resident[i] == pass) {
                            ordered[nh] = ptrs[i];
                            uniq[nh++] = cid[i];
                        }
                uint32_t hits = 0;
                for (uint32_t i = 0; i < n; ++i) hits += resident[i] ? 1 : 0;
                served = uniq;
                if (s == EXPCACHE_OK && hits) s = api->checksum_async(cache, call->layer, ordered, hits, stream, 0);
                if (s == EXPCACHE_OK && hits < n) s = api->ready_wait_async(cache, ready, stream);
                if (s == EXPCACHE_OK && hits < n)
                    s = api->checksum_async(cache, call->layer, ordered + hits, n - hits, stream, hits);
                if (s == EXPCACHE_OK) s = api->synchronize(cache, stream);
                if (s == EXPCACHE_OK) s = api->checksum_results(cache, 0, n, sums);
            } else if (s == EXPCACHE_OK && by_slot) {
                s = api->select_slots_async(cache, call->layer, cid, 32, n, rows, stream);
                served_s = now_s() - ts;
                if (s == EXPCACHE_OK) s = checksum_slots(api, cache, call->layer, rows, n, stream, sums);
            } else if (s == EXPCACHE_OK) {
                s = api->select_async(cache, call->layer, cid, n, stream, ptrs);
                served_s = now_s() - ts;
                if (s == EXPCACHE_OK) s = api->checksum(cache, call->layer, ptrs, n, stream, sums);
            }
        } else {
            if (call->kind == REPLAY_DECODE && by_slot) {
                s = api->select_slots_async(cache, call->layer, cid, 32, n, rows, stream);
            } else if (by_slot) {
                if (mode == REPLAY_MODE_SLAB) s = api->release_all(cache);
                if (s == EXPCACHE_OK)
                    s = api->batch_prepare_slots_async(cache, call->layer, cid, 32, n, stream, uniq, rows, &n, &batch);
                served = uniq;
                have_batch = s == EXPCACHE_OK;
            } else if (call->kind == REPLAY_DECODE) {
                if (mode == REPLAY_MODE_NOCACHE) {
                    s = load_compact(api, cache, call->layer, cid, n, stream, ptrs);
                } else {
                    s = api->select_async(cache, call->layer, cid, n, stream, ptrs);
                }
            } else {
                if (mode == REPLAY_MODE_SLAB) s = api->release_all(cache);
                if (s == EXPCACHE_OK && mode == REPLAY_MODE_NOCACHE) {
                    n = dedupe(cid, n, seen, uniq);
                    served = uniq;
                    s = load_compact(api, cache, call->layer, uniq, n, stream, ptrs);
                } else if (s == EXPCACHE_OK) {
                    s = api->batch_prepare_async(cache, call->layer, cid, n, stream, uniq, ptrs, &n, &batch);
                    served = uniq;
                    have_batch = s == EXPCACHE_OK;
                }
            }
            served_s = now_s() - t0;
            if (s == EXPCACHE_OK)
                s = by_slot ? checksum_slots(api, cache, call->layer, rows, n, stream, sums)
                            : api->checksum(cache, call->layer, ptrs, n, stream, sums);
            if (have_batch) {
                expcache_status_t f = api->batch_finish(cache, batch, stream);
                if (s == EXPCACHE_OK) s = f;
            }
        }
        /* With options, the advice and the non-expert work count in the layer's time. */
        double dt = now_s() - t0;
        if (s != EXPCACHE_OK) goto done;
        uint64_t now_moved = bytes_h2d(api, cache, max_classes);
        if (call->kind == REPLAY_DECODE) {
            out->decode_seconds += dt;
            out->decode_serve_seconds += served_s;
            out->decode_calls++;
            out->decode_bytes_h2d += now_moved - moved;
        } else {
            out->prefill_seconds += dt;
            out->prefill_bytes_h2d += now_moved - moved;
        }
        moved = now_moved;
        verify(out, c, expected + (uint64_t)call->layer * experts_per_layer, served, sums, n);
        out->calls_done = c + 1;
        if (progress && ((c + 1) % 512 == 0 || c + 1 == num_calls) && progress(c + 1, num_calls)) {
            out->stopped = 1;
            break;
        }
    }
done:
    free(uniq);
    free(ptrs);
    free(sums);
    free(seen);
    free(pending);
    free(rows);
    return s;
}

/*
 * Several devices: each decode call's ids are split by owner (owners[layer *
 * experts_per_layer + id], an index into devs), every owner's select is
 * enqueued on its own stream, then every owner's checksum, then the layer waits
 * for all of them, so the owners' links move their misses at the same time.
 * Decode calls only, one wait per layer. call_bytes (may be NULL): per call and
 * device, the host-to-device bytes that device moved for it
 * (call_bytes[call * num_devs + d], read outside the timed region).
 */
typedef struct replay_device_t {
    expcache_t* cache;
    void* stream;
    uint32_t max_classes;
    uint32_t reserved;
} replay_device_t;

#define REPLAY_MAX_DEVICES 64

__attribute__((visibility("default"))) expcache_status_t expcache_replay_devices(
    const replay_api_t* api, const replay_device_t* devs, uint32_t num_devs, const uint8_t* owners,
    const replay_call_t* calls, uint64_t num_calls, const uint32_t* ids, const uint64_t* expected,
    uint32_t experts_per_layer, replay_progress_fn progress, uint64_t* call_bytes, replay_result_t* out) {
    if (!api || api->struct_size != sizeof *api || !devs || num_devs == 0 || num_devs > REPLAY_MAX_DEVICES || !owners ||
        !calls || !ids || !expected || !out)
        return EXPCACHE_ERR_INVALID_ARGUMENT;
    for (uint32_t d = 0; d < num_devs; ++d)
        if (!devs[d].cache) return EXPCACHE_ERR_INVALID_ARGUMENT;
    for (uint64_t c = 0; c < num_calls; ++c)
        if (calls[c].kind != REPLAY_DECODE || calls[c].count == 0 || calls[c].count > EXPCACHE_MAX_SELECT)
            return EXPCACHE_ERR_INVALID_ARGUMENT;
    memset(out, 0, sizeof *out);
    out->first_bad_call = UINT64_MAX;
    uint32_t (*sub)[EXPCACHE_MAX_SELECT] = malloc(sizeof *sub * num_devs); /* each device's ids of a call */
    uint32_t cnt[REPLAY_MAX_DEVICES];
    if (!sub) return EXPCACHE_ERR_OUT_OF_HOST_MEMORY;
    expcache_expert_ptrs_t ptrs[EXPCACHE_MAX_SELECT];
    uint64_t sums[EXPCACHE_MAX_SELECT];
    uint64_t moved[REPLAY_MAX_DEVICES];
    expcache_status_t s = EXPCACHE_OK;
    for (uint32_t d = 0; d < num_devs; ++d) moved[d] = bytes_h2d(api, devs[d].cache, devs[d].max_classes);
    for (uint64_t c = 0; c < num_calls; ++c) {
        const replay_call_t* call = &calls[c];
        const uint32_t* cid = ids + call->offset;
        const uint8_t* own = owners + (uint64_t)call->layer * experts_per_layer;
        memset(cnt, 0, sizeof(uint32_t) * num_devs);
        for (uint32_t i = 0; i < call->count; ++i) {
            if (cid[i] >= experts_per_layer || own[cid[i]] >= num_devs) {
                free(sub);
                return EXPCACHE_ERR_INVALID_ARGUMENT;
            }
            uint32_t d = own[cid[i]];
            sub[d][cnt[d]++] = cid[i];
        }
        double t0 = now_s();
        /* Each owner's select, then its checksum into its own result area: all enqueued first. */
        for (uint32_t d = 0; s == EXPCACHE_OK && d < num_devs; ++d) {
            if (!cnt[d]) continue;
            s = api->select_async(devs[d].cache, call->layer, sub[d], cnt[d], devs[d].stream, ptrs);
            if (s == EXPCACHE_OK) s = api->checksum_async(devs[d].cache, call->layer, ptrs, cnt[d], devs[d].stream, 0);
        }
        for (uint32_t d = 0; s == EXPCACHE_OK && d < num_devs; ++d)
            if (cnt[d]) s = api->synchronize(devs[d].cache, devs[d].stream);
        const double dt = now_s() - t0;
        if (s != EXPCACHE_OK) break;
        out->decode_seconds += dt;
        out->decode_calls++;
        for (uint32_t d = 0; d < num_devs; ++d) {
            uint64_t now_moved = bytes_h2d(api, devs[d].cache, devs[d].max_classes);
            if (call_bytes) call_bytes[c * num_devs + d] = now_moved - moved[d];
            out->decode_bytes_h2d += now_moved - moved[d];
            moved[d] = now_moved;
            if (!cnt[d]) continue;
            if ((s = api->checksum_results(devs[d].cache, 0, cnt[d], sums)) != EXPCACHE_OK) break;
            verify(out, c, expected + (uint64_t)call->layer * experts_per_layer, sub[d], sums, cnt[d]);
        }
        if (s != EXPCACHE_OK) break;
        out->calls_done = c + 1;
        if (progress && ((c + 1) % 512 == 0 || c + 1 == num_calls) && progress(c + 1, num_calls)) {
            out->stopped = 1;
            break;
        }
    }
    free(sub);
    return s;
}
