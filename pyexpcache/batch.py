"""What the prefill and compact paths of :class:`~pyexpcache.ExpertCache` return: a
:class:`Batch` (:meth:`~pyexpcache.ExpertCache.prepare_batch`), held until finished, and a
:class:`CompactBuffer` (:meth:`~pyexpcache.ExpertCache.load_compact`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _lib
from ._cuda import stream_handle


@dataclass(frozen=True)
class CompactRegion:
    """One part's region of a :class:`CompactBuffer`: ``nbytes`` per expert, expert i's at
    ``address + i * nbytes``."""

    name: str
    address: int
    nbytes: int


@dataclass
class CompactBuffer:
    """A contiguous device buffer from :meth:`ExpertCache.load_compact`: one region per part, in
    part order (all gate parts, then all up parts, then all down parts, for three), each holding
    that part of every expert in the ids' order. The gate/up/down fields are parts 0, 1 and 2 of a
    three-part layer (0 otherwise); ``names``, ``part_offsets`` and ``part_bytes`` describe every
    part (:meth:`region`). Owned by the cache; valid until the next load_compact or release_all."""

    base: int
    nbytes: int
    gate_offset: int
    up_offset: int
    down_offset: int
    gate_bytes: int
    up_bytes: int
    down_bytes: int
    num_experts: int
    names: tuple[str, ...] = ("gate", "up", "down")
    part_offsets: tuple[int, ...] = ()
    part_bytes: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.part_offsets:  # made with the three parts' fields alone
            self.part_offsets = (self.gate_offset, self.up_offset, self.down_offset)
            self.part_bytes = (self.gate_bytes, self.up_bytes, self.down_bytes)

    @property
    def regions(self) -> tuple[CompactRegion, ...]:
        """Every part's region, in part order."""
        return tuple(
            CompactRegion(n, self.base + off, b) for n, off, b in zip(self.names, self.part_offsets, self.part_bytes)
        )

    def region(self, name) -> CompactRegion:
        """The region of part ``name`` (or of the part at an index); KeyError naming the parts."""
        if isinstance(name, str):
            if name not in self.names:
                raise KeyError(f"no part {name!r}: this buffer's parts are {', '.join(self.names)}")
            name = self.names.index(name)
        return self.regions[name]

    def pointers(self) -> np.ndarray:
        """[n, parts] uint64 device addresses of each expert's parts (gate, up, down for three)."""
        i = np.arange(self.num_experts, dtype=np.uint64)
        cols = [np.uint64(self.base + off) + i * np.uint64(b) for off, b in zip(self.part_offsets, self.part_bytes)]
        return np.stack(cols, axis=1).astype(np.uint64)


class Batch:
    """A prepared prefill batch: the union of its experts, held in the cache until
    :meth:`finish` (or the end of a ``with`` block)."""

    def __init__(self, cache, layer: int, handle: int, ids: np.ndarray, pointers: np.ndarray, stream, slots=None):
        self._cache = cache
        self.layer = layer
        self.handle = handle
        self.ids = ids
        self.pointers = pointers
        self.slots = slots  # a batch by slot id: each expert's row in its class's bank (int32), else None
        self._stream = stream
        self.finished = False

    def finish(self, stream=None) -> None:
        """Release the batch's holds (idempotent). Staging is freed once the work
        enqueued on ``stream`` (default: the stream it was prepared on) completes."""
        if self.finished:
            return
        s = self._stream if stream is None else stream_handle(stream)
        with self._cache._gate:
            _lib.lib.expcache_batch_finish(self._cache._handle, self.handle, s)
        self.finished = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.finish()

    def __len__(self) -> int:
        return len(self.ids)
