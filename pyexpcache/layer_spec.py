"""One MoE layer of a layout: :class:`LayerSpec`, its experts' count and parts, each a
:class:`PartSpec` (a name, a byte size, optionally a dtype and shape), checked against the
library's limits (exported by :mod:`pyexpcache.layout` and the package).

An expert has 1 to 8 parts (``EXPCACHE_MAX_PARTS``): gate, up and down for a plain FFN (the
three-part shorthand ``LayerSpec(num_experts, gate_bytes, up_bytes, down_bytes)``), or more for a
quantized one: FP8 weights and their block scales, MXFP4 blocks, scales and biases
(:meth:`LayerSpec.of_parts`). The size class of a layer is every part's size, in order."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from ._errors import ArgumentRangeError
from ._ints import checked_int
from ._lib import MAX_EXPERTS_LIMIT, MAX_PART_BYTES_LIMIT, MAX_PARTS

#: The parts of the three-part shorthand, in order.
PARTS = ("gate", "up", "down")
_NOT_GIVEN = object()  # a size left out (None given is a size of the wrong type)


def _within_limit(value, name: str, limit: int) -> int:
    """``value`` as an int in 1..``limit`` (a limit of expcache.h): TypeError for anything but an
    integer (a bool, a float such as 768.0 and a string included), ArgumentRangeError (a ValueError)
    outside."""
    try:
        return checked_int(value, name, 1, limit)
    except ArgumentRangeError:
        raise ArgumentRangeError(f"{name} must be 1..{limit} (the library's limit), got {value}") from None


def layer_spans(indices: list[int]) -> str:
    """Sorted indices as runs: [1, 3, 4, 5] -> "1, 3-5"."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def dtype_name(value, what: Optional[str] = None) -> str:
    """A dtype's canonical name: a numpy dtype or name, ``"bfloat16"``, ``"float8_e4m3fn"``,
    ``"float8_e5m2"``, ``"float8_e8m0fnu"`` (or torch's dtype of that name). TypeError naming
    ``what`` for one the views cannot carry."""
    from .views import _dtype  # views import nothing of the layouts; imported late to stay light

    try:
        dtype = _dtype(value)
    except TypeError as exc:
        if what is None:
            raise
        raise TypeError(f"{what}: {exc}") from None
    return dtype.name


def dtype_itemsize(name: str) -> int:
    from .views import _dtype

    return _dtype(name).itemsize


@dataclass(frozen=True)
class PartSpec:
    """One part of an expert: ``name`` (unique in its layer), ``nbytes`` (1..2^40), and for
    formatted views a ``dtype`` (kept as its name: ``"float8_e4m3fn"``, ``"float32"``, ...) and
    a ``shape`` (one expert's; needs the dtype, and ``prod(shape) * itemsize`` must be
    ``nbytes``). TypeError or ValueError naming the field otherwise."""

    name: str
    nbytes: int
    dtype: Optional[str] = None
    shape: Optional[tuple[int, ...]] = None

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise TypeError(f"a part's name must be a string, got {type(self.name).__name__} {self.name!r}")
        if not self.name or self.name != self.name.strip():
            raise ValueError(f"a part's name must be non-empty, without surrounding spaces, got {self.name!r}")
        what = f"part {self.name!r}"
        object.__setattr__(self, "nbytes", _within_limit(self.nbytes, f"{what}: nbytes", MAX_PART_BYTES_LIMIT))
        if self.dtype is not None:
            object.__setattr__(self, "dtype", dtype_name(self.dtype, f"{what}: dtype"))
        if self.shape is None:
            return
        if self.dtype is None:
            raise ValueError(f"{what}: a shape needs a dtype (the shape {self.shape!r} of what items?)")
        dims = (self.shape,) if isinstance(self.shape, int) else self.shape
        if isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence):
            raise TypeError(f"{what}: shape must be a sequence of whole numbers, got {self.shape!r}")
        shape = tuple(_within_limit(d, f"{what}: shape[{i}]", MAX_PART_BYTES_LIMIT) for i, d in enumerate(dims))
        size = math.prod(shape) * dtype_itemsize(self.dtype)
        if size != self.nbytes:
            raise ValueError(f"{what}: shape {list(shape)} of {self.dtype} is {size} bytes, not its {self.nbytes}")
        object.__setattr__(self, "shape", shape)

    @classmethod
    def of(cls, value, index: int = 0) -> PartSpec:
        """A PartSpec from itself, ``(name, nbytes)``, ``(name, nbytes, dtype, shape)`` or a
        mapping with those keys."""
        if isinstance(value, PartSpec):
            return value
        if isinstance(value, Mapping):
            return cls(**value)
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) not in (2, 3, 4):
            raise TypeError(
                f"parts[{index}] must be a PartSpec, (name, nbytes) or (name, nbytes, dtype, shape), got {value!r}"
            )
        return cls(*value)


def _check_parts(parts) -> tuple[PartSpec, ...]:
    if isinstance(parts, (str, bytes, Mapping)) or not isinstance(parts, Sequence):
        raise TypeError(f"parts must be a sequence of (name, nbytes) or PartSpec, got {type(parts).__name__}")
    if not 1 <= len(parts) <= MAX_PARTS:
        raise ArgumentRangeError(f"an expert has 1..{MAX_PARTS} parts (the library's limit), got {len(parts)}")
    out = tuple(PartSpec.of(p, i) for i, p in enumerate(parts))
    names = [p.name for p in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"part names must be unique in a layer: {', '.join(map(repr, twice))} given twice")
    return out


@dataclass(frozen=True, init=False, repr=False)
class LayerSpec:
    """One MoE layer: ``num_experts`` experts (1..65536) of identical parts (:class:`PartSpec`,
    1..8 of them, each 1..2^40 bytes), checked when the spec is made: a non-integer raises
    TypeError, a value outside ValueError, naming the field.

    ``LayerSpec(num_experts, gate_bytes, up_bytes, down_bytes)`` is the three-part shorthand, equal
    to ``LayerSpec.of_parts(num_experts, [("gate", g), ("up", u), ("down", d)])``."""

    num_experts: int
    parts: tuple[PartSpec, ...]

    def __init__(self, num_experts, gate_bytes=_NOT_GIVEN, up_bytes=_NOT_GIVEN, down_bytes=_NOT_GIVEN, *, parts=None):
        sizes = (gate_bytes, up_bytes, down_bytes)
        if parts is None:
            missing = [f"{p}_bytes" for p, b in zip(PARTS, sizes) if b is _NOT_GIVEN]
            if missing:
                raise TypeError(
                    f"LayerSpec needs gate_bytes, up_bytes and down_bytes (missing {', '.join(missing)}), "
                    "or parts (LayerSpec.of_parts)"
                )
            checked = [_within_limit(b, f"LayerSpec.{p}_bytes", MAX_PART_BYTES_LIMIT) for p, b in zip(PARTS, sizes)]
            parts = tuple(PartSpec(p, b) for p, b in zip(PARTS, checked))
        elif any(b is not _NOT_GIVEN for b in sizes):
            raise TypeError("LayerSpec takes gate/up/down sizes or parts, not both")
        else:
            parts = _check_parts(parts)
        object.__setattr__(self, "num_experts", _within_limit(num_experts, "LayerSpec.num_experts", MAX_EXPERTS_LIMIT))
        object.__setattr__(self, "parts", parts)

    @classmethod
    def of_parts(cls, num_experts: int, parts) -> LayerSpec:
        """A layer whose experts have ``parts``: a sequence of 1..8 ``(name, nbytes)``,
        ``(name, nbytes, dtype, shape)`` or :class:`PartSpec`, names unique, in the order the
        bytes lie in a slot."""
        return cls(num_experts, parts=parts)

    def __repr__(self) -> str:
        if self.part_names == PARTS and all(p.dtype is None for p in self.parts):
            sizes = ", ".join(f"{p}_bytes={b}" for p, b in zip(PARTS, self.class_key))
            return f"LayerSpec(num_experts={self.num_experts}, {sizes})"
        return f"LayerSpec.of_parts({self.num_experts}, {list(self.parts)!r})"

    # -- the parts -------------------------------------------------------
    @property
    def num_parts(self) -> int:
        return len(self.parts)

    @property
    def part_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.parts)

    def part(self, name: str) -> PartSpec:
        """The part called ``name``; KeyError naming the parts there are."""
        for p in self.parts:
            if p.name == name:
                return p
        raise KeyError(f"no part {name!r}: this layer's parts are {', '.join(self.part_names)}")

    def part_index(self, name) -> int:
        """The position of part ``name`` (or an index, checked) in :attr:`parts`."""
        if isinstance(name, str):
            return self.part_names.index(self.part(name).name)
        return checked_int(name, "part", 0, self.num_parts - 1)

    def _shorthand(self, i: int) -> int:
        if self.part_names != PARTS:
            raise AttributeError(
                f"{PARTS[i]}_bytes: this layer's experts have the parts {', '.join(self.part_names)}, not "
                f"gate, up and down; use part({self.part_names[0]!r}).nbytes or class_key"
            )
        return self.parts[i].nbytes

    @property
    def gate_bytes(self) -> int:
        return self._shorthand(0)

    @property
    def up_bytes(self) -> int:
        return self._shorthand(1)

    @property
    def down_bytes(self) -> int:
        return self._shorthand(2)

    @property
    def expert_bytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def class_key(self) -> tuple[int, ...]:
        """The size class: every part's byte size, in order."""
        return tuple(p.nbytes for p in self.parts)

    # -- derived specs -----------------------------------------------------
    def with_experts(self, num_experts: int) -> LayerSpec:
        return LayerSpec(num_experts, parts=self.parts)

    def with_sizes(self, sizes) -> LayerSpec:
        """The same parts at byte sizes ``sizes`` (one per part): names kept, dtypes and shapes
        dropped (they no longer describe the bytes)."""
        sizes = tuple(sizes)
        if len(sizes) != self.num_parts:
            raise ValueError(f"{len(sizes)} sizes for {self.num_parts} parts ({', '.join(self.part_names)})")
        return LayerSpec(self.num_experts, parts=[PartSpec(p.name, b) for p, b in zip(self.parts, sizes)])
