/* The disk measurement's reader (expcache_bench/disk.py): a list of reads of one file done by
 * threads in C, each taking the next read as it finishes, as the library's readers do, so the
 * rate measured is the disk's and not the interpreter's (Python threads contend for its lock
 * between reads). Part of libexpcache_replay.so; it calls nothing of libexpcache. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define ALIGN 4096 /* O_DIRECT's alignment of offsets, lengths and buffers */

typedef struct {
    int fd;
    const uint64_t* offsets;
    const uint64_t* sizes;
    uint64_t n;
    uint64_t next; /* the next read to take (atomic) */
    uint64_t most; /* the widest read's span */
    int error;     /* the first errno (atomic: 0 none); EIO for a short read */
    uint64_t failed_at;
} reads_t;

static void* reader(void* arg) {
    reads_t* r = arg;
    void* buf = NULL;
    if (posix_memalign(&buf, ALIGN, r->most) != 0) {
        int zero = 0;
        __atomic_compare_exchange_n(&r->error, &zero, ENOMEM, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
        return NULL;
    }
    for (;;) {
        const uint64_t i = __atomic_fetch_add(&r->next, 1, __ATOMIC_RELAXED);
        if (i >= r->n || __atomic_load_n(&r->error, __ATOMIC_RELAXED)) break;
        /* the read widened to whole aligned blocks */
        const uint64_t at = r->offsets[i] / ALIGN * ALIGN;
        const uint64_t need = r->offsets[i] + r->sizes[i] - at;
        const uint64_t span = (need + ALIGN - 1) / ALIGN * ALIGN;
        uint64_t done = 0;
        while (done < need) {
            const ssize_t got = pread(r->fd, (char*)buf + done, span - done, (off_t)(at + done));
            if (got < 0 && errno == EINTR) continue;
            if (got <= 0) {
                int zero = 0;
                const int e = got < 0 ? errno : EIO;
                if (__atomic_compare_exchange_n(&r->error, &zero, e, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
                    r->failed_at = at + done;
                break;
            }
            done += (uint64_t)got;
        }
    }
    free(buf);
    return NULL;
}

/* Read [offsets[i], offsets[i] + sizes[i]) for i < n from fd (each widened to 4096-byte blocks,
 * as O_DIRECT needs) with `threads` threads; the seconds taken into *seconds. Returns 0, or an
 * errno (EIO: a read came back short, at *failed_at), EINVAL for bad arguments. */
int expcache_disk_reads(int fd, const uint64_t* offsets, const uint64_t* sizes, uint64_t n, uint32_t threads,
                        double* seconds, uint64_t* failed_at) {
    if (fd < 0 || !offsets || !sizes || n == 0 || threads == 0 || threads > 1024 || !seconds || !failed_at)
        return EINVAL;
    reads_t r = {fd, offsets, sizes, n, 0, 0, 0, 0};
    for (uint64_t i = 0; i < n; ++i) {
        const uint64_t need = offsets[i] % ALIGN + sizes[i];
        const uint64_t span = (need + ALIGN - 1) / ALIGN * ALIGN;
        if (span > r.most) r.most = span;
    }
    pthread_t* ids = calloc(threads, sizeof(pthread_t));
    if (!ids) return ENOMEM;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    uint32_t started = 0;
    for (; started < threads; ++started)
        if (pthread_create(&ids[started], NULL, reader, &r) != 0) break;
    if (started == 0) reader(&r); /* no thread could start: this one reads them all */
    for (uint32_t t = 0; t < started; ++t) pthread_join(ids[t], NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    free(ids);
    *seconds = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    *failed_at = r.failed_at;
    return r.error;
}
