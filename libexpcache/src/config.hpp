// A cache's configuration: the defaults expcache_config_init hands out, and the
// checks and environment overrides a config passes through before a cache runs
// with it. One place, so a new field gets its default and its check together.
#pragma once

#include "expcache.h"

namespace expcache {

// Every field's default, struct_size set.
void config_defaults(expcache_config_t* config);

// Checks the caller's config and applies EXPCACHE_RESERVE_GB and EXPCACHE_VERBOSE: *out is
// what the cache runs with. The first bad field (or variable) is the message.
expcache_status_t resolve_config(const expcache_config_t& config, expcache_config_t* out);

}  // namespace expcache
