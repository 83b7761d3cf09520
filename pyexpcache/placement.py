"""Which device owns each (layer, expert) when one model's experts are cached over several GPUs.

A :class:`Placement` gives every routed expert exactly one owner, a device index
``0..num_devices-1`` (an index into the ``devices`` list of a
:class:`~pyexpcache.MultiDeviceCache`, not a CUDA ordinal). Three ways to make one:

- :meth:`Placement.round_robin`: expert ``e`` of every layer on device ``e % N`` (the default:
  no knowledge of the load needed);
- :meth:`Placement.balanced`: per layer, the experts in decreasing expected load, each given to
  the device with the least load so far (ties: fewer experts, then the lower index), so that each
  device's share of a layer's requests, and with it of the layer's misses, is as even as the
  loads allow. Loads are request counts from a trace (:func:`loads_from_calls`) or any profile;
- :meth:`Placement.explicit`: the owners given per layer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .layout import ModelLayout

#: Most devices one placement spreads over (owners are stored as uint8).
MAX_DEVICES = 64


def _check_devices(num_devices) -> int:
    if isinstance(num_devices, bool) or not isinstance(num_devices, (int, np.integer)):
        raise TypeError(f"num_devices must be an int, got {type(num_devices).__name__}")
    if not 1 <= num_devices <= MAX_DEVICES:
        raise ValueError(f"num_devices must be 1..{MAX_DEVICES}, got {num_devices}")
    return int(num_devices)


def _spread(num_experts: int, n: int) -> np.ndarray:
    """Expert e on device e mod n."""
    return (np.arange(num_experts) % n).astype(np.uint8)


def _per_layer(layout: ModelLayout, given: Sequence, what: str):
    """(layer, spec, given[layer]) for every layer with routed experts, once ``given`` is checked
    to have one entry per layer and one for each such layer."""
    if len(given) != layout.num_layers:
        raise ValueError(f"{what} has {len(given)} layers, the layout {layout.num_layers}")
    for i, spec in enumerate(layout.layers):
        if spec is None:
            continue
        if given[i] is None:
            raise ValueError(f"{what}[{i}] is None but layer {i} has {spec.num_experts} experts")
        yield i, spec, given[i]


@dataclass(frozen=True)
class Placement:
    """The owner of every expert: ``owners[layer]`` is a uint8 array of the layer's experts
    (None for a layer without routed experts)."""

    num_devices: int
    owners: tuple[Optional[np.ndarray], ...]
    kind: str = "explicit"

    # -- construction -------------------------------------------------------
    @classmethod
    def round_robin(cls, layout: ModelLayout, num_devices: int) -> Placement:
        n = _check_devices(num_devices)
        return cls(
            n, tuple(None if spec is None else _spread(spec.num_experts, n) for spec in layout.layers), "round-robin"
        )

    @classmethod
    def balanced(cls, layout: ModelLayout, num_devices: int, loads: Sequence) -> Placement:
        """Balance each layer's expected load over the devices. ``loads[layer]``: one
        non-negative number per expert of the layer (None or absent for layers without routed
        experts; a layer whose loads are all zero falls back to round-robin)."""
        n = _check_devices(num_devices)
        owners: list = [None] * layout.num_layers
        for i, spec, given in _per_layer(layout, loads, "loads"):
            w = np.asarray(given, dtype=np.float64)
            if w.shape != (spec.num_experts,):
                raise ValueError(f"loads[{i}] has shape {w.shape}, want ({spec.num_experts},)")
            if not np.isfinite(w).all() or (w < 0).any():
                raise ValueError(f"loads[{i}] must be finite and non-negative")
            if not w.any():
                owners[i] = _spread(spec.num_experts, n)
                continue
            own = np.empty(spec.num_experts, dtype=np.uint8)
            load = np.zeros(n)
            count = np.zeros(n, dtype=np.int64)
            # Stable: equal loads keep expert order, so the result does not depend on the sort.
            for e in np.argsort(-w, kind="stable"):
                d = min(range(n), key=lambda j: (load[j], count[j], j))
                own[e] = d
                load[d] += w[e]
                count[d] += 1
            owners[i] = own
        return cls(n, tuple(owners), "balanced")

    @classmethod
    def explicit(cls, layout: ModelLayout, num_devices: int, owners: Sequence) -> Placement:
        """``owners[layer]``: the owning device index of each expert of the layer."""
        n = _check_devices(num_devices)
        out: list = [None] * layout.num_layers
        for i, spec, given in _per_layer(layout, owners, "owners"):
            o = np.asarray(given)
            if o.shape != (spec.num_experts,) or not np.issubdtype(o.dtype, np.integer):
                raise ValueError(f"owners[{i}] must be {spec.num_experts} integers, got shape {o.shape} of {o.dtype}")
            if o.size and (o.min() < 0 or o.max() >= n):
                raise ValueError(f"owners[{i}] must be device indices 0..{n - 1}, got {o.min()}..{o.max()}")
            out[i] = o.astype(np.uint8)
        return cls(n, tuple(out), "explicit")

    # -- queries ------------------------------------------------------------
    def experts_per_device(self) -> np.ndarray:
        """Experts each device owns, summed over layers."""
        return np.bincount(np.concatenate([o for o in self.owners if o is not None]), minlength=self.num_devices)

    def load_share(self, loads: Sequence) -> np.ndarray:
        """Each device's share (0..1) of the total of ``loads`` (per layer, per expert)."""
        got = np.zeros(self.num_devices)
        for own, w in zip(self.owners, loads):
            if own is not None and w is not None:
                got += np.bincount(own, weights=np.asarray(w, dtype=np.float64), minlength=self.num_devices)
        total = got.sum()
        return got / total if total else got


def loads_from_calls(layout: ModelLayout, calls: Iterable) -> list[Optional[np.ndarray]]:
    """Request counts per (layer, expert) of a workload's calls (anything with ``.layer`` and
    ``.ids``): the profile :meth:`Placement.balanced` takes."""
    out = [None if spec is None else np.zeros(spec.num_experts, dtype=np.int64) for spec in layout.layers]
    for call in calls:
        counts = out[call.layer]
        if counts is None:
            raise ValueError(f"a call names layer {call.layer}, which has no routed experts in {layout.name}")
        np.add.at(counts, np.asarray(call.ids, dtype=np.int64), 1)
    return out
