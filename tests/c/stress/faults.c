/*
 * faults.c — injected allocation, copy and staging failures: arming them, and accounting for the
 * CUDA status of a call that consumed one.
 */
#include "stress.h"

/* A CUDA status consumed an injected fault; the message says which (both, when a staged piece had
 * failed too before the call's own copy did). A failing call may consume several staging faults
 * (pieces on other threads): the count left is an upper bound, which only makes the check laxer. */
void consumed_copy_fault(Model* m, expcache_status_t s) {
    if (s != CUDA) return;
    const char* msg = expcache_last_error();
    int staged = strstr(msg, "injected staging failure") != NULL;
    int copied = strstr(msg, "injected copy failure") != NULL;
    if (!staged && !copied) diverge("a CUDA status with no injected fault behind it: %s", msg);
    if (staged) g_staging_faults_seen++;
    if (staged && m->staging_faults_left) m->staging_faults_left--;
    if (copied && m->copy_faults_left) m->copy_faults_left--;
}

/* Arm `count` injected faults after `skip` through `inject` (named `fn`); `left`, when given,
   tracks the ones that may still fire. */
static void arm_faults(Model* m, const char* fn, expcache_status_t (*inject)(expcache_t*, uint64_t, uint64_t),
                       uint64_t skip, uint64_t count, uint64_t* left) {
    g_cur_op = fn + strlen("expcache_");
    expcache_status_t s = inject(m->h, skip, count);
    check_status(fn, s, ST(OK));
    trace("%s skip %" PRIu64 " count %" PRIu64 ": %s", g_cur_op, skip, count, sname(s));
    if (s == OK && left) *left = count;
    g_faults_armed += count;
    check_invariants(m, 0, 1);
}

void op_inject(Model* m) {
    uint64_t skip = below(5), count = pct(30) ? 0 : between(1, 3);
    arm_faults(m, "expcache_testing_inject_alloc_failures", expcache_testing_inject_alloc_failures, skip, count, NULL);
}

void op_inject_copy(Model* m) {
    uint64_t skip = below(40), count = pct(20) ? 0 : between(1, 2);
    arm_faults(m, "expcache_testing_inject_copy_failures", expcache_testing_inject_copy_failures, skip, count,
               &m->copy_faults_left);
}

void op_inject_staging(Model* m) {
    uint64_t skip = below(60), count = pct(20) ? 0 : between(1, 2);
    arm_faults(m, "expcache_testing_inject_staging_failures", expcache_testing_inject_staging_failures, skip, count,
               &m->staging_faults_left);
}
