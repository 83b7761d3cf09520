"""libexpcache for ctypes: the library found, loaded and declared once, and every name of its
ctypes interface in one namespace (``_lib.X``), from the modules that hold them by concept:
``_constants`` (expcache.h's constants), ``_structs`` (the struct mirrors, the callback and handle
types, :func:`set_fields`), ``_prototypes`` (each function's argtypes and restype) and ``_errors``
(the status codes). Status-returning functions raise through ``errcheck`` (:func:`raise_for_status`),
so every failure becomes an exception in exactly one place.

The library is loaded on first use of ``lib``, ``library_path``, ``POLICIES``, ``DEFAULT_POLICY`` or
``PATH_NAMES`` (a module ``__getattr__``), not on import, so ``--help`` and the pure-Python tools
work before it is built. When it loads, its struct sizes are checked against the mirrors and its
policies' and paths' names read.
"""

from __future__ import annotations

import ctypes
import threading
import warnings
from ctypes import c_int32

from . import _loader
from ._constants import (  # noqa: F401 (re-exported: the package reads them as _lib.X)
    BACKEND_AUTO,
    BACKEND_CUDA,
    BACKEND_HOST,
    BANK_ARRANGEMENTS,
    CHECKSUM_RESULTS,
    ENVIRONMENTS,
    FILE_READS,
    LOG_DEBUG,
    LOG_NOTICE,
    LOG_SILENT,
    LOG_WARNING,
    LOOKUP_DEVICE,
    LOOKUP_HOST,
    LOOKUPS,
    MAX_BATCH_ROWS,
    MAX_BATCHES,
    MAX_CLASSES_LIMIT,
    MAX_EXPERTS_LIMIT,
    MAX_HOST_BUDGET_BYTES,
    MAX_LAYERS_LIMIT,
    MAX_PART_BYTES_LIMIT,
    MAX_PARTS,
    MAX_SELECT,
    PARTITIONS,
    PATH_BATCH,
    PATH_COMPACT,
    PATH_CONTROL,
    PATH_DECODE,
    PATH_DEVICE,
    SOURCE_FILE,
    SOURCE_PAGEABLE,
    SOURCE_PINNED,
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
from ._prototypes import FUNCTIONS as _FUNCTIONS
from ._structs import (  # noqa: F401 (re-exported)
    DROPPED_FN,
    LOG_FN,
    POOL_FIELDS,
    PREFETCH_FIELDS,
    STAGING_FIELDS,
    STAT_FIELDS,
    STRUCT_MIRRORS,
    Bank,
    CachePtr,
    ClassInfo,
    Compact,
    Config,
    ExpertPtrs,
    LayerDesc,
    MemoryRefPtr,
    Part,
    PoolStats,
    PrefetchStats,
    StagingStats,
    Stats,
    set_fields,
)


def raise_for_status(status, func=None, args=None):
    """ctypes ``errcheck`` of every status-returning function: the exception for a failed status."""
    if status != OK:
        name = lib.expcache_status_string(status).decode()
        raise error_for(status, name, lib.expcache_last_error().decode(errors="replace"))
    return status


def _declare(dll: ctypes.CDLL) -> None:
    for name, argtypes, restype in _FUNCTIONS:
        fn = getattr(dll, name)
        fn.argtypes = argtypes
        fn.restype = restype
        if restype is c_int32:
            fn.errcheck = raise_for_status


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
