"""The Pythonic face of libexpcache: :class:`ExpertCache`."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import _errors, _lib, _lifetime, bank as _bank
from ._cuda import stream_handle
from ._errors import (
    CacheClosedError,
    ExpcacheWarning,
    ForkedError,
    InvalidArgumentError,
    InvalidStateError,
    stacklevel_outside,
)
from ._ints import u32, u64
from ._memory import MemoryPin
from .bank import ExpertBank
from .layout import ModelLayout
from .selection import Selection
from .source import Source
from .stats import CacheStats, ClassInfo, ClassStats, PathStats, PrefetchStats, StagingStats
from .views import ExpertView, ViewCache

logger = logging.getLogger("pyexpcache")

_BACKENDS = {"auto": _lib.BACKEND_AUTO, "host": _lib.BACKEND_HOST, "cuda": _lib.BACKEND_CUDA}
_BACKEND_NAMES = {_lib.BACKEND_HOST: "host", _lib.BACKEND_CUDA: "cuda"}
_LOG_LEVELS = {_lib.LOG_WARNING: logging.WARNING, _lib.LOG_NOTICE: logging.INFO, _lib.LOG_DEBUG: logging.DEBUG}


def staging_defaults() -> tuple[int, int]:
    """The library's default ``(copy_threads, staging_chunk_bytes)`` on this machine (the thread
    count follows the number of cores)."""
    cfg = _lib.Config()
    _lib.lib.expcache_config_init(ctypes.byref(cfg))
    return int(cfg.copy_threads), int(cfg.staging_chunk_bytes)


class _Gate:
    """Lets calls into one cache run while it is open and :meth:`ExpertCache.close` wait for
    them: a call enters (counted) or raises CacheClosedError; close marks the gate shut, waits
    until no call is in flight, and destroys the handle under the gate's lock, so a call that
    starts meanwhile blocks, then raises. Nested entries on one thread are counted alike.
    In a forked child the gate is a new one, shut, raising ForkedError.

    ``after``, when given, runs on a thread when that thread's outermost entry ends with lines
    queued on it (``queue``), the gate already left: the cache's log lines are delivered there,
    so a logging handler may call the cache (close included), and a warning raised as an error
    surfaces at the call."""

    __slots__ = ("lock", "idle", "active", "shut", "forked", "depth", "after")

    def __init__(self, after=None):
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.active = 0
        self.shut = False
        self.forked = False
        self.depth = threading.local()
        self.after = after

    def inside(self) -> bool:
        """True on a thread inside a call through this gate."""
        return getattr(self.depth, "n", 0) > 0

    def queue(self, item) -> None:
        """Keep ``item`` for this thread's ``after``."""
        items = getattr(self.depth, "items", None)
        if items is None:
            items = self.depth.items = []
        items.append(item)

    def take(self) -> list:
        """This thread's queued items, emptied."""
        items = getattr(self.depth, "items", None) or []
        self.depth.items = None
        return items

    def __enter__(self):
        with self.lock:
            if not self.shut:
                self.active += 1
                self.depth.n = getattr(self.depth, "n", 0) + 1
                return
        if self.forked:
            raise ForkedError(
                "this cache was created before the process forked: a cache cannot be used in a "
                "forked child (its threads, locks and device state stayed in the parent); create a "
                "new cache (and source) in the child"
            )
        _lifetime.park_if_exiting()
        raise CacheClosedError("the cache is closed")

    def __exit__(self, exc_type, exc, tb):
        with self.lock:
            self.active -= 1
            self.depth.n -= 1
            outermost = self.depth.n == 0
            if self.shut and self.active == 0:
                self.idle.notify_all()
        if outermost and self.after is not None and getattr(self.depth, "items", None):
            self.after(exc_type is None)


# A cache's callbacks hold it weakly (the library, the gate and the view cache keep them), so
# they make no reference cycle: a cache dropped without close() is closed by its last reference.
def _log_to(ref):
    def on_log(user, level, message):
        cache = ref()
        if cache is not None:
            cache._on_log(level, message)

    return on_log


def _dropped_to(ref):
    def on_dropped(user):
        cache = ref()
        if cache is not None:
            cache._on_memory_dropped()

    return on_dropped


def _deliver_to(ref):
    def deliver(ok):
        cache = ref()
        if cache is not None:
            cache._deliver_log(ok)

    return deliver


def _pin_to(ref):
    def pin(address):
        cache = ref()
        if cache is None:
            raise CacheClosedError("the cache is closed")
        return cache._pin_memory(address)

    return pin


class _Scratch(threading.local):
    """Per-thread buffers of select, with their addresses computed once: several threads
    may share a cache, and numpy's address lookups cost more than the call itself."""

    def __init__(self):
        self.ids = np.empty(_lib.MAX_SELECT, dtype=np.uint32)
        self.out = np.empty((_lib.MAX_SELECT, 3), dtype=np.uint64)
        self.resident = np.empty(_lib.MAX_SELECT, dtype=np.uint8)
        self.ids_address = self.ids.ctypes.data
        self.out_address = self.out.ctypes.data
        self.resident_address = self.resident.ctypes.data


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

    def __init__(self, cache: ExpertCache, layer: int, handle: int, ids: np.ndarray, pointers: np.ndarray, stream):
        self._cache = cache
        self.layer = layer
        self.handle = handle
        self.ids = ids
        self.pointers = pointers
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


class ExpertCache:
    """A GPU expert cache over the experts of ``layout`` whose bytes are in ``source``.

    Args:
        layout: the model layout (:class:`ModelLayout`).
        source: where the experts' bytes are (a :class:`~pyexpcache.source.Source`, e.g.
            :class:`HostSource` or :class:`~pyexpcache.gguf.GGUFSource`). The cache keeps it
            alive: closing the source while this cache is open releases its memory only when
            the cache closes, so no miss ever reads freed memory.
        budget_experts: per-class budget in experts (ds4's ``--ssd-streaming-cache-experts``).
        budget_bytes: total budget over all classes, shared in proportion to class bytes.
        reserve_bytes: device memory always left free (default 1 GiB;
            ``EXPCACHE_RESERVE_GB`` overrides).
        max_classes: size classes held at once (default: the layout's number of distinct expert
            sizes, at most the library's limit of 64). A smaller value warns at construction
            (:class:`~pyexpcache.ExpcacheWarning`): layers of a class beyond it release a whole
            class and rebind it, so they get no hits across each other.
        backend: ``"auto"`` (CUDA when usable, else host), ``"host"`` or ``"cuda"``.
        device: CUDA device ordinal.
        device_capacity_bytes: host backend only: the emulated device size (default 64 GiB).
        slab_bytes: largest single slot allocation (default 512 MiB).
        log_level: 0 silent, 1 warnings only, 2 notices too (default: cap changes, releases),
            3 one line per call too (``EXPCACHE_VERBOSE=1`` sets 3). Lines go to the ``pyexpcache``
            logger (warnings at WARNING, notices at INFO, per-call lines at DEBUG), or to stderr
            when logging is not configured. A warning (a class left with cap 0: nothing of it
            is cached, whether the budget is too small for one of its experts or device memory
            after the reserve is; it says the smallest budget or largest reserve that holds one)
            is also issued once per class through :mod:`warnings` (:class:`~pyexpcache.ExpcacheWarning`).
        copy_threads: pageable and file sources: threads staging misses into a pinned ring, each
            filling whole chunks while the calling thread sends the filled ones over the link, in
            order (default: the cores the process may use less 4, at least 2 and at most 12, the
            calling thread included; see :func:`staging_defaults`; 0 = the driver's pageable
            copies, and file reads on the calling thread).
        staging_bytes: size of that pinned ring (default 64 MiB).
        staging_chunk_bytes: largest piece one thread fills and one transfer moves (default 512 KiB;
            a multiple of 4096 in 64 KiB..64 MiB).
        file_reads: file sources: ``"buffered"`` (default: pread through the page cache) or
            ``"direct"`` (O_DIRECT where the file system allows it: models larger than RAM).
        policy: eviction policy of every class, a name of the library's policy table: ``"duel"``
            (LRU and OppClassLRU, the one followed chosen online from two shadow caches: within
            0.5 points of LRU on every trace measured, most of OppClassLRU's gain where it has
            one), ``"oppclass"`` (OppClassLRU, decayed use count classes with age in missed
            opportunities of the expert's layer) or ``"lru"`` (docs/policy.md). Default (None):
            the library's default, ``"duel"`` (``pyexpcache._lib.DEFAULT_POLICY``).
        partition: how a class's slots are shared among its layers: ``"global"`` (default: a miss
            may evict any slot of its class) or ``"layer"`` (each layer its own share of its
            class's cap, in proportion to its experts; a miss of a layer holding its share
            evicts among that layer's slots: mixtral-offloading's and many engines' layout).
        prefetch_max_per_layer: most experts of one layer prefetched between two serving calls of
            that layer (default 8; 0 turns :meth:`prefetch` off).
        prefetch_piece_bytes: most prefetch bytes in flight at once (two transfers of half), what
            a demand miss shares the link with (default 4 MiB; a multiple of 4096 in 4 KiB..64 MiB).
        lookup: ``"host"`` (default) or ``"device"``: each class's slots become one bank
            (:meth:`bank`) and :meth:`select_device` looks experts up on the GPU, capturable in a
            CUDA graph; the other calls keep working, each synchronizing the device (see
            :meth:`select_device`). A device-lookup cache evicts by LRU (the default policy then),
            refuses :meth:`prefetch` and :meth:`hint`, and needs a pinned source for device selects.

    At least one budget must be given. Use as a context manager, or call :meth:`close`.

    Threads: every method may be called from several threads at once (the library serializes
    calls on one cache); addresses returned to one thread may be invalidated by another
    thread's next call, so threads sharing a cache order their own calls. :meth:`close` may
    race them: calls in flight finish first, later ones raise
    :class:`~pyexpcache.CacheClosedError`. Every integer argument is range-checked against its
    C type (ValueError/OverflowError naming it) before the library sees it.
    """

    def __init__(
        self,
        layout: ModelLayout,
        source: Source,
        *,
        budget_experts: Optional[int] = None,
        budget_bytes: Optional[int] = None,
        reserve_bytes: Optional[int] = None,
        max_classes: Optional[int] = None,
        backend: str = "auto",
        device: int = 0,
        device_capacity_bytes: Optional[int] = None,
        slab_bytes: Optional[int] = None,
        log_level: Optional[int] = None,
        copy_threads: Optional[int] = None,
        staging_bytes: Optional[int] = None,
        staging_chunk_bytes: Optional[int] = None,
        file_reads: str = "buffered",
        policy: Optional[str] = None,
        prefetch_max_per_layer: Optional[int] = None,
        prefetch_piece_bytes: Optional[int] = None,
        lookup: str = "host",
        partition: str = "global",
    ):
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {sorted(_BACKENDS)}, got {backend!r}")
        if lookup not in _lib.LOOKUPS:
            raise ValueError(f"lookup must be one of {sorted(_lib.LOOKUPS)}, got {lookup!r}")
        if lookup == "device":
            if policy is None:
                policy = "lru"
            elif policy != "lru":
                raise ValueError(
                    f"lookup='device' evicts by LRU on the device (recency stamps): use policy='lru' "
                    f"(or leave it unset), got {policy!r}"
                )
        if policy is not None and policy not in _lib.POLICIES:
            raise ValueError(f"policy must be one of {sorted(_lib.POLICIES)}, got {policy!r}")
        if partition not in _lib.PARTITIONS:
            raise ValueError(f"partition must be one of {sorted(_lib.PARTITIONS)}, got {partition!r}")
        if file_reads not in _lib.FILE_READS:
            raise ValueError(f"file_reads must be one of {sorted(_lib.FILE_READS)}, got {file_reads!r}")
        if source.layout.num_layers != layout.num_layers or source.layout.layers != layout.layers:
            raise ValueError("source was built for a different layout")
        self._handle = None
        # Callbacks reach this cache through a weak reference, so the cache holds no cycle: one
        # dropped without close() closes when its last reference goes.
        this = weakref.ref(self)
        self._gate = _Gate(_deliver_to(this))
        self._source_user = False
        lib = _lib.lib
        cfg = _lib.Config()
        lib.expcache_config_init(ctypes.byref(cfg))
        if max_classes is None:
            max_classes = min(max(1, len(layout.classes())), _lib.MAX_CLASSES_LIMIT)
        given = {"device": device, "num_layers": layout.num_layers, "max_classes": max_classes}
        given.update(
            (name, value)
            for name, value in (
                ("budget_experts", budget_experts),
                ("budget_bytes", budget_bytes),
                ("reserve_bytes", reserve_bytes),
                ("device_capacity_bytes", device_capacity_bytes),
                ("slab_bytes", slab_bytes),
                ("log_level", log_level),
                ("copy_threads", copy_threads),
                ("staging_bytes", staging_bytes),
                ("staging_chunk_bytes", staging_chunk_bytes),
                ("prefetch_max_per_layer", prefetch_max_per_layer),
                ("prefetch_piece_bytes", prefetch_piece_bytes),
            )
            if value is not None
        )
        if policy is not None:
            given["policy"] = _lib.POLICIES[policy]
        _lib.set_fields(
            cfg,
            backend=_BACKENDS[backend],
            file_reads=_lib.FILE_READS[file_reads],
            lookup=_lib.LOOKUPS[lookup],
            partition=_lib.PARTITIONS[partition],
            **given,
        )
        self.lookup = lookup
        self.layout = layout
        self.source = source
        self.max_classes = max_classes
        self.policy = _lib.DEFAULT_POLICY if policy is None else policy
        self.partition = partition
        self._scratch = _Scratch()
        self._select_fn = lib.expcache_select_async
        self._split_fn = lib.expcache_select_split_async
        self._views = ViewCache(layout)
        self._dense_layers = layout.dense_layers
        self._warned: set[str] = set()
        # Library log lines -> the pyexpcache logger. Kept on self: ctypes must not collect them.
        self._log_fn = _lib.LOG_FN(_log_to(this))
        self._dropped_fn = _lib.DROPPED_FN(_dropped_to(this))
        add_user = getattr(source, "add_user", None)
        if add_user is not None:
            add_user()  # raises when the source is closed; from now on it outlives this cache
            self._source_user = True
        handle = _lib.CachePtr()
        try:
            lib.expcache_create(ctypes.byref(cfg), ctypes.byref(handle))
        except BaseException:
            self._leave_source()
            raise
        self._handle = handle.value
        _lifetime.register(self)
        try:
            lib.expcache_log_set_callback(self._handle, self._log_fn, None)
            self._device = device
            self._register(layout, source)
        except BaseException:
            self.close()
            raise

    def _register(self, layout: ModelLayout, source: Source) -> None:
        # Through the gate, so its lines (a layout with more size classes than max_classes
        # warns) reach the user as any call's do.
        lib = _lib.lib
        with self._gate:
            lib.expcache_memory_set_dropped_callback(self._handle, self._dropped_fn, None)
            self._is_cuda = self.backend == "cuda"
            if self._is_cuda and getattr(source, "pinned_emulated", False):
                raise ValueError(
                    "the source's pinned memory is emulated (it was made where no CUDA device could be "
                    "used: cuda-python missing, or no GPU), which a CUDA cache cannot read as pinned: "
                    "make the source where cuda-python sees the GPU (pip install .[cuda]), or use "
                    "pinned=False"
                )
            self._views.configure(self._is_cuda, self._device, _pin_to(weakref.ref(self)))
            file_id = None
            if getattr(source, "file_path", None):
                out = ctypes.c_uint32()
                lib.expcache_file_open(self._handle, os.fsencode(source.file_path), ctypes.byref(out))
                file_id = out.value
            for i, spec in enumerate(layout.layers):
                if spec is None:
                    continue
                place = source.placement(i)
                d = _lib.LayerDesc()
                lib.expcache_layer_desc_init(ctypes.byref(d))
                d.num_experts = spec.num_experts
                if file_id is not None:
                    d.source_kind, d.file = _lib.SOURCE_FILE, file_id
                else:
                    d.source_kind = _lib.SOURCE_PINNED if source.pinned else _lib.SOURCE_PAGEABLE
                _lib.set_fields(
                    d,
                    **dict(zip(("gate_bytes", "up_bytes", "down_bytes"), spec.class_key)),
                    **dict(zip(("gate_stride", "up_stride", "down_stride"), place.strides)),
                    **dict(zip(("gate_base", "up_base", "down_base"), place.bases)),
                )
                lib.expcache_layer_register(self._handle, i, ctypes.byref(d))

    def _on_log(self, level: int, message: bytes) -> None:
        # A ctypes callback at the end of a library call: it must not raise. Inside a call on
        # this thread the line waits for the call to leave the gate (_deliver_log); a line from
        # a library thread, or from close(), is delivered at once.
        try:
            line = (level, message.decode(errors="replace"))
            if self._gate.inside():
                self._gate.queue(line)
            else:
                self._emit(*line, raise_warnings=False)
        except Exception:
            pass

    def _deliver_log(self, ok: bool) -> None:
        """The lines the thread's call logged, once it left the gate. A warning made an error
        (``-W error``) raises here, at the call, unless the call is already raising."""
        error = None
        for level, text in self._gate.take():
            try:
                self._emit(level, text, raise_warnings=ok)
            except Exception as e:  # a warning filtered to an error, or a handler's own failure
                if error is None:
                    error = e
        if error is not None:
            raise error

    def _emit(self, level: int, text: str, *, raise_warnings: bool) -> None:
        # A warning goes through warnings the first time its text is seen (once, whatever
        # logging is configured), and to the logger when it comes back; other lines to the
        # logger, or to stderr when nobody configured logging (Python would drop INFO lines).
        if level == _lib.LOG_WARNING and text not in self._warned:
            self._warned.add(text)
            try:
                # Named at the user's line: past the gate and the methods that called C.
                warnings.warn(f"expcache: {text}", ExpcacheWarning, stacklevel=stacklevel_outside(__name__))
                return
            except Exception:
                if raise_warnings:
                    raise
                # an error filter while another error is in flight, or in a library thread: logged
        if logger.hasHandlers():
            logger.log(_LOG_LEVELS.get(level, logging.INFO), "%s", text)
        elif level != _lib.LOG_WARNING:
            print(f"expcache: {text}", file=sys.stderr)

    def _on_memory_dropped(self):
        # A ctypes callback inside a library call (its lock held): the call let go of memory that
        # views keep; the views kept here for reuse go, so only those still in use keep it.
        try:
            self._views.clear()
        except Exception:
            pass

    def _pin_memory(self, address: int) -> MemoryPin:
        with self._gate:
            return MemoryPin(self._handle, address)

    # -- lifetime ----------------------------------------------------------
    def close(self) -> None:
        """Destroy the cache (idempotent): waits for calls in flight on other threads, then for
        its device work, and frees all it allocated, except memory that views (and arrays made
        from them) still use: that goes with the last of them. Later calls raise
        CacheClosedError. The source is released from this cache (and freed if it was closed
        meanwhile). Caches left open are closed at interpreter exit; in a child made by fork()
        close() only forgets the cache (:mod:`pyexpcache._lifetime`)."""
        self._close(None)

    def _close(self, timeout) -> None:
        gate = getattr(self, "_gate", None)
        if gate is None:
            return  # __init__ failed before anything was made
        if gate.inside():
            # This thread's own call would wait for itself (a raw_handle() block, a callback).
            raise InvalidStateError(
                _errors.ERR_INVALID_STATE,
                "EXPCACHE_ERR_INVALID_STATE",
                "close() was called inside a call on this cache on the same thread; close it after that call returns",
            )
        gate.depth.n = 1  # the library's lines from destroy wait until the gate's lock is let go
        try:
            with gate.lock:
                gate.shut = True
                while gate.active:
                    if not gate.idle.wait(timeout):
                        logger.warning(
                            "expcache: a call on this cache was still running at exit; the cache is "
                            "left to the operating system"
                        )
                        return
                handle, self._handle = self._handle, None
                if handle is not None:
                    _lib.lib.expcache_destroy(handle)
                self._views.clear()
                self._leave_source()
        finally:
            gate.depth.n = 0
        self._deliver_log(True)

    def _close_at_exit(self) -> None:
        self._close(10.0)

    def _after_fork_in_child(self) -> None:
        gate = _Gate()  # the parent's may be held by a thread that does not exist here
        gate.shut = gate.forked = True
        self._gate = gate
        self._handle = None  # the parent's: never destroyed here
        self._source_user = False
        self._views = ViewCache(self.layout)  # their pins are the parent's (MemoryPin leaves them)

    def _leave_source(self) -> None:
        if self._source_user:
            self._source_user = False
            self.source.remove_user()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    @property
    def closed(self) -> bool:
        """True once :meth:`close` began (and in a child made by fork())."""
        return self._gate.shut

    @contextlib.contextmanager
    def raw_handle(self):
        """``with cache.raw_handle() as h:`` the ``expcache_t*`` (an int) for C code that calls the
        library itself (an engine's own decode loop, the benchmark's replay loop). The cache
        stays open for the block: a concurrent :meth:`close` waits for it to end."""
        with self._gate:
            yield self._handle

    def _call(self, name: str, *args):
        """One library call through the gate, on this cache's handle."""
        with self._gate:
            return getattr(_lib.lib, name)(self._handle, *args)

    @property
    def backend(self) -> str:
        """``"host"`` or ``"cuda"``: the backend in use."""
        out = ctypes.c_uint32()
        self._call("expcache_backend_get", ctypes.byref(out))
        return _BACKEND_NAMES[out.value]

    # -- serving -------------------------------------------------------------
    @staticmethod
    def _as_ids(expert_ids, what: str, tokens: bool = False) -> np.ndarray:
        """A contiguous 1-D uint32 array of the ids (the library checks them against the layer).
        One token's ids must be 1-D (a 2-D array is not flattened into one select, nor a scalar
        taken for one id); ``tokens``: prepare_batch's tokens x k ids, any shape, flattened."""
        if (
            type(expert_ids) is np.ndarray
            and expert_ids.dtype == np.uint32
            and expert_ids.ndim == 1
            and expert_ids.flags.c_contiguous
        ):
            return expert_ids  # the hot path: nothing to convert or check
        try:
            ids = np.asarray(expert_ids)
        except ValueError:  # numpy refuses rows of different lengths
            raise ValueError(
                f"{what} must be a rectangular array of ids, got a ragged nesting (rows of different lengths)"
            ) from None
        if ids.ndim != 1 and not tokens:
            got = f"a {ids.ndim}-D array of shape {ids.shape}"
            if ids.ndim == 0:
                got = f"a scalar ({ids.item()!r})" + (
                    f"; pass [{ids.item()}] for one expert" if ids.dtype.kind in "iu" else ""
                )
            raise ValueError(
                f"{what} must be 1-D (one token's expert ids), got {got}; prepare_batch takes 2-D (tokens x k) ids"
            )
        if ids.size == 0:
            return np.empty(0, dtype=np.uint32)  # the library reports the empty request
        if ids.dtype.kind not in "iu":
            raise TypeError(f"{what} must be integers, got {ids.dtype}")
        if (ids.dtype.kind == "i" and ids.min() < 0) or (ids.dtype.itemsize > 4 and ids.max() > 0xFFFFFFFF):
            raise ValueError(f"{what} must be in [0, 2^32), got {ids.min()}..{ids.max()}")
        return np.ascontiguousarray(ids.reshape(-1), dtype=np.uint32)

    def _layer(self, layer) -> int:
        """``layer`` as a uint32, refused (ValueError) when it is a dense layer of the layout: the
        library never heard of it. A layer past the last one is the library's to report."""
        layer = u32(layer, "layer")
        if layer in self._dense_layers:
            raise ValueError(self.layout.no_experts_reason(layer))
        return layer

    def _decode(self, fn, layer, expert_ids, stream, *out) -> tuple[int, int]:
        """The decode call every select shares: checks, the ids into this thread's buffer, then
        ``fn(handle, layer, ids, k, stream, out_ptrs, *out)`` through the gate, the addresses left
        in the buffer. Returns (k, the stream's handle)."""
        if type(layer) is not int or not 0 <= layer <= 0xFFFFFFFF or layer in self._dense_layers:
            layer = self._layer(layer)
        ids = self._as_ids(expert_ids, "expert_ids")
        k = ids.size
        if k > _lib.MAX_SELECT:
            raise ValueError(f"at most {_lib.MAX_SELECT} ids per select, got {k}")
        s = stream_handle(stream)
        scratch = self._scratch
        scratch.ids[:k] = ids
        with self._gate:
            fn(self._handle, layer, scratch.ids_address, k, s, scratch.out_address, *out)
        return k, s

    def select(self, layer: int, expert_ids, stream=None) -> np.ndarray:
        """Decode path: make ``expert_ids`` of ``layer`` resident; return a [k, 3] uint64 array of
        device addresses (gate, up, down) per id. Asynchronous on ``stream``; the addresses are
        valid for work enqueued on it before the next select, load_compact or prepare_batch.
        ``expert_ids``: one token's ids, 1-D (ValueError otherwise: several tokens' tokens x k ids
        go to :meth:`prepare_batch`). A contiguous 1-D uint32 array of ids is the fast path (about
        3 µs; a list costs more)."""
        k, _ = self._decode(self._select_fn, layer, expert_ids, stream)
        return self._scratch.out[:k].copy()

    def select_views(self, layer: int, expert_ids, stream=None, *, dtype=None, shapes=None) -> list[ExpertView]:
        """:meth:`select`, returning per id an :class:`~pyexpcache.views.ExpertView` whose ``gate``,
        ``up`` and ``down`` are zero-copy :class:`~pyexpcache.views.TensorView` objects:
        ``torch.from_dlpack``, ``cupy.from_dlpack``, ``numpy.from_dlpack`` take them, and
        ``torch.as_tensor`` / ``numpy.asarray`` through ``__cuda_array_interface__`` (CUDA
        backend) or ``__array_interface__`` (host backend), so one engine runs with and without
        a GPU. Raw bytes (uint8) by default; ``dtype`` (a numpy dtype or ``"bfloat16"``) and
        ``shapes`` (gate, up, down shapes, each covering its part exactly) for unquantized
        layouts. Views are made once per slot and reused: an all-hit call makes only its list.
        A view is valid under the rule of :meth:`select`'s addresses (for work ordered after
        the call on ``stream``, until the cache's next select, load_compact, prepare_batch,
        release_all or layer_class call); its memory stays allocated while the view, or an
        array made from it, lives (after release_all and close too)."""
        k, s = self._decode(self._select_fn, layer, expert_ids, stream)
        return self._views.get(layer, self._scratch.out[:k].tolist(), s, dtype, shapes)

    def select_split(
        self, layer: int, expert_ids, stream=None, *, views: bool = False, dtype=None, shapes=None
    ) -> Selection:
        """Hits before misses: :meth:`select`, except that the misses are copied on the cache's own
        copy stream. Returns a :class:`~pyexpcache.selection.Selection`: ``pointers`` ([k, 3]
        addresses), ``resident`` (a bool per id: usable on ``stream`` at once), with ``views``
        its ``views`` (as :meth:`select_views` makes them, ``dtype`` and ``shapes`` alike), and
        :meth:`~pyexpcache.selection.Selection.wait`, which makes a stream wait for the misses'
        bytes (a no-op on the host backend and when every id was a hit). Launch the hits' work,
        then ``wait(stream)``, then the misses'. Validity as :meth:`select`'s."""
        ready = ctypes.c_void_p()
        scratch = self._scratch
        k, s = self._decode(self._split_fn, layer, expert_ids, stream, scratch.resident_address, ctypes.byref(ready))
        pointers = scratch.out[:k].copy()
        made = self._views.get(layer, pointers.tolist(), s, dtype, shapes) if views else None
        return Selection(self, layer, pointers, scratch.resident[:k].astype(bool), ready.value or 0, s, made)

    def bank(self, layer: int, dtype=None, shapes=None) -> ExpertBank:
        """The slot bank of ``layer``'s class on a ``lookup="device"`` cache (binding the class now
        if needed, which allocates its bank: do it before capturing a graph). ``dtype`` and
        ``shapes`` (one shape per part, as :meth:`select_views` takes them) format each slot's
        parts; the views are ``[cap, *shape]``. The bank's address never changes while the cache
        lives, so views and graphs made from it stay valid."""
        index = self.layer_class(layer)
        b = _lib.Bank()
        b.struct_size = ctypes.sizeof(b)
        self._call("expcache_class_bank_get", index, ctypes.byref(b))
        if not b.base:
            raise RuntimeError(
                f"layer {layer}'s class has no bank: its cap is 0 experts (see the cap warning); raise "
                "the budget or free device memory"
            )
        cuda = self._is_cuda
        owner = self._pin_memory(b.base)
        parts = [
            _bank.slot_view(
                b.base + offset,
                nbytes,
                b.cap,
                b.slot_stride,
                cuda=cuda,
                device_id=self._device,
                dtype=dtype,
                shape=None if shapes is None else shapes[i],
                owner=owner,
            )
            for i, (offset, nbytes) in enumerate(
                ((b.gate_offset, b.gate_bytes), (b.up_offset, b.up_bytes), (b.down_offset, b.down_bytes))
            )
        ]
        return ExpertBank(index, b.cap, b.slot_stride, *parts)

    def select_device(self, layer: int, ids, stream=None, out=None):
        """Device-side select on a ``lookup="device"`` cache: ``ids`` (a [k] or [n, k] int32 or
        int64 array on the GPU: torch, cupy, anything with DLPack or the CUDA Array Interface; a
        numpy array on the host backend) become resident in ``layer``'s bank, and the result (or
        ``out``: int32, same shape) holds each id's slot, for ``bank(layer).gate[slots]`` and the
        like. The n rows of a 2-D call are one step (a speculative verification): each distinct
        expert is copied once and all are protected. Kernels on ``stream`` (default: torch's
        current stream for a torch tensor, else the legacy default stream) do the lookup, the
        LRU update, the misses' copies (read from the pinned source by the GPU) and the counts,
        with no host synchronization: the call may be captured in a CUDA graph (bind each layer
        first: one call outside the capture, or :meth:`bank`), and each replay does the whole
        select. An id out of range in device memory gets slot -1, and the next synchronizing call
        (which does its own work as usual) warns with the first such id (:class:`ExpcacheWarning`),
        as :meth:`close` does for one no call read back; ids in host memory (the host backend) are
        checked here, and one out of range raises InvalidArgumentError with nothing selected.
        ``out`` must be writable (a read-only array is refused).

        The other calls (select, select_views, load_compact, prepare_batch, release_all, stats,
        ...) synchronize the device and see the device selects' residency; they must not run
        while device selects are in flight on other threads' streams."""
        if type(layer) is not int or not 0 <= layer <= 0xFFFFFFFF or layer in self._dense_layers:
            layer = self._layer(layer)
        src = _bank.id_array(ids, "ids")
        if src.size == 0:  # an empty tensor's address may be NULL: said here, for every kind of array
            raise InvalidArgumentError(
                _errors.ERR_INVALID_ARGUMENT,
                "EXPCACHE_ERR_INVALID_ARGUMENT",
                f"select_device: n*k must be 1..{_lib.MAX_SELECT} ids, got an empty array of shape {src.shape}",
            )
        if out is None:
            out = _bank.empty_slots(ids, src.shape)
        dst = _bank.id_array(out, "out", writable=True)
        if dst.bits != 32 or dst.shape != src.shape:
            raise ValueError(f"out must be int32 of the ids' shape {src.shape}, got {dst.bits}-bit {dst.shape}")
        cuda = self._is_cuda
        for a, what in ((src, "ids"), (dst, "out")):
            if a.cuda != cuda:
                where = "device memory (a CUDA tensor)" if cuda else "host memory (a numpy array) on the host backend"
                raise ValueError(f"{what} must be in {where}, got {'device' if a.cuda else 'host'} memory")
        n, k = (1, src.shape[0]) if len(src.shape) == 1 else src.shape
        if not src.cuda:
            self._check_host_ids(layer, src.host_values())
        if stream is None:
            stream = _bank.default_stream(ids)
        s = stream_handle(stream)
        with self._gate:
            _lib.lib.expcache_select_device_async(self._handle, layer, src.ptr, src.bits, n, k, dst.ptr, s)
        return out

    def _check_host_ids(self, layer: int, ids: np.ndarray) -> None:
        # Ids in host memory are read here, so an id out of range is refused at once rather than
        # given slot -1 and logged by a later call, as one in device memory is.
        num_experts = self.layout[layer].num_experts
        bad = np.flatnonzero((ids < 0) | (ids >= num_experts))
        if bad.size:
            i = int(bad[0])
            raise InvalidArgumentError(
                _errors.ERR_INVALID_ARGUMENT,
                "EXPCACHE_ERR_INVALID_ARGUMENT",
                f"select_device: expert id {int(ids[i])} (index {i}) out of range for layer "
                f"{layer} ({num_experts} experts); nothing was selected",
            )

    def wait_ready(self, ready: int, stream=None) -> None:
        """Make ``stream`` wait for ``ready`` (a :class:`Selection`'s ``ready`` event; 0 returns)."""
        self._call("expcache_ready_wait_async", u64(ready, "ready") or None, stream_handle(stream))

    def prefetch(self, layer: int, expert_ids, stream=None) -> int:
        """Copy ``expert_ids`` of ``layer``, expected soon, into the cache over the link's idle time;
        returns at once with the number queued. List them most likely first. At most
        ``prefetch_piece_bytes`` are in flight at a time, sent by a thread of the cache's; the next
        serving call takes back what is still queued (a select or batch listing an expert finishes
        it in place, the others are cancelled), so a demand miss shares the link with at most one
        piece, and waits for it only if it reads or rewrites that prefetch's slot. Never evicts an
        expert the current or previous serving call used or a batch holds;
        at most ``prefetch_max_per_layer`` of a layer between two serving calls of it. ``stream``:
        the engine's compute stream (the first prefetch waits for its work so far). Counted in
        :meth:`prefetch_stats`."""
        layer = self._layer(layer)
        ids = self._as_ids(expert_ids, "expert_ids")
        queued = ctypes.c_uint32()
        self._call(
            "expcache_prefetch_async",
            layer,
            ids.ctypes.data,
            u32(ids.size, "len(expert_ids)"),
            stream_handle(stream),
            ctypes.byref(queued),
        )
        return queued.value

    def wait_prefetch(self) -> None:
        """Block until every queued prefetch has been sent and has landed: each is then resident,
        so a select listing it is a hit and counts it ``used``. Raises CudaError for a prefetch
        piece that failed (once), InvalidStateError while the thread is paused
        (:func:`pyexpcache.testing.pause_prefetch`) with prefetches queued. Synchronizes."""
        self._call("expcache_prefetch_wait")

    def hint(self, layer: int, expert_ids) -> None:
        """Tell the policy that ``expert_ids`` of ``layer`` are expected soon: those resident are
        refreshed as hits would be; nothing is copied. Counted in :meth:`prefetch_stats`."""
        layer = self._layer(layer)
        ids = self._as_ids(expert_ids, "expert_ids")
        self._call("expcache_hint", layer, ids.ctypes.data, u32(ids.size, "len(expert_ids)"))

    def load_compact(self, layer: int, expert_ids, stream=None) -> CompactBuffer:
        """Copy ``expert_ids`` of ``layer`` into one contiguous device buffer (hits device to
        device, misses host to device). Asynchronous on ``stream``."""
        layer = self._layer(layer)
        ids = self._as_ids(expert_ids, "expert_ids")
        out = _lib.Compact()
        out.struct_size = ctypes.sizeof(out)
        self._call(
            "expcache_compact_load_async",
            layer,
            ids.ctypes.data,
            u32(ids.size, "len(expert_ids)"),
            stream_handle(stream),
            ctypes.byref(out),
        )
        return CompactBuffer(
            out.base or 0,
            out.bytes,
            out.gate_offset,
            out.up_offset,
            out.down_offset,
            out.gate_bytes,
            out.up_bytes,
            out.down_bytes,
            out.num_experts,
        )

    def prepare_batch(self, layer: int, expert_ids_2d, stream=None) -> Batch:
        """Prefill path: serve the union of ``expert_ids_2d`` (tokens x k ids of ``layer``) without
        evicting anything. Returns a :class:`Batch` (a context manager) whose ``ids`` are the
        unique experts and ``pointers`` their [n, 3] device addresses, held until finished."""
        layer = self._layer(layer)
        ids = self._as_ids(expert_ids_2d, "expert_ids_2d", tokens=True)
        n = ids.size
        out_ids = np.empty(max(n, 1), dtype=np.uint32)
        out_ptrs = np.empty((max(n, 1), 3), dtype=np.uint64)
        count = ctypes.c_uint32()
        handle = ctypes.c_uint64()
        s = stream_handle(stream)
        self._call(
            "expcache_batch_prepare_async",
            layer,
            ids.ctypes.data,
            n,
            s,
            out_ids.ctypes.data,
            out_ptrs.ctypes.data,
            ctypes.byref(count),
            ctypes.byref(handle),
        )
        c = count.value
        return Batch(self, layer, handle.value, out_ids[:c].copy(), out_ptrs[:c].copy(), s)

    def release_all(self) -> None:
        """Free every expert cache not holding batch slots, and the staging buffers. Synchronizes."""
        self._call("expcache_release_all")
        self._views.clear()

    def synchronize(self, stream=None) -> None:
        """Wait for the work enqueued on ``stream``."""
        self._call("expcache_synchronize", stream_handle(stream))

    # -- inspection ------------------------------------------------------------
    def layer_class(self, layer: int) -> int:
        """The class index ``layer`` is bound to (binding it now if needed)."""
        out = ctypes.c_uint32()
        self._call("expcache_layer_bind_class", self._layer(layer), ctypes.byref(out))
        return out.value

    def classes(self) -> list[ClassInfo]:
        """Every class in use."""
        out = []
        info = _lib.ClassInfo()
        info.struct_size = ctypes.sizeof(info)
        for i in range(self.max_classes):
            self._call("expcache_class_info_get", i, ctypes.byref(info))
            if info.in_use:
                out.append(ClassInfo(i, *(getattr(info, f[0]) for f in _lib.ClassInfo._fields_[2:])))
        return out

    def stats(self) -> CacheStats:
        """Counters per class in use and per path, each with ``hit_rate``."""
        out = []
        st = _lib.Stats()
        st.struct_size = ctypes.sizeof(st)
        for info in self.classes():
            paths = {}
            for p, name in enumerate(_lib.PATH_NAMES):
                self._call("expcache_stats_get", info.index, p, ctypes.byref(st))
                paths[name] = PathStats(**{n: getattr(st, n) for n in _lib.STAT_FIELDS})
            out.append(ClassStats(info, paths))
        return CacheStats(out)

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
        """Zero every counter, the staging ring's and prefetch's too."""
        self._call("expcache_stats_reset")
