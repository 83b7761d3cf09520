"""The disk: how fast the experts of a file source (``--source file|mmap``, or ``--gguf``) read
from it, measured in the same run as the link (:mod:`~expcache_bench.link`): O_DIRECT reads of
the run's own file, which bypass the page cache, several at once as the library's file reads
are (one reader thread per copy thread, each read a piece of an expert). Where the file system
refuses O_DIRECT (tmpfs) the file's pages are dropped from the page cache first and the reads
are buffered, and the figure says so.

A file source's bound is the lower of the link's and the disk's: misses cross the link at most
as fast as the disk gives them (:func:`~expcache_bench.report.bound`)."""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pyexpcache.source import LayerPlacement

from .report import _bytes

ALIGN = 4096  # O_DIRECT's alignment of offsets, lengths and buffers (a page)
PIECE = 1 << 20  # the most one read asks for
READ_BYTES = 4 << 30  # expert bytes read by one measurement (at most the file's experts, each once)


@dataclass(frozen=True)
class Disk:
    """A measured read rate: expert bytes per second, and what was measured."""

    bytes_per_s: float
    label: str
    direct: bool  # O_DIRECT reads (False: the file system refused them; buffered reads after a drop)


def direct_allowed(path: str) -> bool:
    """Whether ``path`` opens with O_DIRECT (tmpfs and some other file systems refuse it; the
    library then reads it buffered)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return False
    return True


def measure(
    path: str,
    placements: Sequence[tuple[LayerPlacement, int]],
    *,
    threads: int,
    total_bytes: int = READ_BYTES,
    seed: int = 0,
    direct: bool = True,
) -> Disk:
    """The read rate of ``path``: ``threads`` threads reading, with O_DIRECT, the experts of
    ``placements`` (per MoE layer: where its parts are in the file, as offsets, and its expert
    count) in random order, up to ``total_bytes`` of them, each part in pieces of at most
    :data:`PIECE` (each read widened to whole aligned blocks); the rate counts the experts'
    bytes. With ``direct`` false, or where O_DIRECT is refused, buffered reads after the file's
    pages were dropped from the page cache (:attr:`Disk.direct` False): the rate buffered reads
    of the file see, whatever caches the disk below the page cache (a virtual disk's host)."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    experts = [(p, e) for p, n in placements for e in range(n)]
    order = np.random.default_rng(seed).permutation(len(experts))
    reads, want = [], 0
    for i in order:
        p, e = experts[i]
        for base, stride, size in zip(p.bases, p.strides, p.sizes):
            start = base + e * stride
            reads += [(start + at, min(PIECE, size - at)) for at in range(0, size, PIECE)]
            want += size
        if want >= total_bytes:
            break
    if not reads:
        raise ValueError(f"{path}: no experts to read")
    asked, direct = direct, direct and direct_allowed(path)
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        lock, errors = threading.Lock(), []
        queue = iter(reads)

        def reader() -> None:
            buf = mmap.mmap(-1, PIECE + 2 * ALIGN)  # page-aligned, as O_DIRECT needs
            try:
                while True:
                    with lock:
                        item = next(queue, None)
                    if item is None or errors:
                        return
                    offset, size = item
                    at = offset - offset % ALIGN
                    span = -(-(offset + size - at) // ALIGN) * ALIGN
                    got = os.preadv(fd, [memoryview(buf)[:span]], at)
                    if got < offset + size - at:
                        raise OSError(f"{path}: a read at {at} of {span} bytes returned {got}")
            except BaseException as exc:
                errors.append(exc)
            finally:
                buf.close()

        workers = [threading.Thread(target=reader, daemon=True) for _ in range(threads)]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        seconds = time.perf_counter() - t0
        if errors:
            raise errors[0]
    finally:
        os.close(fd)
    how = (
        "O_DIRECT"
        if direct
        else "buffered (the page cache dropped first)"
        if not asked
        else "buffered (O_DIRECT refused by the file system; the page cache dropped first)"
    )
    label = (
        f"{how} reads of the run's file, {threads} threads, pieces of up to {PIECE >> 20} MiB of random experts, "
        + _bytes(want)
    )
    return Disk(want / seconds, label, direct)
