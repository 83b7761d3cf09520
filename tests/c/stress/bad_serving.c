/*
 * bad_serving.c — bad input to the serving calls: each is refused and none changes anything.
 */
#include "stress.h"

/* Bad input to the serving calls: none may change anything. */
void op_bad_serving(Model* m) {
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
        case 0:
            s = expcache_select_async(m->h, layer, ids, 0, NULL, out);
            expect_bad("expcache_select_async", s, IA, "k 0");
            break;
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
