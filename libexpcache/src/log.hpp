// A cache's voice and health: its log lines (to the caller's callback or stderr, filtered by
// level) and the sticky poisoned state a CUDA error leaves. Every part of the core that talks
// or checks a backend status holds a reference to these.
#pragma once

#include <cstdint>

#include "expcache.h"

namespace expcache {

// A line is delivered to the callback after the exported call that logged it returns (its locks
// released), so a callback may call into the cache; a line logged on a thread outside any
// exported call (a worker) is delivered at once. stderr lines are printed at once.
class Log {
public:
    explicit Log(uint32_t level) : level_(level) {}
    void operator()(uint32_t level, const char* fmt, ...) const
#if defined(__GNUC__)
        __attribute__((format(printf, 3, 4)))
#endif
        ;
    bool enabled(uint32_t level) const { return level <= level_; }
    void set_level(uint32_t level) { level_ = level; }
    void set_callback(expcache_log_fn fn, void* user) {
        fn_ = fn;
        user_ = user;
    }

private:
    uint32_t level_;
    expcache_log_fn fn_ = nullptr;
    void* user_ = nullptr;
};

// Marks the calling thread as inside an exported call for its lifetime (nested ones count):
// lines logged meanwhile are queued on the thread and delivered when the outermost ends, with
// the call's error message kept across the callbacks' own calls.
class DeferredLog {
public:
    DeferredLog();
    ~DeferredLog();
    DeferredLog(const DeferredLog&) = delete;
    DeferredLog& operator=(const DeferredLog&) = delete;
};

// A POISONED status from the backend is sticky: every later call reports it.
class Health {
public:
    expcache_status_t check(expcache_status_t s) {
        if (s == EXPCACHE_ERR_POISONED) poisoned_ = true;
        return s;
    }
    expcache_status_t usable() const;

private:
    bool poisoned_ = false;
};

}  // namespace expcache
