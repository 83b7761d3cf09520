"""The layer descriptors a cache registers (``expcache_layer_desc_t``): one per MoE layer of a
layout, from the layer's :class:`~pyexpcache.LayerSpec` and its source's
:class:`~pyexpcache.source.LayerPlacement`. Three parts go in the gate/up/down fields (the
shorthand, ``num_parts`` 0), any other count in ``parts[]``; every integer is range-checked
before ctypes sees it."""

from __future__ import annotations

import ctypes
from typing import Optional

from . import _lib
from ._ints import u64

_SHORTHAND = (("gate_bytes", "up_bytes", "down_bytes"), ("gate_stride", "up_stride", "down_stride"))
_SHORTHAND_BASES = ("gate_base", "up_base", "down_base")


def fill_parts(desc: _lib.LayerDesc, spec, place) -> None:
    """Set ``desc``'s parts from ``spec`` (sizes) and ``place`` (bases and strides, one per
    part). ValueError when the placement does not describe the spec's parts."""
    n = spec.num_parts
    if not len(place.bases) == len(place.strides) == n:
        raise ValueError(
            f"the source places {len(place.bases)} parts ({len(place.strides)} strides) of a layer whose "
            f"experts have {n} ({', '.join(spec.part_names)})"
        )
    if n == 3:
        _lib.set_fields(
            desc,
            **dict(zip(_SHORTHAND[0], spec.class_key)),
            **dict(zip(_SHORTHAND[1], place.strides)),
            **dict(zip(_SHORTHAND_BASES, place.bases)),
        )
        return
    desc.num_parts = n
    for p, (part, stride, base) in enumerate(zip(spec.parts, place.strides, place.bases)):
        out = desc.parts[p]
        out.bytes = u64(part.nbytes, f"part {part.name!r} bytes")
        out.stride = u64(stride, f"part {part.name!r} stride")
        out.base = u64(base, f"part {part.name!r} base") or None


def layer_descs(layout, source, file_id: Optional[int]) -> tuple[list[int], ctypes.Array]:
    """The MoE layers of ``layout`` and their descriptors, read from ``source`` (its file's id
    in the cache when it serves from a file)."""
    lib = _lib.lib
    moe = [i for i, spec in enumerate(layout.layers) if spec is not None]
    descs = (_lib.LayerDesc * len(moe))()
    for d, i in zip(descs, moe):
        spec = layout.layers[i]
        lib.expcache_layer_desc_init(ctypes.byref(d))
        d.num_experts = spec.num_experts
        if file_id is not None:
            d.source_kind, d.file = _lib.SOURCE_FILE, file_id
        else:
            d.source_kind = _lib.SOURCE_PINNED if source.pinned else _lib.SOURCE_PAGEABLE
        fill_parts(d, spec, source.placement(i))
    return moe, descs
