#include "log.hpp"

#include <cstdarg>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "errors.hpp"

namespace expcache {

namespace {

struct QueuedLine {
    expcache_log_fn fn;
    void* user;
    uint32_t level;
    std::string message;
};

thread_local unsigned t_call_depth = 0;
thread_local std::vector<QueuedLine> t_queued;

}  // namespace

DeferredLog::DeferredLog() {
    ++t_call_depth;
}

DeferredLog::~DeferredLog() {
    if (--t_call_depth != 0 || t_queued.empty()) return;
    const std::string message = last_error();
    std::vector<QueuedLine> lines = std::move(t_queued);
    t_queued.clear();
    for (const QueuedLine& line : lines) line.fn(line.user, line.level, line.message.c_str());
    restore_last_error(message);
}

void Log::operator()(uint32_t level, const char* fmt, ...) const {
    if (level > level_) return;
    va_list ap;
    va_start(ap, fmt);
    std::string msg = vformat(fmt, ap);
    va_end(ap);
    if (!fn_)
        std::fprintf(stderr, "expcache: %s\n", msg.c_str());
    else if (t_call_depth != 0)
        t_queued.push_back(QueuedLine{fn_, user_, level, std::move(msg)});
    else
        fn_(user_, level, msg.c_str());
}

expcache_status_t Health::usable() const {
    if (poisoned_)
        return fail(EXPCACHE_ERR_POISONED,
                    "an earlier sticky CUDA error poisoned this cache; destroy it (see the first error)");
    return EXPCACHE_OK;
}

}  // namespace expcache
