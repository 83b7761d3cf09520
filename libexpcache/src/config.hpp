// A cache's configuration: the defaults expcache_config_init hands out, and the
// checks and environment overrides a config passes through before a cache runs
// with it. One place, so a new field gets its default and its check together.
#pragma once

#include "expcache.h"

namespace expcache {

struct StagingTuning;  // backend/staging_tuning.hpp

// Every field's default, struct_size set.
void config_defaults(expcache_config_t* config);

// Checks the caller's config and applies EXPCACHE_RESERVE_GB and EXPCACHE_VERBOSE (*out), and
// reads the staging ring's EXPCACHE_STAGING_* variables (*staging): what the cache runs with.
// INVALID_ARGUMENT names the first bad field or variable (its value and what is accepted); on
// failure neither output is written.
expcache_status_t resolve_config(const expcache_config_t& config, expcache_config_t* out, StagingTuning* staging);

}  // namespace expcache
