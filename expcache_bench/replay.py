"""ctypes declarations of the benchmark's C replay loop (``replay.c`` beside this file), built
as ``libexpcache_replay.so`` and loaded privately (RTLD_LOCAL) from the first of
:func:`candidate_paths` that exists: this package's folder (an installed suite), the source
tree's ``build/`` (an editable one), beside the libexpcache in use. The loop links nothing of
libexpcache: it is handed the loaded library's functions in a :class:`ReplayApi` table."""

from __future__ import annotations

import ctypes
import functools
from ctypes import POINTER, c_double, c_int32, c_uint32, c_uint64, c_void_p
from pathlib import Path

from pyexpcache import _lib

DECODE, BATCH = 0, 1
MODE_CACHE, MODE_NOCACHE, MODE_SLAB = 0, 1, 2
BY_SLOT = 0x100  # a flag of MODE_CACHE and MODE_SLAB: served by slot id, the bank's rows checksummed (any parts)
ADVICE_NONE, ADVICE_PREFETCH, ADVICE_HINT = 0, 1, 2


class ReplayCall(ctypes.Structure):
    _fields_ = [
        ("kind", c_uint32),
        ("layer", c_uint32),
        ("offset", c_uint64),
        ("count", c_uint32),
        ("reserved", c_uint32),
    ]


class ReplayResult(ctypes.Structure):
    _fields_ = [
        ("decode_seconds", c_double),
        ("prefill_seconds", c_double),
        ("checksum_errors", c_uint64),
        ("experts_checked", c_uint64),
        ("first_bad_call", c_uint64),
        ("calls_done", c_uint64),
        ("decode_bytes_h2d", c_uint64),
        ("prefill_bytes_h2d", c_uint64),
        ("decode_calls", c_uint64),
        ("decode_serve_seconds", c_double),
        ("stopped", c_uint64),
    ]


class ReplayOptions(ctypes.Structure):
    """replay_options_t: the engine a decode call models (layer_sync mode, the cache's own variants)."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("advice", c_uint32),
        ("compute_ns", c_uint64),
        ("split", c_uint32),
        ("reserved", c_uint32),
        ("advice_offset", c_void_p),
        ("advice_count", c_void_p),
        ("advice_ids", c_void_p),
    ]


class ReplayDevice(ctypes.Structure):
    """replay_device_t: one device of expcache_replay_devices."""

    _fields_ = [("cache", c_void_p), ("stream", c_void_p), ("max_classes", c_uint32), ("reserved", c_uint32)]


# replay_api_t's function pointers, in order, and the libexpcache export each one takes.
API_FUNCTIONS = (
    ("select_async", "expcache_select_async"),
    ("compact_load_async", "expcache_compact_load_async"),
    ("batch_prepare_async", "expcache_batch_prepare_async"),
    ("batch_finish", "expcache_batch_finish"),
    ("release_all", "expcache_release_all"),
    ("synchronize", "expcache_synchronize"),
    ("stats_get", "expcache_stats_get"),
    ("checksum", "expcache_testing_checksum"),
    ("checksum_async", "expcache_testing_checksum_async"),
    ("checksum_results", "expcache_testing_checksum_results"),
    ("select_split_async", "expcache_select_split_async"),
    ("ready_wait_async", "expcache_ready_wait_async"),
    ("prefetch_async", "expcache_prefetch_async"),
    ("hint", "expcache_hint"),
    ("spin_async", "expcache_testing_spin_async"),
    ("select_slots_async", "expcache_select_slots_async"),
    ("batch_prepare_slots_async", "expcache_batch_prepare_slots_async"),
    ("bank_checksum_host_slots_async", "expcache_testing_bank_checksum_host_slots_async"),
)


class ReplayApi(ctypes.Structure):
    _fields_ = [("struct_size", c_uint32), ("reserved", c_uint32)] + [(f, c_void_p) for f, _ in API_FUNCTIONS]


# int (*replay_progress_fn)(uint64_t done, uint64_t total): nonzero stops the replay.
PROGRESS_FN = ctypes.CFUNCTYPE(ctypes.c_int, c_uint64, c_uint64)


LIBRARY = "libexpcache_replay.so"


def candidate_paths() -> list[Path]:
    """Where the replay library is looked for, in order: this package's folder (where ``pip
    install .`` puts it), the source tree's ``build/`` (``make lib``, an editable install), and
    beside the libexpcache in use (loads it)."""
    here = Path(__file__).resolve().parent
    out = []
    for folder in (here, here.parent / "build", Path(_lib.library_path).resolve().parent):
        if folder / LIBRARY not in out:
            out.append(folder / LIBRARY)
    return out


@functools.cache
def load() -> tuple[ctypes.CDLL, ReplayApi]:
    """The replay library and the table of the loaded libexpcache's functions it calls."""
    tried = candidate_paths()
    path = next((p for p in tried if p.exists()), None)
    if path is None:
        raise ImportError(
            f"{LIBRARY} not found (tried {', '.join(map(str, tried))}); build it with `make lib` in the source tree"
        )
    try:
        dll = ctypes.CDLL(str(path))  # RTLD_LOCAL: nothing of it resolves against other libraries
    except OSError as exc:
        raise ImportError(f"{path}: {exc}; build it with `make lib`") from None
    # expcache_status_t expcache_replay(const replay_api_t* api, expcache_t* cache, const replay_call_t* calls,
    #     uint64_t num_calls, const uint32_t* ids, uint32_t mode, void* stream, const uint64_t* expected,
    #     uint32_t experts_per_layer, uint32_t max_classes, uint32_t layer_sync, const replay_options_t* options,
    #     replay_progress_fn progress, replay_result_t* out);
    dll.expcache_replay.argtypes = [
        POINTER(ReplayApi),
        c_void_p,
        c_void_p,
        c_uint64,
        c_void_p,
        c_uint32,
        c_void_p,
        c_void_p,
        c_uint32,
        c_uint32,
        c_uint32,
        POINTER(ReplayOptions),
        PROGRESS_FN,
        POINTER(ReplayResult),
    ]
    dll.expcache_replay.restype = c_int32
    dll.expcache_replay.errcheck = _lib.raise_for_status
    # expcache_status_t expcache_replay_devices(const replay_api_t* api, const replay_device_t* devs,
    #     uint32_t num_devs, const uint8_t* owners, const replay_call_t* calls, uint64_t num_calls,
    #     const uint32_t* ids, const uint64_t* expected, uint32_t experts_per_layer, replay_progress_fn progress,
    #     uint64_t* call_bytes, replay_result_t* out);
    dll.expcache_replay_devices.argtypes = [
        POINTER(ReplayApi),
        c_void_p,
        c_uint32,
        c_void_p,
        c_void_p,
        c_uint64,
        c_void_p,
        c_void_p,
        c_uint32,
        PROGRESS_FN,
        c_void_p,
        POINTER(ReplayResult),
    ]
    dll.expcache_replay_devices.restype = c_int32
    dll.expcache_replay_devices.errcheck = _lib.raise_for_status
    api = ReplayApi()
    api.struct_size = ctypes.sizeof(api)
    for field, name in API_FUNCTIONS:
        setattr(api, field, ctypes.cast(getattr(_lib.lib, name), c_void_p).value)
    return dll, api
