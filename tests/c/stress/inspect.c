/*
 * inspect.c — inspection and test hooks: layer_bind_class, read_resident, read_device and
 * checksum against the sources, struct sizes, the version, status strings, out-pointers NULL.
 */
#include "stress.h"

void op_layer_class(Model* m) {
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
        if (want_is != (s == IS))
            diverge("layer_class(%u) returned %s, predicted %s", layer, sname(s), want_is ? "INVALID_STATE" : "OK");
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

void op_read_resident(Model* m) {
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

void op_read_device(Model* m) {
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

void op_checksum(Model* m) {
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
            case 0:
                s = expcache_testing_checksum(m->h, layer, ptrs, 0, NULL, sums);
                expect_bad("expcache_testing_checksum", s, IA, "n 0");
                break;
            case 1:
                s = expcache_testing_checksum(m->h, layer, NULL, 1, NULL, sums);
                expect_bad("expcache_testing_checksum", s, IA, "ptrs NULL");
                break;
            case 2:
                s = expcache_testing_checksum(m->h, layer, ptrs, 1, NULL, NULL);
                expect_bad("expcache_testing_checksum", s, IA, "out_sums NULL");
                break;
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

void op_misc(Model* m) {
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
        [EXPCACHE_STRUCT_BANK] = sizeof(expcache_bank_t),
        [EXPCACHE_STRUCT_POOL_STATS] = sizeof(expcache_pool_stats_t),
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
