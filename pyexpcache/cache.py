"""The Pythonic face of libexpcache: :class:`ExpertCache`. Its construction and options, lifetime,
log lines and counters are here; its serving calls in :mod:`pyexpcache._serving`, the call gate in
:mod:`pyexpcache._gate`, what prepare_batch and load_compact return in :mod:`pyexpcache.batch`."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import warnings
import weakref
from typing import Optional

from . import _errors, _ints, _lib, _lifetime
from ._errors import CacheClosedError, ExpcacheWarning, InvalidStateError, stacklevel_outside
from ._gate import Gate
from ._inspection import Inspection
from ._layer_desc import layer_descs
from ._memory import MemoryPin
from ._serving import Scratch, Serving
from .batch import Batch, CompactBuffer
from .layout import ModelLayout
from .source import Source
from .stats import StagingStats  # noqa: F401 (importable from here, as before)
from .views import ViewCache

# Batch and CompactBuffer are at home in pyexpcache.batch, and importable from here too.
__all__ = ["Batch", "CompactBuffer", "ExpertCache", "staging_defaults"]

logger = logging.getLogger("pyexpcache")

_BACKENDS = {"auto": _lib.BACKEND_AUTO, "host": _lib.BACKEND_HOST, "cuda": _lib.BACKEND_CUDA}
_BACKEND_NAMES = {_lib.BACKEND_HOST: "host", _lib.BACKEND_CUDA: "cuda"}
_LOG_LEVELS = {_lib.LOG_WARNING: logging.WARNING, _lib.LOG_NOTICE: logging.INFO, _lib.LOG_DEBUG: logging.DEBUG}
# The modules whose frames lie between a user's call and the warning a log line of it raises (the
# cache's methods, the gate, a batch's finish): the warning names the first frame outside them.
_CALL_MODULES = (__name__, Serving.__module__, Gate.__module__, Batch.__module__)


def staging_defaults() -> tuple[int, int]:
    """The library's default ``(copy_threads, staging_chunk_bytes)`` on this machine (the thread
    count follows the number of cores)."""
    cfg = _lib.Config()
    _lib.lib.expcache_config_init(ctypes.byref(cfg))
    return int(cfg.copy_threads), int(cfg.staging_chunk_bytes)


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


class ExpertCache(Serving, Inspection):
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
        host_budget_bytes: pageable and file sources: bytes of the host pool, a tier of pinned host
            RAM between the source and the device cache, shared by every class and allocated when
            the cache is made (default 0: none). A miss of the device cache looks there first: a
            hit is copied from RAM, the source not read; a pool miss reads the source into the
            pool (evicting the victim of ``policy``, which orders the pool's experts as it does
            each class's) and is copied on. A read that failed is never entered. Counted in
            :meth:`pool_stats` (``stats().pool``); prefetches and pinned sources do not use it.
            At most 2^48.
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
        bank_arrangement: how each size class's bank (:meth:`bank`, :meth:`select_slots`,
            :meth:`select_device`) lays out its rows: ``"slots"`` (default: each slot holds every
            part of its expert side by side, so gate and up form one fused view,
            :meth:`ExpertBank.gate_up <pyexpcache.ExpertBank.gate_up>`) or ``"parts"`` (a region
            per part: a part whose bytes are a multiple of 256 is one C-contiguous ``[rows, ...]``
            array, what kernels that take one tensor per projection and assert contiguity want,
            e.g. FP8 batched and grouped matmuls, ggml's ``mul_mat_id``). Served addresses are
            the same experts' bytes either way.
        environment: ``"read"`` (default) or ``"ignore"``: whether the cache reads the
            ``EXPCACHE_*`` environment variables (``EXPCACHE_RESERVE_GB``, ``EXPCACHE_VERBOSE``,
            the staging knobs) when it is made. A malformed one never fails: it is ignored with a
            warning; one that replaces a value given here (``reserve_bytes``, ``log_level``) says
            so in a notice; each line once per process. ``"ignore"``: none is read.
        prefetch_max_per_layer: most experts of one layer prefetched between two serving calls of
            that layer (default 8; 0 turns :meth:`prefetch` off).
        prefetch_piece_bytes: most prefetch bytes in flight at once (two transfers of half), what
            a demand miss shares the link with (default 4 MiB; a multiple of 4096 in 4 KiB..64 MiB).
        lookup: ``"host"`` (default) or ``"device"``: every cache keeps each class's slots in one
            bank (:meth:`bank`; :meth:`select_slots` gives rows of it); a device-lookup bank is
            mapped whole when its class is bound, and :meth:`select_device` looks experts up on the
            GPU, capturable in a CUDA graph. A device-lookup cache keeps its residency and every
            policy's state on the device, once (docs/device_lookup.md): the host-side serving calls
            (:meth:`select`, :meth:`select_slots`, :meth:`select_views`, :meth:`load_compact`,
            :meth:`prepare_batch`) run the same kernel on it and synchronize their stream;
            :meth:`stats` reads it with one copy. It refuses :meth:`select_split`, :meth:`prefetch`
            and :meth:`hint`, and needs a pinned source for device selects (the host-side calls
            serve any source).

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
        environment: str = "read",
        host_budget_bytes: int = 0,
        bank_arrangement: str = "slots",
    ):
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {sorted(_BACKENDS)}, got {backend!r}")
        if lookup not in _lib.LOOKUPS:
            raise ValueError(f"lookup must be one of {sorted(_lib.LOOKUPS)}, got {lookup!r}")
        if policy is not None and policy not in _lib.POLICIES:
            raise ValueError(f"policy must be one of {sorted(_lib.POLICIES)}, got {policy!r}")
        if partition not in _lib.PARTITIONS:
            raise ValueError(f"partition must be one of {sorted(_lib.PARTITIONS)}, got {partition!r}")
        if not isinstance(bank_arrangement, str) or bank_arrangement not in _lib.BANK_ARRANGEMENTS:
            raise ValueError(
                f"bank_arrangement must be one of {sorted(_lib.BANK_ARRANGEMENTS)}, got {bank_arrangement!r}"
            )
        if environment not in _lib.ENVIRONMENTS:
            raise ValueError(f"environment must be one of {sorted(_lib.ENVIRONMENTS)}, got {environment!r}")
        if file_reads not in _lib.FILE_READS:
            raise ValueError(f"file_reads must be one of {sorted(_lib.FILE_READS)}, got {file_reads!r}")
        host_budget_bytes = _ints.checked_int(host_budget_bytes, "host_budget_bytes", 0, _lib.MAX_HOST_BUDGET_BYTES)
        if source.layout.num_layers != layout.num_layers or source.layout.layers != layout.layers:
            raise ValueError("source was built for a different layout")
        self._handle = None
        # Callbacks reach this cache through a weak reference, so the cache holds no cycle: one
        # dropped without close() closes when its last reference goes.
        this = weakref.ref(self)
        self._gate = Gate(_deliver_to(this))
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
                ("host_budget_bytes", host_budget_bytes),
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
            bank_arrangement=_lib.BANK_ARRANGEMENTS[bank_arrangement],
            environment=_lib.ENVIRONMENTS[environment],
            **given,
        )
        self.lookup = lookup
        self.layout = layout
        self.source = source
        self.max_classes = max_classes
        self.policy = _lib.DEFAULT_POLICY if policy is None else policy
        self.partition = partition
        self.bank_arrangement = bank_arrangement
        self._scratch = Scratch()
        self._select_fn = lib.expcache_select_async
        self._split_fn = lib.expcache_select_split_async
        self._slots_fn = lib.expcache_select_slots_async
        self._views = ViewCache(layout)
        self._dense_layers = layout.dense_layers
        self._parted_layers = frozenset(i for i in layout.moe_layers if layout[i].num_parts != 3)
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
            paths = getattr(source, "file_paths", None) or (
                (source.file_path,) if getattr(source, "file_path", None) else ()
            )
            file_ids = []
            for path in paths:  # a checkpoint's shards, or the one file
                out = ctypes.c_uint32()
                lib.expcache_file_open(self._handle, os.fsencode(path), ctypes.byref(out))
                file_ids.append(out.value)
            moe, descs = layer_descs(layout, source, file_ids)
            indices = (ctypes.c_uint32 * len(moe))(*moe)
            if moe:  # every layer at once, all or nothing
                lib.expcache_layers_register(self._handle, len(moe), indices, descs)

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
                warnings.warn(f"expcache: {text}", ExpcacheWarning, stacklevel=stacklevel_outside(*_CALL_MODULES))
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
        gate = Gate()  # the parent's may be held by a thread that does not exist here
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

    # -- the layout and the budgets of a live cache --------------------------------
    def unregister_layer(self, layer: int) -> None:
        """Take ``layer`` out of the cache, keeping the rest of it warm (C:
        ``expcache_layer_unregister``): its resident experts leave (their slots are free for the
        other layers of its class; every other layer's residents stay, byte for byte) and the
        library no longer reads its part of the source. Its queued prefetches are cancelled and
        the device is synchronized first. Later calls on the layer raise
        :class:`~pyexpcache.InvalidStateError` (it is not registered); so does this call while a
        prefill batch of the layer is open (finish it first: nothing changes). The cache keeps its
        source for the other layers."""
        self._call("expcache_layer_unregister", self._layer(layer))

    def set_budget(self, budget_bytes: Optional[int] = None, budget_experts: Optional[int] = None) -> None:
        """Replace the budgets, keeping the warm cache (C: ``expcache_budget_set``).
        ``budget_bytes`` and ``budget_experts`` mean what they mean to the constructor (None: no
        limit from that one); at least one must be given. Every class's cap is recomputed as at
        construction: a class above its new cap evicts the policy's victims (counted as
        ``control`` evictions), moves the residents past the cap into free slots below it and
        gives the bank's memory past it back, in the pieces it was mapped in (the bank's base
        address does not change; residents may change slot); a class below it grows as misses
        come. Synchronous. Raises :class:`~pyexpcache.InvalidArgumentError` when neither budget is
        given, :class:`~pyexpcache.InvalidStateError` (nothing changed) while an open prefill batch
        holds slots of a class that must shrink. Arrays and banks (:meth:`bank`) still held keep
        their memory mapped."""
        experts = 0 if budget_experts is None else _ints.u64(budget_experts, "budget_experts")
        nbytes = 0 if budget_bytes is None else _ints.u64(budget_bytes, "budget_bytes")
        self._call("expcache_budget_set", experts, nbytes)

    def set_reserve(self, reserve_bytes: int) -> None:
        """Replace ``reserve_bytes`` (device memory the expert caches never grow into), keeping
        the warm cache (C: ``expcache_reserve_set``): every class's cap is recomputed and each class
        shrinks or grows as :meth:`set_budget` says, so a larger reserve gives memory back (the
        classes are served in index order: the last ones shrink first). ``EXPCACHE_RESERVE_GB`` is
        read at construction only. Synchronous; :class:`~pyexpcache.InvalidStateError` as
        :meth:`set_budget`."""
        self._call("expcache_reserve_set", _ints.u64(reserve_bytes, "reserve_bytes"))
