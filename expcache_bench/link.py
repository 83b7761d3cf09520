"""The link: how fast host memory reaches a device with plain ``cudaMemcpyAsync``, the one
measurement every bound of the benchmark is taken against (the variants' and the engine model's
link bound, each device's link in the several-devices run, the transfer table's raw columns).
On the host backend, where no link exists, memcpy bandwidth stands in for it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from pyexpcache import _cuda
from pyexpcache.layout import ModelLayout
from pyexpcache.source import HostSource

REPEATS = 20  # timed copies of a link measurement, after one untimed


@dataclass(frozen=True)
class Link:
    """A measured link: bytes per second and what was measured."""

    bytes_per_s: float
    label: str


def copy_rate(src_ptr: int, chunk_bytes: int, repeats: int, stream: int) -> float:
    """Bytes/s of ``repeats`` host-to-device ``cudaMemcpyAsync`` of ``chunk_bytes`` from host
    address ``src_ptr`` into one device buffer on ``stream`` (the current device's), after one
    untimed copy, timed with events recorded on the stream. Synchronizes the stream."""
    rt = _cuda.runtime()
    dev = _cuda.check(rt.cudaMalloc(chunk_bytes), "cudaMalloc")
    start = stop = None
    try:
        kind = rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        start = _cuda.check(rt.cudaEventCreate(), "cudaEventCreate")
        stop = _cuda.check(rt.cudaEventCreate(), "cudaEventCreate")
        _cuda.check(rt.cudaMemcpyAsync(dev, src_ptr, chunk_bytes, kind, stream), "cudaMemcpyAsync")
        _cuda.check(rt.cudaEventRecord(start, stream), "cudaEventRecord")
        for _ in range(repeats):
            _cuda.check(rt.cudaMemcpyAsync(dev, src_ptr, chunk_bytes, kind, stream), "cudaMemcpyAsync")
        _cuda.check(rt.cudaEventRecord(stop, stream), "cudaEventRecord")
        _cuda.check(rt.cudaEventSynchronize(stop), "cudaEventSynchronize")
        ms = _cuda.check(rt.cudaEventElapsedTime(start, stop), "cudaEventElapsedTime")
        return chunk_bytes * repeats / (ms / 1e3)
    finally:
        for event in (start, stop):
            if event is not None:
                rt.cudaEventDestroy(event)
        rt.cudaFree(dev)


def host_copy_rate(src: np.ndarray, repeats: int) -> float:
    """Bytes/s of ``repeats`` numpy copies of ``src`` into one host buffer: the host backend's link."""
    dst = np.empty(src.nbytes, np.uint8)
    t0 = time.perf_counter()
    for _ in range(repeats):
        np.copyto(dst, src)
    return src.nbytes * repeats / (time.perf_counter() - t0)


def measure(
    source, chunk_bytes: int, *, cuda: bool, device: int = 0, stream: Optional[int] = None, repeats: int = REPEATS
) -> Link:
    """The link of ``device``: :func:`copy_rate` of ``chunk_bytes`` pieces (at most the source's
    size) from pinned memory, the source's own when it is pinned, else a pinned buffer made for
    the measurement, whatever the source kind: a link bound is what the link allows. ``stream``:
    a stream of ``device`` to copy on (default: one made for the measurement); the current device
    is the same afterwards. Without ``cuda``, :func:`host_copy_rate` of the source's first bytes
    (of memory made for the measurement where the source is a file: the link is from memory)."""
    chunk = min(chunk_bytes, source.nbytes)
    if not cuda:
        memory = source.buffer[:chunk] if getattr(source, "path", None) is None else np.ones(chunk, np.uint8)
        return Link(host_copy_rate(memory, repeats), "host memcpy (emulated link)")
    rt = _cuda.runtime()
    current = _cuda.check(rt.cudaGetDevice(), "cudaGetDevice")
    _cuda.check(rt.cudaSetDevice(device), "cudaSetDevice")
    own_stream = stream is None
    if own_stream:
        stream = int(_cuda.check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreate"))
    try:
        label = f"cudaMemcpyAsync from pinned memory, {chunk / (1 << 20):.2f} MiB chunks"
        if source.pinned:
            return Link(copy_rate(source.buffer.ctypes.data, chunk, repeats, stream), label)
        spec = next(s for s in source.layout.layers if s)
        probe = ModelLayout((spec.with_experts(max(1, -(-chunk // spec.expert_bytes))),))
        with HostSource(probe, pinned=True) as pinned:
            return Link(copy_rate(pinned.buffer.ctypes.data, chunk, repeats, stream), label)
    finally:
        if own_stream:
            rt.cudaStreamDestroy(stream)
        _cuda.check(rt.cudaSetDevice(current), "cudaSetDevice")
