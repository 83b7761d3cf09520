"""One model's expert cache spread over several devices: :class:`MultiDeviceCache`.

Each (layer, expert) is owned by one device (a :class:`~pyexpcache.placement.Placement`); each
device has an :class:`~pyexpcache.ExpertCache` of its own, with its own budget, link, copy
stream and counters, all reading the same host source. A select splits its ids by owner and
issues each owner's select on that owner's stream. With a pinned source the calls only enqueue,
so every device's misses cross its own link at the same time; a pageable or file source's misses
are staged by the thread that calls, so there each owner's call runs on a thread of its own
(``parallel``). The result gives each expert's addresses on its owner and the owner. On the host
backend the devices are emulated (one host cache each, with its own emulated capacity), so the
whole logic runs without a GPU.

The same CUDA device may be listed twice (two caches sharing one GPU and its link): that runs the
multi-device logic on one GPU, without the second link.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from . import _lib, _lifetime
from ._ints import I32_MAX, checked_int, u32
from .cache import ExpertCache
from .layout import ModelLayout
from .placement import MAX_DEVICES, Placement
from .stats import CacheStats, PathStats, PrefetchStats
from .views import ExpertView


@dataclass
class DeviceSelection:
    """A select over several devices: ``pointers`` ([k, parts] uint64 addresses, each on its owner),
    ``owners`` (k device indices into the cache's ``devices``) and ``devices`` (k CUDA ordinals,
    or emulated device numbers on the host backend). Validity: each address under its owner's
    :meth:`ExpertCache.select` rule, on that owner's stream."""

    pointers: np.ndarray
    owners: np.ndarray
    devices: np.ndarray


@dataclass
class DeviceBatch:
    """A prefill batch over several devices: one :class:`~pyexpcache.Batch` per owner that got ids
    (``batches[d]``, None for the others), held until :meth:`finish`."""

    batches: list = field(default_factory=list)

    def finish(self, streams=None) -> None:
        """Finish every owner's batch (idempotent); ``streams``: one per device, or None."""
        for d, batch in enumerate(self.batches):
            if batch is not None:
                batch.finish(None if streams is None else streams[d])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.finish()


class MultiDeviceCache:
    """Experts cached over several devices, each expert on one owner.

    Args:
        layout, source: as for :class:`~pyexpcache.ExpertCache`; a pinned source serves every
            device (its memory is allocated portable: pinned for all of them).
        devices: CUDA ordinals, one cache each (host backend: emulated device numbers).
        placement: None (round-robin), a :class:`~pyexpcache.placement.Placement` over
            ``len(devices)`` devices, or per-layer expected loads (request counts per expert,
            e.g. :func:`~pyexpcache.placement.loads_from_calls`) to balance.
        budget_bytes, budget_experts: each device's budget (not the total).
        parallel: run each owner's share of a call on a thread of its own (the first owner's on
            the calling thread), so that owners whose misses the calling thread must stage
            (pageable and file sources) move them at the same time. Default: when the source is
            not pinned. A pinned source's calls only enqueue: in order on the calling thread they
            already overlap, without the hand-off.
        options: every other :class:`~pyexpcache.ExpertCache` option, applied to each device.

    A failing owner: in order (``parallel`` off), the call stops there and the owners before it
    keep what they did; in parallel every owner's share runs and the first failure in device
    order is raised. Use as a context manager, or call :meth:`close`. Threads: as for
    ExpertCache; each owner's cache serializes its own calls, and a call that reaches a closed
    owner raises :class:`~pyexpcache.CacheClosedError`.
    """

    def __init__(
        self,
        layout: ModelLayout,
        source,
        *,
        devices: Sequence[int] = (0, 1),
        placement=None,
        budget_bytes: Optional[int] = None,
        budget_experts: Optional[int] = None,
        parallel: Optional[bool] = None,
        **options,
    ):
        if "device" in options:
            raise TypeError("MultiDeviceCache takes devices=[...], not device=")
        devices = [checked_int(d, f"devices[{i}]", 0, I32_MAX) for i, d in enumerate(devices)]
        if not 1 <= len(devices) <= MAX_DEVICES:
            raise ValueError(f"devices must list 1..{MAX_DEVICES} devices, got {len(devices)}")
        if isinstance(placement, Placement):
            if placement.num_devices != len(devices):
                raise ValueError(
                    f"the placement spreads over {placement.num_devices} devices, devices lists {len(devices)}"
                )
            if len(placement.owners) != layout.num_layers or any(
                (o is None) != (s is None) or (o is not None and o.shape != (s.num_experts,))
                for o, s in zip(placement.owners, layout.layers)
            ):
                raise ValueError("the placement was made for a different layout")
        elif placement is None:
            placement = Placement.round_robin(layout, len(devices))
        else:
            placement = Placement.balanced(layout, len(devices), placement)
        self.layout = layout
        self.source = source
        self.devices = devices
        self.placement = placement
        self._device_ids = np.asarray(devices, dtype=np.int64)
        staged = not getattr(source, "pinned", False) or getattr(source, "file_path", None) is not None
        self.parallel = (staged if parallel is None else bool(parallel)) and len(devices) > 1
        self._pool = (
            ThreadPoolExecutor(len(devices) - 1, thread_name_prefix="expcache-owner") if self.parallel else None
        )
        _lifetime.register(self)
        self.caches: list[ExpertCache] = []
        try:
            for d in devices:
                self.caches.append(
                    ExpertCache(
                        layout, source, device=d, budget_bytes=budget_bytes, budget_experts=budget_experts, **options
                    )
                )
        except BaseException:
            self.close()
            raise

    # -- lifetime ----------------------------------------------------------
    def close(self) -> None:
        """Close every device's cache (idempotent), then the owners' threads."""
        for cache in getattr(self, "caches", ()):
            cache.close()
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)

    def _close_at_exit(self) -> None:
        pass  # its caches close themselves at exit

    def _after_fork_in_child(self) -> None:
        self._pool = None  # the owners' threads are not in the child; its caches raise ForkedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def closed(self) -> bool:
        return all(c.closed for c in self.caches)

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def backend(self) -> str:
        return self.caches[0].backend

    # -- splitting ---------------------------------------------------------
    def _layer(self, layer) -> int:
        layer = int(u32(layer, "layer"))
        if layer >= self.layout.num_layers or self.layout.layers[layer] is None:
            raise ValueError(self.layout.no_experts_reason(layer))
        return layer

    def owners_of(self, layer: int, expert_ids) -> np.ndarray:
        """The owning device index of each of ``expert_ids`` (checked against the layer)."""
        layer = self._layer(layer)
        ids = ExpertCache._as_ids(expert_ids, "expert_ids")
        n = self.layout.layers[layer].num_experts
        if ids.size and int(ids.max()) >= n:
            bad = int(np.argmax(ids >= n))
            raise ValueError(f"expert id {int(ids[bad])} (index {bad}) out of range for layer {layer} ({n} experts)")
        return self.placement.owners[layer][ids]

    def split(self, layer: int, expert_ids) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per device, (positions in ``expert_ids``, those ids): empty arrays for a device that
        owns none of them."""
        ids = ExpertCache._as_ids(expert_ids, "expert_ids")
        if ids.size == 0:
            raise ValueError("expert_ids is empty")
        own = self.owners_of(layer, ids)
        out = []
        for d in range(self.num_devices):
            pos = np.flatnonzero(own == d)
            out.append((pos, ids[pos]))
        return out

    def _each(self, parts, fn) -> list:
        """``fn(d, ids)`` for every device with ids (``parts`` from :meth:`split`), in device order
        or, with ``parallel``, at once (the first on this thread); results per device, None where
        it had none. In order the first failure stops the call; in parallel all run, then the
        first failure in device order is raised."""
        out: list = [None] * self.num_devices
        work = [d for d, (pos, _) in enumerate(parts) if pos.size]
        if self._pool is None or len(work) < 2:
            for d in work:
                out[d] = fn(d, parts[d][1])
            return out
        futures = {}
        for d in work[1:]:
            try:
                futures[d] = self._pool.submit(fn, d, parts[d][1])
            except RuntimeError:  # close() shut the pool down: run it here (its cache says it is closed)
                futures[d] = None
        first: Optional[BaseException] = None
        try:
            out[work[0]] = fn(work[0], parts[work[0]][1])
        except BaseException as exc:
            first = exc
        for d in work[1:]:
            try:
                out[d] = futures[d].result() if futures[d] is not None else fn(d, parts[d][1])
            except BaseException as exc:
                first = first or exc
        if first is not None:
            raise first
        return out

    def _streams(self, streams) -> list:
        if streams is None:
            return [None] * self.num_devices
        streams = list(streams)
        if len(streams) != self.num_devices:
            raise ValueError(f"streams must give one stream per device ({self.num_devices}), got {len(streams)}")
        return streams

    # -- serving -----------------------------------------------------------
    def select(self, layer: int, expert_ids, streams=None) -> DeviceSelection:
        """Decode path over every owner: each device's share of ``expert_ids`` is selected on its
        stream (``streams``: one per device; None: each device's legacy stream), all enqueued
        before any waits, so the links move the misses at the same time."""
        streams = self._streams(streams)
        parts = self.split(layer, expert_ids)
        k = sum(len(p) for p, _ in parts)
        if k > _lib.MAX_SELECT:
            raise ValueError(f"at most {_lib.MAX_SELECT} ids per select, got {k}")
        got = self._each(parts, lambda d, ids: self.caches[d].select(layer, ids, streams[d]))
        width = next((g.shape[1] for g in got if g is not None), 3)  # the layer's parts
        pointers = np.empty((k, width), dtype=np.uint64)
        owners = np.empty(k, dtype=np.uint8)
        for d, (pos, _) in enumerate(parts):
            if pos.size:
                pointers[pos] = got[d]
                owners[pos] = d
        return DeviceSelection(pointers, owners, self._device_ids[owners])

    def select_views(self, layer: int, expert_ids, streams=None, *, dtype=None, shapes=None) -> list[ExpertView]:
        """:meth:`select` returning views (as :meth:`ExpertCache.select_views`), each on its owner's
        device and stream."""
        streams = self._streams(streams)
        parts = self.split(layer, expert_ids)
        out: list = [None] * sum(len(p) for p, _ in parts)
        got = self._each(
            parts, lambda d, ids: self.caches[d].select_views(layer, ids, streams[d], dtype=dtype, shapes=shapes)
        )
        for d, (pos, _) in enumerate(parts):
            if pos.size:
                for i, view in zip(pos.tolist(), got[d]):
                    out[i] = view
        return out

    def prefetch(self, layer: int, expert_ids, streams=None) -> int:
        """:meth:`ExpertCache.prefetch` of each owner's share, on its stream; the number queued."""
        streams = self._streams(streams)
        got = self._each(self.split(layer, expert_ids), lambda d, ids: self.caches[d].prefetch(layer, ids, streams[d]))
        return sum(q for q in got if q is not None)

    def wait_prefetch(self) -> None:
        """:meth:`ExpertCache.wait_prefetch` on each device: every queued prefetch landed."""
        for cache in self.caches:
            cache.wait_prefetch()

    def hint(self, layer: int, expert_ids) -> None:
        """:meth:`ExpertCache.hint` of each owner's share."""
        for d, (pos, ids) in enumerate(self.split(layer, expert_ids)):
            if pos.size:
                self.caches[d].hint(layer, ids)

    def load_compact(self, layer: int, expert_ids, streams=None) -> list:
        """:meth:`ExpertCache.load_compact` of each owner's share: per device, (positions in
        ``expert_ids``, its :class:`~pyexpcache.CompactBuffer`), or None where it owns none."""
        streams = self._streams(streams)
        parts = self.split(layer, expert_ids)
        got = self._each(parts, lambda d, ids: self.caches[d].load_compact(layer, ids, streams[d]))
        return [(pos, got[d]) if pos.size else None for d, (pos, _) in enumerate(parts)]

    def prepare_batch(self, layer: int, expert_ids_2d, streams=None) -> DeviceBatch:
        """Prefill path per owner: each device prepares the union of the ids it owns (as
        :meth:`ExpertCache.prepare_batch`: free capacity only, nothing evicted)."""
        streams = self._streams(streams)
        flat = ExpertCache._as_ids(expert_ids_2d, "expert_ids_2d", tokens=True)
        out = DeviceBatch([None] * self.num_devices)

        def prepare(d, ids):
            out.batches[d] = self.caches[d].prepare_batch(layer, ids, streams[d])
            return out.batches[d]

        try:
            self._each(self.split(layer, flat), prepare)
        except BaseException:
            out.finish(streams)  # the owners' batches that were prepared
            raise
        return out

    def synchronize(self, streams=None) -> None:
        """Wait for every device's stream."""
        for cache, s in zip(self.caches, self._streams(streams)):
            cache.synchronize(s)

    def release_all(self) -> None:
        for cache in self.caches:
            cache.release_all()

    # -- a changing memory plan --------------------------------------------
    # In device order, as the serving calls: a failure stops there, the devices before it keep the
    # change (each device's call changes nothing of its own when it refuses).
    def set_budget(self, budget_bytes: Optional[int] = None, budget_experts: Optional[int] = None) -> None:
        """Replace each device's budgets (not the total: as the constructor's), keeping every
        device's warm cache (:meth:`ExpertCache.set_budget`)."""
        for cache in self.caches:
            cache.set_budget(budget_bytes=budget_bytes, budget_experts=budget_experts)

    def set_reserve(self, reserve_bytes: int) -> None:
        """Replace each device's ``reserve_bytes``, keeping its warm cache (:meth:`ExpertCache.set_reserve`)."""
        for cache in self.caches:
            cache.set_reserve(reserve_bytes)

    def unregister_layer(self, layer: int) -> None:
        """Take ``layer`` out of every device's cache, keeping the rest warm
        (:meth:`ExpertCache.unregister_layer`)."""
        layer = self._layer(layer)
        for cache in self.caches:
            cache.unregister_layer(layer)

    # -- counters ----------------------------------------------------------
    def stats(self) -> list[CacheStats]:
        """Each device's counters (:meth:`ExpertCache.stats`), in ``devices`` order."""
        return [c.stats() for c in self.caches]

    def total_stats(self) -> PathStats:
        """Every path of every class of every device, summed."""
        out = PathStats()
        for st in self.stats():
            out = out + st.total
        return out

    def prefetch_stats(self) -> list[PrefetchStats]:
        """Each device's prefetch and hint counters, in ``devices`` order."""
        return [c.prefetch_stats() for c in self.caches]

    def total_prefetch_stats(self) -> PrefetchStats:
        """The prefetch and hint counters of every device, summed."""
        out = PrefetchStats()
        for st in self.prefetch_stats():
            out = out + st
        return out

    def reset_stats(self) -> None:
        for cache in self.caches:
            cache.reset_stats()
