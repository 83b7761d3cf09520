"""A trace's geometry against a model layout: every layer the trace routes must be a layer of the
layout with routed experts, and every id it routes there below that layer's expert count."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import numpy as np

from pyexpcache.routing import Trace

__all__ = ["check_layout"]


def check_layout(trace: Trace, layout, layers: Optional[Iterable[int]] = None) -> None:
    """Raise ValueError unless ``layout`` (a :class:`~pyexpcache.ModelLayout`) can replay ``trace``.

    Args:
        trace: the trace.
        layout: the model layout.
        layers: the model layers of the trace that will be replayed (default: every layer it has
            records of, :attr:`Trace.routed_layers`); the others are not checked.

    Raises:
        ValueError: one line naming the trace and the layout: a traced layer past the layout's
            last layer or dense in it, or an expert id at a layer of the layout with fewer experts.
    """
    keep = None if layers is None else set(layers)
    present = trace.present
    for layer in trace.routed_layers:
        if keep is not None and layer not in keep:
            continue
        spec = layout[layer] if layer < layout.num_layers else None
        if spec is None:
            raise ValueError(
                f"trace {trace.name} has layer {layer}, which layout {layout.name} does not have: "
                f"{layout.no_experts_reason(layer)}"
            )
        i = layer - trace.first_layer
        rows = trace.ids[present[:, i], i]
        top = int(rows.max()) if rows.size else -1
        if top >= spec.num_experts:
            t = int(np.flatnonzero(present[:, i] & (trace.ids[:, i] >= spec.num_experts).any(axis=1))[0])
            raise ValueError(
                f"trace {trace.name} layer {layer} has expert id {top} (first at token "
                f"{int(trace.positions[t])}), which layout {layout.name} does not have: it gives that "
                f"layer {spec.num_experts} experts"
            )
