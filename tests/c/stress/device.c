/*
 * device.c — a device-lookup cache (config.lookup = EXPCACHE_LOOKUP_DEVICE) driven on its own:
 * expcache_select_device_async, in rows of ids of either width, mixed with the host-side calls
 * that share its state (select, release_all, stats, read_resident) and with bad input. After
 * each device select every slot is read back through the bank (expcache_class_bank_get) against
 * the source, the ids are resident, equal ids share a slot and distinct ids never do, and the
 * device path's counters moved by the call; an id out of range gets slot -1 and the next
 * synchronizing call succeeds and logs it as a warning, once. The cache lives for one operation, in a model of its own
 * that the other operations never see (they assume what a device-lookup cache forbids: layers
 * registered after a class is bound, class indices reused).
 */
#include "stress.h"

static Model g_dev;

/* A cache of 1 to 3 layers of one size class (the bank is the class's), every layer registered
 * before the first select binds the class. Returns 0 when the cache could not be made. */
static int make_cache(Model* m, uint32_t* budget) {
    memset(m, 0, sizeof *m);
    m->serial = ++g_serial;
    g_cur = m->serial;
    m->num_layers = (uint32_t)between(1, 3);
    m->max_classes = 1;
    uint64_t key[3];
    for (int p = 0; p < 3; ++p) key[p] = pct(50) ? ALIGN * between(1, 8) : between(1, 700);
    uint64_t total = 0;
    for (uint32_t l = 0; l < m->num_layers; ++l) {
        Layer* L = &m->layers[l];
        L->num_experts = (uint32_t)between(2, MAX_EXPERTS);
        L->pinned = EXPCACHE_SOURCE_PINNED; /* the only kind a device select reads */
        L->nbufs = 3;
        for (int p = 0; p < 3; ++p) {
            L->bytes[p] = key[p];
            L->stride[p] = key[p] + (pct(50) ? 0 : between(1, 40));
            L->bufs[p] = (unsigned char*)xmalloc(L->stride[p] * (L->num_experts - 1) + key[p]);
            for (uint32_t e = 0; e < L->num_experts; ++e)
                fill_part(L->bufs[p] + L->stride[p] * e, key[p], m->serial, l, e, p);
            L->base[p] = L->bufs[p];
        }
        L->mark = (uint32_t*)xcalloc(L->num_experts, sizeof(uint32_t));
        total += L->num_experts;
    }
    *budget = (uint32_t)between(8, total < 8 ? 8 : total);

    expcache_config_t cfg;
    expcache_config_init(&cfg);
    cfg.backend = EXPCACHE_BACKEND_HOST;
    cfg.num_layers = m->num_layers;
    cfg.max_classes = 1;
    cfg.budget_experts = *budget;
    cfg.lookup = EXPCACHE_LOOKUP_DEVICE;
    cfg.policy = EXPCACHE_POLICY_LRU;
    cfg.log_level = EXPCACHE_LOG_SILENT;
    expcache_status_t s = expcache_create(&cfg, &m->h);
    check_status("expcache_create", s, ST(OK));
    if (s != OK) return 0;
    g_creates++;
    m->log.magic = LOG_MAGIC;
    install_log(m, EXPCACHE_LOG_WARNING); /* the report of an id out of range is a warning */
    for (uint32_t l = 0; l < m->num_layers; ++l) {
        Layer* L = &m->layers[l];
        expcache_layer_desc_t d;
        fill_desc(L, &d);
        s = expcache_layer_register(m->h, l, &d);
        check_status("expcache_layer_register", s, ST(OK));
        L->registered = s == OK;
    }
    return 1;
}

static expcache_stats_t device_stats(Model* m) {
    expcache_stats_t st;
    memset(&st, 0, sizeof st);
    get_stat(m, 0, EXPCACHE_PATH_DEVICE, &st);
    return st;
}

/* One device select of n rows of k ids on `layer`, checked; *bank is read after the first. */
static void device_select(Model* m, uint32_t layer, uint32_t budget, expcache_bank_t* bank) {
    Layer* L = &m->layers[layer];
    uint32_t n = (uint32_t)(pct(80) ? 1 : between(2, 3));
    uint32_t k = (uint32_t)between(1, 8);
    uint32_t count = n * k, bits = pct(50) ? 32 : 64;
    uint32_t* ids = (uint32_t*)xmalloc(sizeof(uint32_t) * count);
    gen_ids(L, ids, count);
    int bad = pct(4);
    if (bad) ids[below(count)] = L->num_experts + (uint32_t)below(3); /* out of range: slot -1 */
    void* wide = xmalloc((size_t)count * bits / 8);
    for (uint32_t i = 0; i < count; ++i) {
        if (bits == 32)
            ((int32_t*)wide)[i] = (int32_t)ids[i];
        else
            ((int64_t*)wide)[i] = (int64_t)ids[i];
    }
    int32_t* slots = (int32_t*)xmalloc(sizeof(int32_t) * count);
    uint32_t u = 0, pre = 0;
    mark_clear(m);
    for (uint32_t i = 0; i < count; ++i)
        if (ids[i] < L->num_experts && L->mark[ids[i]] != m->stamp) {
            L->mark[ids[i]] = m->stamp;
            g_u[u] = ids[i];
            pre += (g_pre[u] = (signed char)resident(m, layer, ids[i])) == 1;
            ++u;
        }
    expcache_stats_t before = device_stats(m);
    g_selects++;
    expcache_status_t s = expcache_select_device_async(m->h, layer, wide, bits, n, k, slots, NULL);
    uint64_t experts = 0; /* a bank holds at most the class's experts */
    for (uint32_t l = 0; l < m->num_layers; ++l) experts += m->layers[l].num_experts;
    uint64_t cap = bank->cap ? bank->cap : budget < experts ? budget : experts;
    int too_many = count > cap;
    check_status("expcache_select_device_async", s, too_many ? ST(IA) : ST(OK));
    trace("select_device layer %u n %u k %u (%u unique, %u resident, %u-bit%s): %s", layer, n, k, u, pre, bits,
          bad ? ", an id out of range" : "", sname(s));
    if (too_many != (s == IA))
        diverge("select_device of %u ids with %" PRIu64 " slots returned %s", count, cap, sname(s));
    if (s != OK) goto out;
    if (!bank->cap) {
        bank->struct_size = sizeof *bank;
        s = expcache_class_bank_get(m->h, 0, bank);
        check_status("expcache_class_bank_get", s, ST(OK));
        if (s != OK || !bank->base || bank->cap == 0) goto out;
    }
    for (uint32_t i = 0; i < count; ++i) {
        uint32_t e = ids[i];
        if (e >= L->num_experts) {
            if (slots[i] != -1) diverge("select_device gave out-of-range id %u slot %d, not -1", e, slots[i]);
            continue;
        }
        if (slots[i] < 0 || (uint64_t)slots[i] >= bank->cap) {
            diverge("select_device gave id %u slot %d of a bank of %" PRIu64, e, slots[i], bank->cap);
            continue;
        }
        for (uint32_t j = 0; j < i; ++j)
            if (ids[j] < L->num_experts && (ids[j] == e) != (slots[j] == slots[i]))
                diverge("select_device gave ids %u and %u slots %d and %d", ids[j], e, slots[j], slots[i]);
        const unsigned char* slot = (const unsigned char*)bank->base + bank->slot_stride * (uint64_t)slots[i];
        const uint64_t off[3] = {bank->gate_offset, bank->up_offset, bank->down_offset};
        for (int p = 0; p < 3; ++p)
            if (!verify_range(m, slot + off[p], source(L, p, e), L->bytes[p], "select_device", layer, e, p)) break;
    }
    if (bad) { /* the next synchronizing call does its work and logs the id once, as a warning */
        expcache_stats_t st;
        st.struct_size = sizeof st;
        const uint64_t reports = g_range_reports;
        s = expcache_stats_get(m->h, 0, EXPCACHE_PATH_DEVICE, &st);
        check_status("expcache_stats_get", s, ST(OK));
        if (m->log.installed && m->log.level >= EXPCACHE_LOG_WARNING && g_range_reports != reports + 1)
            diverge("a device select of an id out of range was logged %" PRIu64 " times by the next call, not once",
                    g_range_reports - reports);
        s = expcache_stats_get(m->h, 0, EXPCACHE_PATH_DEVICE, &st);
        check_status("expcache_stats_get", s, ST(OK));
        if (g_range_reports != reports + (m->log.installed && m->log.level >= EXPCACHE_LOG_WARNING))
            diverge("a device select's id out of range was logged again by a later call");
    }
    expcache_stats_t after = device_stats(m);
    if (!bad &&
        (after.calls - before.calls != 1 || after.hits - before.hits != pre || after.misses - before.misses != u - pre))
        diverge("select_device moved the device counters by calls %" PRIu64 " hits %" PRIu64 " misses %" PRIu64
                "; want 1, %u, %u",
                after.calls - before.calls, after.hits - before.hits, after.misses - before.misses, pre, u - pre);
    for (uint32_t j = 0; j < u; ++j)
        if (resident(m, layer, g_u[j]) != 1) diverge("expert %u of a device select is not resident", g_u[j]);
out:
    free(ids);
    free(wide);
    free(slots);
}

static void host_select(Model* m, uint32_t layer) {
    Layer* L = &m->layers[layer];
    uint32_t k = (uint32_t)between(1, 6);
    uint32_t ids[6];
    expcache_expert_ptrs_t out[6];
    gen_ids(L, ids, k);
    g_selects++;
    expcache_status_t s = expcache_select_async(m->h, layer, ids, k, NULL, out);
    check_status("expcache_select_async", s, ST(OK) | ST(IA));
    trace("select (host) layer %u k %u: %s", layer, k, sname(s));
    if (s != OK) return; /* IA: more ids than the bank holds */
    for (uint32_t i = 0; i < k; ++i) verify_expert(m, layer, ids[i], &out[i], "select on a device-lookup cache");
}

static void release(Model* m, const expcache_bank_t* bank) {
    expcache_status_t s = expcache_release_all(m->h);
    g_releases++;
    check_status("expcache_release_all", s, ST(OK));
    if (!bank->cap) return;
    expcache_bank_t now;
    now.struct_size = sizeof now;
    s = expcache_class_bank_get(m->h, 0, &now);
    check_status("expcache_class_bank_get", s, ST(OK));
    if (s == OK && (now.base != bank->base || now.cap != bank->cap))
        diverge("release_all moved or resized the bank (%p, %" PRIu64 " slots; was %p, %" PRIu64 ")", now.base, now.cap,
                bank->base, bank->cap);
    uint32_t layer = (uint32_t)below(m->num_layers);
    uint32_t e = (uint32_t)below(m->layers[layer].num_experts);
    if (resident(m, layer, e) != 0) diverge("expert %u of layer %u is resident after release_all", e, layer);
}

static void bad_device_select(Model* m) {
    int32_t ids[2] = {0, 1}, slots[2];
    const int32_t* in = ids;
    int32_t* out = slots;
    uint32_t layer = 0, bits = 32, n = 1;
    const char* what = "";
    switch (below(5)) {
        case 0:
            bits = 16;
            what = "id_bits 16";
            break;
        case 1:
            n = 0;
            what = "n 0";
            break;
        case 2:
            in = NULL;
            what = "ids NULL";
            break;
        case 3:
            out = NULL;
            what = "out_slots NULL";
            break;
        default:
            layer = m->num_layers + (uint32_t)below(3);
            what = "layer out of range";
    }
    expcache_status_t s = expcache_select_device_async(m->h, layer, in, bits, n, 2, out, NULL);
    expect_bad("expcache_select_device_async", s, IA, what);
}

void op_device_lookup(void) {
    g_cur_op = "device lookup";
    Model* m = &g_dev;
    uint32_t budget = 0;
    if (!make_cache(m, &budget)) {
        forget_model(m);
        return;
    }
    trace("device lookup: cache #%" PRIu64 ", %u layers, budget %u experts", m->serial, m->num_layers, budget);
    expcache_bank_t bank;
    memset(&bank, 0, sizeof bank);
    uint64_t ops = between(20, 120);
    for (uint64_t i = 0; i < ops; ++i) {
        uint32_t layer = (uint32_t)below(m->num_layers);
        unsigned r = (unsigned)below(100);
        if (r < 55)
            device_select(m, layer, budget, &bank);
        else if (r < 75)
            host_select(m, layer);
        else if (r < 83)
            release(m, &bank);
        else if (r < 90)
            bad_device_select(m);
        else
            (void)device_stats(m);
    }
    expcache_destroy(m->h);
    g_calls++;
    g_destroys++;
    forget_model(m);
}
