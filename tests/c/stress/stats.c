/*
 * stats.c — counters: never decreasing but after expcache_stats_reset, unchanged by calls that
 * should change nothing (each serving call checks its own deltas with DELTA), and reset to 0.
 */
#include "stress.h"

/* Compare stats with the snapshot: equal (exact) or never smaller; then take it as the new snapshot. */
#define STAT_FIELDS(X) \
    X(calls)           \
    X(hits)            \
    X(misses)          \
    X(evictions)       \
    X(appends)         \
    X(direct_loads)    \
    X(bytes_h2d)       \
    X(bytes_d2d)       \
    X(releases)        \
    X(alloc_retries)   \
    X(cap_notices)     \
    X(class_reuses)

void check_stats(Model* m, int exact) {
    for (uint32_t c = 0; c < m->max_classes; ++c)
        for (uint32_t p = 0; p < EXPCACHE_NUM_PATHS; ++p) {
            expcache_stats_t st;
            memset(&st, 0xA5, sizeof st);
            st.struct_size = sizeof st;
            expcache_status_t s = expcache_stats_get(m->h, c, p, &st);
            check_status("expcache_stats_get", s, ST(OK));
            if (s != OK) continue;
            if (st.struct_size != sizeof st) diverge("get_stats wrote struct_size %u", st.struct_size);
            const expcache_stats_t* o = &m->snap[c][p];
#define CMP(f)                                                                                              \
    if (exact ? st.f != o->f : st.f < o->f)                                                                 \
        diverge("class %u path %u counter " #f " went from %" PRIu64 " to %" PRIu64 "%s", c, p, o->f, st.f, \
                exact ? " on a call that should change nothing" : " (counters never decrease)");
            STAT_FIELDS(CMP)
#undef CMP
            m->snap[c][p] = st;
        }
}

int get_stat(Model* m, uint32_t c, uint32_t path, expcache_stats_t* st) {
    st->struct_size = sizeof *st;
    expcache_status_t s = expcache_stats_get(m->h, c, path, st);
    check_status("expcache_stats_get", s, ST(OK));
    return s == OK;
}

void op_reset_stats(Model* m) {
    g_cur_op = "reset_stats";
    check_invariants(m, 0, 1);
    expcache_status_t s = expcache_stats_reset(m->h);
    check_status("expcache_stats_reset", s, ST(OK));
    trace("reset_stats: %s", sname(s));
    memset(m->snap, 0, sizeof m->snap);
    for (uint32_t c = 0; c < m->max_classes; ++c)
        for (uint32_t p = 0; p < EXPCACHE_NUM_PATHS; ++p) m->snap[c][p].struct_size = sizeof(expcache_stats_t);
    check_invariants(m, 0, 1); /* every counter is exactly 0 */
}
