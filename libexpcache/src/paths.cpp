// The one table of serving paths' names: per EXPCACHE_PATH_* id the lower-case tail of its
// constant. The log lines that name a path read it, and expcache_path_name hands it to
// bindings (pyexpcache builds its PATH_NAMES from it). A new path is its constant in
// expcache.h, EXPCACHE_NUM_PATHS one higher, and a row here.
#include "paths.hpp"

#include "expcache.h"

namespace expcache {

namespace {

struct PathEntry {
    uint32_t id;
    const char* name;
};

constexpr PathEntry kPaths[] = {
    {EXPCACHE_PATH_DECODE, "decode"},   {EXPCACHE_PATH_COMPACT, "compact"}, {EXPCACHE_PATH_BATCH, "batch"},
    {EXPCACHE_PATH_CONTROL, "control"}, {EXPCACHE_PATH_DEVICE, "device"},
};
constexpr uint32_t kCount = sizeof kPaths / sizeof kPaths[0];

// Row i is id i, so an id indexes the table and bindings can list the paths from 0 until NULL.
constexpr bool rows_are_ids() {
    for (uint32_t i = 0; i < kCount; ++i)
        if (kPaths[i].id != i) return false;
    return true;
}
static_assert(kCount == EXPCACHE_NUM_PATHS, "a row per EXPCACHE_PATH_* and EXPCACHE_NUM_PATHS rows");
static_assert(rows_are_ids(), "row i of kPaths must be EXPCACHE_PATH_* id i");

}  // namespace

const char* path_name(uint32_t path) {
    return path < kCount ? kPaths[path].name : nullptr;
}

}  // namespace expcache
