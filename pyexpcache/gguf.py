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

import functools
import mmap
import os
import re
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from .layer_spec import LayerSpec
from .layout import ModelLayout
from .source import BufferSource, LayerPlacement, checksum_bytes

__all__ = ["GGUFLayoutError", "GGUFExpertLayer", "GGUFSource", "describe_gguf", "inspect_table", "layout_from_gguf"]

_MASK64 = (1 << 64) - 1
_HEADER_BYTES = 24  # magic, version, tensor count, metadata count
_MAGIC = b"GGUF"
_MAX_LAYERS = 1 << 16  # a sanity bound on block indices (no model comes near)
_EXPS_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate_up|gate|up|down)_exps\.weight$")
_PARTS = ("gate", "up", "down")

PathLike = Union[str, "os.PathLike[str]"]


class GGUFLayoutError(ValueError):
    """A GGUF file is malformed or its expert tensors cannot be served as a layout."""


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


@dataclass(frozen=True)
class GGUFExpertLayer:
    """One MoE layer's routed-expert tensors in a GGUF file.

    Offsets are absolute file offsets of expert 0's part; expert e's part starts
    ``e * stride`` bytes later and is ``*_bytes`` long. For a fused gate_up tensor the
    gate and up parts share the tensor (same stride, up offset = gate offset + half).
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

    @property
    def spec(self) -> LayerSpec:
        return LayerSpec(self.num_experts, self.gate_bytes, self.up_bytes, self.down_bytes)

    @property
    def types(self) -> tuple[str, str, str]:
        return (self.gate_type, self.up_type, self.down_type)

    @property
    def offsets(self) -> tuple[int, int, int]:
        return (self.gate_offset, self.up_offset, self.down_offset)

    @property
    def strides(self) -> tuple[int, int, int]:
        return (self.gate_stride, self.up_stride, self.down_stride)

    @property
    def sizes(self) -> tuple[int, int, int]:
        return (self.gate_bytes, self.up_bytes, self.down_bytes)


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
            layer, part = int(m.group(1)), m.group(2)
            if layer >= _MAX_LAYERS:
                raise fail(f"tensor {t.name}: block index {layer} is implausible (>= {_MAX_LAYERS})")
            tensor = _tensor_info(gguf, t, size, fail)
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


def _tensor_info(gguf, t, file_size: int, fail) -> _Tensor:
    qtype = gguf.GGMLQuantizationType(int(t.tensor_type))
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    dims = tuple(int(d) for d in t.shape)
    if len(dims) != 3:
        raise fail(f"tensor {t.name}: expected 3 dimensions [row, rows, experts], got shape {list(dims)}")
    if min(dims) <= 0:
        raise fail(f"tensor {t.name}: empty shape {list(dims)}")
    if dims[0] % block:
        raise fail(f"tensor {t.name}: row length {dims[0]} is not a multiple of the {qtype.name} block size {block}")
    nbytes = dims[0] // block * type_size * dims[1] * dims[2]
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
    missing = [p for p in _PARTS if p not in have]
    if missing:
        names = ", ".join(sorted(t.name for t in parts.values()))
        raise fail(f"layer {layer}: incomplete experts: has {names} but no {'/'.join(missing)} expert tensor")

    counts = {t.name: t.dims[2] for t in parts.values()}
    if len(set(counts.values())) != 1:
        raise fail(
            f"layer {layer}: expert counts disagree: " + ", ".join(f"{n} has {c}" for n, c in sorted(counts.items()))
        )
    n = next(iter(counts.values()))

    def per_expert(t: _Tensor) -> int:
        if t.nbytes % n:
            raise fail(f"tensor {t.name}: {t.nbytes} bytes do not divide into {n} experts")
        return t.nbytes // n

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
    def part(self, layer: int, expert: int, part: int) -> np.ndarray:
        """A read-only uint8 view of one part's bytes in the file."""
        self._check_open()
        rec = self.records[layer]
        if rec is None:
            raise ValueError(f"layer {layer} has no routed experts")
        if not 0 <= expert < rec.num_experts:
            raise ValueError(f"layer {layer}: expert {expert} out of range (0..{rec.num_experts - 1})")
        if part not in (0, 1, 2):
            raise ValueError(f"part must be 0 (gate), 1 (up) or 2 (down), got {part}")
        off = rec.offsets[part] + expert * rec.strides[part]
        return self.buffer[off : off + rec.sizes[part]]

    def expert_bytes(self, layer: int, expert: int) -> np.ndarray:
        """An expert's bytes: gate, then up, then down (a copy)."""
        return np.concatenate([self.part(layer, expert, p) for p in range(3)])

    def expected_checksum(self, layer: int, expert: int) -> int:
        """What expcache_testing_checksum gives for this expert when its bytes are intact."""
        return sum(checksum_bytes(self.part(layer, expert, p)) for p in range(3)) & _MASK64

    # -- lifetime ----------------------------------------------------------
    def _release(self) -> None:
        """Unmap the file; called once, when closed and no cache uses it. Views handed out
        by :meth:`part` keep the mapping alive until they are dropped."""
        self._unmap()

    def __repr__(self) -> str:
        state = "closed" if self._mm is None or self.closed else f"{self.nbytes} bytes"
        return f"GGUFSource({self.path!r}, {len(self.layout.moe_layers)} MoE layers, {state})"


# ---------------------------------------------------------------------------
# Inspection


def _ranges(items: list[int]) -> str:
    """[3, 4, 5, 7] -> "3-5, 7"."""
    out, start, prev = [], None, None
    for i in items:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = i
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ", ".join(out)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.4f}"


def _gib(n: int) -> str:
    return f"{n / 2**30:,.4f}"


def inspect_table(path_or_layout) -> str:
    """A text report of a GGUF file (path), a :class:`GGUFSource` or a
    :class:`~pyexpcache.ModelLayout`: one row per MoE layer (class, quant types, per-expert
    MiB, bytes per layer), one row per size class (its layers, experts, GiB), and the total
    bytes of all experts. Quant types are known only from a file."""
    try:
        from tabulate import tabulate
    except ImportError as exc:
        raise ImportError("inspect_table needs the 'tabulate' package: pip install tabulate") from exc

    if isinstance(path_or_layout, ModelLayout):
        layout, records, title = path_or_layout, None, path_or_layout.name
    elif isinstance(path_or_layout, GGUFSource):
        layout, records, title = path_or_layout.layout, path_or_layout.records, path_or_layout.path
    else:
        records = describe_gguf(path_or_layout)
        layout, title = _layout(records, path_or_layout), os.fspath(path_or_layout)

    classes = layout.classes()
    keys = list(classes)
    rows = []
    for i in layout.moe_layers:
        s = layout[i]
        r = records[i] if records is not None else None
        types = "/".join(r.types) + (" (fused gate_up)" if r.fused else "") if r else "-"
        rows.append(
            [
                i,
                keys.index(s.class_key),
                s.num_experts,
                types,
                f"{s.gate_bytes:,}",
                f"{s.up_bytes:,}",
                f"{s.down_bytes:,}",
                _mib(s.expert_bytes),
                f"{s.num_experts * s.expert_bytes:,}",
            ]
        )
    layer_table = tabulate(
        rows,
        headers=[
            "layer",
            "class",
            "experts",
            "types (gate/up/down)",
            "gate B",
            "up B",
            "down B",
            "expert MiB",
            "layer bytes",
        ],
        disable_numparse=True,
        colalign=("right",) * 3 + ("left",) + ("right",) * 5,
    )

    crows = []
    for c, (key, layers) in enumerate(classes.items()):
        experts = sum(layout[i].num_experts for i in layers)
        total = sum(layout[i].num_experts * layout[i].expert_bytes for i in layers)
        crows.append(
            [
                c,
                f"{key[0]:,} / {key[1]:,} / {key[2]:,}",
                _mib(sum(key)),
                _ranges(layers),
                len(layers),
                f"{experts:,}",
                f"{total:,}",
                _gib(total),
            ]
        )
    class_table = tabulate(
        crows,
        headers=["class", "gate / up / down B", "expert MiB", "layers", "n layers", "experts", "bytes", "GiB"],
        disable_numparse=True,
        colalign=("right", "left", "right", "left") + ("right",) * 4,
    )

    dense = [i for i, s in enumerate(layout.layers) if s is None]
    total = layout.total_bytes
    lines = [
        f"{title}: {layout.num_layers} layers, {len(layout.moe_layers)} with routed experts"
        + (f", dense: {_ranges(dense)}" if dense else ""),
        "",
        layer_table,
        "",
        class_table,
        "",
        f"total: {total:,} bytes ({_gib(total)} GiB) of routed experts in {len(classes)} size class"
        + ("es" if len(classes) != 1 else ""),
    ]
    return "\n".join(lines)
