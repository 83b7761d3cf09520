"""The C ABI, called raw through ctypes: struct sizes, status strings, and a
table of bad input for every exported function. Each bad call must return
the documented status with a message naming the problem, and leave the
cache working."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from ctypes import byref, c_uint32, c_uint64

import numpy as np
import pytest

from pyexpcache import ExpcacheError, ExpertCache, HostSource, ModelLayout, _lib, testing
from pyexpcache._lib import lib

from support.cache import SCALE

INVALID, OOM, STATE, UNSUPPORTED, IO = (
    _lib.ERR_INVALID_ARGUMENT,
    _lib.ERR_OUT_OF_DEVICE_MEMORY,
    _lib.ERR_INVALID_STATE,
    _lib.ERR_UNSUPPORTED,
    _lib.ERR_IO,
)

# The exports of expcache.h and of expcache_testing.h: one naming scheme (expcache_<verb> on the
# cache handle, expcache_<object>_<verb> otherwise; the test hooks expcache_testing_*).
EXPORTS = {
    "expcache_status_string",
    "expcache_last_error",
    "expcache_version",
    "expcache_policy_name",
    "expcache_config_init",
    "expcache_create",
    "expcache_destroy",
    "expcache_backend_get",
    "expcache_layer_desc_init",
    "expcache_file_open",
    "expcache_file_open_fd",
    "expcache_layer_register",
    "expcache_layers_register",
    "expcache_layer_unregister",
    "expcache_budget_set",
    "expcache_reserve_set",
    "expcache_select_async",
    "expcache_select_slots_async",
    "expcache_select_ids_async",
    "expcache_select_split_ids_async",
    "expcache_prefetch_ids_async",
    "expcache_hint_ids",
    "expcache_insert_async",
    "expcache_compact_load_ids_async",
    "expcache_batch_prepare_ids_async",
    "expcache_compact_load_async",
    "expcache_batch_prepare_async",
    "expcache_batch_prepare_slots_async",
    "expcache_batch_finish",
    "expcache_release_all",
    "expcache_synchronize",
    "expcache_class_bank_get",
    "expcache_select_device_async",
    "expcache_select_device_counted_async",
    "expcache_class_count_get",
    "expcache_class_info_get",
    "expcache_layer_bind_class",
    "expcache_class_find",
    "expcache_class_find_parts",
    "expcache_budget_get",
    "expcache_device_memory_get",
    "expcache_path_name",
    "expcache_stats_get",
    "expcache_stats_read",
    "expcache_staging_stats_get",
    "expcache_stats_reset",
    "expcache_log_set_callback",
    "expcache_log_set_level",
    "expcache_select_split_async",
    "expcache_ready_wait_async",
    "expcache_prefetch_async",
    "expcache_hint",
    "expcache_prefetch_stats_get",
    "expcache_pool_stats_get",
    "expcache_prefetch_wait",
    "expcache_memory_retain",
    "expcache_memory_release",
    "expcache_memory_set_dropped_callback",
}
TESTING_EXPORTS = {
    "expcache_testing_read_resident",
    "expcache_testing_read_device",
    "expcache_testing_checksum",
    "expcache_testing_checksum_async",
    "expcache_testing_bank_checksum_async",
    "expcache_testing_bank_checksum_host_slots_async",
    "expcache_testing_checksum_results",
    "expcache_testing_inject_alloc_failures",
    "expcache_testing_inject_copy_failures",
    "expcache_testing_inject_staging_failures",
    "expcache_testing_device_bytes_in_use",
    "expcache_testing_struct_size",
    "expcache_testing_prefetch_pause",
    "expcache_testing_spin_async",
    "expcache_testing_table_reads",
    "expcache_testing_device_reads",
}


def test_struct_sizes_match_library():
    mirrors = {
        _lib.STRUCT_CONFIG: _lib.Config,
        _lib.STRUCT_LAYER_DESC: _lib.LayerDesc,
        _lib.STRUCT_EXPERT_PTRS: _lib.ExpertPtrs,
        _lib.STRUCT_COMPACT: _lib.Compact,
        _lib.STRUCT_CLASS_INFO: _lib.ClassInfo,
        _lib.STRUCT_STATS: _lib.Stats,
        _lib.STRUCT_STAGING_STATS: _lib.StagingStats,
        _lib.STRUCT_PREFETCH_STATS: _lib.PrefetchStats,
        _lib.STRUCT_BANK: _lib.Bank,
        _lib.STRUCT_POOL_STATS: _lib.PoolStats,
    }
    assert sorted(mirrors) == list(range(_lib.STRUCT_COUNT))
    for which, mirror in mirrors.items():
        assert lib.expcache_testing_struct_size(which) == ctypes.sizeof(mirror), mirror.__name__


@pytest.mark.parametrize("which", [_lib.STRUCT_COUNT, _lib.STRUCT_COUNT + 1, 1000, (1 << 32) - 1])
def test_struct_size_of_an_unknown_struct_is_zero(which):
    assert lib.expcache_testing_struct_size(which) == 0


def test_every_exported_function_is_declared():
    out = subprocess.run(["nm", "-D", "--defined-only", str(_lib.library_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    exported = {line.split()[-1] for line in out.stdout.splitlines() if " T expcache_" in line}
    expected = EXPORTS | TESTING_EXPORTS
    assert exported == expected, ("unexpected", sorted(exported - expected), "missing", sorted(expected - exported))
    assert {name for name, _, _ in _lib._FUNCTIONS} == exported
    for name in exported:
        assert getattr(lib, name).restype is not None or name in ("expcache_destroy", "expcache_memory_release"), name
        assert getattr(lib, name).argtypes is not None, name


def _header_exports(name):
    import re
    from pathlib import Path

    header = Path(__file__).resolve().parent.parent / "libexpcache" / "include" / name
    if not header.exists():
        pytest.skip(f"{header} not in this tree")
    return set(re.findall(r"^EXPCACHE_API [^(]*?\b(expcache_\w+)\(", header.read_text(), re.M))


def test_headers_declare_the_exports():
    """expcache.h declares the production exports, expcache_testing.h the test hooks."""
    assert _header_exports("expcache.h") == EXPORTS
    assert _header_exports("expcache_testing.h") == TESTING_EXPORTS


def test_status_codes_match_the_header():
    import re
    from pathlib import Path

    from pyexpcache import _errors

    header = Path(__file__).resolve().parent.parent / "libexpcache" / "include" / "expcache.h"
    if not header.exists():
        pytest.skip(f"{header} not in this tree")
    codes = dict(re.findall(r"^#define EXPCACHE_(OK|ERR_\w+) (\d+)", header.read_text(), re.M))
    assert {n: int(v) for n, v in codes.items()} == {
        n: getattr(_lib, n) for n in dir(_errors) if n == "OK" or n.startswith("ERR_")
    }
    for n in codes:
        assert lib.expcache_status_string(getattr(_lib, n)).decode() == "EXPCACHE_" + n
    assert set(_errors._BY_STATUS) == {getattr(_lib, n) for n in codes if n != "OK"}


def test_status_strings_are_static_and_never_null():
    names = [lib.expcache_status_string(s).decode() for s in range(-1, 11)]
    assert names[1] == "EXPCACHE_OK" and names[2] == "EXPCACHE_ERR_INVALID_ARGUMENT"
    assert names[0] == names[-1] == "EXPCACHE_ERR_UNKNOWN"


def test_policy_names_match_the_header():
    """expcache_policy_name names each EXPCACHE_POLICY_* id by its constant's lower-case tail; the ids
    are 0..EXPCACHE_POLICY_COUNT-1, and past them it returns NULL."""
    import re
    from pathlib import Path

    header = Path(__file__).resolve().parent.parent / "libexpcache" / "include" / "expcache.h"
    if not header.exists():
        pytest.skip(f"{header} not in this tree")
    defines = {n: int(v) for n, v in re.findall(r"^#define EXPCACHE_POLICY_(\w+) (\d+)", header.read_text(), re.M)}
    count = defines.pop("COUNT")
    assert sorted(defines.values()) == list(range(count))
    assert {lib.expcache_policy_name(i).decode(): i for i in range(count)} == {n.lower(): i for n, i in defines.items()}
    assert _lib.POLICIES == {n.lower(): i for n, i in sorted(defines.items(), key=lambda d: d[1])}
    assert list(_lib.POLICIES.values()) == list(range(count))  # in id order
    for unknown in (count, count + 1, 1000, (1 << 32) - 1):
        assert lib.expcache_policy_name(unknown) is None


def test_path_names_match_the_header():
    """expcache_path_name names each EXPCACHE_PATH_* id by its constant's lower-case tail; the ids
    are 0..EXPCACHE_NUM_PATHS-1, past them it returns NULL, and pyexpcache's PATH_NAMES (what
    stats() names the paths) is the library's table in id order."""
    import re
    from pathlib import Path

    header = Path(__file__).resolve().parent.parent / "libexpcache" / "include" / "expcache.h"
    if not header.exists():
        pytest.skip(f"{header} not in this tree")
    text = header.read_text()
    defines = {n: int(v) for n, v in re.findall(r"^#define EXPCACHE_PATH_(\w+) +(\d+)", text, re.M)}
    count = int(re.search(r"^#define EXPCACHE_NUM_PATHS (\d+)", text, re.M).group(1))
    assert sorted(defines.values()) == list(range(count))
    assert {lib.expcache_path_name(i).decode(): i for i in range(count)} == {n.lower(): i for n, i in defines.items()}
    assert _lib.PATH_NAMES == tuple(n.lower() for n, _ in sorted(defines.items(), key=lambda d: d[1]))
    for unknown in (count, count + 1, 1000, (1 << 32) - 1):
        assert lib.expcache_path_name(unknown) is None


def test_unknown_policy_message_lists_the_policies():
    count = len(_lib.POLICIES)
    listed = ", ".join(f"{i} {name}" for name, i in _lib.POLICIES.items())
    _expect(
        "expcache_create",
        (byref(_cfg(policy=count)), byref(_lib.CachePtr())),
        INVALID,
        f"unknown policy {count} ({listed})",
    )


def test_unknown_partition_is_refused_with_the_accepted_values():
    for bad in (2, 7, (1 << 32) - 1):
        _expect(
            "expcache_create",
            (byref(_cfg(partition=bad)), byref(_lib.CachePtr())),
            INVALID,
            f"unknown partition {bad} (0 global, 1 layer)",
        )


def test_unknown_bank_arrangement_is_refused_with_the_accepted_values():
    for bad in (2, 9, (1 << 32) - 1):
        _expect(
            "expcache_create",
            (byref(_cfg(bank_arrangement=bad)), byref(_lib.CachePtr())),
            INVALID,
            f"unknown bank_arrangement {bad} (0 slots, 1 parts)",
        )


def test_bank_arrangement_constants_match_the_header():
    import re
    from pathlib import Path

    header = Path(__file__).resolve().parent.parent / "libexpcache" / "include" / "expcache.h"
    if not header.exists():
        pytest.skip(f"{header} not in this tree")
    defines = {n: int(v) for n, v in re.findall(r"^#define EXPCACHE_BANK_(\w+) (\d+)", header.read_text(), re.M)}
    assert {n.lower(): v for n, v in defines.items()} == _lib.BANK_ARRANGEMENTS


def test_partition_defaults_to_global():
    cfg = _lib.Config()
    lib.expcache_config_init(byref(cfg))
    assert cfg.partition == _lib.PARTITIONS["global"] == 0


@pytest.fixture
def live():
    layout = ModelLayout.preset("q2", scale=SCALE)
    source = HostSource(layout)
    cache = ExpertCache(layout, source, budget_experts=8, backend="host")
    yield cache, source
    cache.close()


@pytest.fixture
def dead():
    layout = ModelLayout.preset("q2", scale=SCALE)
    source = HostSource(layout)
    cache = ExpertCache(layout, source, budget_experts=8, backend="host")
    handle = cache._handle
    cache.close()
    return handle


def _desc(**over):
    d = _lib.LayerDesc()
    lib.expcache_layer_desc_init(byref(d))
    buf = _desc.buf = np.zeros(4096, np.uint8)
    d.num_experts, d.gate_bytes, d.up_bytes, d.down_bytes = 4, 256, 256, 256
    d.gate_stride = d.up_stride = d.down_stride = 256
    d.gate_base = d.up_base = d.down_base = buf.ctypes.data
    for k, v in over.items():
        setattr(d, k, v)
    return d


def _cfg(**over):
    c = _lib.Config()
    lib.expcache_config_init(byref(c))
    c.num_layers, c.budget_experts, c.backend = 2, 4, 1
    for k, v in over.items():
        setattr(c, k, v)
    return c


def test_staging_defaults_follow_the_cores():
    """copy_threads defaults to the usable cores (the CPU affinity) less 4, from 2 to 12; chunks to
    512 KiB; the Python
    helper reports what expcache_config_init fills in."""
    import os

    from pyexpcache import staging_defaults

    c = _lib.Config()
    lib.expcache_config_init(byref(c))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0
    assert c.copy_threads == (min(12, cores - 4) if cores >= 6 else 2)
    assert c.staging_chunk_bytes == 512 << 10
    assert staging_defaults() == (c.copy_threads, c.staging_chunk_bytes)


IDS = (c_uint32 * 8)(1, 2, 3, 4, 5, 6, 7, 8)
NEGATIVE_IDS = (ctypes.c_int64 * 1)(-1)
WIDE_IDS = (ctypes.c_int64 * 1)(1 << 32)
HUGE_ID = (c_uint32 * 1)(1_000_000)
BAD_IDS = (c_uint32 * 2)(1, 999)
PTRS = (_lib.ExpertPtrs * 1024)()
OUT_U32 = c_uint32()
OUT_U64 = c_uint64()


def _compact():
    c = _lib.Compact()
    c.struct_size = ctypes.sizeof(c)
    return c


def _stats(size=None):
    s = _lib.Stats()
    s.struct_size = ctypes.sizeof(s) if size is None else size
    return s


def _staging(size=None):
    s = _lib.StagingStats()
    s.struct_size = ctypes.sizeof(s) if size is None else size
    return s


def _prefetch_stats(size=None):
    s = _lib.PrefetchStats()
    s.struct_size = ctypes.sizeof(s) if size is None else size
    return s


def _pool_stats(size=None):
    s = _lib.PoolStats()
    s.struct_size = ctypes.sizeof(s) if size is None else size
    return s


def _descs(n, bad_size_at=None):
    """n layer descriptors of 8 pageable experts (the one at bad_size_at with struct_size 0)."""
    out = (_lib.LayerDesc * n)()
    for i, d in enumerate(out):
        lib.expcache_layer_desc_init(byref(d))
        d.num_experts, d.source_kind = 8, _lib.SOURCE_PAGEABLE
        for part in ("gate", "up", "down"):
            setattr(d, f"{part}_bytes", 64)
            setattr(d, f"{part}_stride", 64)
            setattr(d, f"{part}_base", HOST_BUF.ctypes.data)
        if i == bad_size_at:
            d.struct_size = 0
    return out


RESIDENT = (ctypes.c_uint8 * 1024)()
READY = ctypes.c_void_p()


def _info():
    i = _lib.ClassInfo()
    i.struct_size = ctypes.sizeof(i)
    return i


def _bank():
    b = _lib.Bank()
    b.struct_size = ctypes.sizeof(b)
    return b


HOST_BUF = np.zeros(1 << 16, np.uint8)

# (name, function, args(h) -> tuple, status, message fragment). `h` is a live handle.
CASES = [
    ("config_init NULL", "expcache_config_init", lambda h: (None,), INVALID, "config is NULL"),
    ("layer_desc_init NULL", "expcache_layer_desc_init", lambda h: (None,), INVALID, "desc is NULL"),
    ("create NULL config", "expcache_create", lambda h: (None, byref(_lib.CachePtr())), INVALID, "config is NULL"),
    ("create NULL out", "expcache_create", lambda h: (byref(_cfg()), None), INVALID, "out_cache is NULL"),
    (
        "create bad struct_size",
        "expcache_create",
        lambda h: (byref(_cfg(struct_size=3)), byref(_lib.CachePtr())),
        INVALID,
        "struct_size",
    ),
    (
        "create zero layers",
        "expcache_create",
        lambda h: (byref(_cfg(num_layers=0)), byref(_lib.CachePtr())),
        INVALID,
        "num_layers",
    ),
    (
        "create too many classes",
        "expcache_create",
        lambda h: (byref(_cfg(max_classes=65)), byref(_lib.CachePtr())),
        INVALID,
        "max_classes",
    ),
    (
        "create no budget",
        "expcache_create",
        lambda h: (byref(_cfg(budget_experts=0)), byref(_lib.CachePtr())),
        INVALID,
        "budget",
    ),
    (
        "create bad backend",
        "expcache_create",
        lambda h: (byref(_cfg(backend=7)), byref(_lib.CachePtr())),
        INVALID,
        "backend",
    ),
    (
        "create bad log level",
        "expcache_create",
        lambda h: (byref(_cfg(log_level=9)), byref(_lib.CachePtr())),
        INVALID,
        "log_level",
    ),
    (
        "create zero slab",
        "expcache_create",
        lambda h: (byref(_cfg(slab_bytes=0)), byref(_lib.CachePtr())),
        INVALID,
        "slab_bytes",
    ),
    (
        "create zero capacity",
        "expcache_create",
        lambda h: (byref(_cfg(device_capacity_bytes=0)), byref(_lib.CachePtr())),
        INVALID,
        "device_capacity_bytes",
    ),
    (
        "create too many copy threads",
        "expcache_create",
        lambda h: (byref(_cfg(copy_threads=65)), byref(_lib.CachePtr())),
        INVALID,
        "copy_threads",
    ),
    (
        "create tiny staging",
        "expcache_create",
        lambda h: (byref(_cfg(staging_bytes=4096)), byref(_lib.CachePtr())),
        INVALID,
        "staging_bytes",
    ),
    (
        "create unaligned staging chunk",
        "expcache_create",
        lambda h: (byref(_cfg(staging_chunk_bytes=(1 << 20) + 1)), byref(_lib.CachePtr())),
        INVALID,
        "staging_chunk_bytes",
    ),
    (
        "create tiny staging chunk",
        "expcache_create",
        lambda h: (byref(_cfg(staging_chunk_bytes=4096)), byref(_lib.CachePtr())),
        INVALID,
        "staging_chunk_bytes",
    ),
    (
        "create unknown file reads",
        "expcache_create",
        lambda h: (byref(_cfg(file_reads=7)), byref(_lib.CachePtr())),
        INVALID,
        "unknown file_reads 7",
    ),
    (
        "create config reserved set",
        "expcache_create",
        lambda h: (byref(_cfg(reserved=3)), byref(_lib.CachePtr())),
        INVALID,
        "reserved must be 0, got 3",
    ),
    (
        "create config reserved2 set",
        "expcache_create",
        lambda h: (byref(_cfg(reserved2=5)), byref(_lib.CachePtr())),
        INVALID,
        "reserved2 must be 0, got 5",
    ),
    (
        "create unknown bank arrangement",
        "expcache_create",
        lambda h: (byref(_cfg(bank_arrangement=2)), byref(_lib.CachePtr())),
        INVALID,
        "unknown bank_arrangement 2 (0 slots, 1 parts)",
    ),
    (
        "create host pool over the limit",
        "expcache_create",
        lambda h: (byref(_cfg(host_budget_bytes=(1 << 48) + 1)), byref(_lib.CachePtr())),
        INVALID,
        "host_budget_bytes must be 0 (no pool)..281474976710656 (2^48), got 281474976710657",
    ),
    (
        "create unknown policy",
        "expcache_create",
        lambda h: (byref(_cfg(policy=9)), byref(_lib.CachePtr())),
        INVALID,
        "unknown policy 9",
    ),
    ("backend_get NULL out", "expcache_backend_get", lambda h: (h, None), INVALID, "out_backend is NULL"),
    (
        "layer_register out of range",
        "expcache_layer_register",
        lambda h: (h, 43, byref(_desc())),
        INVALID,
        "layer 43 out of range",
    ),
    ("layer_register twice", "expcache_layer_register", lambda h: (h, 0, byref(_desc())), STATE, "already registered"),
    ("layer_register NULL desc", "expcache_layer_register", lambda h: (h, 0, None), INVALID, "desc is NULL"),
    (
        "layer_unregister out of range",
        "expcache_layer_unregister",
        lambda h: (h, 43),
        INVALID,
        "layer 43 out of range",
    ),
    ("budget_set both 0", "expcache_budget_set", lambda h: (h, 0, 0), INVALID, "set budget_experts or budget_bytes"),
    ("file_open NULL path", "expcache_file_open", lambda h: (h, None, byref(OUT_U32)), INVALID, "path is NULL"),
    (
        "file_open NULL out",
        "expcache_file_open",
        lambda h: (h, os.fsencode(__file__), None),
        INVALID,
        "out_file is NULL",
    ),
    (
        "file_open missing",
        "expcache_file_open",
        lambda h: (h, b"/nonexistent/x.gguf", byref(OUT_U32)),
        IO,
        "cannot open",
    ),
    ("file_open a folder", "expcache_file_open", lambda h: (h, b"/tmp", byref(OUT_U32)), IO, "not a regular file"),
    ("file_open_fd negative", "expcache_file_open_fd", lambda h: (h, -1, byref(OUT_U32)), INVALID, "fd -1 is not"),
    ("file_open_fd NULL out", "expcache_file_open_fd", lambda h: (h, 0, None), INVALID, "out_file is NULL"),
    (
        "file_open_fd not open",
        "expcache_file_open_fd",
        lambda h: (h, 1 << 20, byref(OUT_U32)),
        INVALID,
        "cannot duplicate descriptor 1048576",
    ),
    ("select NULL ids", "expcache_select_async", lambda h: (h, 0, None, 1, None, PTRS), INVALID, "ids is NULL"),
    (
        "select_ids NULL ids",
        "expcache_select_ids_async",
        lambda h: (h, 0, None, 32, 1, None, PTRS),
        INVALID,
        "ids is NULL",
    ),
    (
        "select_ids NULL out",
        "expcache_select_ids_async",
        lambda h: (h, 0, IDS, 32, 1, None, None),
        INVALID,
        "out_ptrs is NULL",
    ),
    (
        "select_ids id_bits",
        "expcache_select_ids_async",
        lambda h: (h, 0, IDS, 7, 1, None, PTRS),
        INVALID,
        "id_bits must be 32 or 64",
    ),
    ("select_ids k 0", "expcache_select_ids_async", lambda h: (h, 0, IDS, 32, 0, None, PTRS), INVALID, "k must be"),
    (
        "select_ids negative id",
        "expcache_select_ids_async",
        lambda h: (h, 0, NEGATIVE_IDS, 64, 1, None, PTRS),
        INVALID,
        "expert id -1 (index 0) out of range",
    ),
    (
        "select_ids id out of range",
        "expcache_select_ids_async",
        lambda h: (h, 0, HUGE_ID, 32, 1, None, PTRS),
        INVALID,
        "expert id 1000000 (index 0) out of range for layer 0",
    ),
    (
        "select_slots NULL ids",
        "expcache_select_slots_async",
        lambda h: (h, 0, None, 32, 1, HOST_BUF.ctypes.data, None),
        INVALID,
        "ids is NULL",
    ),
    (
        "select_slots NULL out",
        "expcache_select_slots_async",
        lambda h: (h, 0, IDS, 32, 1, None, None),
        INVALID,
        "out_slots is NULL",
    ),
    (
        "select_slots id_bits",
        "expcache_select_slots_async",
        lambda h: (h, 0, IDS, 16, 1, HOST_BUF.ctypes.data, None),
        INVALID,
        "id_bits must be 32 or 64",
    ),
    (
        "select_slots k 0",
        "expcache_select_slots_async",
        lambda h: (h, 0, IDS, 32, 0, HOST_BUF.ctypes.data, None),
        INVALID,
        "k must be",
    ),
    (
        "select_slots k too large",
        "expcache_select_slots_async",
        lambda h: (h, 0, IDS, 32, 5000, HOST_BUF.ctypes.data, None),
        INVALID,
        "k must be",
    ),
    (
        "select_slots negative id",
        "expcache_select_slots_async",
        lambda h: (h, 0, NEGATIVE_IDS, 64, 1, HOST_BUF.ctypes.data, None),
        INVALID,
        "expert id -1 (index 0) out of range",
    ),
    (
        "select_slots id over 32 bits",
        "expcache_select_slots_async",
        lambda h: (h, 0, WIDE_IDS, 64, 1, HOST_BUF.ctypes.data, None),
        INVALID,
        "expert id 4294967296 (index 0) out of range",
    ),
    (
        "select_slots id out of range",
        "expcache_select_slots_async",
        lambda h: (h, 0, HUGE_ID, 32, 1, HOST_BUF.ctypes.data, None),
        INVALID,
        "expert id 1000000 (index 0) out of range for layer 0",
    ),
    (
        "select_slots bad layer",
        "expcache_select_slots_async",
        lambda h: (h, 99, IDS, 32, 1, HOST_BUF.ctypes.data, None),
        INVALID,
        "layer",
    ),
    ("select NULL out", "expcache_select_async", lambda h: (h, 0, IDS, 1, None, None), INVALID, "out_ptrs is NULL"),
    ("select k 0", "expcache_select_async", lambda h: (h, 0, IDS, 0, None, PTRS), INVALID, "k must be"),
    ("select k too large", "expcache_select_async", lambda h: (h, 0, IDS, 5000, None, PTRS), INVALID, "k must be"),
    (
        "select layer out of range",
        "expcache_select_async",
        lambda h: (h, 99, IDS, 1, None, PTRS),
        INVALID,
        "layer 99 out of range",
    ),
    (
        "select expert out of range",
        "expcache_select_async",
        lambda h: (h, 0, BAD_IDS, 2, None, PTRS),
        INVALID,
        "expert id 999",
    ),
    (
        "compact_load NULL ids",
        "expcache_compact_load_async",
        lambda h: (h, 0, None, 1, None, byref(_compact())),
        INVALID,
        "ids is NULL",
    ),
    (
        "compact_load NULL out",
        "expcache_compact_load_async",
        lambda h: (h, 0, IDS, 1, None, None),
        INVALID,
        "out is NULL",
    ),
    (
        "compact_load n 0",
        "expcache_compact_load_async",
        lambda h: (h, 0, IDS, 0, None, byref(_compact())),
        INVALID,
        "n must be",
    ),
    (
        "compact_load bad expert",
        "expcache_compact_load_async",
        lambda h: (h, 0, BAD_IDS, 2, None, byref(_compact())),
        INVALID,
        "expert id 999",
    ),
    (
        "batch NULL ids",
        "expcache_batch_prepare_async",
        lambda h: (h, 0, None, 1, None, IDS, PTRS, byref(OUT_U32), byref(OUT_U64)),
        INVALID,
        "ids is NULL",
    ),
    (
        "batch NULL outs",
        "expcache_batch_prepare_async",
        lambda h: (h, 0, IDS, 1, None, None, PTRS, byref(OUT_U32), byref(OUT_U64)),
        INVALID,
        "must not be NULL",
    ),
    (
        "batch n 0",
        "expcache_batch_prepare_async",
        lambda h: (h, 0, IDS, 0, None, IDS, PTRS, byref(OUT_U32), byref(OUT_U64)),
        INVALID,
        "n must be",
    ),
    (
        "batch bad layer",
        "expcache_batch_prepare_async",
        lambda h: (h, 77, IDS, 1, None, IDS, PTRS, byref(OUT_U32), byref(OUT_U64)),
        INVALID,
        "layer 77",
    ),
    (
        "batch_slots NULL ids",
        "expcache_batch_prepare_slots_async",
        lambda h: (h, 0, None, 32, 1, None, IDS, HOST_BUF.ctypes.data, byref(OUT_U32), byref(OUT_U64)),
        INVALID,
        "ids is NULL",
    ),
    (
        "batch_slots NULL outs",
        "expcache_batch_prepare_slots_async",
        lambda h: (h, 0, IDS, 32, 1, None, IDS, None, byref(OUT_U32), byref(OUT_U64)),
        INVALID,
        "must not be NULL",
    ),
    (
        "batch_slots id_bits",
        "expcache_batch_prepare_slots_async",
        lambda h: (h, 0, IDS, 8, 1, None, IDS, HOST_BUF.ctypes.data, byref(OUT_U32), byref(OUT_U64)),
        INVALID,
        "id_bits must be 32 or 64",
    ),
    (
        "batch_slots bad layer",
        "expcache_batch_prepare_slots_async",
        lambda h: (h, 77, IDS, 32, 1, None, IDS, HOST_BUF.ctypes.data, byref(OUT_U32), byref(OUT_U64)),
        INVALID,
        "layer 77",
    ),
    ("batch_finish unknown", "expcache_batch_finish", lambda h: (h, 12345, None), INVALID, "unknown"),
    (
        "testing_read_resident NULL dst",
        "expcache_testing_read_resident",
        lambda h: (h, 0, 0, None, 10, byref(OUT_U32)),
        INVALID,
        "dst is NULL",
    ),
    (
        "testing_read_resident small dst",
        "expcache_testing_read_resident",
        lambda h: (h, 0, 0, HOST_BUF.ctypes.data, 10, byref(OUT_U32)),
        INVALID,
        "dst_bytes",
    ),
    (
        "testing_read_resident bad expert",
        "expcache_testing_read_resident",
        lambda h: (h, 0, 300, HOST_BUF.ctypes.data, 1 << 16, byref(OUT_U32)),
        INVALID,
        "expert id 300",
    ),
    (
        "testing_read_device foreign address",
        "expcache_testing_read_device",
        lambda h: (h, HOST_BUF.ctypes.data, HOST_BUF.ctypes.data, 16),
        INVALID,
        "not inside memory this cache allocated",
    ),
    (
        "testing_read_device zero bytes",
        "expcache_testing_read_device",
        lambda h: (h, 8, HOST_BUF.ctypes.data, 0),
        INVALID,
        "n must be > 0",
    ),
    (
        "testing_checksum NULL ptrs",
        "expcache_testing_checksum",
        lambda h: (h, 0, None, 1, None, HOST_BUF.ctypes.data),
        INVALID,
        "ptrs is NULL",
    ),
    (
        "testing_checksum foreign ptrs",
        "expcache_testing_checksum",
        lambda h: (h, 0, PTRS, 1, None, HOST_BUF.ctypes.data),
        INVALID,
        "not inside memory",
    ),
    (
        "testing_checksum n 0",
        "expcache_testing_checksum",
        lambda h: (h, 0, PTRS, 0, None, HOST_BUF.ctypes.data),
        INVALID,
        "n must be",
    ),
    (
        "testing_checksum_async NULL ptrs",
        "expcache_testing_checksum_async",
        lambda h: (h, 0, None, 1, None, 0),
        INVALID,
        "ptrs is NULL",
    ),
    (
        "testing_checksum_async past the slots",
        "expcache_testing_checksum_async",
        lambda h: (h, 0, PTRS, 2, None, 65535),
        INVALID,
        "past the 65536 slots",
    ),
    (
        "testing_checksum_async foreign ptrs",
        "expcache_testing_checksum_async",
        lambda h: (h, 0, PTRS, 1, None, 0),
        INVALID,
        "not inside memory",
    ),
    (
        "testing_checksum_results NULL out",
        "expcache_testing_checksum_results",
        lambda h: (h, 0, 1, None),
        INVALID,
        "out is NULL",
    ),
    (
        "testing_checksum_results past the slots",
        "expcache_testing_checksum_results",
        lambda h: (h, 65536, 1, HOST_BUF.ctypes.data),
        INVALID,
        "within the 65536 slots",
    ),
    (
        "testing_checksum_results empty",
        "expcache_testing_checksum_results",
        lambda h: (h, 0, 0, HOST_BUF.ctypes.data),
        INVALID,
        "non-empty",
    ),
    (
        "select_device NULL ids",
        "expcache_select_device_async",
        lambda h: (h, 0, None, 32, 1, 1, HOST_BUF.ctypes.data, None),
        INVALID,
        "ids is NULL",
    ),
    (
        "select_device NULL out",
        "expcache_select_device_async",
        lambda h: (h, 0, HOST_BUF.ctypes.data, 32, 1, 1, None, None),
        INVALID,
        "out_slots is NULL",
    ),
    (
        "select_device on a host-lookup cache",
        "expcache_select_device_async",
        lambda h: (h, 0, HOST_BUF.ctypes.data, 32, 1, 1, HOST_BUF.ctypes.data, None),
        STATE,
        "needs a device-lookup cache",
    ),
    (
        "select_device bad layer",
        "expcache_select_device_async",
        lambda h: (h, 50, HOST_BUF.ctypes.data, 32, 1, 1, HOST_BUF.ctypes.data, None),
        INVALID,
        "layer 50",
    ),
    (
        "select_device_counted NULL ids",
        "expcache_select_device_counted_async",
        lambda h: (h, 0, None, 32, 1, 1, HOST_BUF.ctypes.data, HOST_BUF.ctypes.data, None),
        INVALID,
        "ids is NULL",
    ),
    (
        "select_device_counted NULL out",
        "expcache_select_device_counted_async",
        lambda h: (h, 0, HOST_BUF.ctypes.data, 32, 1, 1, None, HOST_BUF.ctypes.data, None),
        INVALID,
        "out_slots is NULL",
    ),
    (
        "select_device_counted NULL counts",
        "expcache_select_device_counted_async",
        lambda h: (h, 0, HOST_BUF.ctypes.data, 32, 1, 1, HOST_BUF.ctypes.data, None, None),
        INVALID,
        "out_counts is NULL",
    ),
    (
        "select_device_counted on a host-lookup cache",
        "expcache_select_device_counted_async",
        lambda h: (h, 0, HOST_BUF.ctypes.data, 32, 1, 1, HOST_BUF.ctypes.data, HOST_BUF.ctypes.data, None),
        STATE,
        "needs a device-lookup cache",
    ),
    (
        "select_device_counted bad layer",
        "expcache_select_device_counted_async",
        lambda h: (h, 50, HOST_BUF.ctypes.data, 32, 1, 1, HOST_BUF.ctypes.data, HOST_BUF.ctypes.data, None),
        INVALID,
        "layer 50",
    ),
    ("class_bank_get NULL", "expcache_class_bank_get", lambda h: (h, 0, None), INVALID, "out is NULL"),
    (
        "class_bank_get bad struct_size",
        "expcache_class_bank_get",
        lambda h: (h, 0, byref(_lib.Bank())),
        INVALID,
        "struct_size",
    ),
    (
        "class_bank_get out of range",
        "expcache_class_bank_get",
        lambda h: (h, 4, byref(_bank())),
        INVALID,
        "class index 4",
    ),
    (
        "class_bank_get on an unbound class",
        "expcache_class_bank_get",
        lambda h: (h, 0, byref(_bank())),
        STATE,
        "holds no class",
    ),
    (
        "testing_bank_checksum NULL slots",
        "expcache_testing_bank_checksum_async",
        lambda h: (h, 0, None, 1, None, 0),
        INVALID,
        "slots is NULL",
    ),
    (
        "testing_bank_checksum n 0",
        "expcache_testing_bank_checksum_async",
        lambda h: (h, 0, HOST_BUF.ctypes.data, 0, None, 0),
        INVALID,
        "n must be 1..1024",
    ),
    (
        "testing_bank_checksum before the class has a slot",
        "expcache_testing_bank_checksum_async",
        lambda h: (h, 0, HOST_BUF.ctypes.data, 1, None, 0),
        STATE,
        "has no slot yet",
    ),
    (
        "testing_bank_checksum_host_slots NULL slots",
        "expcache_testing_bank_checksum_host_slots_async",
        lambda h: (h, 0, None, 1, None, 0),
        INVALID,
        "slots is NULL",
    ),
    (
        "testing_bank_checksum_host_slots n 0",
        "expcache_testing_bank_checksum_host_slots_async",
        lambda h: (h, 0, HOST_BUF.ctypes.data, 0, None, 0),
        INVALID,
        "n must be 1..1024",
    ),
    (
        "testing_bank_checksum_host_slots n over EXPCACHE_MAX_SELECT",
        "expcache_testing_bank_checksum_host_slots_async",
        lambda h: (h, 0, HOST_BUF.ctypes.data, 1025, None, 0),
        INVALID,
        "n must be 1..1024",
    ),
    (
        "testing_bank_checksum_host_slots past the result slots",
        "expcache_testing_bank_checksum_host_slots_async",
        lambda h: (h, 0, HOST_BUF.ctypes.data, 2, None, 65535),
        INVALID,
        "within the 65536 slots",
    ),
    (
        "testing_bank_checksum_host_slots bad layer",
        "expcache_testing_bank_checksum_host_slots_async",
        lambda h: (h, 50, HOST_BUF.ctypes.data, 1, None, 0),
        INVALID,
        "layer 50",
    ),
    (
        "testing_bank_checksum_host_slots before the class has a slot",
        "expcache_testing_bank_checksum_host_slots_async",
        lambda h: (h, 0, HOST_BUF.ctypes.data, 1, None, 0),
        STATE,
        "has no slot yet",
    ),
    ("class_count_get NULL", "expcache_class_count_get", lambda h: (h, None), INVALID, "out_count is NULL"),
    (
        "class_info_get out of range",
        "expcache_class_info_get",
        lambda h: (h, 4, byref(_info())),
        INVALID,
        "class index 4",
    ),
    ("class_info_get NULL", "expcache_class_info_get", lambda h: (h, 0, None), INVALID, "out is NULL"),
    ("layer_bind_class bad layer", "expcache_layer_bind_class", lambda h: (h, 50, byref(OUT_U32)), INVALID, "layer 50"),
    ("layer_bind_class NULL", "expcache_layer_bind_class", lambda h: (h, 0, None), INVALID, "out_class is NULL"),
    ("staging_stats_get NULL out", "expcache_staging_stats_get", lambda h: (h, None), INVALID, "out is NULL"),
    (
        "staging_stats_get wrong size",
        "expcache_staging_stats_get",
        lambda h: (h, byref(_staging(8))),
        INVALID,
        "struct_size is 8",
    ),
    ("stats_get bad path", "expcache_stats_get", lambda h: (h, 0, 9, byref(_stats())), INVALID, "path 9"),
    ("stats_get bad class", "expcache_stats_get", lambda h: (h, 9, 0, byref(_stats())), INVALID, "class index 9"),
    ("stats_get struct_size", "expcache_stats_get", lambda h: (h, 0, 0, byref(_stats(8))), INVALID, "struct_size"),
    ("stats_read NULL infos", "expcache_stats_read", lambda h: (h, 1, None, byref(_stats())), INVALID, "infos is NULL"),
    ("stats_read NULL stats", "expcache_stats_read", lambda h: (h, 1, byref(_info()), None), INVALID, "stats is NULL"),
    ("stats_read no class", "expcache_stats_read", lambda h: (h, 0, byref(_info()), byref(_stats())), INVALID, "got 0"),
    (
        "stats_read too many classes",
        "expcache_stats_read",
        lambda h: (h, 99, byref(_info()), byref(_stats())),
        INVALID,
        "got 99",
    ),
    (
        "stats_read struct_size",
        "expcache_stats_read",
        lambda h: (h, 1, byref(_info()), byref(_stats(8))),
        INVALID,
        "stats->struct_size",
    ),
    ("log_set_level bad", "expcache_log_set_level", lambda h: (h, 5), INVALID, "log level"),
    (
        "memory_retain NULL out",
        "expcache_memory_retain",
        lambda h: (h, HOST_BUF.ctypes.data, None),
        INVALID,
        "out_ref is NULL",
    ),
    (
        "memory_retain foreign address",
        "expcache_memory_retain",
        lambda h: (h, HOST_BUF.ctypes.data, byref(_lib.MemoryRefPtr())),
        INVALID,
        "not inside device memory",
    ),
    (
        "testing_device_bytes_in_use NULL",
        "expcache_testing_device_bytes_in_use",
        lambda h: (h, None),
        INVALID,
        "out_bytes is NULL",
    ),
    ("testing_table_reads NULL", "expcache_testing_table_reads", lambda h: (h, 0, None), INVALID, "out_count is NULL"),
    (
        "testing_device_reads NULL",
        "expcache_testing_device_reads",
        lambda h: (h, None, byref(OUT_U64)),
        INVALID,
        "must not be NULL",
    ),
    (
        "testing_table_reads on a host-lookup cache",
        "expcache_testing_table_reads",
        lambda h: (h, 0, byref(OUT_U64)),
        STATE,
        "table reads are a device select's",
    ),
    (
        "select_split NULL ids",
        "expcache_select_split_async",
        lambda h: (h, 0, None, 1, None, PTRS, RESIDENT, byref(READY)),
        INVALID,
        "ids is NULL",
    ),
    (
        "select_split NULL out_resident",
        "expcache_select_split_async",
        lambda h: (h, 0, IDS, 1, None, PTRS, None, byref(READY)),
        INVALID,
        "out_resident is NULL",
    ),
    (
        "select_split NULL out_ready",
        "expcache_select_split_async",
        lambda h: (h, 0, IDS, 1, None, PTRS, RESIDENT, None),
        INVALID,
        "out_ready is NULL",
    ),
    (
        "select_split k 0",
        "expcache_select_split_async",
        lambda h: (h, 0, IDS, 0, None, PTRS, RESIDENT, byref(READY)),
        INVALID,
        "k must be",
    ),
    (
        "select_split expert out of range",
        "expcache_select_split_async",
        lambda h: (h, 0, BAD_IDS, 2, None, PTRS, RESIDENT, byref(READY)),
        INVALID,
        "expert id 999",
    ),
    (
        "ready_wait foreign event",
        "expcache_ready_wait_async",
        lambda h: (h, 12345, None),
        INVALID,
        "not an event of this cache",
    ),
    ("prefetch NULL ids", "expcache_prefetch_async", lambda h: (h, 0, None, 1, None, None), INVALID, "ids is NULL"),
    ("prefetch n too large", "expcache_prefetch_async", lambda h: (h, 0, IDS, 5000, None, None), INVALID, "n must be"),
    (
        "prefetch layer out of range",
        "expcache_prefetch_async",
        lambda h: (h, 99, IDS, 1, None, None),
        INVALID,
        "layer 99",
    ),
    (
        "prefetch expert out of range",
        "expcache_prefetch_async",
        lambda h: (h, 0, BAD_IDS, 2, None, None),
        INVALID,
        "expert id 999",
    ),
    ("hint NULL ids", "expcache_hint", lambda h: (h, 0, None, 1), INVALID, "ids is NULL"),
    ("hint n 0", "expcache_hint", lambda h: (h, 0, IDS, 0), INVALID, "n must be"),
    ("hint expert out of range", "expcache_hint", lambda h: (h, 0, BAD_IDS, 2), INVALID, "expert id 999"),
    ("class_find NULL out", "expcache_class_find", lambda h: (h, 528, 528, 264, None), INVALID, "out_class is NULL"),
    (
        "class_find no such sizes",
        "expcache_class_find",
        lambda h: (h, 1, 2, 3, byref(OUT_U32)),
        INVALID,
        "no registered layer has experts of gate 1, up 2, down 3 bytes",
    ),
    (
        "class_find a size 0",
        "expcache_class_find",
        lambda h: (h, 528, 0, 264, byref(OUT_U32)),
        INVALID,
        "part 1's size must be 1..2^40, got 0",
    ),
    (
        "budget_get NULL",
        "expcache_budget_get",
        lambda h: (h, None, byref(OUT_U64), None),
        INVALID,
        "must not be NULL",
    ),
    (
        "device_memory_get NULL",
        "expcache_device_memory_get",
        lambda h: (h, byref(OUT_U64), None),
        INVALID,
        "must not be NULL",
    ),
    (
        "class_find_parts NULL sizes",
        "expcache_class_find_parts",
        lambda h: (h, 2, None, byref(OUT_U32)),
        INVALID,
        "part_bytes is NULL",
    ),
    (
        "class_find_parts NULL out",
        "expcache_class_find_parts",
        lambda h: (h, 1, (c_uint64 * 1)(528), None),
        INVALID,
        "out_class is NULL",
    ),
    (
        "class_find_parts 0 parts",
        "expcache_class_find_parts",
        lambda h: (h, 0, (c_uint64 * 1)(528), byref(OUT_U32)),
        INVALID,
        "num_parts must be 1..8, got 0",
    ),
    (
        "class_find_parts 9 parts",
        "expcache_class_find_parts",
        lambda h: (h, 9, (c_uint64 * 9)(*[16] * 9), byref(OUT_U32)),
        INVALID,
        "num_parts must be 1..8, got 9",
    ),
    (
        "class_find_parts a size past the limit",
        "expcache_class_find_parts",
        lambda h: (h, 2, (c_uint64 * 2)(16, 1 << 41), byref(OUT_U32)),
        INVALID,
        "part 1's size must be 1..2^40",
    ),
    (
        "class_find_parts no such sizes",
        "expcache_class_find_parts",
        lambda h: (h, 2, (c_uint64 * 2)(1, 2), byref(OUT_U32)),
        INVALID,
        "no registered layer has experts of parts 1, 2 bytes",
    ),
    ("layers_register NULL", "expcache_layers_register", lambda h: (h, 1, None, None), INVALID, "must not be NULL"),
    ("layers_register n 0", "expcache_layers_register", lambda h: (h, 0, IDS, _descs(1)), INVALID, "n must be 1.."),
    (
        "layers_register struct_size",
        "expcache_layers_register",
        lambda h: (h, 2, (c_uint32 * 2)(1, 2), _descs(2, bad_size_at=1)),
        INVALID,
        "descs[1].struct_size is 0",
    ),
    (
        "layers_register twice",
        "expcache_layers_register",
        lambda h: (h, 2, (c_uint32 * 2)(50, 50), _descs(2)),
        INVALID,
        "layer 50 is listed twice",
    ),
    (
        "layers_register registered",
        "expcache_layers_register",
        lambda h: (h, 2, (c_uint32 * 2)(3, 4), _descs(2)),
        STATE,
        "descs[0]: layer 3 is already registered",
    ),
    ("insert NULL ids", "expcache_insert_async", lambda h: (h, 0, None, 32, None, 1, None), INVALID, "ids is NULL"),
    ("insert n 0", "expcache_insert_async", lambda h: (h, 0, IDS, 32, None, 0, None), INVALID, "n must be 1.."),
    ("insert id_bits", "expcache_insert_async", lambda h: (h, 0, IDS, 3, None, 1, None), INVALID, "id_bits must be"),
    ("insert bad layer", "expcache_insert_async", lambda h: (h, 77, IDS, 32, None, 1, None), INVALID, "layer 77"),
    ("insert expert", "expcache_insert_async", lambda h: (h, 0, BAD_IDS, 32, None, 2, None), INVALID, "expert id 999"),
    # The *_ids twins: a router's int32 or int64 ids as they are.
    (
        "split_ids id_bits",
        "expcache_select_split_ids_async",
        lambda h: (h, 0, IDS, 16, 1, None, PTRS, RESIDENT, byref(READY)),
        INVALID,
        "id_bits must be 32 or 64",
    ),
    (
        "split_ids NULL ids",
        "expcache_select_split_ids_async",
        lambda h: (h, 0, None, 32, 1, None, PTRS, RESIDENT, byref(READY)),
        INVALID,
        "ids is NULL",
    ),
    (
        "split_ids NULL out_ready",
        "expcache_select_split_ids_async",
        lambda h: (h, 0, IDS, 32, 1, None, PTRS, RESIDENT, None),
        INVALID,
        "out_ready is NULL",
    ),
    (
        "split_ids k 0",
        "expcache_select_split_ids_async",
        lambda h: (h, 0, IDS, 32, 0, None, PTRS, RESIDENT, byref(READY)),
        INVALID,
        "k must be 1..1024",
    ),
    (
        "split_ids negative",
        "expcache_select_split_ids_async",
        lambda h: (h, 0, NEGATIVE_IDS, 64, 1, None, PTRS, RESIDENT, byref(READY)),
        INVALID,
        "expert id -1 (index 0) out of range",
    ),
    (
        "prefetch_ids NULL ids",
        "expcache_prefetch_ids_async",
        lambda h: (h, 0, None, 32, 1, None, None),
        INVALID,
        "ids is NULL",
    ),
    (
        "prefetch_ids n too large",
        "expcache_prefetch_ids_async",
        lambda h: (h, 0, IDS, 32, 5000, None, None),
        INVALID,
        "n must be 1..1024, got 5000",
    ),
    (
        "prefetch_ids wide",
        "expcache_prefetch_ids_async",
        lambda h: (h, 0, WIDE_IDS, 64, 1, None, None),
        INVALID,
        "expert id 4294967296",
    ),
    (
        "prefetch_ids id_bits",
        "expcache_prefetch_ids_async",
        lambda h: (h, 0, IDS, 8, 1, None, None),
        INVALID,
        "id_bits must be 32 or 64",
    ),
    ("hint_ids NULL ids", "expcache_hint_ids", lambda h: (h, 0, None, 32, 1), INVALID, "ids is NULL"),
    ("hint_ids n 0", "expcache_hint_ids", lambda h: (h, 0, IDS, 32, 0), INVALID, "n must be"),
    ("hint_ids expert out of range", "expcache_hint_ids", lambda h: (h, 0, BAD_IDS, 32, 2), INVALID, "expert id 999"),
    (
        "compact_ids NULL out",
        "expcache_compact_load_ids_async",
        lambda h: (h, 0, IDS, 32, 1, None, None),
        INVALID,
        "out is NULL",
    ),
    (
        "compact_ids NULL ids",
        "expcache_compact_load_ids_async",
        lambda h: (h, 0, None, 32, 1, None, byref(_compact())),
        INVALID,
        "ids is NULL",
    ),
    (
        "compact_ids n 0",
        "expcache_compact_load_ids_async",
        lambda h: (h, 0, IDS, 64, 0, None, byref(_compact())),
        INVALID,
        "n must be",
    ),
    (
        "compact_ids negative",
        "expcache_compact_load_ids_async",
        lambda h: (h, 0, NEGATIVE_IDS, 64, 1, None, byref(_compact())),
        INVALID,
        "expert id -1",
    ),
    (
        "batch_ids NULL outs",
        "expcache_batch_prepare_ids_async",
        lambda h: (h, 0, IDS, 32, 1, None, None, PTRS, byref(OUT_U32), byref(OUT_U64)),
        INVALID,
        "must not be NULL",
    ),
    (
        "batch_ids NULL ids",
        "expcache_batch_prepare_ids_async",
        lambda h: (h, 0, None, 32, 1, None, IDS, PTRS, byref(OUT_U32), byref(OUT_U64)),
        INVALID,
        "ids is NULL",
    ),
    (
        "batch_ids n 0",
        "expcache_batch_prepare_ids_async",
        lambda h: (h, 0, IDS, 32, 0, None, IDS, PTRS, byref(OUT_U32), byref(OUT_U64)),
        INVALID,
        "n must be",
    ),
    (
        "batch_ids id_bits",
        "expcache_batch_prepare_ids_async",
        lambda h: (h, 0, IDS, 0, 1, None, IDS, PTRS, byref(OUT_U32), byref(OUT_U64)),
        INVALID,
        "id_bits must be 32 or 64",
    ),
    (
        "batch_ids bad layer",
        "expcache_batch_prepare_ids_async",
        lambda h: (h, 77, IDS, 32, 1, None, IDS, PTRS, byref(OUT_U32), byref(OUT_U64)),
        INVALID,
        "layer 77",
    ),
    ("prefetch_stats_get NULL", "expcache_prefetch_stats_get", lambda h: (h, None), INVALID, "out is NULL"),
    ("pool_stats_get NULL", "expcache_pool_stats_get", lambda h: (h, None), INVALID, "out is NULL"),
    (
        "pool_stats_get wrong size",
        "expcache_pool_stats_get",
        lambda h: (h, byref(_pool_stats(8))),
        INVALID,
        "struct_size is 8",
    ),
    (
        "prefetch_stats_get wrong size",
        "expcache_prefetch_stats_get",
        lambda h: (h, byref(_prefetch_stats(8))),
        INVALID,
        "struct_size is 8",
    ),
    (
        "testing_spin_async too long",
        "expcache_testing_spin_async",
        lambda h: (h, None, 2 * 10**9),
        INVALID,
        "at most 1e9",
    ),
    (
        "testing_prefetch_pause bad flag",
        "expcache_testing_prefetch_pause",
        lambda h: (h, 2),
        INVALID,
        "paused must be 0 or 1",
    ),
    (
        "create bad prefetch limit",
        "expcache_create",
        lambda h: (byref(_cfg(prefetch_max_per_layer=5000)), byref(_lib.CachePtr())),
        INVALID,
        "prefetch_max_per_layer",
    ),
    (
        "create unaligned prefetch piece",
        "expcache_create",
        lambda h: (byref(_cfg(prefetch_piece_bytes=5000)), byref(_lib.CachePtr())),
        INVALID,
        "prefetch_piece_bytes",
    ),
]

# layer_register's descriptor checks, on a fresh layer index of a 2-layer cache.
DESC_CASES = [
    ("zero experts", dict(num_experts=0), "num_experts"),
    ("too many experts", dict(num_experts=70000), "num_experts"),
    ("zero bytes", dict(up_bytes=0), "up_bytes"),
    ("huge bytes", dict(down_bytes=1 << 41), "down_bytes"),
    ("stride < bytes", dict(gate_stride=100), "gate_stride"),
    ("NULL base", dict(down_base=None), "down_base is NULL"),
    ("address overflow", dict(gate_base=(1 << 64) - 512), "past the address space"),
    ("bad source kind", dict(source_kind=3), "source_kind"),
    ("file id without a file source", dict(file=1), "file must be 0"),
    ("file source with an unopened file", dict(source_kind=2, file=3), "not opened"),
    ("bad struct_size", dict(struct_size=12), "struct_size"),
]


_OFFSETS = (c_uint64 * 4)(0, 256, 512, 768)
_FAR_OFFSETS = (c_uint64 * 4)(0, 256, (1 << 64) - 600, 768)
_FILES = (c_uint32 * 4)(0, 0, 0, 0)


def _parts_desc(n, **over):
    """A descriptor of n parts of 256, 512, ... bytes (parts[]), then `over`: {"parts[i].field": v}
    or a field of the descriptor."""
    d = _lib.LayerDesc()
    lib.expcache_layer_desc_init(byref(d))
    buf = _parts_desc.buf = np.zeros(1 << 16, np.uint8)
    d.num_experts, d.num_parts = 4, n
    for p in range(n):
        d.parts[p].bytes = d.parts[p].stride = 256 * (p + 1)
        d.parts[p].base = buf.ctypes.data
    for k, v in over.items():
        if k.startswith("parts["):
            i, field = int(k[6 : k.index("]")]), k[k.index(".") + 1 :]
            setattr(d.parts[i], field, v)
        else:
            setattr(d, k, v)
    return d


PARTS_DESC_CASES = [
    ("9 parts", 8, dict(num_parts=9), "num_parts must be 0 (the gate, up and down fields) or 1..8"),
    ("reserved set", 2, dict(reserved=1), "reserved must be 0, got 1"),
    ("shorthand and parts both", 2, dict(gate_bytes=256), "give the three parts either way, not both"),
    ("a part past num_parts", 2, {"parts[5].bytes": 16}, "parts[5] is set but num_parts is 2"),
    ("parts with num_parts 0", 2, dict(num_parts=0, gate_bytes=256), "but parts[] is set"),
    ("a part of 0 bytes", 5, {"parts[3].bytes": 0}, "parts[3].bytes must be 1..2^40, got 0"),
    ("a part past the size limit", 5, {"parts[4].bytes": 1 << 41}, "parts[4].bytes must be 1..2^40"),
    ("a part's stride < its bytes", 5, {"parts[2].stride": 100}, "parts[2].stride 100 is smaller than parts[2].bytes"),
    ("a part's base NULL", 8, {"parts[7].base": None}, "parts[7].base is NULL"),
    ("a part past the address space", 1, {"parts[0].base": (1 << 64) - 512}, "parts[0] part of expert 3"),
    ("offsets with a stride", 2, {"parts[1].offsets": _OFFSETS}, "parts[1].stride must be 0 with offsets"),
    (
        "an offset past the address space",
        2,
        {"parts[1].offsets": _FAR_OFFSETS, "parts[1].stride": 0},
        "parts[1] part of expert 2 would end past the address space",
    ),
    ("files without a file source", 2, {"parts[0].files": _FILES}, "parts[0].files is set but source_kind"),
]


@pytest.mark.parametrize("case", PARTS_DESC_CASES, ids=[c[0] for c in PARTS_DESC_CASES])
def test_bad_parts_layer_desc(case):
    _, n, over, fragment = case
    handle = _lib.CachePtr()
    lib.expcache_create(byref(_cfg()), byref(handle))
    try:
        _expect("expcache_layer_register", (handle.value, 1, byref(_parts_desc(n, **over))), INVALID, fragment)
        # A valid descriptor of the same parts registers after the refusal.
        lib.expcache_layer_register(handle.value, 1, byref(_parts_desc(n)))
    finally:
        lib.expcache_destroy(handle.value)


# Functions taking a handle, with otherwise valid arguments.
HANDLE_CALLS = [
    ("expcache_backend_get", lambda h: (h, byref(OUT_U32))),
    ("expcache_layer_register", lambda h: (h, 1, byref(_desc()))),
    ("expcache_file_open", lambda h: (h, os.fsencode(__file__), byref(OUT_U32))),
    ("expcache_file_open_fd", lambda h: (h, 0, byref(OUT_U32))),
    ("expcache_select_async", lambda h: (h, 0, IDS, 1, None, PTRS)),
    ("expcache_select_slots_async", lambda h: (h, 0, IDS, 32, 1, HOST_BUF.ctypes.data, None)),
    ("expcache_select_ids_async", lambda h: (h, 0, IDS, 32, 1, None, PTRS)),
    ("expcache_compact_load_async", lambda h: (h, 0, IDS, 1, None, byref(_compact()))),
    ("expcache_batch_prepare_async", lambda h: (h, 0, IDS, 1, None, IDS, PTRS, byref(OUT_U32), byref(OUT_U64))),
    (
        "expcache_batch_prepare_slots_async",
        lambda h: (h, 0, IDS, 32, 1, None, IDS, HOST_BUF.ctypes.data, byref(OUT_U32), byref(OUT_U64)),
    ),
    ("expcache_batch_finish", lambda h: (h, 1, None)),
    ("expcache_release_all", lambda h: (h,)),
    ("expcache_synchronize", lambda h: (h, None)),
    ("expcache_testing_read_resident", lambda h: (h, 0, 0, HOST_BUF.ctypes.data, 1 << 16, byref(OUT_U32))),
    ("expcache_testing_read_device", lambda h: (h, 8, HOST_BUF.ctypes.data, 8)),
    ("expcache_testing_checksum", lambda h: (h, 0, PTRS, 1, None, HOST_BUF.ctypes.data)),
    ("expcache_testing_checksum_async", lambda h: (h, 0, PTRS, 1, None, 0)),
    ("expcache_testing_checksum_results", lambda h: (h, 0, 1, HOST_BUF.ctypes.data)),
    ("expcache_class_count_get", lambda h: (h, byref(OUT_U32))),
    ("expcache_class_info_get", lambda h: (h, 0, byref(_info()))),
    ("expcache_layer_bind_class", lambda h: (h, 0, byref(OUT_U32))),
    ("expcache_stats_get", lambda h: (h, 0, 0, byref(_stats()))),
    ("expcache_staging_stats_get", lambda h: (h, byref(_staging()))),
    ("expcache_stats_reset", lambda h: (h,)),
    ("expcache_log_set_callback", lambda h: (h, _lib.LOG_FN(), None)),
    ("expcache_log_set_level", lambda h: (h, 1)),
    ("expcache_memory_retain", lambda h: (h, None, byref(_lib.MemoryRefPtr()))),
    ("expcache_memory_set_dropped_callback", lambda h: (h, _lib.DROPPED_FN(), None)),
    ("expcache_testing_inject_alloc_failures", lambda h: (h, 0, 0)),
    ("expcache_testing_inject_copy_failures", lambda h: (h, 0, 0)),
    ("expcache_testing_inject_staging_failures", lambda h: (h, 0, 0)),
    ("expcache_testing_device_bytes_in_use", lambda h: (h, byref(OUT_U64))),
    ("expcache_select_split_async", lambda h: (h, 0, IDS, 1, None, PTRS, RESIDENT, byref(READY))),
    ("expcache_ready_wait_async", lambda h: (h, None, None)),
    ("expcache_prefetch_async", lambda h: (h, 0, IDS, 1, None, None)),
    ("expcache_hint", lambda h: (h, 0, IDS, 1)),
    ("expcache_select_split_ids_async", lambda h: (h, 0, IDS, 32, 1, None, PTRS, RESIDENT, byref(READY))),
    ("expcache_prefetch_ids_async", lambda h: (h, 0, IDS, 32, 1, None, None)),
    ("expcache_hint_ids", lambda h: (h, 0, IDS, 32, 1)),
    ("expcache_insert_async", lambda h: (h, 0, IDS, 32, None, 1, None)),
    ("expcache_layers_register", lambda h: (h, 1, (c_uint32 * 1)(1), _descs(1))),
    ("expcache_layer_unregister", lambda h: (h, 0)),
    ("expcache_budget_set", lambda h: (h, 4, 0)),
    ("expcache_reserve_set", lambda h: (h, 1 << 30)),
    ("expcache_class_find", lambda h: (h, 1, 2, 3, byref(OUT_U32))),
    ("expcache_class_find_parts", lambda h: (h, 2, (c_uint64 * 2)(1, 2), byref(OUT_U32))),
    ("expcache_budget_get", lambda h: (h, byref(OUT_U64), byref(OUT_U64), None)),
    ("expcache_device_memory_get", lambda h: (h, byref(OUT_U64), byref(OUT_U64))),
    ("expcache_compact_load_ids_async", lambda h: (h, 0, IDS, 32, 1, None, byref(_compact()))),
    ("expcache_batch_prepare_ids_async", lambda h: (h, 0, IDS, 32, 1, None, IDS, PTRS, byref(OUT_U32), byref(OUT_U64))),
    ("expcache_prefetch_stats_get", lambda h: (h, byref(_prefetch_stats()))),
    ("expcache_pool_stats_get", lambda h: (h, byref(_pool_stats()))),
    ("expcache_testing_prefetch_pause", lambda h: (h, 0)),
    ("expcache_prefetch_wait", lambda h: (h,)),
    ("expcache_testing_spin_async", lambda h: (h, None, 1000)),
    ("expcache_select_device_async", lambda h: (h, 0, HOST_BUF.ctypes.data, 32, 1, 1, HOST_BUF.ctypes.data, None)),
    (
        "expcache_select_device_counted_async",
        lambda h: (h, 0, HOST_BUF.ctypes.data, 32, 1, 1, HOST_BUF.ctypes.data, HOST_BUF.ctypes.data, None),
    ),
    ("expcache_class_bank_get", lambda h: (h, 0, byref(_bank()))),
    ("expcache_testing_bank_checksum_async", lambda h: (h, 0, HOST_BUF.ctypes.data, 1, None, 0)),
    ("expcache_testing_bank_checksum_host_slots_async", lambda h: (h, 0, HOST_BUF.ctypes.data, 1, None, 0)),
    ("expcache_testing_table_reads", lambda h: (h, 0, byref(OUT_U64))),
    ("expcache_stats_read", lambda h: (h, 1, byref(_info()), byref(_stats()))),
    ("expcache_testing_device_reads", lambda h: (h, byref(OUT_U64), byref(OUT_U64))),
]

# Exports that take no cache and cannot fail: checked by the tests above and below, not by a table.
NEVER_FAIL = {
    "expcache_status_string",
    "expcache_last_error",
    "expcache_version",
    "expcache_policy_name",
    "expcache_path_name",
    "expcache_destroy",
    "expcache_memory_release",
    "expcache_testing_struct_size",
}


def test_every_export_has_bad_input():
    """Every export that can fail is in CASES or HANDLE_CALLS."""
    covered = {c[1] for c in CASES} | {c[0] for c in HANDLE_CALLS}
    everything = EXPORTS | TESTING_EXPORTS
    assert covered | NEVER_FAIL == everything, sorted(everything ^ (covered | NEVER_FAIL))


def _expect(fn_name, args, status, fragment):
    with pytest.raises(ExpcacheError) as info:
        getattr(lib, fn_name)(*args)
    assert info.value.status == status, info.value
    assert fragment in info.value.message, info.value.message
    assert info.value.message.startswith(fn_name), info.value.message


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(case, live):
    _, fn_name, make_args, status, fragment = case
    cache, source = live
    _expect(fn_name, make_args(cache._handle), status, fragment)
    # The cache still serves correct bytes afterwards.
    ptrs = cache.select(3, [1, 2])
    assert (testing.read_device(cache, int(ptrs[1][0]), 528) == source.part(3, 2, 0)).all()


@pytest.mark.parametrize("case", DESC_CASES, ids=[c[0] for c in DESC_CASES])
def test_bad_layer_desc(case):
    _, over, fragment = case
    handle = _lib.CachePtr()
    lib.expcache_create(byref(_cfg()), byref(handle))
    try:
        _expect("expcache_layer_register", (handle.value, 1, byref(_desc(**over))), INVALID, fragment)
    finally:
        lib.expcache_destroy(handle.value)


@pytest.mark.parametrize("call", HANDLE_CALLS, ids=[c[0] for c in HANDLE_CALLS])
def test_null_handle(call):
    name, make_args = call
    _expect(name, (None,) + make_args(None)[1:], INVALID, "cache is NULL")


@pytest.mark.parametrize("call", HANDLE_CALLS, ids=[c[0] for c in HANDLE_CALLS])
def test_destroyed_handle(call, dead):
    name, make_args = call
    _expect(name, (dead,) + make_args(dead)[1:], INVALID, "not a live cache")


def test_destroy_accepts_null_and_repeats(dead):
    lib.expcache_destroy(None)
    lib.expcache_destroy(dead)
    lib.expcache_memory_release(None)


def test_unregistered_layer_is_invalid_state():
    handle = _lib.CachePtr()
    lib.expcache_create(byref(_cfg()), byref(handle))
    try:
        _expect("expcache_select_async", (handle.value, 1, IDS, 1, None, PTRS), STATE, "not registered")
    finally:
        lib.expcache_destroy(handle.value)


def test_cuda_backend_unavailable_is_unsupported():
    from support.cache import CUDA_OK

    if CUDA_OK:
        pytest.skip("a CUDA device is present")
    _expect("expcache_create", (byref(_cfg(backend=2)), byref(_lib.CachePtr())), UNSUPPORTED, "")


def test_last_error_is_thread_local():
    import threading

    with pytest.raises(ExpcacheError):
        lib.expcache_config_init(None)
    seen = []
    t = threading.Thread(target=lambda: seen.append(lib.expcache_last_error()))
    t.start()
    t.join()
    assert seen == [b""]
    assert b"config is NULL" in lib.expcache_last_error()


def test_python_rejects_bad_ids(live):
    cache, _ = live
    with pytest.raises(ValueError):
        cache.select(0, [-1])
    with pytest.raises(TypeError):
        cache.select(0, [1.5])
    with pytest.raises(ValueError):
        cache.select(0, list(range(2000)))


def test_host_only_library_serves(tmp_path):
    from pyexpcache._loader import candidate_paths

    host = [p for p in candidate_paths() if p.name == "libexpcache_host.so" and p.exists()]
    if not host:
        pytest.skip("libexpcache_host.so not built")
    code = (
        "import pyexpcache as p\n"
        "from pyexpcache import testing\n"
        "L = p.ModelLayout.preset('q2', scale=4096)\n"
        "s = p.HostSource(L)\n"
        "c = p.ExpertCache(L, s, budget_experts=4)\n"
        "assert c.backend == 'host'\n"
        "ptr = c.select(3, [1, 2])\n"
        "assert (testing.read_expert(c, 3, 2) == s.expert_bytes(3, 2)).all()\n"
        "try:\n"
        "    p.ExpertCache(L, s, budget_experts=4, backend='cuda')\n"
        "except p.UnsupportedError as e:\n"
        "    assert 'built without CUDA' in str(e)\n"
        "else:\n"
        "    raise SystemExit('cuda backend accepted by the host-only library')\n"
        "print('ok')\n"
    )
    env = {"EXPCACHE_LIBRARY": str(host[0]), "PATH": "/usr/bin:/bin"}
    import os

    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_cuda_build_that_cannot_load_falls_back_with_the_reason(tmp_path):
    """A CUDA build that does not load (here: not a library at all, as one whose libcudart.so.13
    is missing) leaves the host-only library in use, and the warning says why."""
    from pyexpcache._loader import candidate_paths

    host = [p for p in candidate_paths() if p.name == "libexpcache_host.so" and p.exists()]
    if not host:
        pytest.skip("libexpcache_host.so not built")
    broken = tmp_path / "libexpcache.so"
    broken.write_bytes(b"not an ELF file")
    code = (
        "import warnings\n"
        "from pathlib import Path\n"
        "import pyexpcache._loader as loader\n"
        f"loader.candidate_paths = lambda: [Path({str(broken)!r}), Path({str(host[0])!r})]\n"
        "from pyexpcache import _lib\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    path = _lib.library_path\n"
        "assert path.name == 'libexpcache_host.so', path\n"
        "msg = ' '.join(str(x.message) for x in w)\n"
        f"assert 'CUDA backend is unavailable' in msg and {str(broken)!r} in msg, msg\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_limits_match_the_header():
    """pyexpcache._lib's copies of expcache.h's limits (layouts are checked against them)."""
    import re
    from pathlib import Path

    header = Path(__file__).resolve().parent.parent / "libexpcache" / "include" / "expcache.h"
    if not header.exists():
        pytest.skip(f"{header} not in this tree")
    limits = dict(re.findall(r"^#define EXPCACHE_(MAX_\w+) (\d+)(?:ULL)?\b", header.read_text(), re.M))
    assert {"MAX_EXPERTS_LIMIT", "MAX_LAYERS_LIMIT", "MAX_PART_BYTES_LIMIT", "MAX_SELECT"} <= set(limits)
    assert {n: int(v) for n, v in limits.items()} == {n: getattr(_lib, n) for n in limits}


def test_layers_register_is_all_or_nothing():
    """A bulk registration with one bad descriptor registers none of them; a good one registers all."""
    handle = _lib.CachePtr()
    lib.expcache_create(byref(_cfg(num_layers=3)), byref(handle))
    h = handle.value
    try:
        _expect("expcache_layers_register", (h, 2, (c_uint32 * 2)(0, 7), _descs(2)), INVALID, "descs[1]: layer 7 out")
        _expect("expcache_hint", (h, 0, IDS, 1), STATE, "layer 0 is not registered")
        lib.expcache_layers_register(h, 2, (c_uint32 * 2)(0, 2), _descs(2))
        lib.expcache_hint(h, 0, IDS, 1)
        lib.expcache_hint(h, 2, IDS, 1)
        _expect("expcache_hint", (h, 1, IDS, 1), STATE, "layer 1 is not registered")
    finally:
        lib.expcache_destroy(h)
