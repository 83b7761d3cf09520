/*
 * files.c — file sources: files written, opened through expcache_file_open and unlinked at once;
 * bad paths; many files on one cache (ids count up, a documented status at the limit, destroy
 * closes every descriptor).
 */
#include "stress.h"

static const char* tmp_dir(void) {
    const char* d = getenv("STRESS_TMPDIR");
    if (!d || !d[0]) d = getenv("TMPDIR");
    return d && d[0] ? d : "/tmp";
}

/* Open a file through the library: OK (id in *out), or a divergence. The file is unlinked at
 * once (the library holds its descriptors; nothing is left behind if the run dies). */
int open_file(Model* m, const unsigned char* image, uint64_t bytes, uint32_t* out) {
    char path[4096];
    snprintf(path, sizeof path, "%s/expcache-stress-XXXXXX", tmp_dir());
    int fd = mkstemp(path);
    if (fd < 0) {
        fprintf(stderr, "stress: cannot create a temporary file in %s (set STRESS_TMPDIR)\n", tmp_dir());
        exit(2);
    }
    for (uint64_t done = 0; done < bytes;) {
        ssize_t w = write(fd, image + done, bytes - done);
        if (w <= 0) {
            fprintf(stderr, "stress: cannot write %s\n", path);
            unlink(path);
            exit(2);
        }
        done += (uint64_t)w;
    }
    close(fd);
    uint32_t id = 0xA5A5A5A5u;
    expcache_status_t s = expcache_file_open(m->h, path, &id);
    unlink(path);
    check_status("expcache_file_open", s, ST(OK));
    if (s != OK) return 0;
    if (id != m->nfiles) diverge("open_file gave id %u, want %u (ids count up from 0)", id, m->nfiles);
    m->nfiles++;
    *out = id;
    return 1;
}

/* expcache_file_open with bad input: none may open anything. */
void bad_open_file(Model* m) {
    uint32_t id = 0xA5A5A5A5u;
    expcache_status_t s;
    switch (below(5)) {
        case 0:
            s = expcache_file_open(m->h, NULL, &id);
            expect_bad("expcache_file_open", s, IA, "path NULL");
            break;
        case 1:
            s = expcache_file_open(m->h, "", &id);
            expect_bad("expcache_file_open", s, IA, "path empty");
            break;
        case 2:
            s = expcache_file_open(m->h, tmp_dir(), NULL);
            expect_bad("expcache_file_open", s, IA, "out_file NULL");
            break;
        case 3:
            s = expcache_file_open(m->h, tmp_dir(), &id);
            expect_bad("expcache_file_open", s, IO, "a directory");
            break;
        default: {
            char path[4200];
            snprintf(path, sizeof path, "%s/expcache-stress-missing-%" PRIu64, tmp_dir(), rnd());
            s = expcache_file_open(m->h, path, &id);
            expect_bad("expcache_file_open", s, IO, "no such file");
            break;
        }
    }
    if (id != 0xA5A5A5A5u) diverge("failed open_file wrote *out_file");
}

/* Many files on one (throwaway) cache: ids count up, whatever limit there is fails with a
 * documented status, and destroy closes every descriptor. Once per run. */
void op_file_limit(void) {
    g_cur_op = "open_file limit";
    g_cur = 0;
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return;
    rlim_t want = 2 * 1100 + 64; /* two descriptors a file where O_DIRECT is allowed */
    if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < want) {
        if (rl.rlim_max != RLIM_INFINITY && rl.rlim_max < want) {
            printf("stress: open_file limit test skipped (RLIMIT_NOFILE hard limit %llu)\n",
                   (unsigned long long)rl.rlim_max);
            return;
        }
        struct rlimit more = rl;
        more.rlim_cur = want;
        if (setrlimit(RLIMIT_NOFILE, &more) != 0) {
            printf("stress: open_file limit test skipped (cannot raise RLIMIT_NOFILE)\n");
            return;
        }
    }
    int fds = count_fds();
    expcache_config_t cfg;
    expcache_config_init(&cfg);
    cfg.backend = EXPCACHE_BACKEND_HOST;
    cfg.num_layers = 1;
    cfg.budget_experts = 1;
    cfg.log_level = EXPCACHE_LOG_SILENT;
    expcache_t* h = NULL;
    expcache_status_t s = expcache_create(&cfg, &h);
    check_status("expcache_create", s, ST(OK));
    if (s != OK) return;
    char path[4096];
    snprintf(path, sizeof path, "%s/expcache-stress-XXXXXX", tmp_dir());
    int fd = mkstemp(path);
    if (fd < 0 || write(fd, "0123456789abcdef", 16) != 16) {
        fprintf(stderr, "stress: cannot create a temporary file in %s (set STRESS_TMPDIR)\n", tmp_dir());
        exit(2);
    }
    close(fd);
    uint32_t n = 0;
    for (; n < 1100; ++n) {
        uint32_t id = 0xA5A5A5A5u;
        s = expcache_file_open(h, path, &id);
        g_calls++;
        if (s != OK) break;
        if (id != n) diverge("open_file gave id %u, want %u", id, n);
    }
    unlink(path);
    if (s != OK) {
        trace("open_file failed after %u files: %s (%s)", n, sname(s), expcache_last_error());
        check_status("expcache_file_open", s, ST(IA) | ST(IS) | ST(IO));
        if (s == IO && n < 1000) diverge("open_file failed after only %u files: %s", n, expcache_last_error());
    }
    /* A layer from the last file opened still works. */
    static const unsigned char bytes[16] = "0123456789abcdef";
    if (n > 0) {
        expcache_layer_desc_t d;
        expcache_layer_desc_init(&d);
        d.num_experts = 1;
        d.source_kind = EXPCACHE_SOURCE_FILE;
        d.file = n - 1;
        d.gate_bytes = d.up_bytes = d.down_bytes = d.gate_stride = d.up_stride = d.down_stride = 5;
        d.up_base = (const void*)(uintptr_t)5;
        d.down_base = (const void*)(uintptr_t)10;
        s = expcache_layer_register(h, 0, &d);
        check_status("expcache_layer_register", s, ST(OK));
        uint32_t e = 0;
        expcache_expert_ptrs_t p;
        s = expcache_select_async(h, 0, &e, 1, NULL, &p);
        check_status("expcache_select_async", s, ST(OK));
        unsigned char got[5];
        if (s == OK && (expcache_testing_read_device(h, p.down, got, 5) != OK || memcmp(got, bytes + 10, 5) != 0))
            diverge("a layer read from file %u holds wrong bytes", n - 1);
    }
    expcache_destroy(h);
    g_calls += 4;
    if (count_fds() != fds)
        diverge("destroying a cache with %u files open left %d descriptors open", n, count_fds() - fds);
}

/* Open file descriptors of this process (-1 where /proc is not there). */
int count_fds(void) {
    DIR* d = opendir("/proc/self/fd");
    if (!d) return -1;
    int n = 0;
    for (struct dirent* e; (e = readdir(d));) n += e->d_name[0] != '.';
    closedir(d);
    return n;
}
