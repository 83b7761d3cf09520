"""The serving calls of :class:`~pyexpcache.ExpertCache` by slot id: its classes' banks
(:meth:`~BankServing.bank`), the select that gives rows of them (:meth:`~BankServing.select_slots`)
and the device-side select (:meth:`~BankServing.select_device`); the addresses of a layer's parts
in its bank, by which the calls of :mod:`pyexpcache._serving` serve experts of other than three
parts."""

from __future__ import annotations

import ctypes

import numpy as np

from . import _errors, _lib, bank as _bank
from ._cuda import stream_handle
from ._errors import InvalidArgumentError
from .bank import ExpertBank
from .views import part_formats


class BankServing:
    """The slot-id methods of :class:`~pyexpcache.ExpertCache` (through
    :class:`~pyexpcache._serving.Serving`), on the state its constructor sets up."""

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

    def _bank_struct(self, layer: int) -> _lib.Bank:
        """expcache_bank_t of ``layer``'s class (bound now if it is not yet)."""
        index = self.bind_class(layer)
        b = _lib.Bank()
        b.struct_size = ctypes.sizeof(b)
        self._call("expcache_class_bank_get", index, ctypes.byref(b))
        return b

    def _part_addresses(self, layer: int, slots) -> np.ndarray:
        """[n, num_parts] uint64 device addresses of each part of the experts in ``slots`` (rows
        of ``layer``'s bank, as :meth:`select_slots` gives them): ``base + part_offset +
        slot * part_stride``. Valid as the slots are."""
        b = self._bank_struct(layer)
        return _addresses(b, np.asarray(slots))

    def bank(self, layer: int, dtype=None, shapes=None) -> ExpertBank:
        """The slot bank of ``layer``'s class, on any cache (binding the class now if needed, which
        reserves its bank, and on a ``lookup="device"`` cache maps all of it: do it before
        capturing a graph): one view ``[rows, ...]`` per part, indexed by the slot ids of
        :meth:`select_slots` and :meth:`select_device`, named after ``layer``'s parts
        (:meth:`ExpertBank.part <pyexpcache.ExpertBank.part>`). ``dtype`` and ``shapes`` (one shape
        per part, as :meth:`select_views` takes them) format each slot's parts; without either,
        each part is shown in the dtype and shape its :class:`~pyexpcache.layer_spec.PartSpec`
        gives (raw bytes where it gives none). The bank's address never changes while its class
        lives, so views and graphs made from it stay valid; a host-lookup cache reserves a new
        bank only when it reuses the class for other sizes (more size classes than
        ``max_classes``)."""
        index = self.bind_class(layer)
        b = self._bank_struct(layer)
        if not b.base:
            raise RuntimeError(
                f"layer {layer}'s class has no bank: its cap is 0 experts (see the cap warning); raise "
                "the budget or free device memory"
            )
        spec = self.layout[layer]
        cuda = self._is_cuda
        owner = self._pin_memory(b.base)
        strides = tuple(b.part_stride[: b.num_parts])
        parts = [
            _bank.slot_view(
                b.base + offset,
                nbytes,
                b.rows,
                stride,
                cuda=cuda,
                device_id=self._device,
                dtype=part_dtype,
                shape=shape,
                owner=owner,
            )
            for offset, nbytes, stride, (part_dtype, shape) in zip(
                b.part_offset, b.part_bytes[: b.num_parts], strides, part_formats(spec.parts, dtype, shapes)
            )
        ]
        arrangement = next(k for k, v in _lib.BANK_ARRANGEMENTS.items() if v == b.arrangement)
        return ExpertBank(index, b.rows, b.cap, b.slot_stride, parts, spec.part_names, spec.parts, strides, arrangement)

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


def _addresses(b: _lib.Bank, rows: np.ndarray) -> np.ndarray:
    """[n, parts] addresses of the parts of bank ``b``'s ``rows``: part p of row r at
    ``base + part_offset[p] + r * part_stride[p]``, whatever the bank's arrangement."""
    offsets = np.array(b.part_offset[: b.num_parts], dtype=np.uint64)
    strides = np.array(b.part_stride[: b.num_parts], dtype=np.uint64)
    return np.uint64(b.base) + offsets + rows.astype(np.uint64).reshape(-1, 1) * strides
