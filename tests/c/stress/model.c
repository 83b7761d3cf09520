/*
 * model.c — the reference model: one Model per live cache (its layers' source bytes, the
 * addresses it handed out and how long each stays valid, outstanding batches, the staging it
 * made, a stats snapshot), and the read-back of device bytes and resident experts against it.
 */
#include "stress.h"

Model g_models[MAX_CACHES];
static unsigned char* g_scratch; /* read-back buffer */
static uint64_t g_scratch_bytes;

static const char* kPart[3] = {"gate", "up", "down"};

void fill_part(unsigned char* dst, uint64_t n, uint64_t serial, uint32_t layer, uint32_t e, int p) {
    uint64_t s = mix64(serial * 0x100000001B3ull ^ ((uint64_t)layer << 48) ^ ((uint64_t)e << 8) ^ (uint64_t)p);
    for (uint64_t i = 0; i < n; ++i) {
        if ((i & 7) == 0) s = mix64(s + i + 1);
        dst[i] = (unsigned char)(s >> ((i & 7) * 8));
    }
}

static unsigned char* scratch(uint64_t n) {
    if (n > g_scratch_bytes) {
        free(g_scratch);
        g_scratch_bytes = n * 2;
        g_scratch = (unsigned char*)xmalloc(g_scratch_bytes);
    }
    return g_scratch;
}

/* Read `n` bytes at device address `dev` and compare them with `want`. */
int verify_range(Model* m, const void* dev, const unsigned char* want, uint64_t n, const char* what, uint32_t layer,
                 uint32_t e, int part) {
    unsigned char* buf = scratch(n);
    expcache_status_t s = expcache_testing_read_device(m->h, dev, buf, n);
    check_status("expcache_testing_read_device", s, ST(OK) | ST(IA));
    if (s != OK) {
        diverge("%s: layer %u expert %u %s at %p (+%" PRIu64 " B) is not readable: %s", what, layer, e, kPart[part],
                dev, n, expcache_last_error());
        return 0;
    }
    if (memcmp(buf, want, n) != 0) {
        uint64_t i = 0;
        while (i < n && buf[i] == want[i]) ++i;
        diverge("%s: layer %u expert %u %s at %p holds wrong bytes (first at offset %" PRIu64 " of %" PRIu64
                ": 0x%02x, want 0x%02x)",
                what, layer, e, kPart[part], dev, i, n, buf[i], want[i]);
        return 0;
    }
    g_verified_bytes += n;
    return 1;
}

int verify_expert(Model* m, uint32_t layer, uint32_t e, const expcache_expert_ptrs_t* p, const char* what) {
    const Layer* L = &m->layers[layer];
    void* parts[3] = {p->gate, p->up, p->down};
    for (int q = 0; q < 3; ++q)
        if (!verify_range(m, parts[q], source(L, q, e), L->bytes[q], what, layer, e, q)) return 0;
    return 1;
}

/* read_resident: 1 resident (bytes checked), 0 not, -1 error. */
int resident(Model* m, uint32_t layer, uint32_t e) {
    const Layer* L = &m->layers[layer];
    uint64_t eb = expert_bytes(L);
    unsigned char* dst = (unsigned char*)xmalloc(eb); /* exact size: ASan catches an overrun */
    uint32_t r = 0xA5A5A5A5u;
    expcache_status_t s = expcache_testing_read_resident(m->h, layer, e, dst, eb, &r);
    check_status("expcache_testing_read_resident", s, ST(OK));
    int out = -1;
    if (s != OK) {
        diverge("read_resident(layer %u, expert %u) failed: %s", layer, e, expcache_last_error());
    } else if (r == 1) {
        const unsigned char* d = dst;
        out = 1;
        for (int q = 0; q < 3; ++q) {
            if (memcmp(d, source(L, q, e), L->bytes[q]) != 0) {
                diverge("resident expert (layer %u, expert %u) %s holds wrong bytes", layer, e, kPart[q]);
                out = -1;
                break;
            }
            d += L->bytes[q];
        }
        if (out == 1) g_verified_bytes += eb;
    } else if (r == 0) {
        out = 0;
    } else {
        diverge("read_resident(layer %u, expert %u) set *out_resident to %u", layer, e, r);
    }
    free(dst);
    return out;
}

void mark_clear(Model* m) {
    if (++m->stamp == 0) {
        for (uint32_t l = 0; l < m->num_layers; ++l)
            if (m->layers[l].mark) memset(m->layers[l].mark, 0, m->layers[l].num_experts * sizeof(uint32_t));
        m->stamp = 1;
    }
}

void free_layer(Layer* L) {
    for (int i = 0; i < L->nbufs; ++i) free(L->bufs[i]);
    free(L->mark);
    memset(L, 0, sizeof *L);
}

void drop_batch(Model* m, int b) {
    Batch* B = &m->batches[b];
    free(B->ids);
    free(B->ptrs);
    free(B->held);
    m->batches[b] = m->batches[--m->nbatches];
}

void forget_model(Model* m) {
    while (m->nbatches) drop_batch(m, m->nbatches - 1);
    for (int l = 0; l < MAX_LAYERS; ++l) free_layer(&m->layers[l]);
    m->live = 0;
}

void free_scratch(void) {
    free(g_scratch);
}
