#include "errors.hpp"

#include <cstdio>

namespace expcache {

namespace {
thread_local std::string t_last_error;
}

std::string vformat(const char* fmt, va_list ap) {
    va_list copy;
    va_copy(copy, ap);
    char small[256];
    int n = std::vsnprintf(small, sizeof small, fmt, copy);
    va_end(copy);
    if (n < 0) return std::string(fmt);
    if (static_cast<size_t>(n) < sizeof small) return std::string(small, static_cast<size_t>(n));
    std::string out(static_cast<size_t>(n) + 1, '\0');
    std::vsnprintf(&out[0], out.size(), fmt, ap);
    out.resize(static_cast<size_t>(n));
    return out;
}

std::string format(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    std::string s = vformat(fmt, ap);
    va_end(ap);
    return s;
}

expcache_status_t fail(expcache_status_t status, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    t_last_error = vformat(fmt, ap);
    va_end(ap);
    return status;
}

void prefix_last_error(const char* function) {
    std::string prefix = std::string(function) + ": ";
    if (t_last_error.compare(0, prefix.size(), prefix) != 0) t_last_error = prefix + t_last_error;
}

const char* last_error() {
    return t_last_error.c_str();
}
void clear_last_error() {
    t_last_error.clear();
}
void restore_last_error(const std::string& message) {
    t_last_error = message;
}

}  // namespace expcache

extern "C" const char* expcache_status_string(expcache_status_t status) {
    switch (status) {
        case EXPCACHE_OK:
            return "EXPCACHE_OK";
        case EXPCACHE_ERR_INVALID_ARGUMENT:
            return "EXPCACHE_ERR_INVALID_ARGUMENT";
        case EXPCACHE_ERR_OUT_OF_DEVICE_MEMORY:
            return "EXPCACHE_ERR_OUT_OF_DEVICE_MEMORY";
        case EXPCACHE_ERR_OUT_OF_HOST_MEMORY:
            return "EXPCACHE_ERR_OUT_OF_HOST_MEMORY";
        case EXPCACHE_ERR_INVALID_STATE:
            return "EXPCACHE_ERR_INVALID_STATE";
        case EXPCACHE_ERR_UNSUPPORTED:
            return "EXPCACHE_ERR_UNSUPPORTED";
        case EXPCACHE_ERR_CUDA:
            return "EXPCACHE_ERR_CUDA";
        case EXPCACHE_ERR_POISONED:
            return "EXPCACHE_ERR_POISONED";
        case EXPCACHE_ERR_INTERNAL:
            return "EXPCACHE_ERR_INTERNAL";
        case EXPCACHE_ERR_IO:
            return "EXPCACHE_ERR_IO";
        default:
            return "EXPCACHE_ERR_UNKNOWN";
    }
}

extern "C" const char* expcache_last_error(void) {
    return expcache::last_error();
}
