"""A cache source over the experts' own host tensors: no copy of the weights."""

from __future__ import annotations

from typing import Optional

import torch

from ..layout import ModelLayout
from ..source import LayerPlacement
from ._experts import ExpertsLayer


class ParameterSource:
    """The experts' weights where they are, as a :class:`~pyexpcache.source.Source`: per layer,
    the first slab's two parts (``gate``, ``up``: ``_experts.split``) and the down slab, each
    expert at a fixed stride in its 3-D host tensor. It keeps the tensors (so their memory)
    alive; the caller keeps it alive while a cache reads it (:class:`~pyexpcache.hf.Offloaded`
    does).

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
            first, down = tensors[e.layer]
            if (
                first.device.type != "cpu"
                or down.device.type != "cpu"
                or not first.is_contiguous()
                or not down.is_contiguous()
            ):
                raise ValueError(f"{e.name}: the source needs contiguous host tensors")
            spec = layout[e.layer]
            stride = first[0].numel() * first.element_size()
            down_stride = down[0].numel() * down.element_size()
            base = first.data_ptr()
            self._placements[e.layer] = LayerPlacement(
                bases=(base, base + spec.gate_bytes, down.data_ptr()),
                strides=(stride, stride, down_stride),
                sizes=spec.class_key,
            )

    def placement(self, layer: int) -> Optional[LayerPlacement]:
        return self._placements.get(layer)

    def tensors(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s host tensors the cache reads: the first weight's and ``down_proj``'s."""
        return self._tensors[layer]
