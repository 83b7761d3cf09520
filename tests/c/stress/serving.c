/*
 * serving.c — what the serving calls (select.c, compact.c, batch.c) share: a layer and ids to
 * ask for, their unique ids and residency before the call, the layer's class, the statuses a
 * valid call may return.
 */
#include "stress.h"

/* The unique ids of the current call, and whether each was resident before it. */
uint32_t g_u[MAX_SERVE_IDS];
signed char g_pre[MAX_SERVE_IDS];

void* rand_stream(void) {
    static const uintptr_t streams[] = {0, 0, 0, 0x1000, 0x2000};
    return (void*)streams[below(5)];
}

/* A registered layer, or -1. */
int pick_layer(Model* m) {
    uint32_t regs[MAX_LAYERS], n = 0;
    for (uint32_t l = 0; l < m->num_layers; ++l)
        if (m->layers[l].registered) regs[n++] = l;
    return n ? (int)regs[below(n)] : -1;
}

void gen_ids(const Layer* L, uint32_t* ids, uint64_t n) {
    uint32_t ne = L->num_experts;
    uint32_t hot = ne < 8 ? ne : (uint32_t)between(2, ne / 2 + 1);
    uint32_t off = (uint32_t)below(ne);
    for (uint64_t i = 0; i < n; ++i) ids[i] = pct(70) ? (off + (uint32_t)below(hot)) % ne : (uint32_t)below(ne);
}

/* Unique ids in first-appearance order; returns the count. */
uint32_t uniq(Model* m, uint32_t layer, const uint32_t* ids, uint64_t n, uint32_t* out) {
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

int layer_class_of(Model* m, uint32_t layer, uint32_t* out) {
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

/* Statuses a valid serving call may return: OK, INVALID_STATE (no class index free), OUT_OF_DEVICE_MEMORY,
 * and CUDA only while injected copy or staging failures may still fire (the host backend has no CUDA
 * otherwise). */
uint32_t serving_statuses(const Model* m) {
    return ST(OK) | ST(IS) | ST(OOM) | (m->copy_faults_left || m->staging_faults_left ? ST(CUDA) : 0);
}
