"""The serving calls of :class:`~pyexpcache.ExpertCache`, which inherits them from
:class:`Serving`: select (plain, as views, split, on the device), the device banks, prefetch
and hints, compact loads, prefill batches, release_all and synchronize. Construction, options,
lifetime, log lines and the counters are in :mod:`pyexpcache.cache`."""

from __future__ import annotations

import ctypes
import threading
from typing import Optional

import numpy as np

from . import _errors, _lib, bank as _bank
from ._cuda import stream_handle
from ._errors import InvalidArgumentError
from ._gate import Gate
from ._ints import u32, u64
from .bank import ExpertBank
from .batch import Batch, CompactBuffer
from .layout import ModelLayout
from .selection import Selection
from .views import ExpertView, ViewCache


class Scratch(threading.local):
    """Per-thread buffers of select, with their addresses computed once: several threads
    may share a cache, and numpy's address lookups cost more than the call itself."""

    def __init__(self):
        self.ids = np.empty(_lib.MAX_SELECT, dtype=np.uint32)
        self.out = np.empty((_lib.MAX_SELECT, 3), dtype=np.uint64)
        self.resident = np.empty(_lib.MAX_SELECT, dtype=np.uint8)
        self.ids_address = self.ids.ctypes.data
        self.out_address = self.out.ctypes.data
        self.resident_address = self.resident.ctypes.data


class Serving:
    """The serving methods of :class:`~pyexpcache.ExpertCache` (its only subclass), on the state
    its constructor sets up: the call gate and handle, this thread's select buffers, the view
    cache; ``_call``, ``_pin_memory`` and ``bind_class`` are the cache's own."""

    layout: ModelLayout
    _gate: Gate
    _handle: Optional[int]
    _scratch: Scratch
    _views: ViewCache
    _dense_layers: frozenset[int]
    _is_cuda: bool
    _device: int

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

    def _decode_ids(self, layer, expert_ids) -> tuple[int, int]:
        """What every decode select checks first: the layer, and one token's ids copied into this
        thread's buffer (``self._scratch.ids``). Returns (the layer as a uint32, k)."""
        if type(layer) is not int or not 0 <= layer <= 0xFFFFFFFF or layer in self._dense_layers:
            layer = self._layer(layer)
        ids = self._as_ids(expert_ids, "expert_ids")
        k = ids.size
        if k > _lib.MAX_SELECT:
            raise ValueError(f"at most {_lib.MAX_SELECT} ids per select, got {k}")
        self._scratch.ids[:k] = ids
        return layer, k

    def _decode(self, fn, layer, expert_ids, stream, *out) -> tuple[int, int]:
        """The decode call by address: :meth:`_decode_ids`, then ``fn(handle, layer, ids, k,
        stream, out_ptrs, *out)`` through the gate, the addresses left in the buffer. Returns (k,
        the stream's handle)."""
        layer, k = self._decode_ids(layer, expert_ids)
        s = stream_handle(stream)
        scratch = self._scratch
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
        release_all or bind_class call); its memory stays allocated while the view, or an
        array made from it, lives (after release_all and close too)."""
        k, s = self._decode(self._select_fn, layer, expert_ids, stream)
        return self._views.get(layer, self._scratch.out[:k].tolist(), s, dtype, shapes)

    def select_slots(self, layer: int, expert_ids, stream=None, out=None) -> np.ndarray:
        """Decode path by slot id: :meth:`select`, returning each id's row in its class's bank
        (:meth:`bank`) as int32 (``out``: a writable int32 numpy array of the ids' length, filled
        and returned), so a kernel reads every selected expert as ``bank(layer).gate[slots]``
        (``torch.index_select``, a fused MoE kernel's ``base + slot * stride``), with no table of
        addresses and no gather. ``expert_ids``: one token's ids on the host, 1-D (as
        :meth:`select` takes them). The misses are copied into their slots on ``stream``; experts
        that get no slot (the class cannot hold the whole request) are staged in the bank's staging
        rows (past its slots). The slots are valid as :meth:`select`'s addresses are."""
        layer, k = self._decode_ids(layer, expert_ids)
        if out is None:
            out = np.empty(k, dtype=np.int32)
        elif (
            not isinstance(out, np.ndarray)
            or out.dtype != np.int32
            or out.shape != (k,)
            or not out.flags.c_contiguous
            or not out.flags.writeable
        ):
            raise ValueError(
                f"out must be a writable contiguous int32 numpy array of shape ({k},), got "
                f"{getattr(out, 'dtype', type(out).__name__)} {getattr(out, 'shape', '')}"
            )
        s = stream_handle(stream)
        with self._gate:
            self._slots_fn(self._handle, layer, self._scratch.ids_address, 32, k, out.ctypes.data, s)
        return out

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

    def _bank_struct(self, layer: int) -> _lib.Bank:
        """expcache_bank_t of ``layer``'s class (bound now if it is not yet)."""
        index = self.bind_class(layer)
        b = _lib.Bank()
        b.struct_size = ctypes.sizeof(b)
        self._call("expcache_class_bank_get", index, ctypes.byref(b))
        return b

    def bank(self, layer: int, dtype=None, shapes=None) -> ExpertBank:
        """The slot bank of ``layer``'s class, on any cache (binding the class now if needed, which
        reserves its bank, and on a ``lookup="device"`` cache maps all of it: do it before
        capturing a graph). ``dtype`` and ``shapes`` (one shape per part, as :meth:`select_views`
        takes them) format each slot's parts; the views are ``[rows, *shape]``, indexed by the
        slot ids of :meth:`select_slots` and :meth:`select_device`. The bank's address never
        changes while its class lives, so views and graphs made from it stay valid; a host-lookup
        cache reserves a new bank only when it reuses the class for other sizes (more size classes
        than ``max_classes``)."""
        index = self.bind_class(layer)
        b = self._bank_struct(layer)
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
                b.rows,
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
        return ExpertBank(index, b.rows, b.cap, b.slot_stride, *parts)

    def select_device(self, layer: int, ids, stream=None, out=None, counts=None):
        """Device-side select on a ``lookup="device"`` cache: ``ids`` (a [k] or [n, k] int32 or
        int64 array on the GPU: torch, cupy, anything with DLPack or the CUDA Array Interface; a
        numpy array on the host backend) become resident in ``layer``'s bank, and the result (or
        ``out``: int32, same shape) holds each id's slot, for ``bank(layer).gate[slots]`` and the
        like. The n rows of a 2-D call are one step (a speculative verification): each distinct
        expert is copied once and all are protected. One kernel on ``stream`` (default: torch's
        current stream for a torch tensor, else the legacy default stream) does the lookup, the
        policy's update and victims (the cache's policy, choosing as the host's would), the
        misses' copies (read from the pinned source by the GPU) and the counts, with no host
        synchronization (a slot-map read and the policy's hit bookkeeping alone when every id is
        resident): the call may be captured in a CUDA graph (bind each layer first: one call
        outside the capture, or :meth:`bank`), and each replay does the whole select. An id out
        of range in device memory gets slot -1, and the next read of the device's counters
        (:meth:`stats`, :meth:`classes`) warns with the first such id (:class:`ExpcacheWarning`),
        as :meth:`close` does for one no call read; ids in host memory (the host backend) are
        checked here, and one out of range raises InvalidArgumentError with nothing selected.
        ``out`` must be writable (a read-only array is refused).

        ``counts`` (optional: 2 int32 or uint32 where ``out`` lives, writable) gets the step's
        counts from the select's kernel, on ``stream`` with no synchronization (capturable too):
        ``counts[0]`` the distinct experts among the ids (the union of the rows), ``counts[1]``
        how many of them missed (were copied by this call). An id out of range is not counted.
        An engine verifying speculative drafts reads them on the device to choose the next
        draft's length (docs/device_lookup.md).

        The other calls (release_all, stats, bank, read_expert, ...; under policy ``"lru"`` also
        select, select_views, load_compact, prepare_batch, which the other policies refuse: their
        state lives on the device) synchronize the device and see the device selects' residency;
        they must not run while device selects are in flight on other threads' streams."""
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
        arrays = [(src, "ids"), (dst, "out")]
        if counts is not None:
            tally = _bank.id_array(counts, "counts", writable=True, unsigned=True)
            if tally.bits != 32 or tally.shape != (2,):
                raise ValueError(
                    f"counts must be 2 int32 or uint32 (distinct experts, misses), got {tally.bits}-bit "
                    f"integers of shape {tally.shape}"
                )
            arrays.append((tally, "counts"))
        cuda = self._is_cuda
        for a, what in arrays:
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
            if counts is None:
                _lib.lib.expcache_select_device_async(self._handle, layer, src.ptr, src.bits, n, k, dst.ptr, s)
            else:
                _lib.lib.expcache_select_device_counted_async(
                    self._handle, layer, src.ptr, src.bits, n, k, dst.ptr, tally.ptr, s
                )
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

    def insert(self, layer: int, expert_ids, priorities=None, stream=None) -> None:
        """Seed the cache with ``expert_ids`` of ``layer`` (an engine's hot list), copied now on
        ``stream``: each id once at its highest priority (``priorities``, one float per id;
        None: the given order, the last highest), lowest first, each taking the policy's victim
        when the class is full, so the highest priorities it can hold stay. Counted on the
        control path, not as decode traffic."""
        layer = self._layer(layer)
        ids = self._as_ids(expert_ids, "expert_ids")
        prio = None
        if priorities is not None:
            prio = np.ascontiguousarray(priorities, dtype=np.float32)
            if prio.shape != ids.shape:
                raise ValueError(f"priorities must have one value per id: {prio.shape} for {ids.shape} ids")
        self._call(
            "expcache_insert_async",
            layer,
            ids.ctypes.data,
            32,
            None if prio is None else prio.ctypes.data,
            u32(ids.size, "len(expert_ids)"),
            stream_handle(stream),
        )

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

    def prepare_batch(self, layer: int, expert_ids_2d, stream=None, *, slots: bool = False) -> Batch:
        """Prefill path: serve the union of ``expert_ids_2d`` (tokens x k ids of ``layer``) without
        evicting anything. Returns a :class:`Batch` (a context manager) whose ``ids`` are the
        unique experts and ``pointers`` their [n, 3] device addresses, held until finished.

        With ``slots=True`` the batch is given by slot id (expcache_batch_prepare_slots_async):
        ``Batch.slots`` (int32) holds each unique expert's row in the class's bank (:meth:`bank`),
        the experts staged for want of free capacity included (in the bank's batch rows), so a
        kernel reads the whole batch as ``bank(layer).gate[batch.slots]``; ``pointers`` are those
        rows' addresses."""
        layer = self._layer(layer)
        ids = self._as_ids(expert_ids_2d, "expert_ids_2d", tokens=True)
        n = ids.size
        out_ids = np.empty(max(n, 1), dtype=np.uint32)
        count = ctypes.c_uint32()
        handle = ctypes.c_uint64()
        s = stream_handle(stream)
        if not slots:
            out_ptrs = np.empty((max(n, 1), 3), dtype=np.uint64)
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
        out_slots = np.empty(max(n, 1), dtype=np.int32)
        self._call(
            "expcache_batch_prepare_slots_async",
            layer,
            ids.ctypes.data,
            32,  # _as_ids checked each id against the layer: all below 2**31
            n,
            s,
            out_ids.ctypes.data,
            out_slots.ctypes.data,
            ctypes.byref(count),
            ctypes.byref(handle),
        )
        c = count.value
        rows = out_slots[:c].copy()
        b = self._bank_struct(layer)
        offsets = np.array([b.gate_offset, b.up_offset, b.down_offset], dtype=np.uint64)
        pointers = np.uint64(b.base) + rows.astype(np.uint64)[:, None] * np.uint64(b.slot_stride) + offsets
        return Batch(self, layer, handle.value, out_ids[:c].copy(), pointers, s, slots=rows)

    def release_all(self) -> None:
        """Free every expert cache not holding batch slots, and the staging buffers. Synchronizes."""
        self._call("expcache_release_all")
        self._views.clear()

    def synchronize(self, stream=None) -> None:
        """Wait for the work enqueued on ``stream``."""
        self._call("expcache_synchronize", stream_handle(stream))
