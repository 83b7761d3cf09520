/*
 * log.c — the log callback (the user pointer it was registered with, levels, one line per
 * message) and changing the level and the callback while the cache serves.
 */
#include "stress.h"

void log_cb(void* user, uint32_t level, const char* msg) {
    LogSink* sink = (LogSink*)user;
    g_log_lines++;
    if (!sink || sink->magic != LOG_MAGIC) {
        diverge("log callback got user %p, not the pointer it was registered with", user);
        return;
    }
    sink->lines++;
    if (!msg) {
        diverge("log callback got a NULL message");
        return;
    }
    if (level < EXPCACHE_LOG_WARNING || level > sink->level)
        diverge("log line at level %u while the level is %u: %s", level, sink->level, msg);
    size_t n = strlen(msg);
    if (n == 0 || msg[n - 1] == '\n') diverge("log line empty or ends in a newline: \"%s\"", msg);
    if (strstr(msg, "injected")) g_faults_seen++;
    if (level == EXPCACHE_LOG_WARNING && strstr(msg, "out of range")) g_range_reports++;
    if (g_trace) fprintf(stderr, "    log[%u]: %s\n", level, msg);
}

void install_log(Model* m, uint32_t level) {
    expcache_status_t s = expcache_log_set_callback(m->h, log_cb, &m->log);
    check_status("expcache_log_set_callback", s, ST(OK));
    s = expcache_log_set_level(m->h, level);
    check_status("expcache_log_set_level", s, ST(OK));
    if (s == OK) m->log.level = level;
    m->log.installed = 1;
}

void op_log(Model* m) {
    g_cur_op = "log";
    expcache_status_t s;
    switch (below(4)) {
        case 0: {
            uint32_t bad = EXPCACHE_LOG_DEBUG + 1 + (uint32_t)below(1000);
            s = expcache_log_set_level(m->h, bad);
            expect_bad("expcache_log_set_level", s, IA, "level out of range");
            break;
        }
        case 1:
            /* stderr again, silenced first so the run's output stays clean; then back. */
            s = expcache_log_set_level(m->h, EXPCACHE_LOG_SILENT);
            check_status("expcache_log_set_level", s, ST(OK));
            if (s == OK) m->log.level = 0;
            s = expcache_log_set_callback(m->h, NULL, NULL);
            check_status("expcache_log_set_callback", s, ST(OK));
            m->log.installed = 0;
            if (pct(50)) op_select(m); /* nothing may reach the callback now */
            install_log(m, (uint32_t)below(3));
            break;
        default: {
            uint32_t level = (uint32_t)below(3);
            s = expcache_log_set_level(m->h, level);
            check_status("expcache_log_set_level", s, ST(OK));
            if (s == OK) m->log.level = level;
            break;
        }
    }
    g_cur_op = "log";
    check_invariants(m, 0, 1);
}
