"""Zero-copy tensor views of cached experts: what an engine gets instead of raw addresses.

A :class:`TensorView` is one part (gate, up, down, or a named part such as FP8 block scales) of
one cached expert, exported to any array library without a copy: DLPack
(``torch.from_dlpack(view)``, ``cupy.from_dlpack``, ``numpy.from_dlpack``), the CUDA Array
Interface v3 on the CUDA backend (``torch.as_tensor(view)``, ``cupy.asarray``, Numba) and the
NumPy array interface on the host backend (``numpy.asarray(view)``). An :class:`ExpertView`
groups an expert's parts by name.

**Validity.** A view's bytes are the expert's under the same rule as the addresses
``ExpertCache.select`` returns: for work ordered after the select on its stream, until the next
``select``, ``load_compact``, ``prepare_batch``, ``release_all`` or ``bind_class`` call on the
cache; after that call its slot may hold another expert. The *memory* stays allocated while the
view, or any array or tensor made from it, lives (:mod:`pyexpcache._memory`): reading one after
``release_all`` or ``close()`` reads stale bytes, never freed memory.

**Streams.** ``stream`` is the handle of the CUDA stream on which the bytes are ready (0: the
legacy default stream). ``__dlpack__(stream=s)`` makes the consumer's stream ``s`` wait for it
(an event recorded on ``stream``, waited on by ``s``; no host synchronization) unless they are
the same stream or ``s`` is -1; ``__cuda_array_interface__`` hands the stream to the consumer,
which waits itself.
"""

from __future__ import annotations

import math
import operator
import threading
from collections.abc import Mapping

import numpy as np

from . import _dlpack, _lifetime
from ._cuda import check, runtime, stream_handle
from ._ints import I32_MAX, checked_int, u64

_I64_MAX = (1 << 63) - 1
PARTS = ("gate", "up", "down")  # the three-part shorthand's names (layer_spec.PARTS, which imports this module)
_LEGACY = 1  # cudaStreamLegacy: what 0 and None mean for a stream here (see _legacy)


def _legacy(handle: int) -> int:
    # The library and stream_handle() use 0 for the legacy default stream; DLPack and the CUDA
    # Array Interface call it 1 (cudaStreamLegacy, also a valid handle for every CUDA call),
    # which stays the legacy stream even if cuda-python is set to per-thread default streams.
    return _LEGACY if handle == 0 else handle


def _dtype(value):
    """A numpy dtype, or an :class:`~pyexpcache._dlpack.ExtraDType` for a type numpy lacks
    ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", or torch's dtype of that
    name); TypeError for one DLPack cannot carry."""
    if value is None:
        return np.dtype(np.uint8)
    if isinstance(value, _dlpack.ExtraDType):
        return value
    name = value if isinstance(value, str) else str(value) if type(value).__module__ == "torch" else None
    if name is not None and name.removeprefix("torch.") in _dlpack.EXTRA_DTYPES:
        return _dlpack.EXTRA_DTYPES[name.removeprefix("torch.")]
    try:
        dtype = np.dtype(value if name is None else name.removeprefix("torch."))
    except TypeError:
        raise TypeError(
            f"dtype must be a numpy dtype, a dtype name or one of {', '.join(_dlpack.EXTRA_DTYPES)}, got {value!r}"
        ) from None
    if dtype.name in _dlpack.EXTRA_DTYPES:  # ml_dtypes' numpy bfloat16 and float8: DLPack's, not void types
        return _dlpack.EXTRA_DTYPES[dtype.name]
    _dlpack.data_type(dtype)  # refuses what DLPack cannot express, here rather than at export
    return dtype


def _shape(value, nbytes: int, dtype) -> tuple[int, ...]:
    """``value`` (None: all of ``nbytes``) as a tuple of dimensions covering exactly ``nbytes``."""
    if value is None:
        if nbytes % dtype.itemsize:
            raise ValueError(f"{nbytes} bytes are not a whole number of {dtype} items ({dtype.itemsize} bytes each)")
        return (nbytes // dtype.itemsize,)
    try:
        dims = (operator.index(value),)
    except TypeError:
        dims = tuple(value)
    shape = tuple(checked_int(d, f"shape[{i}]", 0, _I64_MAX) for i, d in enumerate(dims))
    size = math.prod(shape) * dtype.itemsize
    if size != nbytes:
        raise ValueError(f"shape {shape} of {dtype} is {size} bytes, but the view has {nbytes} bytes")
    return shape


def _strides(value, shape: tuple[int, ...], dtype) -> tuple[int, ...]:
    """Byte strides, one per dimension of ``shape``, each a non-negative multiple of the item size."""
    strides = tuple(checked_int(s, f"strides[{i}]", 0, _I64_MAX) for i, s in enumerate(value))
    if len(strides) != len(shape):
        raise ValueError(f"strides {strides} must have one entry per dimension of shape {shape}")
    if any(s % dtype.itemsize for s in strides):
        raise ValueError(f"strides {strides} must be multiples of the item size ({dtype.itemsize} bytes)")
    return strides


def _consumer_stream(stream):
    """The handle of a DLPack consumer's ``stream`` argument; None for -1 ("do not synchronize")."""
    if stream is None:
        return _LEGACY  # the array API standard: None means the legacy default stream
    if not isinstance(stream, bool):
        try:
            if operator.index(stream) == -1:
                return None
        except TypeError:  # a stream object: stream_handle takes it
            pass
    return _legacy(stream_handle(stream))


class _Events(dict):
    """This thread's event per device, destroyed with the thread's locals."""

    def __del__(self):
        try:
            if _lifetime.in_forked_child:
                return  # the parent's CUDA state
            rt = runtime()
            for event in self.values():
                rt.cudaEventDestroy(event)
        except Exception:  # interpreter shutdown (modules already torn down): nothing left to tidy
            pass


_local = threading.local()


def _make_wait(producer: int, consumer: int, device_id: int) -> None:
    """Enqueue on ``consumer`` a wait for the work enqueued so far on ``producer``."""
    rt = runtime()
    # The event, and a legacy stream handle, belong to the current device: make it ours.
    previous = int(check(rt.cudaGetDevice(), "cudaGetDevice"))
    if previous != device_id:
        check(rt.cudaSetDevice(device_id), f"cudaSetDevice({device_id})")
    try:
        events = getattr(_local, "events", None)
        if events is None:
            events = _local.events = _Events()
        event = events.get(device_id)
        if event is None:
            event = check(rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming), "cudaEventCreateWithFlags")
            events[device_id] = event
        # Re-recording an event that an earlier wait still refers to is fine: a wait captures
        # the event's state when it is enqueued.
        check(rt.cudaEventRecord(event, producer), "cudaEventRecord")
        check(rt.cudaStreamWaitEvent(consumer, event, 0), "cudaStreamWaitEvent")
    finally:
        if previous != device_id:
            rt.cudaSetDevice(previous)


class TensorView:
    """One part (gate, up, down or any named part) of one cached expert: ``nbytes`` bytes at device address
    ``ptr``, seen as ``shape`` of ``dtype`` (default: raw bytes, uint8 of shape ``(nbytes,)``).
    Zero-copy: DLPack and the CUDA Array Interface (CUDA backend) or the NumPy array interface
    (host backend) give consumers the address itself, C-contiguous and writable (NumPy imports
    any unversioned DLPack capsule read-only; ``numpy.asarray(view)`` is writable).

    Its bytes are the expert's under the rule of the addresses ``ExpertCache.select`` returns:
    for work ordered after the select on its stream, until the next ``select``, ``load_compact``,
    ``prepare_batch``, ``release_all`` or ``bind_class`` call on the cache. ``owner`` (the
    cache's :class:`~pyexpcache._memory.MemoryPin` for views it makes) is kept alive by the view
    and by every array made from it, so the memory stays allocated as long as they live.

    ``cuda``: device memory (DLPack device ``(2, device_id)``) or host-backend memory (``(1,
    0)``). ``stream``: the CUDA stream on which the bytes are ready (an int handle, an object
    with ``__cuda_stream__`` or a cuda-python stream; None or 0: the legacy default stream).
    ``dtype``: a numpy dtype or name, or ``"bfloat16"`` (DLPack only: the array interfaces
    cannot express it). ``shape`` must cover exactly ``nbytes``.
    """

    __slots__ = ("ptr", "nbytes", "shape", "dtype", "cuda", "device_id", "stream", "owner", "strides", "__weakref__")

    def __init__(
        self,
        ptr: int,
        nbytes: int,
        *,
        cuda: bool,
        device_id: int = 0,
        stream: int = 0,
        dtype=None,
        shape=None,
        owner=None,
        strides=None,
    ):
        self.ptr = u64(ptr, "ptr")
        self.nbytes = u64(nbytes, "nbytes")
        if self.ptr == 0 and self.nbytes:
            raise ValueError(f"a view of {self.nbytes} bytes needs an address, got 0")
        self.cuda = bool(cuda)
        self.device_id = checked_int(device_id, "device_id", 0, I32_MAX)
        self.stream = stream_handle(stream)
        self.dtype = _dtype(dtype)
        self.shape = _shape(shape, self.nbytes, self.dtype)
        self.owner = owner
        # Strides in bytes (None: C-contiguous): a bank's views step from slot to slot.
        self.strides = None if strides is None else _strides(strides, self.shape, self.dtype)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_dlpack.KDLCUDA, self.device_id) if self.cuda else (_dlpack.KDLCPU, 0)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """A ``"dltensor"`` capsule of the view (unversioned whatever ``max_version`` asks:
        the array API standard lets consumers take it). On CUDA, ``stream`` is the consumer's:
        None or 1 the legacy default stream (so is 0, which the standard disallows), 2 the
        per-thread one, -1 "do not synchronize", another int a ``cudaStream_t`` (or a stream
        object); unless it is the view's own stream (or -1), it is made to wait for the view's
        stream, without blocking the host. On the host backend ``stream`` is ignored.
        ``copy=True`` and a ``dl_device`` other than the view's raise BufferError."""
        if copy:
            raise BufferError("a view is zero-copy; copy=True is not supported")
        device = self.__dlpack_device__()
        if dl_device is not None:
            try:
                wanted = (int(dl_device[0]), int(dl_device[1]))
            except (TypeError, ValueError, IndexError):
                raise BufferError(f"dl_device must be a (device_type, device_id) pair, got {dl_device!r}") from None
            if wanted != device:
                raise BufferError(
                    f"the view is on DLPack device {device}, not {wanted}; it cannot be moved without a copy"
                )
        if self.cuda:
            consumer = _consumer_stream(stream)
            producer = _legacy(self.stream)
            if consumer is not None and consumer != producer:
                _make_wait(producer, consumer, self.device_id)
        return _dlpack.capsule(self, self.ptr, self.shape, self.dtype, *device, strides=self.strides)

    def _interface(self, what: str, error=TypeError) -> dict:
        if isinstance(self.dtype, _dlpack.ExtraDType):
            raise error(
                f"{what} cannot express {self.dtype.name}: export a {self.dtype.name} view "
                "through DLPack (from_dlpack) instead"
            )
        # A zero-size array's address is 0 in both interfaces.
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self.ptr if self.nbytes else 0, False),
            "version": 3,
            "strides": self.strides,
        }

    @property
    def __cuda_array_interface__(self) -> dict:
        """CUDA Array Interface v3 (CUDA backend only: AttributeError otherwise, so that
        ``hasattr`` tells). ``stream`` is the view's, 1 for the legacy default stream (v3
        disallows 0); the consumer synchronizes with it."""
        if not self.cuda:
            raise AttributeError("a host-backend view has no __cuda_array_interface__ (use __array_interface__)")
        # AttributeError for bfloat16, so that consumers probing with hasattr() go on to DLPack.
        interface = self._interface("__cuda_array_interface__", AttributeError)
        interface["stream"] = _legacy(self.stream)
        return interface

    @property
    def __array_interface__(self) -> dict:
        """NumPy array interface v3 (host backend only: AttributeError otherwise)."""
        if self.cuda:
            raise AttributeError("a CUDA view has no __array_interface__ (use DLPack or __cuda_array_interface__)")
        return self._interface("__array_interface__")

    def __repr__(self) -> str:
        device = f"cuda:{self.device_id}" if self.cuda else "host"
        return (
            f"TensorView(ptr={self.ptr:#x}, nbytes={self.nbytes}, dtype={self.dtype}, shape={self.shape}, "
            f"device={device})"
        )


def part_formats(parts, dtype=None, shapes=None) -> list[tuple]:
    """``(dtype, shape)`` of each of ``parts`` (:class:`~pyexpcache.layer_spec.PartSpec`) as views
    show them: ``dtype`` for every part when given, else each part's own (raw bytes, uint8, for a
    part without one); ``shapes`` one per part (a sequence in part order, or a mapping by name),
    else each part's own shape where it is shown in its own dtype, else 1-D."""
    if shapes is None:
        given = [None] * len(parts)
    elif isinstance(shapes, Mapping):
        unknown = sorted(set(shapes) - {p.name for p in parts})
        if unknown:
            raise KeyError(
                f"shapes names {', '.join(map(repr, unknown))}: the parts are {', '.join(p.name for p in parts)}"
            )
        given = [shapes.get(p.name) for p in parts]
    else:
        given = list(shapes)
        if len(given) != len(parts):
            raise ValueError(f"shapes: one shape per part ({', '.join(p.name for p in parts)}), got {len(given)}")
    out = []
    for part, shape in zip(parts, given):
        own = dtype is None and shapes is None
        out.append((part.dtype if dtype is None else dtype, part.shape if own else shape))
    return out


class NamedParts:
    """What a thing made of an expert's parts (:class:`ExpertView`, an
    :class:`~pyexpcache.ExpertBank`) shares: ``names`` and ``parts`` in step, a part looked up by
    name or index, and ``gate``, ``up`` and ``down`` where those are the three parts."""

    __slots__ = ()
    _kind = "expert"  # in messages: "this expert's parts are ..."
    _holder = "view"  # and "use view.part(...)"

    def _index(self, name) -> int:
        if not isinstance(name, str):
            return name
        try:
            return self.names.index(name)
        except ValueError:
            raise KeyError(f"no part {name!r}: this {self._kind}'s parts are {', '.join(self.names)}") from None

    def _named(self, i: int) -> TensorView:
        if self.names != PARTS:
            raise AttributeError(
                f"{PARTS[i]}: this {self._kind}'s parts are {', '.join(self.names)}, not gate, up and down; "
                f"use {self._holder}.part({self.names[0]!r})"
            )
        return self.parts[i]

    @property
    def gate(self) -> TensorView:
        return self._named(0)

    @property
    def up(self) -> TensorView:
        return self._named(1)

    @property
    def down(self) -> TensorView:
        return self._named(2)


class ExpertView(NamedParts):
    """The parts of one cached expert, each a :class:`TensorView` (valid under the same rule as
    each of them), by name: ``view.part("gate_up_proj")`` or ``view["gate_up_proj"]`` (an index
    works too), and ``view.gate``, ``view.up``, ``view.down`` for an expert of those three parts.
    Iterates over the parts' views in order; :attr:`names` are their names."""

    __slots__ = ("parts", "names")

    def __init__(self, *parts: TensorView, names=None):
        self.parts = tuple(parts)
        self.names = PARTS if names is None else tuple(names)
        if len(self.names) != len(self.parts):
            raise ValueError(f"{len(self.parts)} parts and {len(self.names)} names ({', '.join(self.names)})")

    def part(self, name) -> TensorView:
        """The view of part ``name`` (or of the part at an index); KeyError naming the parts."""
        return self.parts[self._index(name)]

    __getitem__ = part

    def keys(self) -> tuple[str, ...]:
        return self.names

    def items(self):
        return zip(self.names, self.parts)

    def __iter__(self):
        return iter(self.parts)

    def __len__(self) -> int:
        return len(self.parts)

    def __repr__(self) -> str:
        return f"ExpertView({', '.join(f'{n}={v!r}' for n, v in zip(self.names, self.parts))})"


class ViewCache:
    """The views :meth:`~pyexpcache.ExpertCache.select_views` hands out, one per slot address and
    format, made on first use: a slot keeps its address for its class's life, so an all-hit
    select only looks its views up (and sets their stream when it changed). A slot reused by
    another class, or asked for in another format, gets new views."""

    _LIMIT = 1 << 16  # addresses kept before starting afresh (slots freed and allocated elsewhere)

    def __init__(self, layout):
        self._layout = layout
        self._cuda = False
        self._device = 0
        self._pin = None
        self._by_first: dict[int, tuple] = {}

    def configure(self, cuda: bool, device_id: int, pin) -> None:
        """``pin(address)``: the owner every view of a slot at ``address`` keeps (a MemoryPin)."""
        self._cuda, self._device, self._pin = bool(cuda), int(device_id), pin
        self._by_first.clear()

    def clear(self) -> None:
        """Forget every view (those still referenced elsewhere keep their memory)."""
        self._by_first = {}

    def get(self, layer: int, rows: list, stream: int, dtype=None, shapes=None) -> list[ExpertView]:
        """Views of ``rows`` (each a list of ``layer``'s part addresses) ready on ``stream``."""
        parts = self._layout[layer].parts
        fmt = (parts, dtype, None if shapes is None else _frozen(shapes))
        table = self._by_first
        out = []
        for row in rows:
            entry = table.get(row[0])
            if entry is None or entry[1] != row or entry[2] != fmt:
                entry = (self._make(row, parts, stream, dtype, shapes), row, fmt)
                if len(table) >= self._LIMIT:
                    table.clear()
                table[row[0]] = entry
            view = entry[0]
            if view.parts[0].stream != stream:
                for v in view.parts:
                    v.stream = stream
            out.append(view)
        return out

    def _make(self, row, parts, stream, dtype, shapes) -> ExpertView:
        owner = self._pin(row[0]) if self._pin is not None else None  # a slot's parts lie in one allocation
        views = [
            TensorView(
                ptr,
                part.nbytes,
                cuda=self._cuda,
                device_id=self._device,
                stream=stream,
                dtype=part_dtype,
                shape=shape,
                owner=owner,
            )
            for ptr, part, (part_dtype, shape) in zip(row, parts, part_formats(parts, dtype, shapes))
        ]
        return ExpertView(*views, names=tuple(p.name for p in parts))


def _frozen(shapes):
    """``shapes`` (a sequence or mapping of shapes) as a hashable key."""
    if isinstance(shapes, Mapping):
        return tuple(sorted((k, _frozen_shape(v)) for k, v in shapes.items()))
    return tuple(_frozen_shape(v) for v in shapes)


def _frozen_shape(shape):
    return shape if shape is None or isinstance(shape, int) else tuple(shape)
