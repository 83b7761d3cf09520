/*
 * compact.c — expcache_compact_load_async: the compact buffer's layout and bytes, the compact
 * counters, residency unchanged, the buffer's device bytes (also after failures).
 */
#include "stress.h"

void op_compact(Model* m) {
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
                if (m->info[c].in_use && !class_busy(m, c) && m->info[c].allocated_experts)
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
