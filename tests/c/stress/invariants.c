/*
 * invariants.c — what holds after every operation: class infos agree with the registered
 * layers and the held experts, device bytes are the slots plus the staging the calls made (never
 * over capacity, never into the reserve), handed-out addresses hold their bytes while valid, and
 * (deep) every resident expert holds its source bytes.
 */
#include "stress.h"

/* Light invariants after every op; `deep` adds a residency sweep of every layer. */
void check_invariants(Model* m, int deep, int exact_stats) {
    if (!m->live) return;
    uint64_t db = 0xA5A5A5A5A5A5A5A5ull;
    expcache_status_t s = expcache_testing_device_bytes_in_use(m->h, &db);
    check_status("expcache_testing_device_bytes_in_use", s, ST(OK));
    uint32_t cc = 0xA5A5u;
    s = expcache_class_count_get(m->h, &cc);
    check_status("expcache_class_count_get", s, ST(OK));
    uint32_t in_use = 0;
    uint64_t slots_bytes = 0, rows_bytes = 0, resident_total = 0;
    for (uint32_t c = 0; c < m->max_classes; ++c) {
        expcache_class_info_t ci;
        memset(&ci, 0xA5, sizeof ci);
        ci.struct_size = sizeof ci;
        s = expcache_class_info_get(m->h, c, &ci);
        check_status("expcache_class_info_get", s, ST(OK));
        if (s != OK) continue;
        m->info[c] = ci;
        if (ci.struct_size != sizeof ci) diverge("class_info wrote struct_size %u", ci.struct_size);
        if (ci.in_use > 1) diverge("class %u in_use is %u", c, ci.in_use);
        if (!ci.in_use) {
            if (ci.allocated_experts || ci.resident_experts || ci.held_experts)
                diverge("empty class index %u reports %" PRIu64 " allocated, %" PRIu64 " resident, %" PRIu64 " held", c,
                        ci.allocated_experts, ci.resident_experts, ci.held_experts);
            continue;
        }
        in_use++;
        uint64_t key[3] = {ci.gate_bytes, ci.up_bytes, ci.down_bytes};
        uint64_t experts = 0, layers = 0;
        for (uint32_t l = 0; l < m->num_layers; ++l) {
            const Layer* L = &m->layers[l];
            if (L->registered && key_eq(key, L->bytes[0], L->bytes[1], L->bytes[2])) {
                experts += L->num_experts;
                layers++;
            }
        }
        if (!layers)
            diverge("class %u has key (%" PRIu64 ", %" PRIu64 ", %" PRIu64 ") of no registered layer", c, key[0],
                    key[1], key[2]);
        if (ci.slot_bytes != slot_bytes_of(key))
            diverge("class %u slot_bytes %" PRIu64 ", want %" PRIu64, c, ci.slot_bytes, slot_bytes_of(key));
        if (!(ci.held_experts <= ci.resident_experts && ci.resident_experts <= ci.allocated_experts))
            diverge("class %u: held %" PRIu64 " <= resident %" PRIu64 " <= allocated %" PRIu64 " does not hold", c,
                    ci.held_experts, ci.resident_experts, ci.allocated_experts);
        if (ci.allocated_experts > experts)
            diverge("class %u allocated %" PRIu64 " slots for %" PRIu64 " experts", c, ci.allocated_experts, experts);
        if (m->budget_experts && ci.allocated_experts > m->budget_experts)
            diverge("class %u allocated %" PRIu64 " slots, budget_experts is %" PRIu64, c, ci.allocated_experts,
                    m->budget_experts);
        if (ci.num_layers > layers)
            diverge("class %u reports %" PRIu64 " layers bound, only %" PRIu64 " registered layers have its key", c,
                    ci.num_layers, layers);
        for (uint32_t o = 0; o < c; ++o)
            if (m->info[o].in_use && key_eq(key, m->info[o].gate_bytes, m->info[o].up_bytes, m->info[o].down_bytes))
                diverge("class indices %u and %u have the same key", o, c);
        slots_bytes += ci.allocated_experts * ci.slot_bytes;
        rows_bytes += ci.staging_bytes;
        if (ci.staging_bytes % ci.slot_bytes ||
            ci.staging_bytes / ci.slot_bytes > EXPCACHE_MAX_SELECT + EXPCACHE_MAX_BATCH_ROWS)
            diverge("class %u maps %" PRIu64 " B of staging and batch rows: not a whole number of its %" PRIu64
                    " B slots up to %d",
                    c, ci.staging_bytes, ci.slot_bytes, EXPCACHE_MAX_SELECT + EXPCACHE_MAX_BATCH_ROWS);
        resident_total += ci.resident_experts;
    }
    if (in_use != cc) diverge("class_count %u, but %u class infos are in use", cc, in_use);

    /* Device memory: the slots plus the staging the calls made; never over capacity; reserve untouched. */
    uint64_t staging = m->compact_cap;
    for (int b = 0; b < m->nbatches; ++b) staging += m->batches[b].staging;
    if (db != slots_bytes + rows_bytes + staging)
        diverge("device_bytes_in_use %" PRIu64 " != slots %" PRIu64 " + staging rows %" PRIu64 " + compact %" PRIu64
                " + batch staging %" PRIu64 " (a leak or lost accounting)",
                db, slots_bytes, rows_bytes, m->compact_cap, staging - m->compact_cap);
    if (db > m->capacity) diverge("device_bytes_in_use %" PRIu64 " > capacity %" PRIu64, db, m->capacity);
    uint64_t growable = m->capacity > m->reserve ? m->capacity - m->reserve : 0;
    if (slots_bytes > growable)
        diverge("expert caches hold %" PRIu64 " B, more than capacity %" PRIu64 " - reserve %" PRIu64, slots_bytes,
                m->capacity, m->reserve);

    /* Held slots: per class, the distinct experts held by outstanding batches. */
    for (uint32_t c = 0; c < m->max_classes; ++c) {
        if (!m->info[c].in_use) continue;
        mark_clear(m);
        uint64_t held = 0;
        for (int b = 0; b < m->nbatches; ++b) {
            Batch* B = &m->batches[b];
            if (B->cls != c) continue;
            Layer* L = &m->layers[B->layer];
            for (uint32_t j = 0; j < B->count; ++j)
                if (B->held[j] && L->mark[B->ids[j]] != m->stamp) {
                    L->mark[B->ids[j]] = m->stamp;
                    held++;
                }
        }
        if (held != m->info[c].held_experts)
            diverge("class %u reports %" PRIu64 " held experts, outstanding batches hold %" PRIu64, c,
                    m->info[c].held_experts, held);
    }
    if (m->nbatches == 0)
        for (uint32_t c = 0; c < m->max_classes; ++c)
            if (m->info[c].held_experts) diverge("class %u holds experts with no batch outstanding", c);

    check_stats(m, exact_stats);

    /* Addresses still valid. */
    if (m->sel_valid) {
        uint32_t n = m->sel_k, step = n > 32 ? n / 16 : 1;
        for (uint32_t i = (uint32_t)below(step); i < n; i += step)
            if (!verify_expert(m, m->sel_layer, m->sel_ids[i], &m->sel_ptrs[i], "select address (still valid)")) {
                m->sel_valid = 0; /* reported once */
                break;
            }
    }
    if (m->cmp_valid) {
        const expcache_compact_t* c = &m->cmp;
        uint32_t i = (uint32_t)below(m->cmp_n);
        unsigned char* b = (unsigned char*)c->base;
        expcache_expert_ptrs_t p = {b + c->gate_offset + i * c->gate_bytes, b + c->up_offset + i * c->up_bytes,
                                    b + c->down_offset + i * c->down_bytes};
        verify_expert(m, m->cmp_layer, m->cmp_ids[i], &p, "compact buffer (still valid)");
    }
    check_batches(m, deep);

    if (deep) {
        uint64_t total = 0;
        for (uint32_t l = 0; l < m->num_layers; ++l) {
            Layer* L = &m->layers[l];
            if (!L->registered) continue;
            for (uint32_t e = 0; e < L->num_experts; ++e) total += resident(m, l, e) == 1;
        }
        if (total != resident_total)
            diverge("read_resident finds %" PRIu64 " resident experts, class infos say %" PRIu64, total,
                    resident_total);
    }
}

/* Outstanding batches: addresses hold their bytes; held experts stay resident. */
void check_batches(Model* m, int all) {
    if (m->nbatches == 0) return;
    int from = all ? 0 : (int)below((uint64_t)m->nbatches), to = all ? m->nbatches : from + 1;
    for (int b = from; b < to; ++b) {
        Batch* B = &m->batches[b];
        for (uint32_t j = 0; j < B->count; ++j) {
            if (!verify_expert(m, B->layer, B->ids[j], &B->ptrs[j], "batch address (batch outstanding)")) break;
            if (B->held[j] && resident(m, B->layer, B->ids[j]) != 1)
                diverge("batch %" PRIu64 " holds (layer %u, expert %u), which is no longer resident", B->id, B->layer,
                        B->ids[j]);
        }
    }
}

/* Does a batch keep class c from a release or a reuse: it holds slots of it, or a batch by slot id
   staged in its batch rows? */
int class_busy(const Model* m, uint32_t c) {
    if (m->info[c].held_experts) return 1;
    for (int b = 0; b < m->nbatches; ++b)
        if (m->batches[b].cls == c && m->batches[b].rows > 0) return 1;
    return 0;
}

/* Would binding `layer` to a class fail (every index in use by another key, all kept by batches)? */
int bind_fails(Model* m, uint32_t layer) {
    const Layer* L = &m->layers[layer];
    for (uint32_t c = 0; c < m->max_classes; ++c) {
        const expcache_class_info_t* ci = &m->info[c];
        if (!ci->in_use) return 0;
        if (key_eq(L->bytes, ci->gate_bytes, ci->up_bytes, ci->down_bytes)) return 0;
        if (!class_busy(m, c)) return 0;
    }
    return 1;
}
