// The serving paths' names (EXPCACHE_PATH_*), from the one table in paths.cpp.
#pragma once

#include <cstdint>

namespace expcache {

// The lower-case tail of path `path`'s constant ("decode", ...); nullptr past EXPCACHE_NUM_PATHS.
const char* path_name(uint32_t path);

}  // namespace expcache
