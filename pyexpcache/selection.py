"""What a split select returns: the experts, which of them were resident, and how to wait
for the rest (:meth:`pyexpcache.ExpertCache.select_split`)."""

from __future__ import annotations

import numpy as np

from ._cuda import stream_handle


class Selection:
    """One layer's experts from :meth:`~pyexpcache.ExpertCache.select_split`.

    Attributes:
        layer: the layer.
        pointers: [k, 3] uint64 device addresses (gate, up, down) per id, as select returns.
        resident: [k] bool: the id was resident when the call began, so its bytes may be read by
            work on the select's stream at once; the others' bytes land on the cache's copy stream.
        ready: the event (a ``cudaEvent_t`` as an int) behind the misses' copies, 0 when there is
            nothing to wait for (every id a hit, or the host backend).
        views: with ``select_split(..., views=True)``, an :class:`~pyexpcache.views.ExpertView` per
            id (None otherwise). A miss's view is ready on the select's stream only after
            :meth:`wait`: wait before handing it to a consumer.

    Valid under the rule of :meth:`~pyexpcache.ExpertCache.select`'s addresses: for work ordered
    after the call on its stream (the misses': after :meth:`wait`), until the cache's next select,
    load_compact, prepare_batch, release_all or bind_class call.
    """

    __slots__ = ("_cache", "layer", "pointers", "resident", "ready", "views", "_stream")

    def __init__(
        self, cache, layer: int, pointers: np.ndarray, resident: np.ndarray, ready: int, stream: int, views=None
    ):
        self._cache = cache
        self.views = views
        self.layer = layer
        self.pointers = pointers
        self.resident = resident
        self.ready = ready
        self._stream = stream

    @property
    def hits(self) -> np.ndarray:
        """Indices (into the ids) of the experts usable at once."""
        return np.flatnonzero(self.resident)

    @property
    def misses(self) -> np.ndarray:
        """Indices of the experts usable after :meth:`wait`."""
        return np.flatnonzero(~self.resident)

    def wait(self, stream=None) -> None:
        """Make ``stream`` (default: the select's) wait, on the device, for the misses' bytes.
        Returns at once; nothing to do when :attr:`ready` is 0."""
        if self.ready:
            s = self._stream if stream is None else stream_handle(stream)
            self._cache.wait_ready(self.ready, s)

    def __len__(self) -> int:
        return len(self.pointers)

    def __repr__(self) -> str:
        return (
            f"Selection(layer={self.layer}, k={len(self)}, hits={int(self.resident.sum())}, "
            f"waits={'yes' if self.ready else 'no'})"
        )
