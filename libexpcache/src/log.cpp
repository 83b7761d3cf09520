#include "log.hpp"

#include <cstdarg>
#include <cstdio>
#include <string>

#include "errors.hpp"

namespace expcache {

void Log::operator()(uint32_t level, const char* fmt, ...) const {
    if (level > level_) return;
    va_list ap;
    va_start(ap, fmt);
    std::string msg = vformat(fmt, ap);
    va_end(ap);
    if (fn_) fn_(user_, level, msg.c_str());
    else std::fprintf(stderr, "expcache: %s\n", msg.c_str());
}

expcache_status_t Health::usable() const {
    if (poisoned_)
        return fail(EXPCACHE_ERR_POISONED,
                    "an earlier sticky CUDA error poisoned this cache; destroy it (see the first error)");
    return EXPCACHE_OK;
}

}  // namespace expcache
