"""What the prefill and compact paths of :class:`~pyexpcache.ExpertCache` return: a
:class:`Batch` (:meth:`~pyexpcache.ExpertCache.prepare_batch`), held until finished, and a
:class:`CompactBuffer` (:meth:`~pyexpcache.ExpertCache.load_compact`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _lib
from ._cuda import stream_handle


@dataclass
class CompactBuffer:
    """A contiguous device buffer from :meth:`ExpertCache.load_compact`: all gate parts,
    then all up parts, then all down parts. Owned by the cache; valid until the next
    load_compact or release_all."""

    base: int
    nbytes: int
    gate_offset: int
    up_offset: int
    down_offset: int
    gate_bytes: int
    up_bytes: int
    down_bytes: int
    num_experts: int

    def pointers(self) -> np.ndarray:
        """[n, 3] uint64 device addresses of each expert's gate, up and down."""
        i = np.arange(self.num_experts, dtype=np.uint64)
        cols = [
            self.base + off + i * np.uint64(b)
            for off, b in (
                (self.gate_offset, self.gate_bytes),
                (self.up_offset, self.up_bytes),
                (self.down_offset, self.down_bytes),
            )
        ]
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
