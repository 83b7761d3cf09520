"""ctypes declarations of the benchmark's C replay loop (benchmarks/c/replay.c),
loaded from beside the libexpcache in use."""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_double, c_int32, c_uint32, c_uint64, c_void_p

from .._lib import _check, library_path

DECODE, BATCH = 0, 1
MODE_CACHE, MODE_NOCACHE, MODE_SLAB = 0, 1, 2


class ReplayCall(ctypes.Structure):
    _fields_ = [("kind", c_uint32), ("layer", c_uint32), ("offset", c_uint64), ("count", c_uint32),
                ("reserved", c_uint32)]


class ReplayResult(ctypes.Structure):
    _fields_ = [("decode_seconds", c_double), ("prefill_seconds", c_double), ("checksum_errors", c_uint64),
                ("experts_checked", c_uint64), ("first_bad_call", c_uint64), ("calls_done", c_uint64),
                ("decode_bytes_h2d", c_uint64), ("prefill_bytes_h2d", c_uint64), ("decode_calls", c_uint64),
                ("decode_serve_seconds", c_double), ("stopped", c_uint64)]


# int (*replay_progress_fn)(uint64_t done, uint64_t total): nonzero stops the replay.
PROGRESS_FN = ctypes.CFUNCTYPE(ctypes.c_int, c_uint64, c_uint64)

_path = library_path.parent / "libexpcache_replay.so"
try:
    lib = ctypes.CDLL(str(_path))
except OSError as exc:
    raise ImportError(f"{_path}: {exc}; build it with `make lib`") from None

# expcache_status_t expcache_replay(expcache_t* cache, const replay_call_t* calls, uint64_t num_calls,
#     const uint32_t* ids, uint32_t mode, void* stream, const uint64_t* expected, uint32_t experts_per_layer,
#     uint32_t max_classes, uint32_t layer_sync, replay_progress_fn progress, replay_result_t* out);
lib.expcache_replay.argtypes = [c_void_p, c_void_p, c_uint64, c_void_p, c_uint32, c_void_p, c_void_p, c_uint32,
                                c_uint32, c_uint32, PROGRESS_FN, POINTER(ReplayResult)]
lib.expcache_replay.restype = c_int32
lib.expcache_replay.errcheck = _check
