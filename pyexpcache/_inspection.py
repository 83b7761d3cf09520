"""What :class:`~pyexpcache.ExpertCache` says about itself: its size classes (binding a layer's,
finding one by its experts' part sizes) and its counters per class and path, the staging ring's and
prefetch's (:class:`Inspection`, which the cache inherits)."""

from __future__ import annotations

import ctypes
import warnings

import numpy as np

from . import _errors, _ints, _lib
from .stats import CacheStats, ClassInfo, ClassStats, PathStats, PoolStats, PrefetchStats, StagingStats


class Inspection:
    """The inspection methods of :class:`~pyexpcache.ExpertCache`, on its handle (``_call``) and
    ``max_classes``."""

    def bind_class(self, layer: int) -> int:
        """Bind ``layer`` to its size class now if it is not bound yet (on a device-lookup cache this
        allocates the class's bank: do it before capturing a graph) and return the class index."""
        out = ctypes.c_uint32()
        self._call("expcache_layer_bind_class", self._layer(layer), ctypes.byref(out))
        return out.value

    def find_class(self, *part_bytes) -> int:
        """The index of the class holding experts of these part sizes now (C:
        ``expcache_class_find_parts``): ``find_class(gate_bytes, up_bytes, down_bytes)``, any
        1..8 sizes in part order, or one sequence of them (a layer's ``class_key``). An engine that
        knows its quantization's sizes reads that class's cap in :meth:`classes` by it. Raises
        InvalidArgumentError when no layer has those sizes, InvalidStateError when one has but no
        class holds them yet (bind it first); ValueError (naming the size) for a count or a size
        out of range, TypeError for a non-integer."""
        if len(part_bytes) == 1 and not isinstance(part_bytes[0], (int, np.integer)):
            part_bytes = tuple(part_bytes[0])
        if not 1 <= len(part_bytes) <= _lib.MAX_PARTS:
            raise _errors.ArgumentRangeError(
                f"find_class takes 1..{_lib.MAX_PARTS} part sizes (the library's limit), got {len(part_bytes)}"
            )
        out = ctypes.c_uint32()
        if len(part_bytes) == 3:  # the shorthand's call, whose messages name gate, up and down
            sizes = [_ints.u64(v, f"{name}_bytes") for v, name in zip(part_bytes, ("gate", "up", "down"))]
            self._call("expcache_class_find", *sizes, ctypes.byref(out))
            return out.value
        checked = [_ints.u64(v, f"part_bytes[{i}]") for i, v in enumerate(part_bytes)]
        self._call(
            "expcache_class_find_parts", len(checked), (ctypes.c_uint64 * len(checked))(*checked), ctypes.byref(out)
        )
        return out.value

    def layer_class(self, layer: int) -> int:
        """Deprecated spelling of :meth:`bind_class` (it binds, as its C name says); goes in the next
        release."""
        warnings.warn(
            "ExpertCache.layer_class() is deprecated and goes in the next release: use bind_class(), "
            "which binds the layer's class as its C name, expcache_layer_bind_class, says",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.bind_class(layer)

    def _read_stats(self) -> list[tuple[ClassInfo, dict]]:
        """Every class in use with its counters per path, read at once (expcache_stats_read: a
        device-lookup cache reads the device with one copy)."""
        n = self.max_classes
        infos = (_lib.ClassInfo * n)()
        stats = (_lib.Stats * (n * len(_lib.PATH_NAMES)))()
        infos[0].struct_size = ctypes.sizeof(_lib.ClassInfo)
        stats[0].struct_size = ctypes.sizeof(_lib.Stats)
        self._call("expcache_stats_read", n, infos, stats)
        out = []
        for i, info in enumerate(infos):
            if not info.in_use:
                continue
            paths = {}
            for p, name in enumerate(_lib.PATH_NAMES):
                st = stats[i * len(_lib.PATH_NAMES) + p]
                paths[name] = PathStats(**{f: getattr(st, f) for f in _lib.STAT_FIELDS})
            counts = (getattr(info, f[0]) for f in _lib.ClassInfo._fields_[2:13])  # gate_bytes .. staging_bytes
            out.append((ClassInfo(i, *counts, part_bytes=tuple(info.part_bytes[: info.num_parts])), paths))
        return out

    def classes(self) -> list[ClassInfo]:
        """Every class in use."""
        return [info for info, _ in self._read_stats()]

    def stats(self) -> CacheStats:
        """Counters per class in use and per path, each with ``hit_rate`` (the device tier), and
        the host pool's (``.pool``, :meth:`pool_stats`)."""
        classes = [ClassStats(info, paths) for info, paths in self._read_stats()]
        return CacheStats(classes, self.pool_stats())

    def pool_stats(self) -> PoolStats:
        """Counters of the host pool (``host_budget_bytes``): its hits, the source's reads and
        their bytes, inserts, evictions, failed and bypassed reads, and its slots now. On a
        device-lookup cache a device select's are counted by the feed's threads: read them after
        synchronizing its stream."""
        st = _lib.PoolStats()
        st.struct_size = ctypes.sizeof(st)
        self._call("expcache_pool_stats_get", ctypes.byref(st))
        return PoolStats(**{n: getattr(st, n) for n in _lib.POOL_FIELDS})

    def staging_stats(self) -> StagingStats:
        """Counters of the staging ring that moves pageable and file misses (zeros when none was
        staged): pieces, bytes, and where the time of a staged call goes."""
        st = _lib.StagingStats()
        st.struct_size = ctypes.sizeof(st)
        self._call("expcache_staging_stats_get", ctypes.byref(st))
        return StagingStats(**{n: getattr(st, n) for n in _lib.STAGING_FIELDS})

    def prefetch_stats(self) -> PrefetchStats:
        """Counters of :meth:`prefetch` and :meth:`hint`: issued, used, wasted, cancelled (and their
        bytes), skipped, dropped, bytes sent, hints and refreshes."""
        st = _lib.PrefetchStats()
        st.struct_size = ctypes.sizeof(st)
        self._call("expcache_prefetch_stats_get", ctypes.byref(st))
        return PrefetchStats(**{n: getattr(st, n) for n in _lib.PREFETCH_FIELDS})

    def reset_stats(self) -> None:
        """Zero every counter, the staging ring's, prefetch's and the host pool's too."""
        self._call("expcache_stats_reset")
