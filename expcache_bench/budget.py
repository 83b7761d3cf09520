"""The benchmark's budget at divided sizes: the budget a run whose expert sizes are divided by a
scale needs to keep the full-size slot counts (:func:`scaled_budget`), and whether one does
(:func:`keeps_slot_counts`). The budget itself, and what the library makes of it per size class, is
:mod:`pyexpcache.budget`'s.

Dividing the part sizes by a scale does not divide the slots' alignment padding, so the same budget
divided by the scale can give other slot counts (a part of 3,456 B takes a 3,584 B stride at / 256);
:func:`scaled_budget` asks the library for both layouts' counts and picks the budget that gives the
full-size ones, or says why none does.
"""

from __future__ import annotations

from collections.abc import Sequence

from pyexpcache.budget import class_targets, least_budget, unscaled
from pyexpcache.layout import ModelLayout


def _class_name(key: Sequence[int]) -> str:
    return f"[gate {key[0]}, up {key[1]}, down {key[2]} B]"


def _keeping(layout: ModelLayout, want: list[int], guess: int) -> tuple[int, list[int]]:
    """(budget, its class targets): ``guess`` when its targets are ``want``, else the smallest
    budget whose targets reach ``want`` (they equal it unless no budget gives it)."""
    got = class_targets(layout, guess)
    if got == want:
        return guess, got
    budget = least_budget(layout, lambda targets: all(t >= w for t, w in zip(targets, want)))
    return budget, class_targets(layout, budget)


def scaled_budget(layout: ModelLayout, full_budget_bytes: int, scale: int) -> int:
    """The budget for ``layout`` (a model's experts with every part size divided by ``scale``)
    that gives each size class the slot count the full-size layout has at ``full_budget_bytes``:
    ``full_budget_bytes // scale`` when that does, else the smallest budget that does. Both
    layouts' counts are the library's (:func:`class_targets`).

    Raises ValueError when no budget gives them (the slots' alignment padding, which does not
    scale, weighs differently on the classes), naming a class whose count differs and the largest
    scale that keeps them."""
    if scale == 1:
        return full_budget_bytes
    full = unscaled(layout, scale)
    want = class_targets(full, full_budget_bytes)
    budget, got = _keeping(layout, want, max(1, full_budget_bytes // scale))
    if got == want:
        return budget
    keys = list(full.classes())
    i = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
    kept = next(
        s
        for s in (scale >> n for n in range(1, scale.bit_length()))
        if s == 1
        or (
            all(b % s == 0 for k in keys for b in k)
            and _keeping(full.scaled(s), want, max(1, full_budget_bytes // s))[1] == want
        )
    )
    raise ValueError(
        f"at sizes / {scale} no budget keeps every size class's slot count of the full-size "
        f"{full.name} at a budget of {full_budget_bytes} B: class {_class_name(keys[i])} has {want[i]} "
        f"at full size and {got[i]} at the smallest budget that gives every class at least its count "
        f"(the slots' alignment does not scale); scale {kept} keeps them"
    )


def keeps_slot_counts(layout: ModelLayout, budget_bytes: int, full_budget_bytes: int, scale: int) -> bool:
    """Whether ``budget_bytes`` gives each class of ``layout`` (sizes divided by ``scale``) the
    slot count the full-size layout has at ``full_budget_bytes``."""
    return class_targets(layout, budget_bytes) == class_targets(unscaled(layout, scale), full_budget_bytes)
