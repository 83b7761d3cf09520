"""A minimal DLPack producer: :func:`capsule` wraps a raw address as a PyCapsule named
``"dltensor"`` holding an unversioned ``DLManagedTensor`` (the DLPack C ABI,
https://dmlc.github.io/dlpack/latest/c_api.html), C-contiguous with explicit strides, that any
DLPack consumer (``numpy.from_dlpack``, ``torch.from_dlpack``, ``cupy.from_dlpack``, ...)
imports without a copy, on the host or on a CUDA device.

Unversioned is enough. The Python array API standard's ``__dlpack__`` (v2023.12 on) says a
producer may answer a consumer's ``max_version`` with a capsule "of a different version", so
"the consumer must verify the version even when max_version is passed": consumers that ask
``max_version=(1, 0)`` (NumPy, PyTorch) accept the unversioned ``"dltensor"`` capsule of a
producer that does not implement the versioned ABI
(https://data-apis.org/array-api/latest/API_specification/generated/array_api.array.__dlpack__.html).
What the versioned struct would add (a read-only flag, a copied flag) says nothing here: the
memory is writable and never copied. (NumPy imports an unversioned capsule read-only anyway.)

Why numpy builds the struct. The capsule destructor and the tensor's deleter run whenever the
consumer lets go, which is often while an exception propagates (an imported temporary freed as
the expression using it fails); DLPack's Python spec has the destructor save and restore that
exception. A ctypes callback cannot: CPython turns a Python function that returns while an
exception is set into SystemError, so a ctypes deleter would replace the user's error with
"error return without exception set". So no Python runs in either. ``numpy.ndarray.__dlpack__``
exports a numpy array made over the address (never read: numpy touches an array's bytes only
when asked to); numpy's C deleter and destructor do the lifetime work, saving the in-flight
exception (and, in recent numpy, taking the GIL, so a consumer may call the deleter from any
thread). This module only rewrites the fields numpy cannot know, before anyone sees the
capsule: the device (``kDLCUDA`` for device memory) and the type code (bfloat16, which numpy
lacks, travels as uint16 until then). Neither numpy's deleter nor its destructor reads them.

Lifetime. The numpy array is the struct's ``manager_ctx``; its base holds ``owner``, so
``owner`` lives until the consumer calls the deleter (when it drops the imported array) or the
capsule dies unconsumed (still named ``"dltensor"``). ``owner`` only keeps a Python object
alive: whether the bytes at the address stay valid is the owner's business.
"""

from __future__ import annotations

import ctypes

import numpy as np

KDLCPU = 1  # DLDeviceType
KDLCUDA = 2
_KDLINT, _KDLUINT, _KDLFLOAT, _KDLBFLOAT = 0, 1, 2, 4  # DLDataTypeCode
_KDLFLOAT8_E4M3FN, _KDLFLOAT8_E5M2, _KDLFLOAT8_E8M0FNU = 10, 12, 14  # DLPack 1.1's 8-bit floats
_CODES = {"i": _KDLINT, "u": _KDLUINT, "f": _KDLFLOAT}  # numpy dtype.kind -> code


class ExtraDType:
    """A dtype numpy lacks but DLPack carries (bfloat16, the 8-bit floats of quantized weights
    and scales): what a view needs of a dtype."""

    __slots__ = ("name", "itemsize", "code")

    def __init__(self, name: str, itemsize: int, code: int):
        self.name, self.itemsize, self.code = name, itemsize, code

    def __repr__(self) -> str:
        return self.name


BFLOAT16 = ExtraDType("bfloat16", 2, _KDLBFLOAT)
#: Every ExtraDType by name (torch's names: ``torch.float8_e4m3fn`` is ``"float8_e4m3fn"``).
EXTRA_DTYPES = {
    d.name: d
    for d in (
        BFLOAT16,
        ExtraDType("float8_e4m3fn", 1, _KDLFLOAT8_E4M3FN),
        ExtraDType("float8_e5m2", 1, _KDLFLOAT8_E5M2),
        ExtraDType("float8_e8m0fnu", 1, _KDLFLOAT8_E8M0FNU),
    )
}


def data_type(dtype) -> tuple[int, int]:
    """``(code, bits)`` of the DLDataType for a numpy dtype or :data:`BFLOAT16`; TypeError for
    a dtype DLPack cannot carry here: not an int, uint or IEEE float of 1 to 8 bytes (no long
    double), or not in native byte order (DLPack has none)."""
    if isinstance(dtype, ExtraDType):
        return dtype.code, dtype.itemsize * 8
    dtype = np.dtype(dtype)
    code = _CODES.get(dtype.kind)
    if code is None or dtype.itemsize not in ((2, 4, 8) if code == _KDLFLOAT else (1, 2, 4, 8)):
        raise TypeError(f"dtype {dtype} cannot be exported: only int, uint, float16/32/64 and bfloat16 are")
    if not dtype.isnative:
        raise TypeError(f"dtype {dtype.str} is not in native byte order, which DLPack cannot express")
    return code, dtype.itemsize * 8


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    """DLTensor, the first member of DLManagedTensor (so at the managed tensor's address)."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _Device),
        ("ndim", ctypes.c_int32),
        ("dtype", _DataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_NAME = b"dltensor"
# pythonapi[name], not pythonapi.name: a private function object, so setting its argtypes does
# not change them for every other user of ctypes.pythonapi.
_capsule_pointer = ctypes.pythonapi["PyCapsule_GetPointer"]
_capsule_pointer.restype, _capsule_pointer.argtypes = ctypes.c_void_p, (ctypes.py_object, ctypes.c_char_p)


class _Base:
    """The exported numpy array's base: the interface numpy reads the array from, and the owner."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, interface: dict, owner):
        self.__array_interface__, self.owner = interface, owner


def capsule(owner, ptr: int, shape: tuple[int, ...], dtype, device_type: int, device_id: int, strides=None):
    """A ``"dltensor"`` PyCapsule for the array of ``shape`` and ``dtype`` (a numpy dtype or
    :data:`BFLOAT16`) at address ``ptr`` on DLPack device ``(device_type, device_id)``,
    C-contiguous or with ``strides`` in bytes (multiples of the item size).
    ``owner`` stays referenced until the consumer's deleter runs (or the unconsumed capsule
    dies). The caller validates the address, shape and device; this lays them out."""
    code, bits = data_type(dtype)
    # An unsigned integer of the same size: numpy exports it whatever the type (bfloat16 too).
    typestr = np.dtype(f"u{bits // 8}").str
    array = np.asarray(
        _Base(
            {
                "shape": tuple(shape),
                "typestr": typestr,
                "data": (ptr, False),
                "version": 3,
                "strides": None if strides is None else tuple(strides),
            },
            owner,
        )
    )
    result = array.__dlpack__()
    tensor = _Tensor.from_address(_capsule_pointer(result, _NAME))
    tensor.data = ptr or None  # numpy's stand-in buffer for an empty array is not on the device
    tensor.device = _Device(device_type, device_id)
    tensor.dtype = _DataType(code, bits, 1)
    return result
