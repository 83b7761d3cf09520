/*
 * batch.c — batches: expcache_batch_prepare_async and, a third of the time, its slot-id twin
 * expcache_batch_prepare_slots_async (unique ids in first-appearance order, held experts stay
 * resident, nothing evicted, the batch counters; by slot id every row inside the bank, the staged
 * experts in its batch rows, whose memory the class's staging_bytes counts),
 * expcache_batch_finish (known and unknown ids), and filling every batch slot.
 */
#include "stress.h"

/* expcache_batch_prepare_slots_async with int32 or int64 ids, its rows turned into the addresses
   the pointer form gives (base + row * stride + each part's offset). A failed call must leave
   out_ptrs untouched (they are filled here only on success). */
static expcache_status_t prepare_by_slots(Model* m, uint32_t layer, const uint32_t* ids, uint64_t n, void* stream,
                                          uint32_t* out_ids, expcache_expert_ptrs_t* out_ptrs, uint32_t* count,
                                          uint64_t* id) {
    int32_t* slots = (int32_t*)xmalloc(sizeof(int32_t) * n);
    const int wide = pct(50);
    int64_t* ids64 = wide ? (int64_t*)xmalloc(sizeof(int64_t) * n) : NULL;
    for (uint64_t i = 0; wide && i < n; ++i) ids64[i] = ids[i];
    expcache_status_t s = expcache_batch_prepare_slots_async(m->h, layer, wide ? (const void*)ids64 : (const void*)ids,
                                                             wide ? 64 : 32, n, stream, out_ids, slots, count, id);
    uint32_t c = 0;
    expcache_bank_t b;
    b.struct_size = sizeof b;
    if (s == OK && layer_class_of(m, layer, &c) && expcache_class_bank_get(m->h, c, &b) == OK) {
        for (uint32_t j = 0; j < *count && j < n; ++j) {
            if (slots[j] < 0 || (uint64_t)slots[j] >= b.rows) {
                diverge("batch_prepare_slots gave id %u row %d, outside the bank's %" PRIu64 " rows", out_ids[j],
                        slots[j], b.rows);
                break;
            }
            unsigned char* row = (unsigned char*)b.base + (uint64_t)slots[j] * b.slot_stride;
            out_ptrs[j].gate = row + b.gate_offset;
            out_ptrs[j].up = row + b.up_offset;
            out_ptrs[j].down = row + b.down_offset;
        }
    } else if (s == OK) {
        diverge("batch_prepare_slots on layer %u succeeded but its class's bank cannot be read", layer);
    }
    free(slots);
    free(ids64);
    return s;
}

void op_batch_prepare(Model* m, int quiet, uint64_t max_n) {
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
    const int by_slots = pct(33);
    expcache_status_t s =
        by_slots ? prepare_by_slots(m, layer, ids, n, rand_stream(), out_ids, out_ptrs, &count, &id)
                 : expcache_batch_prepare_async(m->h, layer, ids, n, rand_stream(), out_ids, out_ptrs, &count, &id);
    check_status(by_slots ? "expcache_batch_prepare_slots_async" : "expcache_batch_prepare_async", s,
                 serving_statuses(m));
    consumed_copy_fault(m, s);
    if (!quiet || s != OK)
        trace("batch_prepare layer %u n %" PRIu64 " (%u unique, %u resident; %d outstanding): %s id %" PRIu64, layer, n,
              u, pre_res, m->nbatches, sname(s), s == OK ? id : 0);
    /* By slot id, an INVALID_STATE may also say the open batches took the class's batch rows. */
    const int rows_full = by_slots && s == IS && strstr(expcache_last_error(), "batch rows") != NULL;
    if (want_is != (s == IS) && !rows_full)
        diverge("batch_prepare on layer %u returned %s with %d batches outstanding; the class infos say binding %s",
                layer, sname(s), m->nbatches, bind_fails(m, layer) ? "must fail" : "is possible");
    if (s != OK) {
        for (uint64_t i = 0; i < n; ++i)
            if (out_ids[i] != 0xA5A5A5A5u) {
                diverge("failed batch_prepare wrote out_ids[%" PRIu64 "]", i);
                break;
            }
        if (count != 0xA5A5A5A5u || id != 0xA5A5A5A5A5A5A5A5ull)
            diverge("failed batch_prepare wrote out_count/out_batch");
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
        /* A batch by slot id stages in its class's batch rows: class_info's staging_bytes counts them. */
        B->staging = by_slots ? 0 : (uint64_t)(count - held) * slot_bytes_of(L->bytes);
        B->rows = by_slots ? count - held : 0;
    } else {
        diverge("batch_prepare succeeded with %d batches outstanding", m->nbatches);
        free(heldv);
    }
    free(ids);
    free(out_ids);
    free(out_ptrs);
    check_invariants(m, pct(10), 0);
}

void op_batch_finish(Model* m) {
    g_cur_op = "batch_finish";
    expcache_status_t s;
    if (m->nbatches == 0 || pct(10)) {
        uint64_t id = pct(50) && m->nfinished ? m->finished[below((uint64_t)m->nfinished)]
                      : pct(50)               ? 0
                                              : rnd() | ((uint64_t)1 << 62);
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
    if (m->nfinished < MAX_FINISHED)
        m->finished[m->nfinished++] = id;
    else
        m->finished[below(MAX_FINISHED)] = id;
    check_invariants(m, pct(5), 0);
}

/* Fill up to EXPCACHE_MAX_BATCHES outstanding batches, then one more must be refused. */
void op_fill_batches(Model* m) {
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
