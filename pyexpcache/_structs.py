"""The ctypes mirrors of expcache.h's structs, field by field, with the callback and handle types
(re-exported by ``_lib``). :func:`set_fields` is how a struct is filled: it range-checks every
integer against its C field type, since ctypes would silently wrap it. The library's own sizes are
checked against these when it loads (``_lib.check_struct_sizes``, by ``STRUCT_MIRRORS``)."""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_char_p, c_int32, c_uint32, c_uint64, c_void_p

from ._constants import (
    MAX_PARTS,
    STRUCT_BANK,
    STRUCT_CLASS_INFO,
    STRUCT_COMPACT,
    STRUCT_CONFIG,
    STRUCT_COUNT,
    STRUCT_EXPERT_PTRS,
    STRUCT_LAYER_DESC,
    STRUCT_POOL_STATS,
    STRUCT_PREFETCH_STATS,
    STRUCT_STAGING_STATS,
    STRUCT_STATS,
)
from ._ints import I32_MAX, I32_MIN, U32_MAX, U64_MAX, checked_int


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
        ("bank_arrangement", c_uint32),
        ("reserved2", c_uint32),
    ]


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
        ("arrangement", c_uint32),
        ("reserved", c_uint32),
        ("part_stride", c_uint64 * MAX_PARTS),
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
