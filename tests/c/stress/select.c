/*
 * select.c — expcache_select_async (and expcache_select_slots_async): addresses hold the experts' bytes until the next
 * call that invalidates them, hits stay resident, the decode counters move by the call, and what got no slot was staged
 * in the class bank's staging rows (the memory they hold is checked with every invariant).
 */
#include "stress.h"

/* expcache_select_slots_async, its slots turned into the addresses select_async would give (the
   class's bank: base + slot * stride + each part's offset); a failed call must leave out_slots
   untouched, and out_ptrs then too. */
static expcache_status_t select_by_slots(Model* m, uint32_t layer, const uint32_t* ids, uint32_t k, void* stream,
                                         expcache_expert_ptrs_t* out) {
    int32_t* slots = (int32_t*)xmalloc(sizeof(int32_t) * k);
    memset(slots, 0xA5, sizeof(int32_t) * k);
    const int wide = pct(50);
    int64_t* ids64 = wide ? (int64_t*)xmalloc(sizeof(int64_t) * k) : NULL;
    for (uint32_t i = 0; wide && i < k; ++i) ids64[i] = ids[i];
    expcache_status_t s = expcache_select_slots_async(m->h, layer, wide ? (const void*)ids64 : (const void*)ids,
                                                      wide ? 64 : 32, k, slots, stream);
    if (s != OK) {
        for (uint32_t i = 0; i < k; ++i)
            if (slots[i] != (int32_t)0xA5A5A5A5) {
                diverge("failed select_slots wrote out_slots[%u]", i);
                break;
            }
    } else {
        uint32_t c = 0;
        expcache_bank_t b;
        b.struct_size = sizeof b;
        if (layer_class_of(m, layer, &c) && expcache_class_bank_get(m->h, c, &b) == OK) {
            for (uint32_t i = 0; i < k; ++i) {
                if (slots[i] < 0 || (uint64_t)slots[i] >= b.rows) {
                    diverge("select_slots gave id %u slot %d, outside the bank's %" PRIu64 " rows", ids[i], slots[i],
                            b.rows);
                    break;
                }
                unsigned char* row = (unsigned char*)b.base + (uint64_t)slots[i] * b.slot_stride;
                out[i].gate = row + b.gate_offset;
                out[i].up = row + b.up_offset;
                out[i].down = row + b.down_offset;
            }
        } else {
            diverge("select_slots on layer %u succeeded but its class's bank cannot be read", layer);
        }
    }
    free(slots);
    free(ids64);
    return s;
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
    /* Now and then by slot id (int32 or int64 ids): the slots' bank rows stand for the addresses. */
    const int by_slots = pct(30);
    expcache_status_t s = by_slots ? select_by_slots(m, layer, ids, k, stream, out)
                                   : expcache_select_async(m->h, layer, ids, k, stream, out);
    check_status(by_slots ? "expcache_select_slots_async" : "expcache_select_async", s, serving_statuses(m));
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
        /* What got no slot was staged in the bank's staging rows, which only grow until a release. */
        expcache_class_info_t ci;
        ci.struct_size = sizeof ci;
        uint64_t need = (uint64_t)(u - post_res) * slot_bytes_of(L->bytes);
        if (expcache_class_info_get(m->h, c, &ci) == OK && ci.staging_bytes < need)
            diverge("select staged %u experts of class %u, whose staging rows hold %" PRIu64 " B, less than %" PRIu64,
                    u - post_res, c, ci.staging_bytes, need);
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
