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

import mmap
import os
from typing import Optional

import numpy as np

from ._gguf_scan import GGUFExpertLayer, GGUFExpertPart, GGUFLayoutError, PathLike, _scan
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
    # Parts past the first three (a GGUF file's expert biases, a layout's quantized parts): a column.
    extra = any(layout[i].num_parts > 3 for i in layout.moe_layers)
    for i in layout.moe_layers:
        s = layout[i]
        r = records[i] if records is not None else None
        types = "/".join(r.types) + (" (fused gate_up)" if r.fused else "") if r else "-"
        sizes = [f"{b:,}" for b in s.class_key[:3]] + [""] * (3 - min(s.num_parts, 3))
        more = ", ".join(f"{p.name} {p.nbytes:,}" for p in s.parts[3:])
        rows.append(
            [i, keys.index(s.class_key), s.num_experts, types, *sizes]
            + ([more] if extra else [])
            + [_mib(s.expert_bytes), f"{s.num_experts * s.expert_bytes:,}"]
        )
    layer_table = tabulate(
        rows,
        headers=["layer", "class", "experts", "types (gate/up/down)", "gate B", "up B", "down B"]
        + (["more parts B"] if extra else [])
        + ["expert MiB", "layer bytes"],
        disable_numparse=True,
        colalign=("right",) * 3 + ("left",) + ("right",) * 3 + (("left",) if extra else ()) + ("right",) * 2,
    )

    crows = []
    for c, (key, layers) in enumerate(classes.items()):
        experts = sum(layout[i].num_experts for i in layers)
        total = sum(layout[i].num_experts * layout[i].expert_bytes for i in layers)
        crows.append(
            [
                c,
                " / ".join(f"{b:,}" for b in key),
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
        headers=[
            "class",
            "part B (gate / up / down ...)",
            "expert MiB",
            "layers",
            "n layers",
            "experts",
            "bytes",
            "GiB",
        ],
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
