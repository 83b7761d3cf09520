"""The bench's experts in a file (``--source mmap|file``): the bytes a generated
:class:`~pyexpcache.source.HostSource` holds (its pattern, placement and checksums), written to a
file and served from it, mapped (``mmap``: misses copied from the mapping, pageable memory over
the page cache) or read (``file``: pread, with O_DIRECT or through the page cache, as the cache's
``file_reads`` says), as a model streamed from SSD is.

The file is written one layer at a time (host memory holds one layer's experts, not the model's),
flushed to the disk as it goes and dropped from the page cache, after a check that its folder has
the room (:func:`check_space`); it is removed when the source is released. Between two loops
:meth:`FileSource.drop_page_cache` evicts its pages, so each loop starts from the disk;
:meth:`FileSource.page_cache_fraction` says how much of it the page cache holds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import shutil
import tempfile
from typing import Callable, Optional

import numpy as np

from pyexpcache.layout import GiB, ModelLayout
from pyexpcache.source import BufferSource, HostSource, LayerPlacement, plan

READS = ("mmap", "file")  # how a file source serves misses
#: Where the bench's generated experts are served from (--source): pinned or pageable host memory,
#: or a file written with them, mapped (misses copied from the mapping) or read (pread).
SOURCES = ("pinned", "pageable") + READS
WRITE_PIECE = 256 << 20  # bytes written, flushed and dropped from the page cache at a time


class NotEnoughSpace(OSError):
    """The file's folder lacks the room for it (checked before anything is written)."""


def file_bytes(layout: ModelLayout, arrangement: str) -> int:
    """Bytes of the file holding ``layout``'s experts in ``arrangement`` (HostSource's buffer)."""
    return plan(layout, arrangement)[1]


def check_space(directory: Optional[str], nbytes: int) -> None:
    """NotEnoughSpace when ``directory`` (None: the system's temporary folder) has fewer than
    ``nbytes`` free, saying how much is needed and how much is free."""
    directory = directory or tempfile.gettempdir()
    free = shutil.disk_usage(directory).free
    if free < nbytes:
        raise NotEnoughSpace(
            f"the file source needs {nbytes / GiB:.2f} GiB in {directory}, which has {free / GiB:.2f} GiB free"
        )


def _one_layer(layout: ModelLayout, layer: int) -> ModelLayout:
    return ModelLayout(tuple(s if i == layer else None for i, s in enumerate(layout.layers)), name=layout.name)


class FileSource(BufferSource):
    """``layout``'s generated experts (HostSource's bytes) in a new file, served from it.

    Args:
        layout: the model layout.
        reads: ``"mmap"`` (placements are addresses in a mapping of the file: pageable memory)
            or ``"file"`` (placements are file offsets; the cache reads the file itself with
            pread, through the page cache or with O_DIRECT: its ``file_reads``).
        arrangement: HostSource's ``"expert"`` or ``"tensor"`` placement.
        directory: the folder the file is written in (default: a temporary folder, removed with
            the file).
        progress: called as ``progress(done_bytes, total_bytes)`` while writing.

    NotEnoughSpace (before writing) when the folder lacks the room; OSError when writing fails
    (the partial file is removed). The file is removed when the source is released.
    """

    pinned = False

    def __init__(
        self,
        layout: ModelLayout,
        *,
        reads: str = "file",
        arrangement: str = "expert",
        directory: Optional[str] = None,
        progress: Optional[Callable[[int, int], None]] = None,
    ):
        if reads not in READS:
            raise ValueError(f"reads must be one of {', '.join(READS)}, got {reads!r}")
        if arrangement not in ("tensor", "expert"):
            raise ValueError(f"arrangement must be 'tensor' or 'expert', got {arrangement!r}")
        self.layout = layout
        self.reads = reads
        self.arrangement = arrangement
        self._mm = None
        self.buffer = np.empty(0, np.uint8)
        offsets, total = plan(layout, arrangement)
        check_space(directory, total)
        self._own_dir = None if directory else tempfile.mkdtemp(prefix="expcache-bench-")
        fd, self.path = tempfile.mkstemp(prefix="experts-", suffix=".bin", dir=directory or self._own_dir)
        self._checksums: list[Optional[np.ndarray]] = [None] * layout.num_layers
        try:
            with os.fdopen(fd, "wb", buffering=0) as f:
                self._write(f, offsets, total, progress)
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except BaseException:
            self._remove()
            raise
        self.buffer = np.frombuffer(self._mm, dtype=np.uint8)
        base = self.buffer.ctypes.data
        #: Where each layer's parts are in the file (offsets), whatever ``reads`` is.
        self.file_placements = [
            LayerPlacement(offs, strides, spec.class_key) if spec else None
            for (offs, strides), spec in zip(offsets, layout.layers)
        ]
        # "file": the cache reads the file itself (pread); the mapping is for page-cache queries.
        self.file_path = self.path if reads == "file" else None
        origin = 0 if self.file_path else base
        self._placements = [
            LayerPlacement(tuple(origin + o for o in p.bases), p.strides, p.sizes) if p else None
            for p in self.file_placements
        ]
        self._track()

    def _write(self, f, offsets, total: int, progress) -> None:
        """Each layer's bytes, made by a HostSource of that layer alone (a layer's range starts
        256-byte aligned, so its parts lie where the whole layout's HostSource puts them), at its
        offset: flushed to the disk and dropped from the page cache a piece at a time."""
        fd = f.fileno()
        done = 0
        for layer in self.layout.moe_layers:
            with HostSource(_one_layer(self.layout, layer), arrangement=self.arrangement) as one:
                start = offsets[layer][0][0]
                view = memoryview(one.buffer)
                f.seek(start)
                for at in range(0, len(view), WRITE_PIECE):
                    piece = view[at : at + WRITE_PIECE]
                    while piece:
                        piece = piece[f.write(piece) :]
                    os.fdatasync(fd)
                    os.posix_fadvise(fd, start + at, min(WRITE_PIECE, len(view) - at), os.POSIX_FADV_DONTNEED)
                    done += min(WRITE_PIECE, len(view) - at)
                    if progress:
                        progress(done, total)
                self._checksums[layer] = np.array(
                    [one.expected_checksum(layer, e) for e in range(self.layout[layer].num_experts)], np.uint64
                )
        f.truncate(total)

    # -- what the cache needs --------------------------------------------
    def placement(self, layer: int) -> Optional[LayerPlacement]:
        """Where expert 0's parts are (addresses in the mapping, or file offsets when
        ``reads="file"``), strides and sizes; None for a layer without routed experts."""
        self._check_open()
        return self._placements[layer]

    # -- verification ------------------------------------------------------
    def part(self, layer: int, expert: int, part: int) -> np.ndarray:
        """A read-only uint8 view of one part's bytes in the file (through the mapping: reading
        it brings them into the page cache)."""
        self._check_open()
        place = self.file_placements[layer]
        off = place.bases[part] + expert * place.strides[part]
        return self.buffer[off : off + place.sizes[part]]

    def expert_bytes(self, layer: int, expert: int) -> np.ndarray:
        """An expert's bytes: every part in order (a copy)."""
        return np.concatenate([self.part(layer, expert, p) for p in range(self.layout[layer].num_parts)])

    def expected_checksum(self, layer: int, expert: int) -> int:
        """What expcache_testing_checksum gives for this expert when its bytes are intact
        (computed when it was written: nothing is read back)."""
        self._check_open()
        return int(self._checksums[layer][expert])

    # -- the page cache ----------------------------------------------------
    def drop_page_cache(self) -> None:
        """Evict the file's pages from the page cache (written back already: clean), this
        process's mapping of them first. Only while no cache reads the source."""
        self._check_open()
        if hasattr(self._mm, "madvise"):
            self._mm.madvise(mmap.MADV_DONTNEED)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def page_cache_fraction(self) -> Optional[float]:
        """The share of the file's pages in the page cache now (mincore over the mapping; the
        file is this process's, so the kernel reports the page cache's pages, not only those
        mapped here), or None where that cannot be read."""
        self._check_open()
        return _resident_fraction(self.buffer)

    # -- lifetime ----------------------------------------------------------
    def _check_open(self) -> None:
        self._check_usable()
        if self._mm is None or self.closed:
            raise ValueError(f"{self.path}: the source is closed")

    def _remove(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        if self._own_dir:
            shutil.rmtree(self._own_dir, ignore_errors=True)

    def _release(self) -> None:
        """Unmap and remove the file (and the folder made for it); called once, when closed and
        no cache uses it."""
        self._unmap()
        self._remove()

    def _close_at_exit(self) -> None:
        if not self._forked:  # a forked child's file is its parent's
            self._remove()  # the mapping goes with the process

    def __repr__(self) -> str:
        state = "closed" if self._mm is None or self.closed else f"{self.nbytes} bytes"
        return f"FileSource({self.path!r}, {self.reads} reads, {self.arrangement} placement, {state})"


_libc = None


def _resident_fraction(mapped: np.ndarray) -> Optional[float]:
    """mincore over the pages of ``mapped`` (a mapping's bytes): the share in memory."""
    global _libc
    if not mapped.nbytes:
        return None
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
            _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            _libc.mincore.restype = ctypes.c_int
        pages = -(-mapped.nbytes // mmap.PAGESIZE)
        vec = np.zeros(pages, np.uint8)
        if _libc.mincore(mapped.ctypes.data, mapped.nbytes, vec.ctypes.data) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return float(np.count_nonzero(vec & 1)) / pages
