/*
 * handles.c — destroyed and foreign handles: every call refuses them with INVALID_ARGUMENT and
 * expcache_destroy ignores them.
 */
#include "stress.h"

static expcache_t* g_stale[MAX_STALE];
static int g_nstale;
unsigned char g_foreign[256]; /* a "handle" the library never made */

static int is_stale_live(const expcache_t* h) {
    for (int i = 0; i < MAX_CACHES; ++i)
        if (g_models[i].live && g_models[i].h == h) return 1;
    return 0;
}

/* The random draws never depend on heap addresses (a new cache may reuse a destroyed one's
 * address): a seed replays the same sequence under ASan, valgrind or neither. */
void add_stale(expcache_t* h) {
    uint64_t r = rnd();
    if (g_nstale < MAX_STALE)
        g_stale[g_nstale++] = h;
    else
        g_stale[r % MAX_STALE] = h;
}

/* A new cache at a destroyed one's address is no longer stale. */
void unstale(expcache_t* h) {
    for (int i = 0; i < g_nstale; ++i)
        if (g_stale[i] == h) g_stale[i--] = g_stale[--g_nstale];
}

/* Destroyed and foreign handles: INVALID_ARGUMENT from everything, destroy ignores them. */
void op_stale(void) {
    g_cur_op = "stale handle";
    g_cur = 0;
    expcache_t* h = (expcache_t*)g_foreign;
    int use_stale = pct(80);
    uint64_t r = rnd();
    if (g_nstale && use_stale) {
        h = g_stale[r % (uint64_t)g_nstale];
        if (is_stale_live(h)) h = (expcache_t*)g_foreign;
    }
    uint32_t ids[1] = {0}, u = 0, cnt = 0;
    uint64_t u64 = 0, sum = 0;
    expcache_expert_ptrs_t p[1];
    expcache_compact_t cmp;
    memset(&cmp, 0, sizeof cmp);
    cmp.struct_size = sizeof cmp;
    expcache_class_info_t ci;
    ci.struct_size = sizeof ci;
    expcache_stats_t st;
    st.struct_size = sizeof st;
    expcache_layer_desc_t d;
    expcache_layer_desc_init(&d);
    unsigned char buf[16];
    expcache_status_t s;
    const char* fn = "";
    switch (below(21)) {
        case 0:
            s = expcache_backend_get(h, &u);
            fn = "expcache_backend_get";
            break;
        case 1:
            s = expcache_layer_register(h, 0, &d);
            fn = "expcache_layer_register";
            break;
        case 2:
            s = expcache_select_async(h, 0, ids, 1, NULL, p);
            fn = "expcache_select_async";
            break;
        case 3:
            s = expcache_compact_load_async(h, 0, ids, 1, NULL, &cmp);
            fn = "expcache_compact_load_async";
            break;
        case 4:
            s = expcache_batch_prepare_async(h, 0, ids, 1, NULL, &u, p, &cnt, &u64);
            fn = "expcache_batch_prepare_async";
            break;
        case 5:
            s = expcache_batch_finish(h, 1, NULL);
            fn = "expcache_batch_finish";
            break;
        case 6:
            s = expcache_release_all(h);
            fn = "expcache_release_all";
            break;
        case 7:
            s = expcache_synchronize(h, NULL);
            fn = "expcache_synchronize";
            break;
        case 8:
            s = expcache_testing_read_resident(h, 0, 0, buf, sizeof buf, &u);
            fn = "expcache_testing_read_resident";
            break;
        case 9:
            s = expcache_testing_read_device(h, buf, buf + 8, 8);
            fn = "expcache_testing_read_device";
            break;
        case 10:
            p[0].gate = p[0].up = p[0].down = buf;
            s = expcache_testing_checksum(h, 0, p, 1, NULL, &sum);
            fn = "expcache_testing_checksum";
            break;
        case 11:
            s = expcache_class_count_get(h, &u);
            fn = "expcache_class_count_get";
            break;
        case 12:
            s = expcache_class_info_get(h, 0, &ci);
            fn = "expcache_class_info_get";
            break;
        case 13:
            s = expcache_layer_bind_class(h, 0, &u);
            fn = "expcache_layer_bind_class";
            break;
        case 14:
            s = expcache_stats_get(h, 0, 0, &st);
            fn = "expcache_stats_get";
            break;
        case 15:
            s = expcache_stats_reset(h);
            fn = "expcache_stats_reset";
            break;
        case 16:
            s = expcache_log_set_callback(h, log_cb, NULL);
            fn = "expcache_log_set_callback";
            break;
        case 17:
            s = expcache_log_set_level(h, 0);
            fn = "expcache_log_set_level";
            break;
        case 18:
            if (pct(50))
                s = expcache_testing_inject_alloc_failures(h, 0, 1), fn = "expcache_testing_inject_alloc_failures";
            else
                s = expcache_testing_inject_copy_failures(h, 0, 1), fn = "expcache_testing_inject_copy_failures";
            break;
        case 19:
            s = expcache_testing_device_bytes_in_use(h, &u64);
            fn = "expcache_testing_device_bytes_in_use";
            break;
        default:
            s = expcache_file_open(h, "/dev/null", &u);
            fn = "expcache_file_open";
            break;
    }
    trace("%s on %s handle %p: %s", fn, h == (expcache_t*)g_foreign ? "foreign" : "destroyed", (void*)h, sname(s));
    expect_bad(fn, s, IA, h == (expcache_t*)g_foreign ? "foreign handle" : "destroyed handle");
    expcache_destroy(h); /* ignored */
    g_calls++;
}
