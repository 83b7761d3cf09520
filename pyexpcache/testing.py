"""Test hooks of an :class:`~pyexpcache.ExpertCache`: the Python face of ``expcache_testing.h``.

For tests, benchmarks and bindings, not for serving a model: like the header's hooks, these may
change or go in any release, and an engine needs none of them (the product API is
:class:`~pyexpcache.ExpertCache`'s methods). Each function takes the cache first and calls the
library through the cache's call gate, so it raises
:class:`~pyexpcache.CacheClosedError` once the cache is closed, waits for nothing a concurrent
:meth:`~pyexpcache.ExpertCache.close` would not, and raises :class:`~pyexpcache.ForkedError` in a
child made by fork(), as the cache's own methods do. Integer arguments are range-checked against
their C types first (ValueError/OverflowError naming them).

A :class:`~pyexpcache.MultiDeviceCache` has no hooks of its own: pass one of its per-device caches
(``multi.caches[d]``).

Reading back:
    :func:`read_expert`, :func:`read_device`, :func:`device_bytes_in_use`, :func:`table_reads`, :func:`device_reads`
The checksum kernel (what :meth:`~pyexpcache.HostSource.expected_checksum` predicts):
    :func:`checksum`, :func:`checksum_async`, :func:`checksum_results`
Fault injection and prefetch control:
    :func:`fail_device_alloc_after`, :func:`fail_copy_after`, :func:`fail_staging_after`,
    :func:`pause_prefetch`
"""

from __future__ import annotations

import ctypes
from typing import Optional

import numpy as np

from . import _lib, bank as _bank
from ._cuda import stream_handle
from ._ints import u32, u64
from .cache import ExpertCache

__all__ = [
    "CHECKSUM_RESULTS",
    "bank_checksum_async",
    "checksum",
    "checksum_async",
    "checksum_results",
    "device_bytes_in_use",
    "fail_copy_after",
    "fail_device_alloc_after",
    "fail_staging_after",
    "pause_prefetch",
    "read_device",
    "read_expert",
    "table_reads",
    "device_reads",
]

#: Result slots of :func:`checksum_async` per cache (EXPCACHE_CHECKSUM_RESULTS).
CHECKSUM_RESULTS = _lib.CHECKSUM_RESULTS


def _cache(cache, hook: str) -> ExpertCache:
    if not isinstance(cache, ExpertCache):
        hint = " (a MultiDeviceCache's are its .caches)" if hasattr(cache, "caches") else ""
        raise TypeError(f"pyexpcache.testing.{hook} takes an ExpertCache{hint}, got {type(cache).__name__}")
    return cache


# -- reading back ------------------------------------------------------------------------------


def read_expert(cache: ExpertCache, layer: int, expert: int) -> Optional[np.ndarray]:
    """The resident bytes of (layer, expert) of ``cache`` (gate, up, down) as uint8, or None when it
    is not resident. Synchronizes."""
    cache = _cache(cache, "read_expert")
    layer, expert = cache._layer(layer), u32(expert, "expert")
    spec = cache.layout[layer] if layer < cache.layout.num_layers else None
    nbytes = spec.expert_bytes if spec else 1  # the library reports a bad or dense layer
    out = np.empty(nbytes, dtype=np.uint8)
    resident = ctypes.c_uint32()
    cache._call("expcache_testing_read_resident", layer, expert, out.ctypes.data, nbytes, ctypes.byref(resident))
    return out if resident.value else None


def read_device(cache: ExpertCache, address: int, nbytes: int) -> np.ndarray:
    """Copy ``nbytes`` at a device ``address`` that ``cache`` handed out to host memory.
    Synchronizes."""
    cache = _cache(cache, "read_device")
    address, nbytes = u64(address, "address"), u64(nbytes, "nbytes")
    out = np.empty(nbytes, dtype=np.uint8)
    cache._call("expcache_testing_read_device", address, out.ctypes.data, nbytes)
    return out


def device_bytes_in_use(cache: ExpertCache) -> int:
    """Device bytes ``cache`` holds now (slots and staging buffers, as allocated, not rounded)."""
    cache = _cache(cache, "device_bytes_in_use")
    out = ctypes.c_uint64()
    cache._call("expcache_testing_device_bytes_in_use", ctypes.byref(out))
    return out.value


def table_reads(cache: ExpertCache, layer: int) -> int:
    """How many :meth:`~pyexpcache.ExpertCache.select_device` calls of ``layer``'s class were
    served by their table read (every id in range resident: hits refreshed and counted, no
    victim search, nothing copied) since the class was bound; 0 before. A ``lookup="device"``
    cache only. Synchronizes."""
    cache = _cache(cache, "table_reads")
    out = ctypes.c_uint64()
    cache._call("expcache_testing_table_reads", cache._layer(layer), ctypes.byref(out))
    return out.value


def device_reads(cache: ExpertCache) -> tuple[int, int]:
    """``(syncs, copies)``: the device synchronizations and synchronous device-to-host copies
    ``cache`` has made since it was created (both backends count them)."""
    cache = _cache(cache, "device_reads")
    syncs, copies = ctypes.c_uint64(), ctypes.c_uint64()
    cache._call("expcache_testing_device_reads", ctypes.byref(syncs), ctypes.byref(copies))
    return syncs.value, copies.value


# -- checksums ---------------------------------------------------------------------------------


def checksum(cache: ExpertCache, layer: int, pointers, stream=None) -> np.ndarray:
    """Run the checksum kernel over experts at ``pointers`` ([n, 3] addresses of ``layer``'s
    class, as :meth:`~pyexpcache.ExpertCache.select` returns): uint64 per expert. Reads every
    byte. Synchronizes."""
    cache = _cache(cache, "checksum")
    layer = cache._layer(layer)
    ptrs = np.ascontiguousarray(pointers, dtype=np.uint64).reshape(-1, 3)
    out = np.empty(ptrs.shape[0], dtype=np.uint64)
    cache._call(
        "expcache_testing_checksum",
        layer,
        ptrs.ctypes.data,
        u32(ptrs.shape[0], "len(pointers)"),
        stream_handle(stream),
        out.ctypes.data,
    )
    return out


def checksum_async(cache: ExpertCache, layer: int, pointers, first: int, stream=None) -> None:
    """:func:`checksum` without waiting: the sums go to result slots ``[first, first + n)`` when
    ``stream`` reaches the kernel; read them with :func:`checksum_results` after synchronizing it."""
    cache = _cache(cache, "checksum_async")
    layer, first = cache._layer(layer), u32(first, "first")
    ptrs = np.ascontiguousarray(pointers, dtype=np.uint64).reshape(-1, 3)
    cache._call(
        "expcache_testing_checksum_async",
        layer,
        ptrs.ctypes.data,
        u32(ptrs.shape[0], "len(pointers)"),
        stream_handle(stream),
        first,
    )


def bank_checksum_async(cache: ExpertCache, layer: int, slots, first: int, stream=None) -> None:
    """The checksum kernel over the experts in ``slots`` of ``layer``'s bank (a device-lookup
    cache; ``slots`` an int32 array where :meth:`~pyexpcache.ExpertCache.select_device` writes
    them: a CUDA array, or numpy on the host backend): one sum per slot into result slots
    ``[first, first + n)``, read by the kernel from ``slots`` (capturable in a graph after one call
    outside it). Read them with :func:`checksum_results` after synchronizing ``stream``."""
    cache = _cache(cache, "bank_checksum_async")
    layer, first = cache._layer(layer), u32(first, "first")
    ids = _bank.id_array(slots, "slots")
    if ids.bits != 32:
        raise TypeError(f"slots must be int32 (as select_device gives them), got {ids.bits}-bit integers")
    count = 1
    for dim in ids.shape:
        count *= dim
    cache._call(
        "expcache_testing_bank_checksum_async", layer, ids.ptr, u32(count, "len(slots)"), stream_handle(stream), first
    )


def checksum_results(cache: ExpertCache, first: int, n: int) -> np.ndarray:
    """Result slots ``[first, first + n)`` of :func:`checksum_async` (does not wait)."""
    cache = _cache(cache, "checksum_results")
    first, n = u32(first, "first"), u32(n, "n")
    if n > CHECKSUM_RESULTS:
        raise ValueError(f"n must be at most {CHECKSUM_RESULTS}, got {n}")
    out = np.empty(max(n, 1), dtype=np.uint64)
    cache._call("expcache_testing_checksum_results", first, n, out.ctypes.data)
    return out[:n]


# -- fault injection and prefetch control ------------------------------------------------------


def fail_device_alloc_after(cache: ExpertCache, n: int, count: int = 1) -> None:
    """Fault injection: let ``n`` device allocations of ``cache`` succeed, then fail the next
    ``count`` as if device memory were exhausted (``count=0`` turns injection off)."""
    cache = _cache(cache, "fail_device_alloc_after")
    cache._call("expcache_testing_inject_alloc_failures", u64(n, "n"), u64(count, "count"))


def fail_copy_after(cache: ExpertCache, n: int, count: int = 1) -> None:
    """Fault injection: let ``n`` copies of ``cache`` be issued, then fail the next ``count``
    (CudaError; ``count=0`` turns injection off)."""
    cache = _cache(cache, "fail_copy_after")
    cache._call("expcache_testing_inject_copy_failures", u64(n, "n"), u64(count, "count"))


def fail_staging_after(cache: ExpertCache, n: int, count: int = 1) -> None:
    """Fault injection: let ``n`` staged pieces of ``cache`` (pageable and file uploads) be filled,
    then fail the next ``count`` on the staging threads (CudaError from the call that staged them;
    ``count=0`` turns injection off)."""
    cache = _cache(cache, "fail_staging_after")
    cache._call("expcache_testing_inject_staging_failures", u64(n, "n"), u64(count, "count"))


def pause_prefetch(cache: ExpertCache, paused: bool = True) -> None:
    """While paused the prefetch thread of ``cache`` sends nothing, so queued prefetches stay
    queued until the next serving call cancels them
    (:meth:`~pyexpcache.ExpertCache.wait_prefetch` refuses to wait for them)."""
    cache = _cache(cache, "pause_prefetch")
    cache._call("expcache_testing_prefetch_pause", 1 if paused else 0)
