"""One MoE layer of a layout: :class:`LayerSpec`, its experts' count and part sizes, checked
against the library's limits (exported by :mod:`pyexpcache.layout` and the package)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ._errors import ArgumentRangeError
from ._ints import checked_int
from ._lib import MAX_EXPERTS_LIMIT, MAX_PART_BYTES_LIMIT

#: An expert's parts, in the order of a layer's sizes.
PARTS = ("gate", "up", "down")


def _within_limit(value, name: str, limit: int) -> int:
    """``value`` as an int in 1..``limit`` (a limit of expcache.h): TypeError for anything but an
    integer (a bool, a float such as 768.0 and a string included), ArgumentRangeError (a ValueError)
    outside."""
    try:
        return checked_int(value, name, 1, limit)
    except ArgumentRangeError:
        raise ArgumentRangeError(f"{name} must be 1..{limit} (the library's limit), got {value}") from None


def layer_spans(indices: list[int]) -> str:
    """Sorted indices as runs: [1, 3, 4, 5] -> "1, 3-5"."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


@dataclass(frozen=True)
class LayerSpec:
    """One MoE layer: ``num_experts`` experts of identical part sizes (bytes). Each is checked
    when the spec is made against the library's limits (``num_experts`` 1..65536, each part
    1..2^40 bytes): a non-integer raises TypeError, a value outside ValueError, naming the field."""

    num_experts: int
    gate_bytes: int
    up_bytes: int
    down_bytes: int

    def __post_init__(self):
        for f in fields(self):
            limit = MAX_EXPERTS_LIMIT if f.name == "num_experts" else MAX_PART_BYTES_LIMIT
            # Stored as a plain int (a numpy integer is accepted and converted).
            object.__setattr__(self, f.name, _within_limit(getattr(self, f.name), f"LayerSpec.{f.name}", limit))

    @property
    def expert_bytes(self) -> int:
        return self.gate_bytes + self.up_bytes + self.down_bytes

    @property
    def class_key(self) -> tuple[int, int, int]:
        """The size class: the exact (gate, up, down) byte layout."""
        return (self.gate_bytes, self.up_bytes, self.down_bytes)
