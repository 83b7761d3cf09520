"""The disk: how fast the experts of a file source (``--source file|mmap``, or ``--gguf``) read
from it, measured in the same run as the link (:mod:`~expcache_bench.link`): O_DIRECT reads of
the run's own file, which bypass the page cache, several at once as the library's file reads
are. Where the file system refuses O_DIRECT (tmpfs) the file's pages are dropped from the page
cache first and the reads are buffered, and the figure says so.

The figure is an upper bound of what the library can read, not one shape's rate: reads of the
shape the library's feed uses (one reader per copy thread, each part cut into the feed's pieces,
:func:`feed_piece`) and of other shapes, more reads in flight (:data:`DEPTHS` threads) and larger
pieces up to a whole expert in one read; the best of them, and the shape that gave it. The search
is two steps over one budget of bytes: the depths at the feed's piece, then the pieces at the best
depth (:func:`measure`).

A disk whose host caches it (a virtual disk) reads experts read before faster than cold ones, so
a run that reads hot experts again and again can beat any cold shape. :func:`replay` reads a
run's own misses, in its order, in the library's shape: the bench takes the faster of the two
rates as the disk's (a bound is the fastest the disk was seen to read).

A file source's bound is the lower of the link's and the disk's: misses cross the link at most
as fast as the disk gives them (:func:`~expcache_bench.report.bound`)."""

from __future__ import annotations

import ctypes
import errno
import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np

from pyexpcache.source import LayerPlacement

from .report import _bytes

ALIGN = 4096  # O_DIRECT's alignment of offsets, lengths and buffers (a page)
READ_BYTES = 4 << 30  # expert bytes read by one measurement, over all its shapes
DEPTHS = (8, 16, 32, 64)  # reader threads tried beside the library's own count
ROUNDS = 2  # a shape is tried where its share of the bytes gives each thread this many reads at least
# The library's feed (libexpcache/src/kernels/feed_protocol.hpp, feed.cpp feed_piece): a part is
# cut into FEED_PIECES pieces at most, of FEED_MIN_PIECE bytes at least, a multiple of FEED_CHUNK.
FEED_PIECES = 16
FEED_MIN_PIECE = 256 << 10
FEED_CHUNK = 16 << 10


def feed_piece(part_bytes: Sequence[int]) -> int:
    """The piece the library's feed reads experts of ``part_bytes`` in (feed.cpp's feed_piece):
    256 KiB, or larger so that no part has more than 16 pieces; a multiple of 16 KiB."""
    largest = max(part_bytes, default=0)
    per = -(-largest // FEED_PIECES)
    return max(FEED_MIN_PIECE, -(-per // FEED_CHUNK) * FEED_CHUNK)


@dataclass(frozen=True)
class Shape:
    """How a measurement reads: ``threads`` readers, each read a piece of at most ``piece``
    bytes of one part (None: a whole expert, its parts in one read where they lie together)."""

    threads: int
    piece: Optional[int]

    def __str__(self) -> str:
        reads = "whole experts" if self.piece is None else f"pieces of {_bytes(self.piece)}"
        return f"{self.threads} threads, {reads}"


@dataclass(frozen=True)
class Disk:
    """A measured read rate: expert bytes per second, and what was measured: the best ``shape``
    of those ``tried`` (each with its rate, in the order tried)."""

    bytes_per_s: float
    label: str
    direct: bool  # O_DIRECT reads (False: the file system refused them; buffered reads after a drop)
    shape: Shape
    tried: tuple[tuple[Shape, float], ...]
    # A replay (:func:`replay`): the expert bytes it read, its reads (pieces), the misses it
    # replayed and the run's misses it was given (more where the run's bytes passed the cap).
    read_bytes: int = 0
    reads: int = 0
    misses: int = 0
    of_misses: int = 0


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


def _open(path: str, direct: bool) -> tuple[int, bool, str]:
    """``path`` opened for a measurement: with O_DIRECT when ``direct`` and the file system allows
    it; the descriptor, whether it is O_DIRECT, and how the label says it reads (buffered reads
    drop the file's pages first, the caller's part)."""
    asked, direct = direct, direct and direct_allowed(path)
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    how = (
        "O_DIRECT"
        if direct
        else "buffered (the page cache dropped first)"
        if not asked
        else "buffered (O_DIRECT refused by the file system; the page cache dropped first)"
    )
    return fd, direct, how


def expert_ranges(p: LayerPlacement, e: int) -> list[tuple[int, int]]:
    """Expert ``e``'s bytes in the file as ``(offset, size)`` ranges: its parts, those that lie
    together (apart by less than a block) merged into one."""
    parts = sorted((base + e * stride, size) for base, stride, size in zip(p.bases, p.strides, p.sizes) if size)
    ranges: list[tuple[int, int]] = []
    for start, size in parts:
        if ranges and 0 <= start - sum(ranges[-1]) < ALIGN:
            ranges[-1] = (ranges[-1][0], start + size - ranges[-1][0])
        else:
            ranges.append((start, size))
    return ranges


def reads_of(p: LayerPlacement, e: int, piece: Optional[int]) -> list[tuple[int, int]]:
    """The reads of expert ``e`` in pieces of at most ``piece`` bytes of one part, as the feed
    reads it, or (``piece`` None) its :func:`expert_ranges` whole: ``(offset, size)`` each."""
    if piece is None:
        return expert_ranges(p, e)
    return [
        (base + e * stride + at, min(piece, size - at))
        for base, stride, size in zip(p.bases, p.strides, p.sizes)
        for at in range(0, size, piece)
    ]


def pieces(placements: Sequence[tuple[LayerPlacement, int]]) -> list[Optional[int]]:
    """The pieces tried: the feed's piece of the largest expert, doubled while under its largest
    part, then whole experts (None)."""
    largest = max(s for p, _ in placements for s in p.sizes)
    ladder = [feed_piece([largest])]
    while ladder[-1] * 2 < largest:
        ladder.append(ladder[-1] * 2)
    return [*ladder, None]


def _read(fd: int, path: str, reads: Sequence[tuple[int, int]], threads: int) -> float:
    """Seconds that ``threads`` threads take to read ``reads`` (``(offset, size)`` each, widened
    to whole aligned blocks) from ``fd``, a read at a time each, taking the next as they finish:
    C threads (``disk_reads.c`` in the replay library), whose reads the interpreter's lock does
    not hold back."""
    offsets = np.fromiter((o for o, _ in reads), np.uint64, len(reads))
    sizes = np.fromiter((n for _, n in reads), np.uint64, len(reads))
    seconds, failed_at = ctypes.c_double(), ctypes.c_uint64()
    code = _reader()(fd, offsets.ctypes.data, sizes.ctypes.data, len(reads), threads, seconds, failed_at)
    if code == errno.EIO:
        raise OSError(f"{path}: a read at {failed_at.value} came back short (the file ends early)")
    if code:
        raise OSError(code, f"{path}: reading at {failed_at.value}: {os.strerror(code)}")
    return seconds.value


@functools.cache
def _reader():
    """``expcache_disk_reads`` of the replay library (:func:`~expcache_bench.replay.load`)."""
    from .replay import load

    fn = load()[0].expcache_disk_reads
    fn.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_uint64,
        ctypes.c_uint32,
        ctypes.POINTER(ctypes.c_double),
        ctypes.POINTER(ctypes.c_uint64),
    ]
    fn.restype = ctypes.c_int
    return fn


def measure(
    path: str,
    placements: Sequence[tuple[LayerPlacement, int]],
    *,
    threads: int,
    depths: Sequence[int] = DEPTHS,
    total_bytes: int = READ_BYTES,
    seed: int = 0,
    direct: bool = True,
) -> Disk:
    """The read rate of ``path``, the best of several shapes (:class:`Shape`): ``threads`` (the
    library's reader count) and ``depths`` threads reading, with O_DIRECT, the experts of
    ``placements`` (per MoE layer: where its parts are in the file, as offsets, and its expert
    count) in random order, in pieces of the feed's size (:func:`feed_piece`); then, at the
    fastest of those counts, in larger pieces up to whole experts (:func:`pieces`). Each shape
    reads an equal share of ``total_bytes`` (the next experts in the random order, at most each
    of the file's once; whole experts) where that share gives each of its threads :data:`ROUNDS`
    reads at least: a count it does not is skipped (the library's own is read all the same), a
    larger piece is read by as many threads as it does. The rate counts the experts' bytes (each
    read widened to whole aligned blocks); :attr:`Disk.tried` holds each shape's. With ``direct`` false, or
    where O_DIRECT is refused, buffered reads, the file's pages dropped from the page cache
    before each shape (:attr:`Disk.direct` False): the rate buffered reads of the file see,
    whatever caches the disk below the page cache (a virtual disk's host)."""
    if threads < 1 or any(d < 1 for d in depths):
        raise ValueError(f"threads must be >= 1, got {threads} and depths {tuple(depths)}")
    experts = [(p, e) for p, n in placements for e in range(n)]
    if not any(s for p, _ in experts for s in p.sizes):
        raise ValueError(f"{path}: no experts to read")
    order = np.random.default_rng(seed).permutation(len(experts))
    ladder = pieces(placements)
    counts = sorted({threads, *depths})
    share = max(1, total_bytes // (len(counts) + len(ladder) - 1))
    fd, direct, how = _open(path, direct)
    tried: list[tuple[Shape, float]] = []
    cursor, read_bytes = 0, 0

    def attempt(count: int, piece: Optional[int], short: str) -> None:
        """Read the next share of experts with ``count`` threads in ``piece`` pieces; where the
        share has fewer than :data:`ROUNDS` reads a thread, ``short`` says what then: ``"read"``
        all the same, ``"fit"`` with as many threads as it has reads for, ``"skip"``."""
        nonlocal cursor, read_bytes
        reads, want, taken = [], 0, 0
        while taken < len(order) and want < share:
            p, e = experts[order[(cursor + taken) % len(order)]]
            reads += reads_of(p, e, piece)
            want += sum(p.sizes)
            taken += 1
        if len(reads) < ROUNDS * count and short != "read":
            if short == "skip" or len(reads) < ROUNDS:
                return
            count = len(reads) // ROUNDS
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        tried.append((Shape(count, piece), want / _read(fd, path, reads, count)))
        cursor, read_bytes = cursor + taken, read_bytes + want

    try:
        for n in counts:  # the library's own shape whatever the share
            attempt(n, ladder[0], "read" if n == threads else "skip")
        deepest = max(tried, key=lambda t: t[1])[0].threads
        for piece in ladder[1:]:
            attempt(deepest, piece, "fit")
    finally:
        os.close(fd)
    best, rate = max(tried, key=lambda t: t[1])
    others = ", ".join(str(n) for n in counts if n != threads)
    label = (
        f"{how} reads of the run's file, random experts, {_bytes(read_bytes)}: the best of {len(tried)} shapes "
        f"(the library's {threads} threads" + (f" and {others}" if others else "") + f" in the feed's pieces of "
        f"{_bytes(ladder[0])}, then pieces up to whole experts at the fastest count): {best}"
    )
    return Disk(rate, label, direct, best, tuple(tried))


#: At most this many bytes of a run's misses are replayed (:func:`replay`), its first ones.
REPLAY_BYTES = 32 << 30


def replay(
    path: str,
    places: Mapping[int, LayerPlacement],
    misses: Sequence[tuple[int, int]],
    *,
    threads: int,
    limit_bytes: int = REPLAY_BYTES,
    direct: bool = True,
) -> Disk:
    """The read rate of a run's own misses: ``misses`` (``(layer, expert)`` each, in the order
    the run read them) read from ``path`` (``places``: each layer's placement in the file) in
    that order by ``threads`` readers (the library's count), each expert's parts in the feed's
    pieces (:func:`feed_piece`), with O_DIRECT where the file system allows it (else buffered,
    the file's pages dropped first). At most ``limit_bytes`` of expert bytes, the first misses
    (the label says so). :attr:`Disk.tried` holds the one shape read."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if not misses:
        raise ValueError(f"{path}: no misses to replay")
    reads, want, taken = [], 0, 0
    for layer, expert in misses:
        p = places[layer]
        if want + sum(p.sizes) > limit_bytes and taken:
            break
        reads += reads_of(p, expert, feed_piece(p.sizes))
        want += sum(p.sizes)
        taken += 1
    fd, direct, how = _open(path, direct)
    try:
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        rate = want / _read(fd, path, reads, threads)
    finally:
        os.close(fd)
    cut = sorted({feed_piece(places[layer].sizes) for layer, _ in misses[:taken]})
    shape = Shape(threads, cut[-1])
    first = f"its first {taken:,} of {len(misses):,} misses" if taken < len(misses) else f"its {taken:,} misses"
    label = (
        f"{how} reads replaying the run's own misses, {first} ({_bytes(want)}) in its order: "
        f"{threads} threads, the feed's pieces of {', '.join(_bytes(x) for x in cut)}"
    )
    return Disk(rate, label, direct, shape, ((shape, rate),), want, len(reads), taken, len(misses))


def faster(cold: float, replayed: Optional[float]) -> tuple[float, str]:
    """The disk's rate a bound is taken at, and which: the larger of the ``cold`` best shape's
    (:func:`measure`) and a run's ``replayed`` misses' (:func:`replay`; None where none was),
    ``"cold"`` or ``"replay"``: a bound is the fastest the disk was seen to read."""
    if replayed is not None and replayed > cold:
        return replayed, "replay"
    return cold, "cold"
