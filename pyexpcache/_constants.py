"""The constants of expcache.h and expcache_testing.h (the status codes are in ``_errors``; the
policies' and paths' names are the library's own tables, read when it loads: ``_lib``).
Re-exported by ``_lib``, where the package reads them."""

from __future__ import annotations

BACKEND_AUTO, BACKEND_HOST, BACKEND_CUDA = 0, 1, 2
SOURCE_PAGEABLE, SOURCE_PINNED, SOURCE_FILE = 0, 1, 2
LOG_SILENT, LOG_WARNING, LOG_NOTICE, LOG_DEBUG = 0, 1, 2, 3
# POLICIES, {name: EXPCACHE_POLICY_* id} in id order, is the library's own table
# (_lib.policy_table), read when it loads: a policy is named once, in
# libexpcache/src/policy/registry.cpp. DEFAULT_POLICY is the name of the one expcache_config_init
# fills in.
FILE_READS = {"buffered": 0, "direct": 1}
LOOKUP_HOST, LOOKUP_DEVICE = 0, 1
LOOKUPS = {"host": LOOKUP_HOST, "device": LOOKUP_DEVICE}
# EXPCACHE_ENVIRONMENT_*: whether expcache_create reads the EXPCACHE_* variables.
ENVIRONMENTS = {"read": 0, "ignore": 1}
PATH_DECODE, PATH_COMPACT, PATH_BATCH, PATH_CONTROL, PATH_DEVICE = 0, 1, 2, 3, 4
# PATH_NAMES, the EXPCACHE_PATH_* names in id order, is the library's own table (_lib.path_table),
# read when it loads: a path is named once, in libexpcache/src/paths.cpp.
# EXPCACHE_PARTITION_*: how a class's slots are shared among its layers.
PARTITIONS = {"global": 0, "layer": 1}
# EXPCACHE_BANK_*: how a class's bank lays its rows out (slot-major, or a region per part).
BANK_ARRANGEMENTS = {"slots": 0, "parts": 1}
MAX_SELECT = 1024
MAX_BATCHES = 64
MAX_BATCH_ROWS = 4096  # a class's batch rows (batches by slot id)
MAX_CLASSES_LIMIT = 64
MAX_LAYERS_LIMIT = 4096  # layers of one cache (a layout is checked against these when it is made)
MAX_EXPERTS_LIMIT = 65536  # experts of one layer
MAX_PART_BYTES_LIMIT = 1 << 40  # bytes of one gate, up or down part
MAX_HOST_BUDGET_BYTES = 1 << 48  # expcache_config_t.host_budget_bytes
MAX_PARTS = 8  # EXPCACHE_MAX_PARTS
# Constants of expcache_testing.h.
CHECKSUM_RESULTS = 65536
(
    STRUCT_CONFIG,
    STRUCT_LAYER_DESC,
    STRUCT_EXPERT_PTRS,
    STRUCT_COMPACT,
    STRUCT_CLASS_INFO,
    STRUCT_STATS,
    STRUCT_STAGING_STATS,
    STRUCT_PREFETCH_STATS,
    STRUCT_BANK,
    STRUCT_POOL_STATS,
) = range(10)
STRUCT_COUNT = 10
