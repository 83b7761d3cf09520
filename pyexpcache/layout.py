"""Model layouts: how many MoE layers, how many experts each, and the byte
sizes of each expert's gate, up and down parts.

The DeepSeek V4 Flash presets use the sizes from the GGUF block formats
(IQ2_XXS: 66 B per 256 weights, Q2_K: 84 B, Q4_K: 144 B) and the model's
shape (43 layers, 256 routed experts, 4096 x 2048 gate/up and 2048 x 4096
down matrices, 8,388,608 weights each):

=========  =============  ===========  ==========
preset     gate / up      down         expert
=========  =============  ===========  ==========
q2         2.0625 MiB     2.625 MiB    6.75 MiB
q4 (Q4_K)  4.5 MiB        4.5 MiB      13.5 MiB
mixed      q4 in layers 37-42, q2 elsewhere
=========  =============  ===========  ==========
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Iterable, Optional

from ._errors import ArgumentRangeError
from ._ints import checked_int
from ._lib import MAX_EXPERTS_LIMIT, MAX_LAYERS_LIMIT, MAX_PART_BYTES_LIMIT

WEIGHTS_PER_MATRIX = 4096 * 2048
GiB = 1 << 30
NUM_LAYERS = 43
NUM_EXPERTS = 256
TOP_K = 6
FIRST_ROUTED_LAYER = 3  # layers 0-2 route by token-id hash and are absent from decode traces
MIXED_Q4_LAYERS = range(37, 43)

# Bytes per 256 weights of each GGUF block type used by the presets.
_BLOCK_BYTES = {"IQ2_XXS": 66, "Q2_K": 84, "Q4_K": 144}


def _within_limit(value, name: str, limit: int) -> int:
    """``value`` as an int in 1..``limit`` (a limit of expcache.h): TypeError for anything but an
    integer (a bool, a float such as 768.0 and a string included), ArgumentRangeError (a ValueError)
    outside."""
    try:
        return checked_int(value, name, 1, limit)
    except ArgumentRangeError:
        raise ArgumentRangeError(f"{name} must be 1..{limit} (the library's limit), got {value}") from None


def _spans(indices: list[int]) -> str:
    """Sorted indices as runs: [1, 3, 4, 5] -> "1, 3-5"."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _matrix_bytes(block: str) -> int:
    return WEIGHTS_PER_MATRIX // 256 * _BLOCK_BYTES[block]


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


@dataclass(frozen=True)
class ModelLayout:
    """An ordered list of layers. Index i is model layer i; an entry is None for a
    layer without routed experts (a dense layer), which the cache never sees. At most
    the library's 4096 layers; each entry a :class:`LayerSpec` or None (any sequence of
    them is kept as a tuple)."""

    layers: tuple[Optional[LayerSpec], ...]
    name: str = "custom"

    def __post_init__(self):
        if not isinstance(self.layers, tuple):
            object.__setattr__(self, "layers", tuple(self.layers))
        if not 1 <= len(self.layers) <= MAX_LAYERS_LIMIT:
            raise ValueError(f"a layout has 1..{MAX_LAYERS_LIMIT} layers (the library's limit), got {len(self.layers)}")
        for i, spec in enumerate(self.layers):
            if spec is not None and not isinstance(spec, LayerSpec):
                raise TypeError(f"layer {i} must be a LayerSpec or None (a dense layer), got {type(spec).__name__} "
                                f"{spec!r}")
        if not any(s is not None for s in self.layers):
            raise ValueError("a layout needs at least one MoE layer")

    # -- presets ---------------------------------------------------------
    @classmethod
    def deepseek_v4_flash(cls, quant: str = "mixed", *, scale: int = 1) -> "ModelLayout":
        """DeepSeek V4 Flash routed experts: ``quant`` is "q2", "q4" or "mixed".

        ``scale`` divides every part size (a power of two up to 65536 keeps the
        sizes exact multiples of 8), keeping layer and expert counts: the same
        slot counts at a fraction of the memory, for tests and host runs.
        """
        q2 = LayerSpec(NUM_EXPERTS, _matrix_bytes("IQ2_XXS"), _matrix_bytes("IQ2_XXS"), _matrix_bytes("Q2_K"))
        q4 = LayerSpec(NUM_EXPERTS, _matrix_bytes("Q4_K"), _matrix_bytes("Q4_K"), _matrix_bytes("Q4_K"))
        if quant == "q2":
            specs = [q2] * NUM_LAYERS
        elif quant == "q4":
            specs = [q4] * NUM_LAYERS
        elif quant == "mixed":
            specs = [q4 if i in MIXED_Q4_LAYERS else q2 for i in range(NUM_LAYERS)]
        else:
            raise ValueError(f"unknown quant {quant!r}: expected 'q2', 'q4' or 'mixed'")
        layout = cls(tuple(specs), name=f"deepseek-v4-flash-{quant}")
        return layout.scaled(scale) if scale != 1 else layout

    @classmethod
    def preset(cls, name: str, *, scale: int = 1) -> "ModelLayout":
        """``"q2"``, ``"q4"`` or ``"mixed"`` (DeepSeek V4 Flash)."""
        return cls.deepseek_v4_flash(name, scale=scale)

    # -- derived layouts -------------------------------------------------
    def scaled(self, divisor: int) -> "ModelLayout":
        """Every part size divided by ``divisor`` (which must divide each size)."""
        if divisor < 1:
            raise ValueError(f"scale divisor must be >= 1, got {divisor}")
        out = []
        for i, s in enumerate(self.layers):
            if s is None:
                out.append(None)
                continue
            if any(b % divisor for b in s.class_key):
                raise ValueError(f"layer {i}: part sizes {s.class_key} are not divisible by {divisor}")
            out.append(replace(s, gate_bytes=s.gate_bytes // divisor, up_bytes=s.up_bytes // divisor,
                               down_bytes=s.down_bytes // divisor))
        suffix = f"/{divisor}" if divisor != 1 else ""
        return ModelLayout(tuple(out), name=self.name + suffix)

    def with_experts(self, num_experts: int) -> "ModelLayout":
        """The same layout with ``num_experts`` experts per layer."""
        return ModelLayout(tuple(s and replace(s, num_experts=num_experts) for s in self.layers),
                           name=f"{self.name}x{num_experts}")

    # -- queries ---------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer: int) -> Optional[LayerSpec]:
        return self.layers[layer]

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the layers with routed experts."""
        return [i for i, s in enumerate(self.layers) if s is not None]

    @property
    def dense_layers(self) -> frozenset[int]:
        """Indices of the layers without routed experts (``None`` entries)."""
        return frozenset(i for i, s in enumerate(self.layers) if s is None)

    def no_experts_reason(self, layer: int) -> str:
        """Why ``layer`` (dense or past the last layer) has no routed experts, naming those that do."""
        where = (f"it is a dense layer of {self.name}" if 0 <= layer < self.num_layers
                 else f"{self.name} has {self.num_layers} layers")
        return (f"layer {layer} has no routed experts: {where}; "
                f"the layers with routed experts are {_spans(self.moe_layers)}")

    @property
    def total_bytes(self) -> int:
        """Bytes of every expert of every layer."""
        return sum(s.num_experts * s.expert_bytes for s in self.layers if s is not None)

    def classes(self) -> dict[tuple[int, int, int], list[int]]:
        """Size class key -> the layers in it, in first-appearance order."""
        out: dict[tuple[int, int, int], list[int]] = {}
        for i, s in enumerate(self.layers):
            if s is not None:
                out.setdefault(s.class_key, []).append(i)
        return out

    def layer_class_index(self, layers: Iterable[int] | None = None) -> list[int]:
        """For each layer (or each of ``layers``), the index of its class in :meth:`classes` order."""
        keys = list(self.classes())
        pick = self.moe_layers if layers is None else layers
        return [keys.index(self.layers[i].class_key) for i in pick]
