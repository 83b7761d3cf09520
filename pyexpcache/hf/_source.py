"""A cache source over the experts' own host tensors: no copy of the weights."""

from __future__ import annotations

from typing import Optional

import torch

from ..layout import ModelLayout
from ..source import LayerPlacement
from ._experts import ExpertsLayer


class ParameterSource:
    """The experts' weights where they are, as a :class:`~pyexpcache.source.Source`: per layer,
    each part of its spec (:meth:`ExpertsLayer.part_rows`: the first slab's ``gate`` and ``up``
    and the down slab; or each quantized tensor), each expert at a fixed stride in its host
    tensor. It keeps the tensors (so their memory) alive; the caller keeps it alive while a cache
    reads it (:class:`~pyexpcache.hf.Offloaded` does).

    ``pinned``: whether the tensors are page-locked (a CUDA cache reads misses from them with the
    GPU); the host backend takes either.
    """

    file_path = None  # bytes come from memory, not a file

    def __init__(
        self,
        layout: ModelLayout,
        layers: list[ExpertsLayer],
        tensors: dict[int, tuple[torch.Tensor, ...]],
        pinned: bool,
    ):
        self.layout = layout
        self.pinned = pinned
        self._tensors = tensors
        self._placements: dict[int, LayerPlacement] = {}
        for e in layers:
            held = tensors[e.layer]
            if any(t.device.type != "cpu" or not t.is_contiguous() for t in held):
                raise ValueError(f"{e.name}: the source needs contiguous host tensors")
            rows = e.part_rows(held)
            self._placements[e.layer] = LayerPlacement(
                bases=tuple(t.data_ptr() + offset for t, offset in rows),
                strides=tuple(t[0].numel() * t.element_size() for t, _ in rows),
                sizes=layout[e.layer].class_key,
            )

    def placement(self, layer: int) -> Optional[LayerPlacement]:
        return self._placements.get(layer)

    def tensors(self, layer: int) -> tuple[torch.Tensor, ...]:
        """``layer``'s host tensors the cache reads, in :attr:`ExpertsLayer.weight_names` order."""
        return self._tensors[layer]
