"""A safetensors checkpoint's tensors as byte ranges, and the placeholders that let transformers
load a model with its experts' tensors never read.

:func:`read_headers` gives each tensor's file, offset, dtype and shape from the shards' headers
(an 8-byte little-endian length, then JSON with ``data_offsets`` counted from the header's end).
:class:`Unread` is a meta tensor that remembers where its bytes are in the checkpoint: handed to
``from_pretrained`` in its ``state_dict`` (as :class:`Lazy`), it goes through transformers'
weight conversion as a real tensor would, and comes out as the parameter with, per expert, the
byte ranges it was made of. Stacking along the experts' dimension (``MergeModulelist``),
concatenating within an expert (``Concatenate``), moving and renaming keep the ranges; any other
operation (a transpose, a split, a conversion to another dtype) marks the result as not a byte
range of the checkpoint, with the reason.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Optional

import torch

#: safetensors dtype names -> torch dtypes (those an expert can be served in, and the others the model loads).
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 << 20  # safetensors' own limit on a header


@dataclass(frozen=True)
class Tensor:
    """One checkpoint tensor: its name, shard (an index into the shards), offset in the file, bytes, dtype, shape."""

    name: str
    file: int
    offset: int
    nbytes: int
    dtype: Optional[torch.dtype]
    shape: tuple[int, ...]


def read_headers(paths: list[str]) -> dict[str, Tensor]:
    """Every tensor of the shards ``paths`` by name. ValueError naming the file for a header that
    is not safetensors'."""
    out = {}
    for i, path in enumerate(paths):
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError(f"{path}: not a safetensors file (shorter than its header's length)")
            (length,) = struct.unpack("<Q", raw)
            if length > _MAX_HEADER:
                raise ValueError(f"{path}: not a safetensors file (a header of {length} bytes)")
            try:
                header = json.loads(f.read(length))
            except ValueError as exc:
                raise ValueError(f"{path}: not a safetensors file (its header: {exc})") from None
        size = os.path.getsize(path)
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            begin, end = entry["data_offsets"]
            if not 0 <= begin <= end or 8 + length + end > size:
                raise ValueError(f"{path}: {name}'s bytes {begin}..{end} lie outside the file")
            out[name] = Tensor(
                name, i, 8 + length + begin, end - begin, _DTYPES.get(entry["dtype"]), tuple(entry["shape"])
            )
    return out


@dataclass(frozen=True)
class Range:
    """Bytes of one checkpoint tensor: (its name, shard, offset in the file, bytes)."""

    name: str
    file: int
    offset: int
    nbytes: int


class Unread(torch.Tensor):
    """A meta tensor standing for checkpoint bytes nobody reads.

    ``ranges``: a list of :class:`Range` for a tensor that is one checkpoint tensor (``experts``
    None), or ``experts``: per index of dimension 0, the ranges of that expert's bytes in order.
    ``refused``: why the tensor is not a byte range of the checkpoint (then neither applies)."""

    ranges: list
    experts: Optional[list]
    refused: Optional[str]

    @staticmethod
    def make(base: torch.Tensor, ranges=None, experts=None, refused=None, origin=()) -> Unread:
        out = base.as_subclass(Unread)
        out.ranges, out.experts, out.refused = ranges, experts, refused
        out.origin = frozenset(origin) | {r.name for r in ranges or []} | {r.name for e in experts or [] for r in e}
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _name(func) == "to":  # to any device: stays on meta (to another dtype: refused below)
            dtype = kwargs.get("dtype") or next((a for a in args[1:] if isinstance(a, torch.dtype)), None)
            args, kwargs = (args[0],), {} if dtype is None else {"dtype": dtype}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor) or out.device.type != "meta":
            return out
        if isinstance(out, Unread) and any(out is a for a in args):
            return out  # in place (requires_grad_): unchanged
        return _traced(func, args, kwargs, out)

    def __deepcopy__(self, memo):
        return self  # nothing to copy: a placeholder

    def names(self) -> list[str]:
        """The checkpoint tensors this one was made from."""
        return sorted(self.origin)


def _name(func) -> str:
    return getattr(func, "__name__", str(func))


def _traced(func, args, kwargs, out: torch.Tensor) -> Unread:
    """The result of ``func`` over Unread inputs, with its byte ranges where they are still ranges."""
    name = _name(func)
    inputs = [a for a in args if isinstance(a, Unread)] or [
        t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, Unread)
    ]
    origin = frozenset().union(*(t.origin for t in inputs))
    refused = next((t.refused for t in inputs if t.refused), None)
    if refused:
        return Unread.make(out, refused=refused, origin=origin)
    first = inputs[0] if inputs else None
    if (
        name in ("__getitem__",)
        and len(args) == 2
        and args[1] is Ellipsis
        or name
        in (
            "detach",
            "contiguous",
            "clone",
            "__get__",
        )
    ):
        if first is None:
            return Unread.make(out, refused=name)
        return Unread.make(out, first.ranges, first.experts)
    if name == "to":
        if first is not None and out.dtype != first.dtype:
            return Unread.make(
                out,
                origin=origin,
                refused=f"{first.names()[0]} is {first.dtype} in the checkpoint, {out.dtype} in the model: the "
                f"cache serves the checkpoint's bytes as they are, unconverted (load with dtype={first.dtype})",
            )
        return Unread.make(out, first.ranges, first.experts)
    tensors = args[0] if args and isinstance(args[0], (list, tuple)) else None
    dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    if name == "stack" and tensors and dim == 0 and all(t.experts is None for t in tensors):
        return Unread.make(out, experts=[list(t.ranges) for t in tensors])
    if name == "cat" and tensors and all(t.experts is not None for t in tensors):
        if dim == 0:
            return Unread.make(out, experts=[e for t in tensors for e in t.experts])
        if dim == 1 and len({len(t.experts) for t in tensors}) == 1:
            return Unread.make(out, experts=[sum(parts, []) for parts in zip(*(t.experts for t in tensors))])
    what = ", ".join(t.names()[0] for t in inputs[:2]) if inputs else "a tensor"
    return Unread.make(
        out, refused=f"transformers' loading applies {name} to {what}: not a byte range of the file", origin=origin
    )


class Lazy:
    """A ``state_dict`` value for ``from_pretrained``: read as transformers reads a safetensors
    slice (``value[...]``), it gives the :class:`Unread` standing for the tensor."""

    def __init__(self, tensor: Tensor):
        self.tensor = tensor
        self.dtype = tensor.dtype

    def __getitem__(self, item) -> Unread:
        t = self.tensor
        if t.dtype is None:
            raise ValueError(f"{t.name}: a dtype pyexpcache cannot place")
        base = torch.empty(t.shape, dtype=t.dtype, device="meta")
        return Unread.make(base, ranges=[Range(t.name, t.file, t.offset, t.nbytes)])[item]

    def get_shape(self):
        return list(self.tensor.shape)

    def is_floating_point(self) -> bool:
        return self.dtype is not None and self.dtype.is_floating_point

    def __deepcopy__(self, memo):
        return self


class Slice:
    """A ``state_dict`` value that is the shard's safetensors slice (read by transformers as it
    reads its own), kept as it is by the deepcopy ``from_pretrained``'s auto classes make."""

    def __init__(self, inner, dtype, counted=None):
        self._inner, self.dtype = inner, dtype
        self._read = counted(inner.__getitem__) if counted is not None else inner.__getitem__

    def __getitem__(self, item):
        return self._read(item)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def is_floating_point(self) -> bool:
        return self.dtype is not None and self.dtype.is_floating_point

    def __deepcopy__(self, memo):
        return self
