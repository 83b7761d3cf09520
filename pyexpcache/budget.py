"""A cache budget in bytes from what a caller gives (:func:`resolve_budget`: bytes, a fraction
of the model's experts' bytes, or the default), and what the library makes of a budget per size
class (:func:`class_info`, :func:`class_targets`), down to the smallest budget that holds an expert
of every class (:func:`smallest_budget`).

A class's slot count is the library's: its share of the budget over the slot bytes of every
expert, each part of a slot starting at an aligned offset; it is asked of a cache over a source
without bytes, so nothing is allocated for the experts.
"""

from __future__ import annotations

import math
from typing import Optional

from . import _lib
from .cache import ExpertCache
from .layout import GiB, ModelLayout
from .source import LayerPlacement

DEFAULT_BUDGET_BYTES = 12 * GiB

# The address a _Placements source gives every part: never read (a cache over it only answers
# what its budget gives each class), but the library wants one that is not NULL.
_NOWHERE = 1 << 12


class _Placements:
    """A source of ``layout``'s placements without bytes, for a cache that is only asked what
    its budget gives each class: a select over it would read unmapped memory."""

    pinned = False
    file_path = None

    def __init__(self, layout: ModelLayout):
        self.layout = layout

    def placement(self, layer: int) -> Optional[LayerPlacement]:
        spec = self.layout[layer]
        if spec is None:
            return None
        return LayerPlacement((_NOWHERE,) * spec.num_parts, spec.class_key, spec.class_key)


def class_info(layout: ModelLayout, budget_bytes: int) -> list:
    """Each size class of ``layout`` (in :meth:`~pyexpcache.ModelLayout.classes` order) as the
    library makes it at ``budget_bytes``: its :class:`~pyexpcache.stats.ClassInfo` (slot bytes,
    the experts the budget gives it). Nothing is allocated for the experts."""
    keys = list(layout.classes())
    if len(keys) > _lib.MAX_CLASSES_LIMIT:
        raise ValueError(
            f"layout {layout.name} has {len(keys)} size classes, more than a cache holds at once "
            f"({_lib.MAX_CLASSES_LIMIT})"
        )
    # ExpertCache's max_classes holds every size class of the layout.
    with ExpertCache(
        layout, _Placements(layout), budget_bytes=budget_bytes, backend="host", log_level=0, copy_threads=0
    ) as cache:
        for layers in layout.classes().values():
            cache.bind_class(layers[0])
        found = {c.key: c for c in cache.classes()}
    return [found[k] for k in keys]


def class_targets(layout: ModelLayout, budget_bytes: int) -> list[int]:
    """The experts ``budget_bytes`` gives each size class of ``layout`` (:func:`class_info`): the
    slot counts of a cache whose device memory is not short."""
    return [c.target_experts for c in class_info(layout, budget_bytes)]


def least_budget(layout: ModelLayout, enough) -> int:
    """The smallest budget (>= 1) whose class targets satisfy ``enough`` (true from some budget
    on: targets grow with the budget)."""
    hi = 1 << 20
    while not enough(class_targets(layout, hi)):
        hi *= 2
    lo = 1
    while lo < hi:
        mid = (lo + hi) // 2
        if enough(class_targets(layout, mid)):
            hi = mid
        else:
            lo = mid + 1
    return lo


def smallest_budget(layout: ModelLayout) -> int:
    """The smallest budget_bytes that gives every size class of ``layout`` one expert."""
    return least_budget(layout, lambda targets: min(targets) >= 1)


def unscaled(layout: ModelLayout, scale: int) -> ModelLayout:
    """The layout whose :meth:`~pyexpcache.ModelLayout.scaled` by ``scale`` is ``layout``: every
    part size times ``scale``."""
    if scale == 1:
        return layout
    return ModelLayout(
        tuple(s and s.with_sizes(b * scale for b in s.class_key) for s in layout.layers),
        name=layout.name.removesuffix(f"/{scale}"),
    )


def _round_up(value: float) -> str:
    """``value`` rounded up to 3 significant digits, as %g writes it (a value that is not less)."""
    step = 10.0 ** (math.floor(math.log10(value)) - 2)
    return f"{math.ceil(value / step - 1e-9) * step:.3g}"


def _spelled(name: str, value) -> str:
    """An option as the user gave it: ``--budget-gib 1e-09`` on the command line, ``budget_fraction=1e-09``."""
    shown = f"{value:g}" if isinstance(value, float) else str(value)
    return f"{name} {shown}" if name.startswith("--") else f"{name}={shown}"


def resolve_budget(
    layout: ModelLayout,
    budget_bytes=None,
    budget_fraction: Optional[float] = None,
    *,
    scale: int = 1,
    names: tuple[str, str] = ("budget_bytes", "budget_fraction"),
    bytes_unit: int = 1,
) -> int:
    """The cache budget in bytes for ``layout``: ``budget_bytes`` divided by ``scale``, or
    ``budget_fraction`` (0 < F <= 1) of the bytes of every expert of ``layout``
    (:attr:`~pyexpcache.ModelLayout.total_bytes`), rounded down, or :data:`DEFAULT_BUDGET_BYTES`
    divided by ``scale`` when neither is given. ``scale``: what ``layout``'s part sizes were
    divided by (a host run's); ``budget_bytes`` is the model's.

    ValueError for both, a fraction outside (0, 1], or a budget that rounds to 0 bytes: that one
    names the option as the caller calls it (``names``: the option that gives ``budget_bytes``,
    in units of ``bytes_unit`` bytes, and the fraction's; the command line's are
    ``("--budget-gib", "--budget-fraction")`` in GiB) and the smallest value of it that holds an
    expert of every class of the full-size layout (:func:`smallest_budget`)."""
    if budget_fraction is None:
        if budget_bytes is None:
            return DEFAULT_BUDGET_BYTES // scale
        budget = budget_bytes // scale if isinstance(budget_bytes, int) else int(budget_bytes / scale)
        if budget > 0:
            return budget
        given, name = budget_bytes / bytes_unit if bytes_unit != 1 else budget_bytes, names[0]
    else:
        if budget_bytes is not None:
            raise ValueError(f"give {names[0]} or {names[1]}, not both")
        if (
            isinstance(budget_fraction, bool)
            or not isinstance(budget_fraction, (int, float))
            or not 0 < budget_fraction <= 1
        ):
            raise ValueError(f"{names[1]} must be a number in (0, 1], got {budget_fraction!r}")
        budget = int(budget_fraction * layout.total_bytes)
        if budget > 0:
            return budget
        given, name = budget_fraction, names[1]
    full = unscaled(layout, scale)
    least = smallest_budget(full)
    least_value = (
        _round_up(least / full.total_bytes)
        if name == names[1]
        else (_round_up(least / bytes_unit) if bytes_unit != 1 else str(least))
    )
    at = f" at the host run's sizes / {scale}" if scale != 1 else ""
    classes = len(full.classes())
    holds = "one expert" if classes == 1 else f"one expert of each of its {classes} size classes"
    raise ValueError(
        f"{_spelled(name, given)} is a budget of 0 bytes{at}; the smallest {name} that holds {holds} is {least_value}"
    )
