/*
 * lifetime.c — a cache's lifetime: expcache_create with random configurations planned tight
 * against the layout (and bad ones, and the environment's overrides), release_all, destroy.
 */
#include "stress.h"

void op_destroy(Model* m) {
    g_cur_op = "destroy";
    trace("destroy cache #%" PRIu64 " (%d batches outstanding)", m->serial, m->nbatches);
    expcache_destroy(m->h);
    g_calls++;
    g_destroys++;
    add_stale(m->h);
    forget_model(m);
}

static const uint64_t kSizes[] = {1, 2, 3, 7, 8, 9, 63, 64, 100, 255, 256, 257, 511, 512, 513, 1000, 1728, 3000};

static void pick_key(uint64_t k[3], int tiny) {
    for (int p = 0; p < 3; ++p)
        k[p] = tiny ? between(1, 4) : pct(70) ? kSizes[below(sizeof kSizes / sizeof kSizes[0])] : between(1, 2500);
}

static void bad_configs(void) {
    expcache_config_t cfg;
    expcache_t* h = (expcache_t*)(uintptr_t)0xDEAD0;
    int which = (int)below(15);
    expcache_config_init(&cfg);
    cfg.budget_experts = 4;
    cfg.backend = EXPCACHE_BACKEND_HOST;
    cfg.num_layers = 2;
    const char* what = "";
    expcache_status_t want = IA;
    switch (which) {
        case 0:
            cfg.struct_size = sizeof cfg - 8;
            what = "struct_size too small";
            break;
        case 1:
            cfg.num_layers = 0;
            what = "num_layers 0";
            break;
        case 2:
            cfg.num_layers = EXPCACHE_MAX_LAYERS_LIMIT + 1;
            what = "num_layers over the limit";
            break;
        case 3:
            cfg.max_classes = pct(50) ? 0 : EXPCACHE_MAX_CLASSES_LIMIT + 1;
            what = "max_classes";
            break;
        case 4:
            cfg.backend = 3 + (uint32_t)below(100);
            what = "backend";
            break;
        case 5:
            cfg.log_level = EXPCACHE_LOG_DEBUG + 1;
            what = "log_level";
            break;
        case 6:
            cfg.budget_experts = cfg.budget_bytes = 0;
            what = "no budget";
            break;
        case 7:
            cfg.device_capacity_bytes = 0;
            what = "device_capacity_bytes 0";
            break;
        case 8:
            cfg.slab_bytes = 0;
            what = "slab_bytes 0";
            break;
        case 9:
            cfg.copy_threads = 65;
            what = "copy_threads";
            break;
        case 10:
            cfg.policy = EXPCACHE_POLICY_COUNT + (uint32_t)below(100);
            what = "policy";
            break;
        case 11:
            cfg.staging_bytes = pct(50) ? 1000 : (uint64_t)17 << 30;
            what = "staging_bytes";
            break;
        case 12:
            cfg.backend = EXPCACHE_BACKEND_CUDA;
            want = UNSUP;
            what = "CUDA backend in a host-only build";
            break;
        case 13: {
            static const uint64_t bad[] = {0, 4096, (64u << 10) - 4096, (64u << 10) + 1, (uint64_t)65 << 20};
            cfg.staging_chunk_bytes = bad[below(5)];
            what = "staging_chunk_bytes";
            break;
        }
        case 14:
            cfg.file_reads = 2 + (uint32_t)below(100);
            what = "file_reads";
            break;
    }
    expcache_status_t s = expcache_create(&cfg, &h);
    expect_bad("expcache_create", s, want, what);
    if (s == OK) { /* would leak otherwise */
        expcache_destroy(h);
        return;
    }
    if (h != (expcache_t*)(uintptr_t)0xDEAD0) diverge("failed expcache_create wrote *out_cache");
    if (pct(30)) {
        s = expcache_create(NULL, &h);
        expect_bad("expcache_create", s, IA, "config NULL");
        expcache_config_init(&cfg);
        cfg.budget_experts = 1;
        s = expcache_create(&cfg, NULL);
        expect_bad("expcache_create", s, IA, "out_cache NULL");
    }
}

void op_create(void) {
    g_cur_op = "create";
    Model* m = NULL;
    for (int i = 0; i < MAX_CACHES; ++i)
        if (!g_models[i].live) {
            m = &g_models[i];
            break;
        }
    if (!m) return;
    if (pct(25)) bad_configs();
    memset(m, 0, sizeof *m);
    m->serial = ++g_serial;
    g_cur = m->serial;

    expcache_config_t cfg;
    memset(&cfg, 0x5A, sizeof cfg);
    expcache_status_t s = expcache_config_init(&cfg);
    check_status("expcache_config_init", s, ST(OK));
    if (cfg.struct_size != sizeof cfg || cfg.max_classes != 4 || cfg.reserve_bytes != ((uint64_t)1 << 30) ||
        cfg.budget_bytes || cfg.budget_experts || cfg.policy != EXPCACHE_POLICY_DUEL ||
        cfg.backend != EXPCACHE_BACKEND_AUTO || cfg.lookup != EXPCACHE_LOOKUP_HOST ||
        cfg.partition != EXPCACHE_PARTITION_GLOBAL)
        diverge("expcache_config_init defaults are not the documented ones");

    /* The layout is planned now so that capacity and budgets are tight against it. */
    m->num_layers = (uint32_t)between(1, MAX_LAYERS);
    m->nkeys = (int)between(1, MAX_KEYS - 1);
    for (int k = 0; k < m->nkeys; ++k) pick_key(m->keys[k], 0);
    pick_key(m->keys[m->nkeys], 1); /* tiny parts, for the big layers */
    uint64_t model_bytes = 0;
    for (uint32_t l = 0; l < m->num_layers; ++l) {
        Layer* L = &m->layers[l];
        if (pct(4)) {
            L->key = m->nkeys;
            L->num_experts = (uint32_t)between(1024, BIG_EXPERTS_MAX);
        } else {
            L->key = (int)below((uint64_t)m->nkeys);
            L->num_experts = (uint32_t)(pct(10) ? between(1, 3) : between(4, MAX_EXPERTS));
        }
        model_bytes += slot_bytes_of(m->keys[L->key]) * L->num_experts;
    }
    m->max_classes = (uint32_t)(pct(10) ? between(5, 8) : between(1, 4));

    cfg.backend = pct(80) ? EXPCACHE_BACKEND_HOST : EXPCACHE_BACKEND_AUTO;
    cfg.num_layers = m->num_layers;
    cfg.max_classes = m->max_classes;
    uint32_t level = (uint32_t)below(EXPCACHE_LOG_DEBUG + 1);
    cfg.log_level = level;
    cfg.budget_experts = pct(50) ? between(1, 64) : 0;
    cfg.budget_bytes = (pct(50) || !cfg.budget_experts) ? between(1, model_bytes + model_bytes / 2) : 0;
    int r = (int)below(10);
    cfg.reserve_bytes = r < 2   ? 0
                        : r < 8 ? between(0, 8 * slot_bytes_of(m->keys[below((uint64_t)m->nkeys)]))
                        : r < 9 ? ((uint64_t)1 << 30)
                                : model_bytes;
    int c = (int)below(10);
    cfg.device_capacity_bytes = c < 1   ? ((uint64_t)64 << 30)
                                : c < 2 ? slot_bytes_of(m->keys[0]) + between(0, 4096)
                                : c < 6 ? between(256, model_bytes / 2 + 256)
                                        : between(model_bytes / 2, 2 * model_bytes + 4096);
    cfg.slab_bytes = pct(20) ? ((uint64_t)512 << 20) : between(1, 32768);
    cfg.copy_threads = (uint32_t)below(9);
    cfg.staging_chunk_bytes = (uint64_t)(64 << 10) << below(6); /* 64 KiB..2 MiB */
    /* Sometimes a ring of only a few chunks, so that pieces wait for their chunk's turn and
       chunks are reused within one call. */
    if (pct(30)) cfg.staging_bytes = (uint64_t)1 << 20;
    cfg.file_reads = pct(50) ? EXPCACHE_FILE_READS_DIRECT : EXPCACHE_FILE_READS_BUFFERED;
    /* Nothing below predicts victims, so every check holds for any policy. */
    cfg.policy = (uint32_t)below(EXPCACHE_POLICY_COUNT);
    m->capacity = cfg.device_capacity_bytes;
    m->reserve = cfg.reserve_bytes;
    m->budget_experts = cfg.budget_experts;

    /* The environment overrides, sometimes; a malformed variable is ignored (a warning), never a
       failed create; config.environment IGNORE reads none. */
    int env = (int)below(20);
    cfg.environment = pct(10) ? EXPCACHE_ENVIRONMENT_IGNORE : EXPCACHE_ENVIRONMENT_READ;
    const int read_env = cfg.environment == EXPCACHE_ENVIRONMENT_READ;
    if (env == 0) {
        setenv("EXPCACHE_RESERVE_GB", "0", 1);
        if (read_env) m->reserve = 0;
    } else if (env == 1) {
        setenv("EXPCACHE_RESERVE_GB", "0.000001", 1);
        if (read_env) m->reserve = (uint64_t)(0.000001 * (double)((uint64_t)1 << 30));
    } else if (env == 2) {
        setenv("EXPCACHE_RESERVE_GB", pct(50) ? "lots" : "-1", 1); /* ignored: the reserve stays */
    } else if (env == 3) {
        static const char* const on[] = {"1", "true", "YES", "On"};
        setenv("EXPCACHE_VERBOSE", on[below(4)], 1);
    } else if (env == 4) {
        static const char* const off[] = {"0", "false", "No", "OFF"};
        setenv("EXPCACHE_VERBOSE", off[below(4)], 1);
    } else if (env == 5) {
        setenv("EXPCACHE_VERBOSE", pct(50) ? "2" : "verbose", 1); /* ignored */
    }

    expcache_t* h = (expcache_t*)(uintptr_t)0xDEAD0;
    s = expcache_create(&cfg, &h);
    unsetenv("EXPCACHE_RESERVE_GB");
    unsetenv("EXPCACHE_VERBOSE");
    g_creates += s == OK;
    check_status("expcache_create", s, ST(OK));
    trace("create cache #%" PRIu64 ": %s, %u layers, %u class slots, %d keys, capacity %" PRIu64 ", reserve %" PRIu64
          ", budget %" PRIu64 " experts / %" PRIu64 " B, slab %" PRIu64 ", model %" PRIu64 " B",
          m->serial, sname(s), m->num_layers, m->max_classes, m->nkeys, m->capacity, m->reserve, cfg.budget_experts,
          cfg.budget_bytes, cfg.slab_bytes, model_bytes);
    if (s != OK) {
        if (h != (expcache_t*)(uintptr_t)0xDEAD0) diverge("failed expcache_create wrote *out_cache");
        return;
    }
    m->h = h;
    m->live = 1;
    unstale(h); /* a new cache may reuse a destroyed one's address */
    uint32_t backend = 0;
    s = expcache_backend_get(h, &backend);
    check_status("expcache_backend_get", s, ST(OK));
    if (backend != EXPCACHE_BACKEND_HOST) diverge("backend %u, want host", backend);
    m->log.magic = LOG_MAGIC;
    m->log.level = env == 3 ? EXPCACHE_LOG_DEBUG : level;
    install_log(m, pct(70) ? level : (uint32_t)below(EXPCACHE_LOG_DEBUG + 1));
    check_invariants(m, 1, 1);
}

void op_release_all(Model* m) {
    g_cur_op = "release_all";
    m->sel_valid = m->cmp_valid = 0;
    expcache_status_t s = expcache_release_all(m->h);
    check_status("expcache_release_all", s, ST(OK));
    g_releases++;
    trace("release_all (%d batches outstanding): %s", m->nbatches, sname(s));
    if (s != OK) return;
    m->compact_cap = 0;
    check_invariants(m, pct(30), 0);
    for (uint32_t c = 0; c < m->max_classes; ++c)
        if (!class_busy(m, c) && (m->info[c].allocated_experts || m->info[c].resident_experts))
            diverge("release_all left class %u with %" PRIu64 " slots and no batch keeping it", c,
                    m->info[c].allocated_experts);
    if (m->nbatches == 0) {
        uint64_t db = 1;
        s = expcache_testing_device_bytes_in_use(m->h, &db);
        check_status("expcache_testing_device_bytes_in_use", s, ST(OK));
        if (db != 0) diverge("device_bytes_in_use is %" PRIu64 " after release_all with no batch held", db);
    }
}
