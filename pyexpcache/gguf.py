"""GGUF model files as expert sources.

A llama.cpp GGUF file holds each MoE layer's routed experts as 3-D tensors whose
slowest dimension is the expert count::

    blk.{i}.ffn_gate_exps.weight   [n_embd, n_ff, n_expert]
    blk.{i}.ffn_up_exps.weight     [n_embd, n_ff, n_expert]
    blk.{i}.ffn_down_exps.weight   [n_ff, n_embd, n_expert]

or, fused, ``blk.{i}.ffn_gate_up_exps.weight`` ``[n_embd, 2 * n_ff, n_expert]`` whose
first half of each expert's rows is the gate and second half the up matrix. Expert e
of a tensor is the e-th contiguous run of ``tensor bytes / n_expert`` bytes, so each
part of a layer is a (base, stride) pair into the file: exactly what the cache needs.
Per-expert biases (GPT-OSS: ``blk.{i}.ffn_{gate,up,down}_exps.bias`` ``[n, n_expert]``) are
parts of their own after gate, up and down (``gate_bias``, ``up_bias``, ``down_bias``), as the
file keeps them apart; a layer without them has the three parts.

* :func:`describe_gguf` lists each layer's expert tensors (types, sizes, offsets).
* :func:`layout_from_gguf` turns that into a :class:`~pyexpcache.ModelLayout`.
* :class:`GGUFSource` maps the file read-only and serves it as a
  :class:`~pyexpcache.source.Source` (pageable memory).
* :func:`inspect_table` prints the layers and size classes of a file.

The file is read with the ``gguf`` package (``pip install gguf``), imported only when
needed. Malformed files raise :class:`GGUFLayoutError` (a ``ValueError``) naming the
file and what is wrong.
"""

from __future__ import annotations

import math
import mmap
import os
import re
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from ._gguf_reader import _bounded_reader_class, _import_gguf, _Truncated
from .layer_spec import LayerSpec, PartSpec
from .layout import ModelLayout
from .source import BufferSource, LayerPlacement, checksum_bytes

__all__ = [
    "GGUFLayoutError",
    "GGUFExpertLayer",
    "GGUFExpertPart",
    "GGUFSource",
    "describe_gguf",
    "inspect_table",
    "layout_from_gguf",
]

_MASK64 = (1 << 64) - 1
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


# ---------------------------------------------------------------------------
# Public functions


def describe_gguf(path: PathLike) -> list[Optional[GGUFExpertLayer]]:
    """One entry per model layer: its expert tensors (:class:`GGUFExpertLayer`), or None
    for a layer without routed experts. Raises :class:`GGUFLayoutError`."""
    return _scan(path)[0]


def _layout(records, path) -> ModelLayout:
    return ModelLayout(tuple(r.spec if r else None for r in records), name=os.path.basename(os.fspath(path)))


def layout_from_gguf(path: PathLike) -> ModelLayout:
    """The :class:`~pyexpcache.ModelLayout` of a GGUF file's routed experts, named after the
    file. Layers without expert tensors are None; the layer count is ``{arch}.block_count``
    when present, else one more than the largest block index with experts."""
    return _layout(describe_gguf(path), path)


class GGUFSource(BufferSource):
    """A GGUF file, mapped read-only, as an expert source (pageable memory).

    Args:
        path: the GGUF file.
        layout: if given, must equal the file's layout (:func:`layout_from_gguf`);
            it then becomes ``self.layout``.
        reads: ``"mmap"`` (misses copied from the mapping, staged through the pinned ring)
            or ``"file"`` (misses read from the file with pread, several reads in flight,
            through the page cache or, with ``ExpertCache(..., file_reads="direct")``, with
            O_DIRECT where the file system allows it: for models larger than RAM).

    The file must not be modified or truncated while mapped. A cache keeps its source
    alive: closing the source while a cache uses it releases the mapping when the last
    such cache closes (:class:`~pyexpcache.source.BufferSource`).
    """

    pinned = False

    def __init__(self, path: PathLike, *, layout: Optional[ModelLayout] = None, reads: str = "mmap"):
        if reads not in ("mmap", "file"):
            raise ValueError(f"reads must be 'mmap' or 'file', got {reads!r}")
        self.path = os.fspath(path)
        # "file": the cache reads misses from the file itself (pread; the cache's file_reads says
        # whether through the page cache or O_DIRECT); the mapping then only serves verification.
        self.file_path = self.path if reads == "file" else None
        self._mm = None
        self.buffer = np.empty(0, np.uint8)
        records, size = _scan(self.path)
        file_layout = _layout(records, self.path)
        if layout is not None and (layout.num_layers != file_layout.num_layers or layout.layers != file_layout.layers):
            raise ValueError(f"{self.path}: the given layout {layout.name!r} differs from the file's")
        self.layout = layout if layout is not None else file_layout
        self.records = records
        with open(self.path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if len(self._mm) != size:
            self.close()
            raise GGUFLayoutError(f"{self.path}: the file changed size while being opened")
        self.buffer = np.frombuffer(self._mm, dtype=np.uint8)
        self._base = self.buffer.ctypes.data
        origin = 0 if self.file_path else self._base  # file offsets, or addresses in the mapping
        self._placements = [
            LayerPlacement(tuple(origin + o for o in r.offsets), r.strides, r.sizes) if r else None for r in records
        ]
        self._track()

    def _check_open(self):
        self._check_usable()
        if self._mm is None or self.closed:
            raise ValueError(f"{self.path}: the source is closed")

    # -- what the cache needs --------------------------------------------
    def placement(self, layer: int) -> Optional[LayerPlacement]:
        """Where expert 0's parts are (addresses in the mapping, or file offsets when
        ``reads="file"``), strides and sizes; None for a dense layer."""
        self._check_open()
        return self._placements[layer]

    # -- verification ------------------------------------------------------
    def part(self, layer: int, expert: int, part) -> np.ndarray:
        """A read-only uint8 view of one part's bytes in the file (``part``: its index or name)."""
        self._check_open()
        rec = self.records[layer]
        if rec is None:
            raise ValueError(f"layer {layer} has no routed experts")
        if not 0 <= expert < rec.num_experts:
            raise ValueError(f"layer {layer}: expert {expert} out of range (0..{rec.num_experts - 1})")
        spec = rec.spec
        try:
            part = spec.part_index(part)
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"part must be one of {', '.join(spec.part_names)} or its index, got {part!r}") from None
        off = rec.offsets[part] + expert * rec.strides[part]
        return self.buffer[off : off + rec.sizes[part]]

    def expert_bytes(self, layer: int, expert: int) -> np.ndarray:
        """An expert's bytes: every part in order, gate, up and down first (a copy)."""
        return np.concatenate([self.part(layer, expert, p) for p in range(self._num_parts(layer))])

    def expected_checksum(self, layer: int, expert: int) -> int:
        """What expcache_testing_checksum gives for this expert when its bytes are intact."""
        return sum(checksum_bytes(self.part(layer, expert, p)) for p in range(self._num_parts(layer))) & _MASK64

    def _num_parts(self, layer: int) -> int:
        rec = self.records[layer]
        return 3 if rec is None else 3 + len(rec.extra)  # a dense layer: part() says so

    # -- lifetime ----------------------------------------------------------
    def _release(self) -> None:
        """Unmap the file; called once, when closed and no cache uses it. Views handed out
        by :meth:`part` keep the mapping alive until they are dropped."""
        self._unmap()

    def __repr__(self) -> str:
        state = "closed" if self._mm is None or self.closed else f"{self.nbytes} bytes"
        return f"GGUFSource({self.path!r}, {len(self.layout.moe_layers)} MoE layers, {state})"


# The text report of a file's layers and classes: pyexpcache.gguf_inspect (importable from here too).
from .gguf_inspect import inspect_table  # noqa: E402 (it imports this module's names)
