// How many cores the library's threads may use: the process's CPU affinity where the platform
// has one (a container or `taskset` limits it below the machine's count), else the machine's.
#pragma once

#include <thread>

#if defined(__linux__)
#include <sched.h>
#endif

namespace expcache {

// 0 when unknown.
inline unsigned usable_cores() {
#if defined(__linux__) && defined(CPU_COUNT)
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) return static_cast<unsigned>(CPU_COUNT(&set));
#endif
    return std::thread::hardware_concurrency();
}

}  // namespace expcache
