"""The layer descriptors a cache registers (``expcache_layer_desc_t``): one per MoE layer of a
layout, from the layer's :class:`~pyexpcache.LayerSpec` and its source's
:class:`~pyexpcache.source.LayerPlacement`. Three parts without per-expert tables go in the
gate/up/down fields (the shorthand, ``num_parts`` 0), any other layer in ``parts[]``; every
integer, the tables' included, is range-checked before ctypes sees it."""

from __future__ import annotations

import ctypes
from typing import Optional

from . import _lib
from ._ints import U64_MAX, checked_int, u64

_SHORTHAND = (("gate_bytes", "up_bytes", "down_bytes"), ("gate_stride", "up_stride", "down_stride"))
_SHORTHAND_BASES = ("gate_base", "up_base", "down_base")


def expert_table(values, num_experts: int, name: str, hi: int, ctype):
    """``values`` (one integer per expert, each in [0, hi]) as a ctypes array of ``ctype``.
    ValueError for another length, TypeError for a non-integer, ArgumentRangeError (a
    ValueError) for one out of range, each naming the table and the expert."""
    try:
        n = len(values)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of one integer per expert, got {type(values).__name__}") from None
    if n != num_experts:
        raise ValueError(f"{name} has {n} entries for a layer of {num_experts} experts: one per expert")
    return (ctype * n)(*(checked_int(v, f"{name}[{e}]", 0, hi) for e, v in enumerate(values)))


def _table(tables, p: int):
    return None if tables is None or p >= len(tables) else tables[p]


def fill_parts(desc: _lib.LayerDesc, spec, place, file_ids: Optional[list[int]] = None) -> None:
    """Set ``desc``'s parts from ``spec`` (sizes) and ``place`` (bases and strides, one per
    part, and the per-expert tables); ``file_ids``: the cache's id of each of the source's files,
    which ``place.files`` index. ValueError when the placement does not describe the spec's parts."""
    n = spec.num_parts
    if not len(place.bases) == len(place.strides) == n:
        raise ValueError(
            f"the source places {len(place.bases)} parts ({len(place.strides)} strides) of a layer whose "
            f"experts have {n} ({', '.join(spec.part_names)})"
        )
    for what, tables in (("offsets", place.offsets), ("files", place.files)):
        if tables is not None and len(tables) != n:
            raise ValueError(f"the placement's {what} has {len(tables)} tables for {n} parts: one per part (or None)")
    tabled = any(_table(place.offsets, p) is not None or _table(place.files, p) is not None for p in range(n))
    if n == 3 and not tabled:
        _lib.set_fields(
            desc,
            **dict(zip(_SHORTHAND[0], spec.class_key)),
            **dict(zip(_SHORTHAND[1], place.strides)),
            **dict(zip(_SHORTHAND_BASES, place.bases)),
        )
        return
    desc.num_parts = n
    for p, (part, stride, base) in enumerate(zip(spec.parts, place.strides, place.bases)):
        out, where = desc.parts[p], f"part {part.name!r}"
        out.bytes = u64(part.nbytes, f"{where} bytes")
        out.stride = u64(stride, f"{where} stride")
        out.base = u64(base, f"{where} base") or None
        offsets, files = _table(place.offsets, p), _table(place.files, p)
        if offsets is not None:
            if stride != 0:
                raise ValueError(f"{where}: stride must be 0 with per-expert offsets, got {stride}")
            # Assigned to the struct, the arrays are kept alive by it until the layer is registered (which copies them).
            out.offsets = expert_table(offsets, spec.num_experts, f"{where} offsets", U64_MAX, ctypes.c_uint64)
        if files is not None:
            if not file_ids:
                raise ValueError(f"{where}: per-expert files need a source over files (its file_paths)")
            index = expert_table(files, spec.num_experts, f"{where} files", len(file_ids) - 1, ctypes.c_uint32)
            out.files = (ctypes.c_uint32 * len(index))(*(file_ids[i] for i in index))


def layer_descs(layout, source, file_ids: Optional[list[int]]) -> tuple[list[int], ctypes.Array]:
    """The MoE layers of ``layout`` and their descriptors, read from ``source`` (``file_ids``:
    the cache's ids of its files, in the order of its ``file_paths``, when it serves from files)."""
    lib = _lib.lib
    moe = [i for i, spec in enumerate(layout.layers) if spec is not None]
    descs = (_lib.LayerDesc * len(moe))()
    for d, i in zip(descs, moe):
        spec = layout.layers[i]
        lib.expcache_layer_desc_init(ctypes.byref(d))
        d.num_experts = spec.num_experts
        if file_ids:
            d.source_kind, d.file = _lib.SOURCE_FILE, file_ids[0]
        else:
            d.source_kind = _lib.SOURCE_PINNED if source.pinned else _lib.SOURCE_PAGEABLE
        fill_parts(d, spec, source.placement(i), file_ids)
    return moe, descs
