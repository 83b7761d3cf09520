/*
 * select.c — expcache_select_async: addresses hold the experts' bytes until the next call that
 * invalidates them, hits stay resident, the decode counters move by the call, and the overflow
 * staging buffer is accounted for (also after failures).
 */
#include "stress.h"

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
    if (db == other + alt)
        *cap = alt;
    else if (db != other + *cap)
        diverge("after a failed call device_bytes_in_use is %" PRIu64 "; with the %s buffer at %" PRIu64 " or %" PRIu64
                " B it would be %" PRIu64 " or %" PRIu64,
                db, what, *cap, alt, other + *cap, other + alt);
}

void op_select(Model* m) {
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
        if (s == CUDA) {                   /* a copy failed: the overflow buffer may have been replaced first */
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
