/*
 * layers.c — layers: source bytes in memory (tensor or expert-major arrangement) or in a file,
 * the descriptor, expcache_layer_register with good and bad descriptors.
 */
#include "stress.h"

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
    L->pinned =
        pct(20) ? EXPCACHE_SOURCE_PINNED : EXPCACHE_SOURCE_PAGEABLE; /* host backend: pinned is a plain memcpy, pageable
                                                                        goes through the staging ring */
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
        if (as_file)
            L->file_bytes = lead + size + below(100);
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

void fill_desc(const Layer* L, expcache_layer_desc_t* d) {
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

void op_register(Model* m) {
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
            case 0:
                dp = NULL;
                what = "desc NULL";
                break;
            case 1:
                d.struct_size = pct(50) ? 0 : (uint32_t)sizeof d + 8;
                what = "struct_size";
                break;
            case 2:
                d.num_experts = pct(50) ? 0 : EXPCACHE_MAX_EXPERTS_LIMIT + 1;
                what = "num_experts";
                break;
            case 3:
                d.source_kind = EXPCACHE_SOURCE_FILE + 1 + (uint32_t)below(5);
                what = "source_kind";
                break;
            case 4:
                if (L->from_file)
                    d.file = m->nfiles + (uint32_t)below(3), what = "file not opened";
                else
                    d.file = 1 + (uint32_t)below(3), what = "file not 0 for a memory source";
                break;
            case 5:
                *bytes[p] = pct(50) ? 0 : ((uint64_t)1 << 40) + 1;
                what = "part bytes";
                break;
            case 6:
                *stride[p] = *bytes[p] - 1;
                what = "stride < bytes";
                break;
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
            case 9:
                layer = m->num_layers + (uint32_t)below(5);
                what = "layer out of range";
                break;
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
            case 11:
                layer = UINT32_MAX;
                what = "layer UINT32_MAX";
                break;
            default:
                d.source_kind = EXPCACHE_SOURCE_FILE;
                d.file = m->nfiles + (uint32_t)below(1000);
                what = "file id never opened";
                break;
        }
        s = expcache_layer_register(m->h, layer, dp);
        expect_bad("expcache_layer_register", s, IA, what);
        trace("register_layer %u bad (%s): %s", layer, what, sname(s));
        if (s == OK && layer == l)
            L->registered = 1; /* refused nothing: keep the model in step */
        else
            free_layer(L), L->key = key, L->num_experts = n;
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
    if (s == OK)
        L->registered = 1;
    else
        free_layer(L), L->key = key, L->num_experts = n;
    check_invariants(m, 0, 0);
}
