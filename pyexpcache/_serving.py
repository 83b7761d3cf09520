"""The serving calls of :class:`~pyexpcache.ExpertCache`, which inherits them from
:class:`Serving`: select (plain, as views, split, on the device), the device banks, prefetch
and hints, compact loads, prefill batches, release_all and synchronize. Construction, options,
lifetime, log lines and the counters are in :mod:`pyexpcache.cache`."""

from __future__ import annotations

import ctypes
import threading
from typing import Optional

import numpy as np

from . import _errors, _lib
from ._cuda import stream_handle
from ._errors import InvalidStateError
from ._gate import Gate
from ._ints import u32, u64
from ._serving_bank import BankServing
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


class Serving(BankServing):
    """The serving methods of :class:`~pyexpcache.ExpertCache` (its only subclass), on the state
    its constructor sets up: the call gate and handle, this thread's select buffers, the view
    cache; ``_call``, ``_pin_memory`` and ``bind_class`` are the cache's own."""

    layout: ModelLayout
    _gate: Gate
    _handle: Optional[int]
    _scratch: Scratch
    _views: ViewCache
    _dense_layers: frozenset[int]
    _parted_layers: frozenset[int]  # the layers whose experts have other than three parts
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

    def _refuse_parts(self, layer: int, call: str, instead: str):
        spec = self.layout[layer]
        raise InvalidStateError(
            _errors.ERR_INVALID_STATE,
            "EXPCACHE_ERR_INVALID_STATE",
            f"{call}: layer {layer}'s experts have {spec.num_parts} parts ({', '.join(spec.part_names)}); "
            f"{call} hands out three-part addresses: use {instead}",
        )

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
        3 µs; a list costs more).

        A layer whose experts have other than three parts is served by slot id
        (:meth:`select_slots`): the result is then [k, num_parts], each part's address in the
        slot's row of the class's bank (``base + slot * slot_stride + part_offset``), in the
        layer's part order."""
        if layer in self._parted_layers:
            return self._part_addresses(layer, self.select_slots(layer, expert_ids, stream))
        k, _ = self._decode(self._select_fn, layer, expert_ids, stream)
        return self._scratch.out[:k].copy()

    def select_views(self, layer: int, expert_ids, stream=None, *, dtype=None, shapes=None) -> list[ExpertView]:
        """:meth:`select`, returning per id an :class:`~pyexpcache.views.ExpertView` whose ``gate``,
        ``up`` and ``down`` are zero-copy :class:`~pyexpcache.views.TensorView` objects:
        ``torch.from_dlpack``, ``cupy.from_dlpack``, ``numpy.from_dlpack`` take them, and
        ``torch.as_tensor`` / ``numpy.asarray`` through ``__cuda_array_interface__`` (CUDA
        backend) or ``__array_interface__`` (host backend), so one engine runs with and without
        a GPU. Each part in the dtype and shape its :class:`~pyexpcache.layer_spec.PartSpec` gives,
        raw bytes (uint8) where it gives none; ``dtype`` (a numpy dtype, ``"bfloat16"``, an 8-bit
        float's name) for every part and ``shapes`` (one per part, in order or by name, each
        covering its part exactly) override them. A view's parts are by name
        (``view.part("down_proj_scale_inv")``, ``view["..."]``; ``view.gate``, ``.up``,
        ``.down`` for three parts); a layer of other than three parts is served through
        :meth:`select_slots` and the bank. Views are made once per slot and reused: an all-hit call makes only its list.
        A view is valid under the rule of :meth:`select`'s addresses (for work ordered after
        the call on ``stream``, until the cache's next select, load_compact, prepare_batch,
        release_all or bind_class call); its memory stays allocated while the view, or an
        array made from it, lives (after release_all and close too)."""
        if layer in self._parted_layers:
            rows = self.select(layer, expert_ids, stream)
            return self._views.get(layer, rows.tolist(), stream_handle(stream), dtype, shapes)
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
        then ``wait(stream)``, then the misses'. Validity as :meth:`select`'s. Layers of three
        parts only (InvalidStateError otherwise: serve others with :meth:`select_slots`,
        :meth:`select` or :meth:`select_views`)."""
        if layer in self._parted_layers:
            self._refuse_parts(layer, "select_split", "select_slots, select or select_views")
        ready = ctypes.c_void_p()
        scratch = self._scratch
        k, s = self._decode(self._split_fn, layer, expert_ids, stream, scratch.resident_address, ctypes.byref(ready))
        pointers = scratch.out[:k].copy()
        made = self._views.get(layer, pointers.tolist(), s, dtype, shapes) if views else None
        return Selection(self, layer, pointers, scratch.resident[:k].astype(bool), ready.value or 0, s, made)

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
        device, misses host to device): one region per part, in part order, each holding that
        part of every expert in the ids' order (:meth:`CompactBuffer.region
        <pyexpcache.CompactBuffer.region>`). Asynchronous on ``stream``."""
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
        n = out.num_parts
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
            names=self.layout[layer].part_names,
            part_offsets=tuple(out.part_offset[:n]),
            part_bytes=tuple(out.part_bytes[:n]),
        )

    def prepare_batch(self, layer: int, expert_ids_2d, stream=None, *, slots: bool = False) -> Batch:
        """Prefill path: serve the union of ``expert_ids_2d`` (tokens x k ids of ``layer``) without
        evicting anything. Returns a :class:`Batch` (a context manager) whose ``ids`` are the
        unique experts and ``pointers`` their [n, 3] device addresses, held until finished.

        With ``slots=True`` the batch is given by slot id (expcache_batch_prepare_slots_async):
        ``Batch.slots`` (int32) holds each unique expert's row in the class's bank (:meth:`bank`),
        the experts staged for want of free capacity included (in the bank's batch rows), so a
        kernel reads the whole batch as ``bank(layer).gate[batch.slots]``; ``pointers`` are those
        rows' addresses. A layer whose experts have other than three parts is always given by slot
        id, its ``pointers`` [n, num_parts] (each part's address, in part order)."""
        layer = self._layer(layer)
        ids = self._as_ids(expert_ids_2d, "expert_ids_2d", tokens=True)
        n = ids.size
        out_ids = np.empty(max(n, 1), dtype=np.uint32)
        count = ctypes.c_uint32()
        handle = ctypes.c_uint64()
        s = stream_handle(stream)
        if not slots and layer not in self._parted_layers:
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
        pointers = self._part_addresses(layer, rows)
        return Batch(self, layer, handle.value, out_ids[:c].copy(), pointers, s, slots=rows)

    def release_all(self) -> None:
        """Free every expert cache not holding batch slots, and the staging buffers. Synchronizes."""
        self._call("expcache_release_all")
        self._views.clear()

    def synchronize(self, stream=None) -> None:
        """Wait for the work enqueued on ``stream``."""
        self._call("expcache_synchronize", stream_handle(stream))
