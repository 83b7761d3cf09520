// A cache's configuration: the defaults expcache_config_init hands out, and the
// checks and environment overrides a config passes through before a cache runs
// with it. One place, so a new field gets its default and its check together.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "expcache.h"

namespace expcache {

struct StagingTuning;  // backend/staging_tuning.hpp

// Every field's default, struct_size set.
void config_defaults(expcache_config_t* config);

// What reading the environment has to say, as log lines (level, text) for the cache to log once
// per process: a malformed variable ignored (a warning), an explicit field overridden (a notice).
using EnvironmentLines = std::vector<std::pair<uint32_t, std::string>>;

// Checks the caller's config and, unless config.environment is IGNORE, applies
// EXPCACHE_RESERVE_GB and EXPCACHE_VERBOSE (*out) and reads the staging ring's
// EXPCACHE_STAGING_* variables (*staging): what the cache runs with. INVALID_ARGUMENT names the
// first bad field (its value and what is accepted); on failure no output is written. A variable
// never fails it: *lines says what was ignored or overridden.
expcache_status_t resolve_config(const expcache_config_t& config, expcache_config_t* out, StagingTuning* staging,
                                 EnvironmentLines* lines);

// Logs each of `lines` through `log` unless this process logged the same line before.
void log_environment_once(const class Log& log, const EnvironmentLines& lines);

}  // namespace expcache
