"""ctypes declarations of libexpcache, nothing else: each struct mirrors
expcache.h field by field, each function has argtypes and restype, and the C
prototype is quoted above it. Status-returning functions raise through
``errcheck``, so every failure becomes an exception in exactly one place.

The library is loaded on first use of ``lib``, ``library_path``, ``POLICIES``, ``DEFAULT_POLICY`` or
``PATH_NAMES`` (a module ``__getattr__``), not on import, so ``--help`` and the pure-Python tools
work before it is built. :func:`set_fields` is how a struct is filled: it range-checks
every integer against its C field type, since ctypes would silently wrap it.
"""

from __future__ import annotations

import ctypes
import threading
import warnings
from ctypes import POINTER, c_char_p, c_int32, c_uint32, c_uint64, c_void_p

from . import _loader
from ._errors import (  # noqa: F401 (re-exported: the status codes, defined once in _errors)
    ERR_CUDA,
    ERR_INTERNAL,
    ERR_INVALID_ARGUMENT,
    ERR_INVALID_STATE,
    ERR_IO,
    ERR_OUT_OF_DEVICE_MEMORY,
    ERR_OUT_OF_HOST_MEMORY,
    ERR_POISONED,
    ERR_UNSUPPORTED,
    OK,
    error_for,
)
from ._ints import I32_MAX, I32_MIN, U32_MAX, U64_MAX, checked_int

# Constants of expcache.h (the status codes: ``OK``, ``ERR_*`` above).
BACKEND_AUTO, BACKEND_HOST, BACKEND_CUDA = 0, 1, 2
SOURCE_PAGEABLE, SOURCE_PINNED, SOURCE_FILE = 0, 1, 2
LOG_SILENT, LOG_WARNING, LOG_NOTICE, LOG_DEBUG = 0, 1, 2, 3
# POLICIES, {name: EXPCACHE_POLICY_* id} in id order, is the library's own table (policy_table), read
# when it loads: a policy is named once, in libexpcache/src/policy/registry.cpp. DEFAULT_POLICY is the
# name of the one expcache_config_init fills in.
FILE_READS = {"buffered": 0, "direct": 1}
LOOKUP_HOST, LOOKUP_DEVICE = 0, 1
LOOKUPS = {"host": LOOKUP_HOST, "device": LOOKUP_DEVICE}
# EXPCACHE_ENVIRONMENT_*: whether expcache_create reads the EXPCACHE_* variables.
ENVIRONMENTS = {"read": 0, "ignore": 1}
PATH_DECODE, PATH_COMPACT, PATH_BATCH, PATH_CONTROL, PATH_DEVICE = 0, 1, 2, 3, 4
# PATH_NAMES, the EXPCACHE_PATH_* names in id order, is the library's own table (path_table), read
# when it loads: a path is named once, in libexpcache/src/paths.cpp.
# EXPCACHE_PARTITION_*: how a class's slots are shared among its layers.
PARTITIONS = {"global": 0, "layer": 1}
MAX_SELECT = 1024
MAX_BATCHES = 64
MAX_BATCH_ROWS = 4096  # a class's batch rows (batches by slot id)
MAX_CLASSES_LIMIT = 64
MAX_LAYERS_LIMIT = 4096  # layers of one cache (a layout is checked against these when it is made)
MAX_EXPERTS_LIMIT = 65536  # experts of one layer
MAX_PART_BYTES_LIMIT = 1 << 40  # bytes of one gate, up or down part
MAX_HOST_BUDGET_BYTES = 1 << 48  # expcache_config_t.host_budget_bytes
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


class Config(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_uint32),
        ("backend", c_uint32),
        ("device", c_int32),
        ("num_layers", c_uint32),
        ("max_classes", c_uint32),
        ("log_level", c_uint32),
        ("budget_experts", c_uint64),
        ("budget_bytes", c_uint64),
        ("reserve_bytes", c_uint64),
        ("device_capacity_bytes", c_uint64),
        ("slab_bytes", c_uint64),
        ("copy_threads", c_uint32),
        ("policy", c_uint32),
        ("staging_bytes", c_uint64),
        ("staging_chunk_bytes", c_uint64),
        ("file_reads", c_uint32),
        ("prefetch_max_per_layer", c_uint32),
        ("prefetch_piece_bytes", c_uint64),
        ("lookup", c_uint32),
        ("partition", c_uint32),
        ("environment", c_uint32),
        ("reserved", c_uint32),
        ("host_budget_bytes", c_uint64),
    ]


MAX_PARTS = 8  # EXPCACHE_MAX_PARTS


class Part(ctypes.Structure):
    _fields_ = [
        ("bytes", c_uint64),
        ("stride", c_uint64),
        ("base", c_void_p),
        ("offsets", POINTER(c_uint64)),
        ("files", POINTER(c_uint32)),
    ]


class LayerDesc(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_uint32),
        ("num_experts", c_uint32),
        ("source_kind", c_uint32),
        ("file", c_uint32),
        ("gate_bytes", c_uint64),
        ("up_bytes", c_uint64),
        ("down_bytes", c_uint64),
        ("gate_stride", c_uint64),
        ("up_stride", c_uint64),
        ("down_stride", c_uint64),
        ("gate_base", c_void_p),
        ("up_base", c_void_p),
        ("down_base", c_void_p),
        ("num_parts", c_uint32),
        ("reserved", c_uint32),
        ("parts", Part * MAX_PARTS),
    ]


class ExpertPtrs(ctypes.Structure):
    _fields_ = [("gate", c_void_p), ("up", c_void_p), ("down", c_void_p)]


class Compact(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_uint32),
        ("num_experts", c_uint32),
        ("base", c_void_p),
        ("bytes", c_uint64),
        ("gate_offset", c_uint64),
        ("up_offset", c_uint64),
        ("down_offset", c_uint64),
        ("gate_bytes", c_uint64),
        ("up_bytes", c_uint64),
        ("down_bytes", c_uint64),
        ("num_parts", c_uint32),
        ("reserved", c_uint32),
        ("part_offset", c_uint64 * MAX_PARTS),
        ("part_bytes", c_uint64 * MAX_PARTS),
    ]


class ClassInfo(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_uint32),
        ("in_use", c_uint32),
        ("gate_bytes", c_uint64),
        ("up_bytes", c_uint64),
        ("down_bytes", c_uint64),
        ("slot_bytes", c_uint64),
        ("target_experts", c_uint64),
        ("cap_experts", c_uint64),
        ("allocated_experts", c_uint64),
        ("resident_experts", c_uint64),
        ("held_experts", c_uint64),
        ("num_layers", c_uint64),
        ("staging_bytes", c_uint64),
        ("num_parts", c_uint32),
        ("reserved", c_uint32),
        ("part_bytes", c_uint64 * MAX_PARTS),
    ]


class Bank(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_uint32),
        ("num_parts", c_uint32),
        ("base", c_void_p),
        ("slot_stride", c_uint64),
        ("cap", c_uint64),
        ("gate_offset", c_uint64),
        ("up_offset", c_uint64),
        ("down_offset", c_uint64),
        ("gate_bytes", c_uint64),
        ("up_bytes", c_uint64),
        ("down_bytes", c_uint64),
        ("rows", c_uint64),
        ("part_offset", c_uint64 * MAX_PARTS),
        ("part_bytes", c_uint64 * MAX_PARTS),
    ]


STAT_FIELDS = (
    "calls",
    "hits",
    "misses",
    "evictions",
    "appends",
    "direct_loads",
    "bytes_h2d",
    "bytes_d2d",
    "releases",
    "alloc_retries",
    "cap_notices",
    "class_reuses",
)


class Stats(ctypes.Structure):
    _fields_ = [("struct_size", c_uint32), ("reserved", c_uint32)] + [(n, c_uint64) for n in STAT_FIELDS]


STAGING_FIELDS = (
    "calls",
    "pieces",
    "bytes",
    "caller_fills",
    "fill_ns",
    "chunk_waits",
    "chunk_wait_ns",
    "wait_ns",
    "send_ns",
    "sends",
    "span_ns",
    "first_fill_ns",
)


class StagingStats(ctypes.Structure):
    _fields_ = [("struct_size", c_uint32), ("reserved", c_uint32)] + [(n, c_uint64) for n in STAGING_FIELDS]


PREFETCH_FIELDS = (
    "calls",
    "issued",
    "used",
    "wasted",
    "cancelled",
    "skipped",
    "dropped",
    "bytes_issued",
    "bytes_used",
    "bytes_wasted",
    "bytes_cancelled",
    "bytes_sent",
    "pieces",
    "hints",
    "hint_refreshes",
    "late",
    "bytes_late_sent",
)


class PrefetchStats(ctypes.Structure):
    _fields_ = [("struct_size", c_uint32), ("reserved", c_uint32)] + [(n, c_uint64) for n in PREFETCH_FIELDS]


POOL_FIELDS = (
    "budget_bytes",
    "slot_bytes",
    "slots",
    "resident",
    "hits",
    "bytes_hit",
    "source_reads",
    "bytes_source",
    "inserts",
    "evictions",
    "failed",
    "bypassed",
)


class PoolStats(ctypes.Structure):
    _fields_ = [("struct_size", c_uint32), ("reserved", c_uint32)] + [(n, c_uint64) for n in POOL_FIELDS]


LOG_FN = ctypes.CFUNCTYPE(None, c_void_p, c_uint32, c_char_p)
DROPPED_FN = ctypes.CFUNCTYPE(None, c_void_p)
CachePtr = c_void_p
MemoryRefPtr = c_void_p

# The range of each C field type (c_void_p: addresses, as uint64).
_RANGES = {c_uint32: (0, U32_MAX), c_int32: (I32_MIN, I32_MAX), c_uint64: (0, U64_MAX), c_void_p: (0, U64_MAX)}


def set_fields(struct: ctypes.Structure, **values) -> None:
    """Set integer fields of a ctypes struct, each checked against its C type first
    (ValueError/OverflowError naming the field, never a silent wrap)."""
    types = dict(struct._fields_)
    for name, value in values.items():
        lo, hi = _RANGES[types[name]]
        setattr(struct, name, checked_int(value, name, lo, hi))


def raise_for_status(status, func=None, args=None):
    """ctypes ``errcheck`` of every status-returning function: the exception for a failed status."""
    if status != OK:
        name = lib.expcache_status_string(status).decode()
        raise error_for(status, name, lib.expcache_last_error().decode(errors="replace"))
    return status


# Each exported function: (name, argtypes, restype); status-returning ones (c_int32) raise on failure.
# expcache.h, in the header's order:
_FUNCTIONS = [
    # const char* expcache_status_string(expcache_status_t status);
    ("expcache_status_string", [c_int32], c_char_p),
    # const char* expcache_last_error(void);
    ("expcache_last_error", [], c_char_p),
    # uint32_t expcache_version(void);
    ("expcache_version", [], c_uint32),
    # const char* expcache_policy_name(uint32_t policy);
    ("expcache_policy_name", [c_uint32], c_char_p),
    # expcache_status_t expcache_config_init(expcache_config_t* config);
    ("expcache_config_init", [POINTER(Config)], c_int32),
    # expcache_status_t expcache_create(const expcache_config_t* config, expcache_t** out_cache);
    ("expcache_create", [POINTER(Config), POINTER(CachePtr)], c_int32),
    # void expcache_destroy(expcache_t* cache);
    ("expcache_destroy", [CachePtr], None),
    # expcache_status_t expcache_backend_get(const expcache_t* cache, uint32_t* out_backend);
    ("expcache_backend_get", [CachePtr, POINTER(c_uint32)], c_int32),
    # expcache_status_t expcache_layer_desc_init(expcache_layer_desc_t* desc);
    ("expcache_layer_desc_init", [POINTER(LayerDesc)], c_int32),
    # expcache_status_t expcache_file_open(expcache_t* cache, const char* path, uint32_t* out_file);
    ("expcache_file_open", [CachePtr, c_char_p, POINTER(c_uint32)], c_int32),
    # expcache_status_t expcache_file_open_fd(expcache_t* cache, int fd, uint32_t* out_file);
    ("expcache_file_open_fd", [CachePtr, c_int32, POINTER(c_uint32)], c_int32),
    # expcache_status_t expcache_layer_register(expcache_t* cache, uint32_t layer, const expcache_layer_desc_t* desc);
    ("expcache_layer_register", [CachePtr, c_uint32, POINTER(LayerDesc)], c_int32),
    # expcache_status_t expcache_layers_register(expcache_t* cache, uint32_t n, const uint32_t* layers,
    #                                            const expcache_layer_desc_t* descs);
    ("expcache_layers_register", [CachePtr, c_uint32, c_void_p, c_void_p], c_int32),
    # expcache_status_t expcache_layer_unregister(expcache_t* cache, uint32_t layer);
    ("expcache_layer_unregister", [CachePtr, c_uint32], c_int32),
    # expcache_status_t expcache_budget_set(expcache_t* cache, uint64_t budget_experts, uint64_t budget_bytes);
    ("expcache_budget_set", [CachePtr, c_uint64, c_uint64], c_int32),
    # expcache_status_t expcache_reserve_set(expcache_t* cache, uint64_t reserve_bytes);
    ("expcache_reserve_set", [CachePtr, c_uint64], c_int32),
    # expcache_status_t expcache_budget_get(const expcache_t* cache, uint64_t* out_budget_experts,
    #     uint64_t* out_budget_bytes, uint32_t* out_free_memory);
    ("expcache_budget_get", [CachePtr, POINTER(c_uint64), POINTER(c_uint64), POINTER(c_uint32)], c_int32),
    # expcache_status_t expcache_device_memory_get(expcache_t* cache, uint64_t* out_free, uint64_t* out_total);
    ("expcache_device_memory_get", [CachePtr, POINTER(c_uint64), POINTER(c_uint64)], c_int32),
    # expcache_status_t expcache_select_async(expcache_t* cache, uint32_t layer, const uint32_t* ids, uint32_t k,
    #                                         void* stream, expcache_expert_ptrs_t* out_ptrs);
    ("expcache_select_async", [CachePtr, c_uint32, c_void_p, c_uint32, c_void_p, c_void_p], c_int32),
    # expcache_status_t expcache_select_ids_async(expcache_t* cache, uint32_t layer, const void* ids,
    #                                             uint32_t id_bits, uint32_t k, void* stream,
    #                                             expcache_expert_ptrs_t* out_ptrs);
    ("expcache_select_ids_async", [CachePtr, c_uint32, c_void_p, c_uint32, c_uint32, c_void_p, c_void_p], c_int32),
    # expcache_status_t expcache_select_slots_async(expcache_t* cache, uint32_t layer, const void* ids,
    #                                               uint32_t id_bits, uint32_t k, int32_t* out_slots, void* stream);
    ("expcache_select_slots_async", [CachePtr, c_uint32, c_void_p, c_uint32, c_uint32, c_void_p, c_void_p], c_int32),
    # expcache_status_t expcache_select_split_async(expcache_t* cache, uint32_t layer, const uint32_t* ids,
    #     uint32_t k, void* stream, expcache_expert_ptrs_t* out_ptrs, uint8_t* out_resident, void** out_ready);
    (
        "expcache_select_split_async",
        [CachePtr, c_uint32, c_void_p, c_uint32, c_void_p, c_void_p, c_void_p, POINTER(c_void_p)],
        c_int32,
    ),
    # expcache_status_t expcache_select_split_ids_async(expcache_t* cache, uint32_t layer, const void* ids,
    #     uint32_t id_bits, uint32_t k, void* stream, expcache_expert_ptrs_t* out_ptrs, uint8_t* out_resident,
    #     void** out_ready);
    (
        "expcache_select_split_ids_async",
        [CachePtr, c_uint32, c_void_p, c_uint32, c_uint32, c_void_p, c_void_p, c_void_p, POINTER(c_void_p)],
        c_int32,
    ),
    # expcache_status_t expcache_prefetch_ids_async(expcache_t* cache, uint32_t layer, const void* ids,
    #                                               uint32_t id_bits, uint32_t n, void* stream, uint32_t* out_queued);
    (
        "expcache_prefetch_ids_async",
        [CachePtr, c_uint32, c_void_p, c_uint32, c_uint32, c_void_p, POINTER(c_uint32)],
        c_int32,
    ),
    # expcache_status_t expcache_hint_ids(expcache_t* cache, uint32_t layer, const void* ids, uint32_t id_bits,
    #                                     uint32_t n);
    ("expcache_hint_ids", [CachePtr, c_uint32, c_void_p, c_uint32, c_uint32], c_int32),
    # expcache_status_t expcache_compact_load_ids_async(expcache_t* cache, uint32_t layer, const void* ids,
    #     uint32_t id_bits, uint32_t n, void* stream, expcache_compact_t* out);
    (
        "expcache_compact_load_ids_async",
        [CachePtr, c_uint32, c_void_p, c_uint32, c_uint32, c_void_p, POINTER(Compact)],
        c_int32,
    ),
    # expcache_status_t expcache_batch_prepare_ids_async(expcache_t* cache, uint32_t layer, const void* ids,
    #     uint32_t id_bits, uint64_t n, void* stream, uint32_t* out_ids, expcache_expert_ptrs_t* out_ptrs,
    #     uint32_t* out_count, uint64_t* out_batch);
    (
        "expcache_batch_prepare_ids_async",
        [
            CachePtr,
            c_uint32,
            c_void_p,
            c_uint32,
            c_uint64,
            c_void_p,
            c_void_p,
            c_void_p,
            POINTER(c_uint32),
            POINTER(c_uint64),
        ],
        c_int32,
    ),
    # expcache_status_t expcache_insert_async(expcache_t* cache, uint32_t layer, const void* ids, uint32_t id_bits,
    #                                         const float* priorities, uint32_t n, void* stream);
    ("expcache_insert_async", [CachePtr, c_uint32, c_void_p, c_uint32, c_void_p, c_uint32, c_void_p], c_int32),
    # expcache_status_t expcache_class_find(const expcache_t* cache, uint64_t gate_bytes, uint64_t up_bytes,
    #                                       uint64_t down_bytes, uint32_t* out_class);
    ("expcache_class_find", [CachePtr, c_uint64, c_uint64, c_uint64, POINTER(c_uint32)], c_int32),
    # expcache_status_t expcache_class_find_parts(const expcache_t* cache, uint32_t num_parts,
    #     const uint64_t* part_bytes, uint32_t* out_class);
    ("expcache_class_find_parts", [CachePtr, c_uint32, POINTER(c_uint64), POINTER(c_uint32)], c_int32),
    # expcache_status_t expcache_ready_wait_async(expcache_t* cache, void* ready, void* stream);
    ("expcache_ready_wait_async", [CachePtr, c_void_p, c_void_p], c_int32),
    # expcache_status_t expcache_prefetch_async(expcache_t* cache, uint32_t layer, const uint32_t* ids,
    #                                           uint32_t n, void* stream, uint32_t* out_queued);
    ("expcache_prefetch_async", [CachePtr, c_uint32, c_void_p, c_uint32, c_void_p, POINTER(c_uint32)], c_int32),
    # expcache_status_t expcache_prefetch_wait(expcache_t* cache);
    ("expcache_prefetch_wait", [CachePtr], c_int32),
    # expcache_status_t expcache_hint(expcache_t* cache, uint32_t layer, const uint32_t* ids, uint32_t n);
    ("expcache_hint", [CachePtr, c_uint32, c_void_p, c_uint32], c_int32),
    # expcache_status_t expcache_compact_load_async(expcache_t* cache, uint32_t layer, const uint32_t* ids, uint32_t n,
    #                                               void* stream, expcache_compact_t* out);
    ("expcache_compact_load_async", [CachePtr, c_uint32, c_void_p, c_uint32, c_void_p, POINTER(Compact)], c_int32),
    # expcache_status_t expcache_batch_prepare_async(expcache_t* cache, uint32_t layer, const uint32_t* ids, uint64_t n,
    #     void* stream, uint32_t* out_ids, expcache_expert_ptrs_t* out_ptrs, uint32_t* out_count, uint64_t* out_batch);
    (
        "expcache_batch_prepare_async",
        [CachePtr, c_uint32, c_void_p, c_uint64, c_void_p, c_void_p, c_void_p, POINTER(c_uint32), POINTER(c_uint64)],
        c_int32,
    ),
    # expcache_status_t expcache_batch_prepare_slots_async(expcache_t* cache, uint32_t layer, const void* ids,
    #     uint32_t id_bits, uint64_t n, void* stream, uint32_t* out_ids, int32_t* out_slots, uint32_t* out_count,
    #     uint64_t* out_batch);
    (
        "expcache_batch_prepare_slots_async",
        [
            CachePtr,
            c_uint32,
            c_void_p,
            c_uint32,
            c_uint64,
            c_void_p,
            c_void_p,
            c_void_p,
            POINTER(c_uint32),
            POINTER(c_uint64),
        ],
        c_int32,
    ),
    # expcache_status_t expcache_batch_finish(expcache_t* cache, uint64_t batch, void* stream);
    ("expcache_batch_finish", [CachePtr, c_uint64, c_void_p], c_int32),
    # expcache_status_t expcache_release_all(expcache_t* cache);
    ("expcache_release_all", [CachePtr], c_int32),
    # expcache_status_t expcache_synchronize(expcache_t* cache, void* stream);
    ("expcache_synchronize", [CachePtr, c_void_p], c_int32),
    # expcache_status_t expcache_class_bank_get(expcache_t* cache, uint32_t class_index, expcache_bank_t* out);
    ("expcache_class_bank_get", [CachePtr, c_uint32, POINTER(Bank)], c_int32),
    # expcache_status_t expcache_select_device_async(expcache_t* cache, uint32_t layer, const void* ids,
    #                                                uint32_t id_bits, uint32_t n, uint32_t k, int32_t* out_slots,
    #                                                void* stream);
    (
        "expcache_select_device_async",
        [CachePtr, c_uint32, c_void_p, c_uint32, c_uint32, c_uint32, c_void_p, c_void_p],
        c_int32,
    ),
    # expcache_status_t expcache_select_device_counted_async(expcache_t* cache, uint32_t layer, const void* ids,
    #                                                        uint32_t id_bits, uint32_t n, uint32_t k,
    #                                                        int32_t* out_slots, uint32_t* out_counts, void* stream);
    (
        "expcache_select_device_counted_async",
        [CachePtr, c_uint32, c_void_p, c_uint32, c_uint32, c_uint32, c_void_p, c_void_p, c_void_p],
        c_int32,
    ),
    # expcache_status_t expcache_class_count_get(const expcache_t* cache, uint32_t* out_count);
    ("expcache_class_count_get", [CachePtr, POINTER(c_uint32)], c_int32),
    # expcache_status_t expcache_class_info_get(const expcache_t* cache, uint32_t class_index,
    #                                           expcache_class_info_t* out);
    ("expcache_class_info_get", [CachePtr, c_uint32, POINTER(ClassInfo)], c_int32),
    # expcache_status_t expcache_stats_read(const expcache_t* cache, uint32_t num_classes,
    #                                       expcache_class_info_t* infos, expcache_stats_t* stats);
    ("expcache_stats_read", [CachePtr, c_uint32, POINTER(ClassInfo), POINTER(Stats)], c_int32),
    # expcache_status_t expcache_layer_bind_class(expcache_t* cache, uint32_t layer, uint32_t* out_class);
    ("expcache_layer_bind_class", [CachePtr, c_uint32, POINTER(c_uint32)], c_int32),
    # const char* expcache_path_name(uint32_t path);
    ("expcache_path_name", [c_uint32], c_char_p),
    # expcache_status_t expcache_stats_get(const expcache_t* cache, uint32_t class_index, uint32_t path,
    #                                      expcache_stats_t* out);
    ("expcache_stats_get", [CachePtr, c_uint32, c_uint32, POINTER(Stats)], c_int32),
    # expcache_status_t expcache_staging_stats_get(const expcache_t* cache, expcache_staging_stats_t* out);
    ("expcache_staging_stats_get", [CachePtr, POINTER(StagingStats)], c_int32),
    # expcache_status_t expcache_prefetch_stats_get(const expcache_t* cache, expcache_prefetch_stats_t* out);
    ("expcache_prefetch_stats_get", [CachePtr, POINTER(PrefetchStats)], c_int32),
    # expcache_status_t expcache_pool_stats_get(const expcache_t* cache, expcache_pool_stats_t* out);
    ("expcache_pool_stats_get", [CachePtr, POINTER(PoolStats)], c_int32),
    # expcache_status_t expcache_stats_reset(expcache_t* cache);
    ("expcache_stats_reset", [CachePtr], c_int32),
    # expcache_status_t expcache_memory_retain(expcache_t* cache, const void* ptr, expcache_memory_ref_t** out_ref);
    ("expcache_memory_retain", [CachePtr, c_void_p, POINTER(MemoryRefPtr)], c_int32),
    # void expcache_memory_release(expcache_memory_ref_t* ref);
    ("expcache_memory_release", [MemoryRefPtr], None),
    # expcache_status_t expcache_memory_set_dropped_callback(expcache_t* cache, expcache_memory_dropped_fn fn,
    #                                                        void* user);
    ("expcache_memory_set_dropped_callback", [CachePtr, DROPPED_FN, c_void_p], c_int32),
    # expcache_status_t expcache_log_set_callback(expcache_t* cache, expcache_log_fn fn, void* user);
    ("expcache_log_set_callback", [CachePtr, LOG_FN, c_void_p], c_int32),
    # expcache_status_t expcache_log_set_level(expcache_t* cache, uint32_t level);
    ("expcache_log_set_level", [CachePtr, c_uint32], c_int32),
    # expcache_testing.h:
    # expcache_status_t expcache_testing_read_resident(expcache_t* cache, uint32_t layer, uint32_t expert,
    #                                                  void* dst, uint64_t dst_bytes, uint32_t* out_resident);
    ("expcache_testing_read_resident", [CachePtr, c_uint32, c_uint32, c_void_p, c_uint64, POINTER(c_uint32)], c_int32),
    # expcache_status_t expcache_testing_read_device(expcache_t* cache, const void* src, void* dst, uint64_t n);
    ("expcache_testing_read_device", [CachePtr, c_void_p, c_void_p, c_uint64], c_int32),
    # expcache_status_t expcache_testing_checksum(expcache_t* cache, uint32_t layer,
    #                                             const expcache_expert_ptrs_t* ptrs, uint32_t n,
    #                                             void* stream, uint64_t* out_sums);
    ("expcache_testing_checksum", [CachePtr, c_uint32, c_void_p, c_uint32, c_void_p, c_void_p], c_int32),
    # expcache_status_t expcache_testing_checksum_async(expcache_t* cache, uint32_t layer,
    #                                                   const expcache_expert_ptrs_t* ptrs, uint32_t n,
    #                                                   void* stream, uint32_t first);
    ("expcache_testing_checksum_async", [CachePtr, c_uint32, c_void_p, c_uint32, c_void_p, c_uint32], c_int32),
    # expcache_status_t expcache_testing_bank_checksum_async(expcache_t* cache, uint32_t layer, const int32_t* slots,
    #                                                        uint32_t n, void* stream, uint32_t first);
    ("expcache_testing_bank_checksum_async", [CachePtr, c_uint32, c_void_p, c_uint32, c_void_p, c_uint32], c_int32),
    # expcache_status_t expcache_testing_checksum_results(expcache_t* cache, uint32_t first, uint32_t n,
    #                                                     uint64_t* out);
    ("expcache_testing_checksum_results", [CachePtr, c_uint32, c_uint32, c_void_p], c_int32),
    # expcache_status_t expcache_testing_inject_alloc_failures(expcache_t* cache, uint64_t skip, uint64_t count);
    ("expcache_testing_inject_alloc_failures", [CachePtr, c_uint64, c_uint64], c_int32),
    # expcache_status_t expcache_testing_inject_copy_failures(expcache_t* cache, uint64_t skip, uint64_t count);
    ("expcache_testing_inject_copy_failures", [CachePtr, c_uint64, c_uint64], c_int32),
    # expcache_status_t expcache_testing_inject_staging_failures(expcache_t* cache, uint64_t skip, uint64_t count);
    ("expcache_testing_inject_staging_failures", [CachePtr, c_uint64, c_uint64], c_int32),
    # expcache_status_t expcache_testing_prefetch_pause(expcache_t* cache, uint32_t paused);
    ("expcache_testing_prefetch_pause", [CachePtr, c_uint32], c_int32),
    # expcache_status_t expcache_testing_spin_async(expcache_t* cache, void* stream, uint64_t ns);
    ("expcache_testing_spin_async", [CachePtr, c_void_p, c_uint64], c_int32),
    # expcache_status_t expcache_testing_device_bytes_in_use(const expcache_t* cache, uint64_t* out_bytes);
    ("expcache_testing_device_bytes_in_use", [CachePtr, POINTER(c_uint64)], c_int32),
    # expcache_status_t expcache_testing_table_reads(expcache_t* cache, uint32_t layer, uint64_t* out_count);
    ("expcache_testing_table_reads", [CachePtr, c_uint32, POINTER(c_uint64)], c_int32),
    # expcache_status_t expcache_testing_device_reads(const expcache_t* cache, uint64_t* out_syncs,
    #                                                 uint64_t* out_copies);
    ("expcache_testing_device_reads", [CachePtr, POINTER(c_uint64), POINTER(c_uint64)], c_int32),
    # uint32_t expcache_testing_struct_size(uint32_t which);
    ("expcache_testing_struct_size", [c_uint32], c_uint32),
]


def _declare(dll: ctypes.CDLL) -> None:
    for name, argtypes, restype in _FUNCTIONS:
        fn = getattr(dll, name)
        fn.argtypes = argtypes
        fn.restype = restype
        if restype is c_int32:
            fn.errcheck = raise_for_status


# The ctypes mirror of each public struct, by its EXPCACHE_STRUCT_* index.
STRUCT_MIRRORS = {
    STRUCT_CONFIG: Config,
    STRUCT_LAYER_DESC: LayerDesc,
    STRUCT_EXPERT_PTRS: ExpertPtrs,
    STRUCT_COMPACT: Compact,
    STRUCT_CLASS_INFO: ClassInfo,
    STRUCT_STATS: Stats,
    STRUCT_STAGING_STATS: StagingStats,
    STRUCT_PREFETCH_STATS: PrefetchStats,
    STRUCT_BANK: Bank,
    STRUCT_POOL_STATS: PoolStats,
}
assert sorted(STRUCT_MIRRORS) == list(range(STRUCT_COUNT))


def check_struct_sizes(dll: ctypes.CDLL, path) -> None:
    """Raise ImportError when a ctypes mirror disagrees with the library's struct sizes
    (every public struct, through expcache_testing_struct_size)."""
    for which, mirror in STRUCT_MIRRORS.items():
        size = dll.expcache_testing_struct_size(which)
        if ctypes.sizeof(mirror) != size:
            raise ImportError(
                f"{path}: struct {mirror.__name__} is {size} bytes in the library but "
                f"{ctypes.sizeof(mirror)} in pyexpcache; rebuild the library (make lib)"
            )


def policy_table(dll: ctypes.CDLL) -> dict[str, int]:
    """{name: id} of the library's eviction policies: expcache_policy_name of ids 0, 1, ... until NULL."""
    table: dict[str, int] = {}
    while (name := dll.expcache_policy_name(len(table))) is not None:
        table[name.decode()] = len(table)
    return table


def path_table(dll: ctypes.CDLL) -> tuple[str, ...]:
    """The names of the library's serving paths in id order: expcache_path_name of ids 0, 1, ... until NULL."""
    names: list[str] = []
    while (name := dll.expcache_path_name(len(names))) is not None:
        names.append(name.decode())
    return tuple(names)


def default_policy(dll: ctypes.CDLL) -> str:
    """The name of the policy expcache_config_init fills in."""
    cfg = Config()
    dll.expcache_config_init(ctypes.byref(cfg))
    return dll.expcache_policy_name(cfg.policy).decode()


_load_lock = threading.Lock()


def _load() -> None:
    """Find, load and declare the library once; then ``lib``, ``library_path``, ``POLICIES``,
    ``DEFAULT_POLICY`` and ``PATH_NAMES`` are plain globals."""
    global lib, library_path, POLICIES, DEFAULT_POLICY, PATH_NAMES
    with _load_lock:
        if "lib" in globals():
            return
        dll, path = _loader.load()
        if _loader.skipped and path.name == "libexpcache_host.so":
            warnings.warn(
                f"libexpcache: loaded {path}; the CUDA backend is unavailable because "
                + "; ".join(_loader.skipped)
                + " (the CUDA build links the shared CUDA runtime: install the toolkit, or torch's "
                "nvidia-cuda-runtime wheel, or build with `make lib CUDART=static`)",
                RuntimeWarning,
                stacklevel=2,
            )
        _declare(dll)
        check_struct_sizes(dll, path)
        POLICIES = policy_table(dll)
        DEFAULT_POLICY = default_policy(dll)
        PATH_NAMES = path_table(dll)
        library_path = path
        lib = dll


def __getattr__(name: str):
    # Only reached while ``lib`` / ``library_path`` are not yet globals (PEP 562).
    if name in ("lib", "library_path", "POLICIES", "DEFAULT_POLICY", "PATH_NAMES"):
        _load()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
