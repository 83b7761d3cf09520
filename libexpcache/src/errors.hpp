// Error vocabulary shared by every layer of the library: status codes come
// from expcache.h; the detail goes to a thread-local message that
// expcache_last_error() returns.
#pragma once

#include <cstdarg>
#include <string>

#include "expcache.h"

namespace expcache {

// Record the calling thread's error detail and return `status`, so callers
// can write `return fail(EXPCACHE_ERR_..., "...")`.
expcache_status_t fail(expcache_status_t status, const char* fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

// Prefix the current thread's message with the exported function's name,
// once, at the ABI boundary.
void prefix_last_error(const char* function);

const char* last_error();
void clear_last_error();
// Put back a message saved from last_error() (a clean-up's failure must not replace the call's).
void restore_last_error(const std::string& message);

std::string vformat(const char* fmt, va_list ap);
std::string format(const char* fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;

}  // namespace expcache
