"""Reading a GGUF file's routed-expert tensors for :mod:`pyexpcache.gguf`: the ``gguf`` package's
reader, imported when a file is first read, with every read bounds-checked against the file
(:func:`_bounded_reader_class`), and the scan that turns the tensors into a record per layer
(:class:`GGUFExpertLayer`: gate, up, down and any further per-expert tensor, each a part)."""

from __future__ import annotations

import functools
import math
import os
import re
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from .layer_spec import LayerSpec, PartSpec


def _import_gguf():
    try:
        import gguf  # lazy on purpose: the package is optional
    except ImportError as exc:
        raise ImportError(
            "reading GGUF files needs the 'gguf' package: pip install gguf (or pip install 'expcache[gguf]')"
        ) from exc
    return gguf


@functools.lru_cache(maxsize=1)
def _bounded_reader_class():
    """GGUFReader whose every read is bounds-checked against the file size.

    The stock reader slices its memmap without checking, so a truncated or corrupted
    file can make it read empty arrays (IndexError at best; a corrupted array length
    makes it loop for ~2^64 iterations without reading a byte). This raises instead,
    and rejects a metadata array whose length cannot fit in the rest of the file
    before the reader walks it item by item (through a multi-GB file, that walk
    would take hours).
    """
    gguf = _import_gguf()
    vt = gguf.GGUFValueType

    class _BoundedReader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, *args, **kwargs):
            n = int(count)
            end = int(offset) + np.dtype(dtype).itemsize * n
            size = int(self.data.shape[0])
            if int(offset) < 0 or n < 0 or end > size:
                raise _Truncated(
                    f"a field at byte {int(offset)} needs {end - int(offset)} bytes but the file ends at byte {size}",
                    int(offset),
                    end,
                    size,
                )
            return super()._get(offset, dtype, count, *args, **kwargs)

        def _build_tensors(self, start_offs, fields, *args, **kwargs):
            try:
                return super()._build_tensors(start_offs, fields, *args, **kwargs)
            except _Truncated as exc:
                # Name the tensor whose data runs past the end (an incomplete download).
                try:
                    names = {
                        int(start_offs) + int(f.parts[-1][0]): bytes(f.parts[1]).decode("utf-8", "replace")
                        for f in fields
                    }
                except Exception:
                    raise exc from None
                name = names.get(exc.offset)
                if name is None:
                    raise
                raise _Truncated(
                    f"the data of tensor {name} (bytes {exc.offset}..{exc.end}) runs past the "
                    f"end of the file ({exc.size} bytes)",
                    exc.offset,
                    exc.end,
                    exc.size,
                ) from None

        def _get_field_parts(self, orig_offs, raw_type, *args, **kwargs):
            if int(raw_type) == int(vt.ARRAY):
                item_type = int(self._get(orig_offs, np.uint32)[0])
                length = int(self._get(orig_offs + 4, np.uint64)[0])
                scalar = {int(k): v for k, v in self.gguf_scalar_to_np.items()}.get(item_type)
                min_item = (
                    np.dtype(scalar).itemsize
                    if scalar is not None
                    else 8
                    if item_type == int(vt.STRING)
                    else 12
                    if item_type == int(vt.ARRAY)
                    else 1
                )
                left = int(self.data.shape[0]) - (int(orig_offs) + 12)
                if length * min_item > left:
                    raise _Truncated(
                        f"a metadata array at byte {int(orig_offs)} claims {length} items of at "
                        f"least {min_item} bytes but {left} bytes are left in the file"
                    )
            return super()._get_field_parts(orig_offs, raw_type, *args, **kwargs)

    return _BoundedReader


class _Truncated(ValueError):
    def __init__(self, message: str, offset: int = -1, end: int = -1, size: int = -1):
        super().__init__(message)
        self.offset, self.end, self.size = offset, end, size


_HEADER_BYTES = 24  # magic, version, tensor count, metadata count
_MAGIC = b"GGUF"
_MAX_LAYERS = 1 << 16  # a sanity bound on block indices (no model comes near)
_EXPS_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate_up|gate|up|down)_exps\.(weight|bias)$")
_PARTS = ("gate", "up", "down")

PathLike = Union[str, "os.PathLike[str]"]


class GGUFLayoutError(ValueError):
    """A GGUF file is malformed or its expert tensors cannot be served as a layout."""


@dataclass(frozen=True)
class GGUFExpertLayer:
    """One MoE layer's routed-expert tensors in a GGUF file.

    Offsets are absolute file offsets of expert 0's part; expert e's part starts
    ``e * stride`` bytes later and is ``*_bytes`` long. For a fused gate_up tensor the
    gate and up parts share the tensor (same stride, up offset = gate offset + half).
    ``extra``: the layer's other per-expert tensors, each a part of its own after gate, up and
    down (GPT-OSS's expert biases: ``gate_bias``, ``up_bias``, ``down_bias``).
    """

    layer: int
    num_experts: int
    fused: bool
    gate_type: str
    up_type: str
    down_type: str
    gate_bytes: int
    up_bytes: int
    down_bytes: int
    gate_offset: int
    up_offset: int
    down_offset: int
    gate_stride: int
    up_stride: int
    down_stride: int
    extra: tuple[GGUFExpertPart, ...] = ()

    @property
    def spec(self) -> LayerSpec:
        if not self.extra:
            return LayerSpec(self.num_experts, self.gate_bytes, self.up_bytes, self.down_bytes)
        parts = [(p, b) for p, b in zip(("gate", "up", "down"), self.sizes)]
        return LayerSpec.of_parts(self.num_experts, parts + [p.part for p in self.extra])

    @property
    def types(self) -> tuple[str, ...]:
        return (self.gate_type, self.up_type, self.down_type) + tuple(p.type_name for p in self.extra)

    @property
    def offsets(self) -> tuple[int, ...]:
        return (self.gate_offset, self.up_offset, self.down_offset) + tuple(p.offset for p in self.extra)

    @property
    def strides(self) -> tuple[int, ...]:
        return (self.gate_stride, self.up_stride, self.down_stride) + tuple(p.nbytes for p in self.extra)

    @property
    def sizes(self) -> tuple[int, ...]:
        return (self.gate_bytes, self.up_bytes, self.down_bytes) + tuple(p.nbytes for p in self.extra)


# GGUF types whose items a view can show, for the extra parts' dtypes.
_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


@dataclass(frozen=True)
class GGUFExpertPart:
    """One more per-expert tensor of a layer (a bias): expert e's ``nbytes`` at ``offset + e *
    nbytes`` in the file; ``rows`` items of its type per expert."""

    name: str
    type_name: str
    nbytes: int
    offset: int
    rows: int

    @property
    def part(self) -> PartSpec:
        dtype = _DTYPES.get(self.type_name)
        return PartSpec(self.name, self.nbytes, dtype, None if dtype is None else (self.rows,))


@dataclass(frozen=True)
class _Tensor:
    name: str
    type_name: str
    dims: tuple[int, ...]  # GGUF order: fastest first
    offset: int  # absolute file offset
    nbytes: int


def _scan(path: PathLike) -> tuple[list[Optional[GGUFExpertLayer]], int]:
    """(per-layer records, file size). Raises GGUFLayoutError for a malformed file."""
    path = os.fspath(path)
    size = os.stat(path).st_size  # OSError (missing file, ...) propagates as is

    def fail(msg: str) -> GGUFLayoutError:
        return GGUFLayoutError(f"{path}: {msg}")

    if size < 4:
        raise fail(f"not a GGUF file: {size} bytes, too short for the magic")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != _MAGIC:
        raise fail(f"not a GGUF file: bad magic {magic!r} (expected {_MAGIC!r})")
    if size < _HEADER_BYTES:
        raise fail(f"truncated: {size} bytes, smaller than the {_HEADER_BYTES}-byte GGUF header")

    gguf = _import_gguf()
    reader_cls = _bounded_reader_class()
    try:
        reader = reader_cls(path, "r")
    except _Truncated as exc:
        raise fail(f"truncated or corrupted: {exc}") from exc
    except Exception as exc:  # the reader's failures on malformed input are of many types
        raise fail(f"unreadable GGUF ({type(exc).__name__}: {exc})") from exc

    try:
        if getattr(reader, "byte_order", "I") != "I":
            raise fail("a GGUF file of the other byte order (big-endian) is not supported")
        arch = _field_value(reader, "general.architecture")
        block_count = _field_value(reader, f"{arch}.block_count") if isinstance(arch, str) else None

        found: dict[int, dict[str, _Tensor]] = {}
        for t in reader.tensors:
            m = _EXPS_RE.match(t.name)
            if not m:
                continue
            layer, part = int(m.group(1)), m.group(2) + ("_bias" if m.group(3) == "bias" else "")
            if layer >= _MAX_LAYERS:
                raise fail(f"tensor {t.name}: block index {layer} is implausible (>= {_MAX_LAYERS})")
            tensor = _tensor_info(gguf, t, size, fail, 2 if m.group(3) == "bias" else 3)
            parts = found.setdefault(layer, {})
            if part in parts:
                raise fail(f"layer {layer}: two {part} expert tensors")
            parts[part] = tensor
    finally:
        del reader

    if not found:
        raise fail("no MoE expert tensors (ffn_*_exps) found")

    max_layer = max(found)
    if block_count is not None:
        if isinstance(block_count, bool) or not isinstance(block_count, int) or not 0 < block_count <= _MAX_LAYERS:
            raise fail(f"{arch}.block_count is {block_count!r}, not a layer count")
        if max_layer >= block_count:
            raise fail(f"expert tensors of block {max_layer} but {arch}.block_count is {block_count}")
        num_layers = block_count
    else:
        num_layers = max_layer + 1

    records: list[Optional[GGUFExpertLayer]] = [None] * num_layers
    for layer in sorted(found):
        records[layer] = _layer_record(layer, found[layer], fail)
    return records, size


def _field_value(reader, key: str):
    field = reader.get_field(key)
    if field is None:
        return None
    try:
        value = field.contents()
    except Exception:  # a corrupted field: treat as unusable
        return None
    return value


def _tensor_info(gguf, t, file_size: int, fail, ndim: int = 3) -> _Tensor:
    """A tensor of ``ndim`` dimensions, experts the last (3: a weight [row, rows, experts]; 2: a
    bias [row, experts])."""
    qtype = gguf.GGMLQuantizationType(int(t.tensor_type))
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    dims = tuple(int(d) for d in t.shape)
    if len(dims) != ndim:
        what = "[row, rows, experts]" if ndim == 3 else "[row, experts]"
        raise fail(f"tensor {t.name}: expected {ndim} dimensions {what}, got shape {list(dims)}")
    if min(dims) <= 0:
        raise fail(f"tensor {t.name}: empty shape {list(dims)}")
    if dims[0] % block:
        raise fail(f"tensor {t.name}: row length {dims[0]} is not a multiple of the {qtype.name} block size {block}")
    nbytes = dims[0] // block * type_size * math.prod(dims[1:])
    if nbytes != int(t.n_bytes):
        raise fail(f"tensor {t.name}: {nbytes} bytes by its shape, the reader says {int(t.n_bytes)}")
    offset = int(t.data_offset)
    if offset < 0 or offset + nbytes > file_size:
        raise fail(f"truncated: tensor {t.name} spans bytes {offset}..{offset + nbytes} but the file has {file_size}")
    return _Tensor(t.name, qtype.name, dims, offset, nbytes)


def _layer_record(layer: int, parts: dict[str, _Tensor], fail) -> GGUFExpertLayer:
    if "gate_up" in parts and ("gate" in parts or "up" in parts):
        raise fail(f"layer {layer}: both a fused ffn_gate_up_exps and separate gate/up expert tensors")
    have = set(parts) - {"gate_up"} | ({"gate", "up"} if "gate_up" in parts else set())
    biases = [p for p in ("gate_up_bias", "gate_bias", "up_bias", "down_bias") if p in parts]
    missing = [p for p in _PARTS if p not in have]
    if missing:
        names = ", ".join(sorted(t.name for t in parts.values()))
        raise fail(f"layer {layer}: incomplete experts: has {names} but no {'/'.join(missing)} expert tensor")

    counts = {t.name: t.dims[-1] for t in parts.values()}
    if len(set(counts.values())) != 1:
        raise fail(
            f"layer {layer}: expert counts disagree: " + ", ".join(f"{n} has {c}" for n, c in sorted(counts.items()))
        )
    n = next(iter(counts.values()))

    def per_expert(t: _Tensor) -> int:
        if t.nbytes % n:
            raise fail(f"tensor {t.name}: {t.nbytes} bytes do not divide into {n} experts")
        return t.nbytes // n

    extra = tuple(
        GGUFExpertPart(b, parts[b].type_name, per_expert(parts[b]), parts[b].offset, parts[b].dims[0]) for b in biases
    )
    down = parts["down"]
    down_bytes = per_expert(down)
    if "gate_up" in parts:
        gu = parts["gate_up"]
        stride = per_expert(gu)
        if gu.dims[1] % 2:
            raise fail(f"tensor {gu.name}: {gu.dims[1]} rows per expert do not split into equal gate/up halves")
        half = stride // 2
        return GGUFExpertLayer(
            layer,
            n,
            True,
            gu.type_name,
            gu.type_name,
            down.type_name,
            half,
            half,
            down_bytes,
            gu.offset,
            gu.offset + half,
            down.offset,
            stride,
            stride,
            down_bytes,
            extra,
        )
    gate, up = parts["gate"], parts["up"]
    gate_bytes, up_bytes = per_expert(gate), per_expert(up)
    return GGUFExpertLayer(
        layer,
        n,
        False,
        gate.type_name,
        up.type_name,
        down.type_name,
        gate_bytes,
        up_bytes,
        down_bytes,
        gate.offset,
        up.offset,
        down.offset,
        gate_bytes,
        up_bytes,
        down_bytes,
        extra,
    )
