"""Serving from the device: a class's slot bank as zero-copy arrays, and the id arrays a
device-side select reads and writes (:meth:`pyexpcache.ExpertCache.select_device`).

A cache made with ``lookup="device"`` keeps each size class's slots in one bank, one device
allocation of ``cap`` slots at a fixed stride that never moves while the cache lives. An
:class:`ExpertBank` shows it as one strided view per part (``bank.part(name)``; ``gate``, ``up``
and ``down`` for three parts), of shape ``[cap, ...]``: ``bank.gate[slots]`` in torch (or a fused
MoE kernel given slot ids) reads the experts in place, and a CUDA graph captured with them stays
valid for the cache's life.

Id arrays are taken from whatever holds them, without a copy: the CUDA Array Interface
(torch, cupy, numba), DLPack, or the NumPy array interface on the host backend.
"""

from __future__ import annotations

import ctypes
import math
import sys
from dataclasses import dataclass

import numpy as np

from . import _dlpack
from .views import PARTS, NamedParts, TensorView

_INT_BITS = {"<i4": 32, "<i8": 64, "|i4": 32, "|i8": 64}
_UINT_BITS = {"<u4": 32, "|u4": 32}  # also taken where ``unsigned`` (select_device's counts)
_CAPSULE_POINTER = ctypes.pythonapi["PyCapsule_GetPointer"]
_CAPSULE_POINTER.restype, _CAPSULE_POINTER.argtypes = ctypes.c_void_p, (ctypes.py_object, ctypes.c_char_p)


@dataclass(frozen=True)
class IdArray:
    """Where an array of ids is and what it holds: ``ptr`` (a device address, or a host address
    on the host backend), ``shape`` (1-D [k] or 2-D [n, k]), ``bits`` (32 or 64), ``cuda``."""

    ptr: int
    shape: tuple[int, ...]
    bits: int
    cuda: bool
    keep: object = None  # what keeps ``ptr`` valid during the call (a DLPack capsule)
    readonly: bool = False  # the array interface says its memory must not be written

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def host_values(self) -> np.ndarray:
        """The ids as a numpy array over their host memory (not for device memory)."""
        if self.cuda:
            raise ValueError("the ids are in device memory")
        kind = ctypes.c_int32 if self.bits == 32 else ctypes.c_int64
        return np.ctypeslib.as_array((kind * self.size).from_address(self.ptr))


def _contiguous(shape, strides, itemsize) -> bool:
    if strides is None:
        return True
    expected = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim != 1 and stride != expected:
            return False
        expected *= dim
    return True


def id_array(array, what: str, *, writable: bool = False, unsigned: bool = False) -> IdArray:
    """``array`` seen through the CUDA Array Interface, the NumPy array interface or DLPack:
    a C-contiguous 1-D or 2-D array of int32 or int64 (or uint32 when ``unsigned``), writable
    when ``writable`` (an array interface that marks its memory read-only is refused).
    TypeError or ValueError saying what is wrong otherwise."""
    if type(array).__module__ == "torch" and isinstance(array, sys.modules["torch"].Tensor):
        ids = _torch_ids(array, what, unsigned)  # the common case, without building an interface dict
    else:
        ids = _interface_ids(array, what, unsigned)
    if writable and ids.readonly:
        raise ValueError(
            f"{what} is read-only (its array interface says so): the select writes the slot ids into "
            "it; pass a writable array"
        )
    return ids


def _kinds(unsigned: bool) -> str:
    return "int32, int64 or uint32 integers" if unsigned else "int32 or int64 ids"


def _interface_ids(array, what: str, unsigned: bool) -> IdArray:
    interface = getattr(array, "__cuda_array_interface__", None)
    cuda = interface is not None
    if interface is None:
        interface = getattr(array, "__array_interface__", None)
    if interface is not None:
        typestr = interface["typestr"]
        shape = tuple(interface["shape"])
        ptr = interface["data"][0] if interface.get("data") else 0
        bits = _INT_BITS.get(typestr) or (_UINT_BITS.get(typestr) if unsigned else None)
        strides = interface.get("strides")
        keep = None
        readonly = bool(interface["data"][1]) if interface.get("data") else False
    elif hasattr(array, "__dlpack__"):
        keep = array.__dlpack__()
        tensor = _dlpack._Tensor.from_address(_CAPSULE_POINTER(keep, b"dltensor"))
        cuda = tensor.device.device_type == _dlpack.KDLCUDA
        shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
        ptr = (tensor.data or 0) + tensor.byte_offset
        code, nbits = tensor.dtype.code, tensor.dtype.bits
        # DLPack's type codes: 0 signed, 1 unsigned integers
        integer = (code == 0 and nbits in (32, 64)) or (unsigned and code == 1 and nbits == 32)
        bits = nbits if integer and tensor.dtype.lanes == 1 else None
        typestr = f"DLPack type code {code}, {nbits} bits"
        itemsize = max(nbits // 8, 1)
        strides = None if not tensor.strides else tuple(tensor.strides[i] * itemsize for i in range(tensor.ndim))
        readonly = False  # an unversioned DLPack tensor carries no read-only flag
    else:
        raise TypeError(
            f"{what} must be an array (torch, cupy, numpy: DLPack or an array interface), got {type(array).__name__}"
        )
    if bits is None:
        raise TypeError(f"{what} must hold {_kinds(unsigned)}, got {typestr}")
    if len(shape) not in (1, 2):
        raise ValueError(f"{what} must be 1-D [k] or 2-D [n, k], got shape {shape}")
    if not _contiguous(shape, strides, bits // 8):
        raise ValueError(f"{what} must be C-contiguous, got strides {strides} for shape {shape}")
    return IdArray(int(ptr), shape, bits, cuda, keep, readonly)


def _torch_ids(tensor, what: str, unsigned: bool) -> IdArray:
    torch = sys.modules["torch"]
    bits = {torch.int32: 32, torch.int64: 64}.get(tensor.dtype)
    if bits is None and unsigned and tensor.dtype == getattr(torch, "uint32", None):
        bits = 32
    if bits is None:
        raise TypeError(f"{what} must hold {_kinds(unsigned)}, got torch.{str(tensor.dtype).split('.')[-1]}")
    if tensor.dim() not in (1, 2):
        raise ValueError(f"{what} must be 1-D [k] or 2-D [n, k], got shape {tuple(tensor.shape)}")
    if not tensor.is_contiguous():
        raise ValueError(
            f"{what} must be C-contiguous, got strides {tuple(tensor.stride())} for shape {tuple(tensor.shape)}"
        )
    if tensor.device.type not in ("cuda", "cpu"):
        raise ValueError(f"{what} must be in CUDA or host memory, got a tensor on {tensor.device}")
    return IdArray(tensor.data_ptr(), tuple(tensor.shape), bits, tensor.device.type == "cuda", tensor)


def empty_slots(like, shape: tuple[int, ...]):
    """An int32 array of ``shape`` where ``like`` lives: a torch tensor on its device, a cupy
    array, or a numpy array. TypeError for anything else (pass ``out=``)."""
    module = type(like).__module__.split(".")[0]
    if module == "torch":
        torch = sys.modules["torch"]
        return torch.empty(shape, dtype=torch.int32, device=like.device)
    if module == "cupy":
        cupy = sys.modules["cupy"]
        with cupy.cuda.Device(like.device.id):
            return cupy.empty(shape, dtype=cupy.int32)
    if isinstance(like, np.ndarray):
        return np.empty(shape, dtype=np.int32)
    raise TypeError(
        f"cannot make the slot array beside a {type(like).__name__}: pass out= (an int32 array of "
        f"shape {shape} in the ids' memory)"
    )


def default_stream(like) -> int | None:
    """The stream a torch tensor's work goes to by default (torch's current stream on its device),
    so that an eager or captured torch step needs no stream argument; None otherwise."""
    if type(like).__module__.split(".")[0] == "torch" and like.is_cuda:
        torch = sys.modules["torch"]
        return torch.cuda.current_stream(like.device).cuda_stream
    return None


def slot_view(
    ptr: int, nbytes: int, cap: int, slot_stride: int, *, cuda: bool, device_id: int, dtype, shape, owner
) -> TensorView:
    """``nbytes`` at ``ptr`` in each of ``cap`` slots ``slot_stride`` bytes apart (a part's stride in
    its bank), as one view ``[cap, *shape]`` (each slot's bytes C-contiguous; the whole view too
    when ``slot_stride == nbytes``, as a parts bank's part of 256-multiple bytes is)."""
    one = TensorView(ptr, nbytes, cuda=cuda, device_id=device_id, dtype=dtype, shape=shape)
    inner, step = [], one.dtype.itemsize  # each dimension's stride in a slot (none for one item)
    for dim in reversed(one.shape):
        inner.insert(0, step)
        step *= dim
    return TensorView(
        ptr,
        cap * nbytes,
        cuda=cuda,
        device_id=device_id,
        dtype=dtype,
        shape=(cap, *one.shape),
        strides=(slot_stride, *inner),
        owner=owner,
    )


class ExpertBank(NamedParts):
    """One size class's slot bank (:meth:`pyexpcache.ExpertCache.bank`).

    Attributes:
        class_index: the class.
        rows: rows the slot ids of the class's layers address: every slot id
            :meth:`~pyexpcache.ExpertCache.select_slots`,
            :meth:`~pyexpcache.ExpertCache.select_device` or a batch by slot id gives is in
            0..rows-1.
        cap: slots mapped when the bank was taken (a device-lookup bank: all of them; a
            host-lookup bank grows as its class does, up to the class's cap). Past the slots,
            1024 staging rows hold the experts a decode select stages when they get no slot, then
            ``MAX_BATCH_ROWS`` batch rows those batches by slot id stage (:meth:`prepare_batch`
            with ``slots=True``); the last of them is row ``rows - 1``.
        slot_stride: bytes from one slot to the next in a ``"slots"`` bank; 0 in a ``"parts"``
            bank (no slot is one range: see ``part_strides``).
        part_strides: bytes from one row of each part to the next (part p of slot s at the part's
            view's address + ``s * part_strides[p]``): every entry is ``slot_stride`` in a
            ``"slots"`` bank; the part's bytes rounded up to 256 in a ``"parts"`` bank.
        arrangement: ``"slots"`` or ``"parts"`` (the cache's ``bank_arrangement``). In a
            ``"parts"`` bank each part is its own region: a part whose bytes are a multiple of 256
            is one C-contiguous ``[rows, ...]`` array (what kernels asserting a contiguous
            ``[E, N, K]`` weight take); gate and up are never adjacent (:meth:`gate_up` needs
            ``"slots"``).
        names: the parts' names, in the order they lie in a slot.
        parts: one :class:`~pyexpcache.views.TensorView` per part, of shape ``[rows, ...part
            shape]`` (strided by its ``part_strides`` entry), zero-copy: DLPack always, the CUDA Array
            Interface on the CUDA backend, the NumPy array interface on the host backend (not for
            the dtypes numpy lacks: bfloat16, the 8-bit floats). :meth:`part` gives one by name,
            in any format; ``gate``, ``up`` and ``down`` are the parts of a three-part expert.
            Read the rows a select gave (``index_select``, a fused MoE kernel): a row no select
            gave may have no memory behind it.

    A slot's bytes are its expert's for work ordered after the select that returned the slot
    on its stream, until the next call that serves or releases on the cache. The bank's address
    never changes while its class lives, and the memory stays allocated while the bank, or an
    array made from it, lives.
    """

    __slots__ = ("class_index", "rows", "cap", "slot_stride", "part_strides", "arrangement", "names", "parts", "_specs")
    _kind = _holder = "bank"

    def __init__(
        self,
        class_index: int,
        rows: int,
        cap: int,
        slot_stride: int,
        parts,
        names=None,
        specs=None,
        part_strides=None,
        arrangement: str = "slots",
    ):
        self.class_index, self.rows, self.cap, self.slot_stride = class_index, rows, cap, slot_stride
        self.parts = tuple(parts)
        self.part_strides = tuple(part_strides) if part_strides is not None else (slot_stride,) * len(self.parts)
        self.arrangement = arrangement
        self.names = PARTS if names is None else tuple(names)
        self._specs = specs  # the layer's PartSpec per part: each part's own dtype and shape

    def part(self, name, dtype=None, shape=None) -> TensorView:
        """Part ``name`` (or the part at an index) across the slots, zero-copy: ``[rows, *shape]``
        of ``dtype``. Without ``dtype`` and ``shape`` the view :meth:`ExpertCache.bank
        <pyexpcache.ExpertCache.bank>` made (each part in its own dtype and shape when the layout
        gives them, else raw bytes); with them, those bytes in that format (``shape`` one slot's:
        it must cover the part's bytes exactly, 1-D when left out). KeyError naming the parts."""
        index = self._index(name)
        view = self.parts[index]
        if dtype is None and shape is None:
            return view
        if dtype is None:
            own = self._specs[index].dtype if self._specs is not None else None
            dtype = own if own is not None else view.dtype
        return self._over(view, self._slot_bytes(view), dtype, shape, self.part_strides[index])

    def _slot_bytes(self, view: TensorView) -> int:
        """One slot's bytes of a part's view."""
        return view.nbytes // self.rows if self.rows else 0

    def _over(self, view: TensorView, nbytes: int, dtype, shape, stride: int) -> TensorView:
        """``nbytes`` of each row from where ``view`` starts, rows ``stride`` bytes apart, as
        ``[rows, *shape]`` of ``dtype``."""
        return slot_view(
            view.ptr,
            nbytes,
            self.rows,
            stride,
            cuda=view.cuda,
            device_id=view.device_id,
            dtype=dtype,
            shape=shape,
            owner=view.owner,
        )

    def gate_up(self, shape=None, dtype=None) -> TensorView:
        """The gate and up parts as one view ``[cap, *shape]``: each slot's two parts side by side,
        the fused gate-and-up weight most engines keep per expert (transformers' ``gate_up_proj``,
        vLLM's ``w13``). ``shape`` covers both parts' bytes (default: the gate's shape with its
        first dimension doubled when the two parts have one shape, else the bytes 1-D); ``dtype``
        defaults to the parts'. Up must start where gate ends, which it does when the gate's byte
        size is a multiple of the slot alignment (256 B); ValueError otherwise, and always in a
        ``"parts"`` bank, where gate and up are separate regions (a fused gate-and-up view needs
        ``bank_arrangement="slots"``; in a ``"parts"`` bank use :attr:`gate` and :attr:`up`)."""
        if self.arrangement != "slots":
            raise ValueError(
                f"gate and up are separate regions in a {self.arrangement!r} bank: a fused gate_up view needs a "
                "cache made with bank_arrangement='slots' (or use bank.gate and bank.up apart)"
            )
        gate, up = self.gate, self.up
        gate_bytes, up_bytes = self._slot_bytes(gate), self._slot_bytes(up)
        if up.ptr != gate.ptr + gate_bytes:
            raise ValueError(
                f"gate ({gate_bytes} B) and up are {up.ptr - gate.ptr - gate_bytes} B apart in a slot: "
                "they are one view only when the gate's bytes are a multiple of 256 (the slot alignment)"
            )
        dtype = gate.dtype if dtype is None else dtype
        if shape is None and dtype == gate.dtype and gate.shape[1:] == up.shape[1:] and len(gate.shape) > 1:
            shape = (2 * gate.shape[1], *gate.shape[2:])
        return self._over(gate, gate_bytes + up_bytes, dtype, shape, self.slot_stride)

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}={v.shape} {v.dtype}" for n, v in zip(self.names, self.parts))
        return (
            f"ExpertBank(class {self.class_index}, {self.arrangement}, rows={self.rows}, cap={self.cap}, "
            f"slot_stride={self.slot_stride}, part_strides={self.part_strides}, {parts})"
        )
