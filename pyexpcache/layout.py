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

Any other model is described by a layout file (:meth:`ModelLayout.from_json`, written by
:meth:`ModelLayout.write_json`), read from its Hugging Face ``config.json``
(:meth:`ModelLayout.from_hf_config`) or from a GGUF file (:func:`pyexpcache.gguf.layout_from_gguf`),
or named as a preset of a well-known model (:meth:`ModelLayout.preset`, :data:`PRESETS`).
:func:`matrix_bytes` gives the bytes of a matrix in any GGUF block type. docs/models.md has the
file format and the rules for each source.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Optional, Union

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

PathLike = Union[str, "os.PathLike[str]"]
_PARTS = ("gate", "up", "down")


class LayoutFileError(ValueError):
    """A layout file or a Hugging Face ``config.json`` that cannot be read as a layout. The
    message names the file and the entry, as ``mixtral.json: layers[0].gate.shape: ...``."""


# -- GGUF block types --------------------------------------------------------------------------

# (weights per block, bytes per block) of the GGUF types used for experts, used when the gguf
# package is not installed; with it, its GGML_QUANT_SIZES (every type it knows) is used, and
# tests/test_layout.py holds this table to it. Source: llama.cpp's gguf-py/gguf/constants.py.
_BUILTIN_BLOCKS = {
    "F32": (1, 4),
    "F16": (1, 2),
    "BF16": (1, 2),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q2_K": (256, 84),
    "Q3_K": (256, 110),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
    "IQ1_S": (256, 50),
    "IQ1_M": (256, 56),
    "IQ2_XXS": (256, 66),
    "IQ2_XS": (256, 74),
    "IQ2_S": (256, 82),
    "IQ3_XXS": (256, 98),
    "IQ3_S": (256, 110),
    "IQ4_NL": (32, 18),
    "IQ4_XS": (256, 136),
    "MXFP4": (32, 17),
}
# The unquantized types as Hugging Face configs and PyTorch spell them (upper case).
_DTYPE_NAMES = {
    "BFLOAT16": "BF16",
    "FLOAT16": "F16",
    "FP16": "F16",
    "HALF": "F16",
    "FLOAT32": "F32",
    "FP32": "F32",
    "FLOAT": "F32",
}


@functools.lru_cache(maxsize=1)
def _block_table() -> tuple[dict[str, tuple[int, int]], str]:
    """The block sizes and where they come from (for messages)."""
    try:
        from gguf.constants import GGML_QUANT_SIZES  # optional, imported when needed
    except ImportError:
        return dict(_BUILTIN_BLOCKS), "the built-in table; pip install gguf for every type it knows"
    return {t.name: (int(b), int(n)) for t, (b, n) in GGML_QUANT_SIZES.items()}, "the gguf package"


def quant_types() -> dict[str, tuple[int, int]]:
    """Every GGUF block type whose size is known here: its name -> (weights per block, bytes per
    block), e.g. ``"Q4_K": (256, 144)``. From the gguf package's ``GGML_QUANT_SIZES`` when it is
    installed, else a built-in table of the types used for experts (F32, F16, BF16, Q4_0 to
    Q8_0, the K quants Q2_K to Q6_K, the IQ quants, MXFP4)."""
    return dict(_block_table()[0])


def quant_type(name: str) -> str:
    """The GGUF type name ``name`` stands for: a GGUF type in any case (``"q4_k"`` is ``"Q4_K"``)
    or an unquantized dtype as Hugging Face and PyTorch write it (``"bfloat16"``,
    ``"torch.float16"``, ``"fp32"`` are BF16, F16, F32). ValueError for an unknown name, listing
    the known types; TypeError for anything but a string."""
    if not isinstance(name, str):
        raise TypeError(f"a quant type is a name such as 'Q4_K' or 'bf16', got {type(name).__name__} {name!r}")
    key = name.strip().upper()
    key = key[len("TORCH.") :] if key.startswith("TORCH.") else key
    key = _DTYPE_NAMES.get(key, key)
    table, origin = _block_table()
    if key not in table:
        raise ValueError(
            f"unknown quant type {name!r}: the known types ({origin}) are {', '.join(table)}; "
            "the dtypes bf16, fp16 and fp32 are BF16, F16 and F32"
        )
    return key


def matrix_bytes(quant: str, rows: int, cols: int) -> int:
    """Bytes of a ``[rows, cols]`` matrix stored in the GGUF block type ``quant`` (any name
    :func:`quant_type` takes: ``"Q4_K"``, ``"MXFP4"``, ``"bf16"``).

    ``cols`` is the row length, the contiguous dimension along which a block runs: a PyTorch
    weight ``[out_features, in_features]`` is ``[rows, cols]`` (GGUF lists the same shape the
    other way round, its ``ne[0]`` being ``cols``). An expert's gate and up matrices are
    ``[ffn, hidden]`` and its down matrix ``[hidden, ffn]``. Mixtral 8x7B's gate in Q4_K is
    ``matrix_bytes("Q4_K", 14336, 4096)`` = 14336 * 4096 / 256 * 144 = 33,030,144 bytes.

    Raises ValueError for an unknown type (listing the known ones) or a row length that is not
    a multiple of the type's block, TypeError for a size that is not an integer.
    """
    name = quant_type(quant)
    block, size = _block_table()[0][name]
    rows = checked_int(rows, "rows", 1, MAX_PART_BYTES_LIMIT)
    cols = checked_int(cols, "cols", 1, MAX_PART_BYTES_LIMIT)
    if cols % block:
        raise ValueError(
            f"a row of {cols} weights is not a multiple of the {name} block of {block} weights "
            f"(in a [rows, cols] matrix, cols is the row length)"
        )
    return rows * (cols // block) * size


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
    """A DeepSeek V4 Flash expert matrix (every row length a multiple of 256) in ``block``."""
    return matrix_bytes(block, WEIGHTS_PER_MATRIX // 4096, 4096)


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
                raise TypeError(
                    f"layer {i} must be a LayerSpec or None (a dense layer), got {type(spec).__name__} {spec!r}"
                )
        if not any(s is not None for s in self.layers):
            raise ValueError("a layout needs at least one MoE layer")

    # -- presets ---------------------------------------------------------
    @classmethod
    def deepseek_v4_flash(cls, quant: str = "mixed", *, scale: int = 1) -> ModelLayout:
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
    def preset(cls, name: str, *, scale: int = 1) -> ModelLayout:
        """A well-known model's routed experts, by name (:data:`PRESETS` lists them, with the
        source of their numbers in :data:`PRESET_SOURCES`): ``"q2"``, ``"q4"`` or ``"mixed"``
        (DeepSeek V4 Flash, also ``"deepseek-v4-flash-mixed"`` etc.), ``"mixtral-8x7b-q4k"``,
        ``"qwen3-30b-a3b-bf16"``, ``"olmoe-1b-7b-bf16"``, ``"deepseek-v3-q4k"``,
        ``"gpt-oss-20b-mxfp4"``. The layout is named after the preset. ``scale`` divides every
        part size (see :meth:`scaled`). ValueError for an unknown name, listing the presets."""
        flash = name.removeprefix("deepseek-v4-flash-") if name.startswith("deepseek-v4-flash-") else name
        if flash in ("q2", "q4", "mixed"):
            return cls.deepseek_v4_flash(flash, scale=scale)
        if name not in _PRESETS:
            raise ValueError(f"unknown preset {name!r}: the presets are {', '.join(PRESETS)}")
        model, quant = _PRESETS[name]
        layout = cls.from_hf_config(_MODEL_CONFIGS[model][0], quant, name=name)
        return layout.scaled(scale) if scale != 1 else layout

    # -- layout files ----------------------------------------------------
    @classmethod
    def from_json(cls, source: Union[PathLike, Mapping]) -> ModelLayout:
        """A layout from a layout file (a path) or its parsed contents (a dict).

        The file is ``{"name": str, "layers": [...]}`` with one entry per model layer: ``null``
        for a dense layer, or ``{"experts": E, "gate_bytes": g, "up_bytes": u, "down_bytes": d}``.
        Shorthands: a part as a GGUF type and a ``[rows, cols]`` shape instead of its bytes
        (``"gate": {"type": "Q4_K", "shape": [14336, 4096]}``, sized by :func:`matrix_bytes`),
        with a default ``"type"`` (or ``"dtype"``) at the top, in a layer or in a repeat; and
        ``{"repeat": n, "layer": {...}}`` (or ``null``) for n equal layers, or
        ``{"repeat": n, "layers": [...]}`` for a group of layers n times over. ``"comment"`` is
        allowed in any object and ignored; any other unknown key is an error (a misspelt key
        would otherwise be lost). ``name`` defaults to the file's name without ``.json``.

        Raises :class:`LayoutFileError` (a ValueError) naming the file and the entry at fault;
        OSError when the file cannot be read. docs/models.md has examples.
        """
        if isinstance(source, Mapping):
            return _layout_from_object(source, "the layout", "custom")
        path = os.fspath(source)
        stem = os.path.basename(path)
        return _layout_from_object(_read_json(path), path, stem[:-5] if stem.endswith(".json") else stem)

    def to_json(self) -> dict:
        """This layout as a layout file's contents (what :meth:`from_json` reads back equal):
        the name and each layer's byte sizes, a run of equal consecutive layers written as one
        ``{"repeat": n, "layer": ...}`` entry."""
        entries: list = []
        i = 0
        while i < len(self.layers):
            spec, run = self.layers[i], 1
            while i + run < len(self.layers) and self.layers[i + run] == spec:
                run += 1
            item = (
                None
                if spec is None
                else {
                    "experts": spec.num_experts,
                    "gate_bytes": spec.gate_bytes,
                    "up_bytes": spec.up_bytes,
                    "down_bytes": spec.down_bytes,
                }
            )
            entries.append(item if run == 1 else {"repeat": run, "layer": item})
            i += run
        return {"name": self.name, "layers": entries}

    def write_json(self, path: PathLike) -> None:
        """Write :meth:`to_json` to ``path`` as a layout file (JSON, two-space indent)."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=2)
            f.write("\n")

    # -- Hugging Face configs --------------------------------------------
    @classmethod
    def from_hf_config(
        cls,
        source: Union[PathLike, Mapping],
        quant: Union[str, Mapping[str, str], None] = None,
        *,
        name: Optional[str] = None,
    ) -> ModelLayout:
        """The routed experts of a model described by its Hugging Face ``config.json`` (a path
        or the parsed dict; transformers is not needed).

        Read: ``num_hidden_layers``; the routed experts per layer (``num_local_experts``,
        ``num_experts``, ``n_routed_experts`` or ``moe_num_experts``); ``hidden_size``; an
        expert's FFN width (``moe_intermediate_size``, else ``intermediate_size``); and which
        layers have experts, as transformers' modeling code of each family chooses them. A list
        of the layers decides alone (as in transformers, where it overrides the keys it is made
        from): ``mlp_layer_types`` (GLM-4.7-Flash, DeepSeek V3.2/V4, ...: ``"sparse"``,
        ``"moe"`` or ``"hash_moe"`` per layer, else ``"dense"``), ``moe_layers`` (Llama 4),
        ``moe_layers_enum`` (Step 3.7), ``layers_num_experts`` (Jamba: more than 1); two lists
        that disagree are refused. Else layer i has experts when every rule the config has
        holds: ``mlp_only_layers`` does not list it and ``(i + 1) % decoder_sparse_step == 0``
        (Qwen2-MoE, Qwen3-MoE); ``(i + 1) % interleave_moe_layer_step == 0`` (Llama 4); ``i >=
        first_k_dense_replace`` and ``i % moe_layer_freq == 0``, or ``moe_layer_freq[i]`` for a
        list (DeepSeek V2/V3, Kimi K2, GLM-4.5, dots.llm3); ``i >= num_dense_layers`` (AFMoE,
        LFM2-MoE) or ``dense_mlp_idx``; ``i % expert_layer_period == expert_layer_offset``
        (Jamba); ``moe_layer_start_index <= i <= moe_layer_end_index`` (-1: the last) and ``(i +
        1) % moe_layer_interval == 0`` (ERNIE 4.5); ``enable_moe_block`` (Gemma 4). A rule key
        left out takes transformers' default for the ``model_type`` where that is not the
        neutral value (Jamba: period 2, offset 1; ERNIE 4.5: start 1; AFMoE: 1 and LFM2-MoE: 2
        dense layers). A model with none of them (Mixtral, OLMoE, GPT-OSS) has experts in every
        layer. Refused, as rules this reader does not implement: Nemotron-H's
        ``hybrid_override_pattern`` or a ``layers_block_type`` with ``"moe"`` blocks (its experts
        have no gate, either), dots.llm3's ``pyramid_num_routed``, a ``per_layer_config``
        overriding any key read here, and a list of experts or FFN widths per layer. A config
        whose model sits under ``text_config`` (a multimodal wrapper) is read there. Gate and up
        are ``[ffn, hidden]``, down ``[hidden, ffn]``.

        The stored type: ``quant`` when given (a GGUF type or dtype for every part, or a dict
        ``{"gate": ..., "up": ..., "down": ...}``); else MXFP4 for ``quantization_config``'s
        ``quant_method`` ``"mxfp4"`` (GPT-OSS's experts: 4-bit values and a shared scale per 32
        weights, 17 bytes, GGUF's MXFP4 block); else ``torch_dtype`` (or ``dtype``): bf16, fp16,
        fp32. Another ``quant_method`` (fp8, ...) warns that the sizes are the dtype's.

        ``name`` defaults to the model folder's name (or ``model_type``) and the type. Raises
        :class:`LayoutFileError` naming the missing or unusable key.
        """
        if isinstance(source, Mapping):
            config, where, default = dict(source), "the config", None
        else:
            where = os.fspath(source)
            config = _read_json(where)
            parent = os.path.basename(os.path.dirname(os.path.abspath(where)))
            stem = os.path.basename(where)
            default = parent if stem == "config.json" and parent else stem.removesuffix(".json")
        return _layout_from_hf(cls, config, where, quant, name, default)

    # -- derived layouts -------------------------------------------------
    def scaled(self, divisor: int) -> ModelLayout:
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
            out.append(
                replace(
                    s,
                    gate_bytes=s.gate_bytes // divisor,
                    up_bytes=s.up_bytes // divisor,
                    down_bytes=s.down_bytes // divisor,
                )
            )
        suffix = f"/{divisor}" if divisor != 1 else ""
        return ModelLayout(tuple(out), name=self.name + suffix)

    def with_experts(self, num_experts: int) -> ModelLayout:
        """The same layout with ``num_experts`` experts per layer."""
        return ModelLayout(
            tuple(s and replace(s, num_experts=num_experts) for s in self.layers), name=f"{self.name}x{num_experts}"
        )

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
        where = (
            f"it is a dense layer of {self.name}"
            if 0 <= layer < self.num_layers
            else f"{self.name} has {self.num_layers} layers"
        )
        return (
            f"layer {layer} has no routed experts: {where}; "
            f"the layers with routed experts are {_spans(self.moe_layers)}"
        )

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


# -- reading layout files ----------------------------------------------------------------------


def _read_json(path: str):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise LayoutFileError(f"{path}: not JSON: {exc}") from None


def _shown(value) -> str:
    """A value as JSON writes it, for messages."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


class _File:
    """One layout file being read: its name for messages, and the checks that name the entry."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, at: str, message: str) -> LayoutFileError:
        return LayoutFileError(f"{self.where}: {at}: {message}")

    def keys(self, obj, at: str, allowed: tuple) -> None:
        if not isinstance(obj, Mapping):
            raise self.fail(at, f"expected an object, got {_shown(obj)}")
        unknown = [k for k in obj if k not in allowed and k != "comment"]
        if unknown:
            raise self.fail(at, f"unknown key {', '.join(map(repr, unknown))}; expected {', '.join(allowed)}")

    def whole(self, value, at: str, limit: int) -> int:
        try:
            return checked_int(value, at, 1, limit)
        except TypeError:
            raise self.fail(at, f"expected a whole number, got {_shown(value)}") from None
        except ArgumentRangeError:
            raise self.fail(at, f"must be 1..{limit} (the library's limit), got {value}") from None

    def type_at(self, obj, at: str, inherited: Optional[str]) -> Optional[str]:
        """The type ``obj`` gives ("type" or "dtype"), else ``inherited``."""
        given = [k for k in ("type", "dtype") if k in obj]
        if len(given) > 1:
            raise self.fail(at, 'give "type" or "dtype", not both')
        if not given:
            return inherited
        try:
            return quant_type(obj[given[0]])
        except (TypeError, ValueError) as exc:
            raise self.fail(f"{at}.{given[0]}", str(exc)) from None

    def part_bytes(self, layer, at: str, part: str, quant: Optional[str]) -> int:
        key = f"{part}_bytes"
        if key in layer and part in layer:
            raise self.fail(at, f'give "{key}" or "{part}", not both')
        if key in layer:
            return self.whole(layer[key], f"{at}.{key}", MAX_PART_BYTES_LIMIT)
        if part not in layer:
            raise self.fail(at, f'no "{key}" (or "{part}": {{"type": ..., "shape": [rows, cols]}})')
        here = f"{at}.{part}"
        spec = layer[part]
        self.keys(spec, here, ("type", "dtype", "shape"))
        quant = self.type_at(spec, here, quant)
        if quant is None:
            raise self.fail(here, 'no type: give "type" here, in the layer or at the top of the file')
        shape = spec.get("shape")
        if not isinstance(shape, list) or len(shape) != 2:
            raise self.fail(f"{here}.shape", f"expected [rows, cols], got {_shown(shape)}")
        rows, cols = (self.whole(v, f"{here}.shape[{k}]", MAX_PART_BYTES_LIMIT) for k, v in enumerate(shape))
        try:
            return matrix_bytes(quant, rows, cols)
        except ValueError as exc:
            raise self.fail(here, str(exc)) from None

    def layer(self, entry, at: str, quant: Optional[str]) -> Optional[LayerSpec]:
        if entry is None:
            return None
        self.keys(entry, at, ("experts", "type", "dtype") + _PARTS + tuple(f"{p}_bytes" for p in _PARTS))
        quant = self.type_at(entry, at, quant)
        if "experts" not in entry:
            raise self.fail(at, 'no "experts" (the number of routed experts; null is a dense layer)')
        experts = self.whole(entry["experts"], f"{at}.experts", MAX_EXPERTS_LIMIT)
        sizes = [self.part_bytes(entry, at, p, quant) for p in _PARTS]
        try:
            return LayerSpec(experts, *sizes)
        except (TypeError, ValueError) as exc:
            raise self.fail(at, str(exc)) from None

    def layer_list(self, entries, at: str, quant: Optional[str]) -> list[Optional[LayerSpec]]:
        if not isinstance(entries, list):
            raise self.fail(at, f"expected a list of layers, got {_shown(entries)}")
        out: list[Optional[LayerSpec]] = []
        for i, entry in enumerate(entries):
            here = f"{at}[{i}]"
            if isinstance(entry, Mapping) and "repeat" in entry:
                self.keys(entry, here, ("repeat", "layer", "layers", "type", "dtype"))
                times = self.whole(entry["repeat"], f"{here}.repeat", MAX_LAYERS_LIMIT)
                inner = self.type_at(entry, here, quant)
                if ("layer" in entry) == ("layers" in entry):
                    raise self.fail(
                        here,
                        'a repeat takes "layer" (one layer, or null) or "layers" (a group of '
                        "layers, repeated in order)",
                    )
                group = (
                    [self.layer(entry["layer"], f"{here}.layer", inner)]
                    if "layer" in entry
                    else self.layer_list(entry["layers"], f"{here}.layers", inner)
                )
                if not group:
                    raise self.fail(f"{here}.layers", "an empty group")
                added = group * times if len(out) + times * len(group) <= MAX_LAYERS_LIMIT else None
            else:
                added = [self.layer(entry, here, quant)]
            if added is None or len(out) + len(added) > MAX_LAYERS_LIMIT:
                raise self.fail(here, f"the layers pass the library's limit of {MAX_LAYERS_LIMIT}")
            out.extend(added)
        return out


def _looks_like_hf_config(obj) -> bool:
    return isinstance(obj, Mapping) and ("model_type" in obj or "architectures" in obj)


def _layout_from_object(obj, where: str, default_name: str) -> ModelLayout:
    file = _File(where)
    if not isinstance(obj, Mapping):
        raise LayoutFileError(f'{where}: expected an object {{"name": ..., "layers": [...]}}, got {_shown(obj)}')
    if "layers" not in obj:
        hint = (
            ": this looks like a Hugging Face config.json (ModelLayout.from_hf_config reads it)"
            if _looks_like_hf_config(obj)
            else ""
        )
        raise LayoutFileError(f'{where}: no "layers" list{hint}')
    file.keys(obj, "top level", ("name", "layers", "type", "dtype"))
    name = obj.get("name", default_name)
    if not isinstance(name, str) or not name:
        raise file.fail("name", f"expected a non-empty string, got {_shown(name)}")
    layers = file.layer_list(obj["layers"], "layers", file.type_at(obj, "top level", None))
    try:
        return ModelLayout(tuple(layers), name=name)
    except ValueError as exc:
        raise file.fail("layers", str(exc)) from None


# -- reading Hugging Face configs --------------------------------------------------------------

_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_FFN_KEYS = ("moe_intermediate_size", "intermediate_size")


def _layout_from_hf(cls, config, where: str, quant, name: Optional[str], default_name: Optional[str]):
    if not isinstance(config, Mapping):
        raise LayoutFileError(f"{where}: expected a JSON object, got {_shown(config)}")
    if not any(config.get(k) is not None for k in _EXPERT_KEYS) and isinstance(config.get("text_config"), Mapping):
        outer, config = config, config["text_config"]
        where = f"{where} (text_config)"
        config = dict(
            config,
            **{k: outer[k] for k in ("torch_dtype", "dtype", "quantization_config") if k in outer and k not in config},
        )
    model = config.get("model_type") or (config.get("architectures") or [None])[0] or "model"
    file = _File(where)
    _refuse_unread_rules(config, file)

    def number(keys: tuple, what: str, lowest: int = 1) -> tuple[str, int]:
        key = next((k for k in keys if config.get(k) is not None), None)
        if key is None:
            raise LayoutFileError(
                f"{where}: no {' or '.join(map(repr, keys))} key ({what}) in this {model} config; "
                "a layout file describes any model (docs/models.md)"
            )
        try:
            return key, checked_int(config[key], key, lowest, MAX_PART_BYTES_LIMIT)
        except (TypeError, ArgumentRangeError):
            if isinstance(config[key], list):
                raise file.fail(
                    key,
                    f"a list, one value per layer ({what}), which this reader does not implement: a "
                    "layout file gives each layer its own (docs/models.md)",
                ) from None
            raise file.fail(key, f"expected a whole number >= {lowest} ({what}), got {_shown(config[key])}") from None

    _, num_layers = number(("num_hidden_layers",), "the number of layers")
    key, experts = number(_EXPERT_KEYS, "the routed experts per layer", lowest=0)
    if experts == 0:
        raise file.fail(key, "0 routed experts: not a mixture-of-experts model")
    _, hidden = number(("hidden_size",), "the model width")
    _, ffn = number(_FFN_KEYS, "an expert's FFN width")
    routed = _routed_layers(config, model, num_layers, file)
    types = _hf_types(config, quant, file)
    try:
        gate = matrix_bytes(types[0], ffn, hidden)
        up = matrix_bytes(types[1], ffn, hidden)
        down = matrix_bytes(types[2], hidden, ffn)
        spec = LayerSpec(experts, gate, up, down)
    except (TypeError, ValueError) as exc:
        raise LayoutFileError(
            f"{where}: experts of [{ffn}, {hidden}] gate/up and [{hidden}, {ffn}] down in {'/'.join(types)}: {exc}"
        ) from None

    label = types[0].lower() if len(set(types)) == 1 else "-".join(t.lower() for t in types)
    name = name or f"{default_name or model}-{label}"
    try:
        return cls(tuple(spec if i in routed else None for i in range(num_layers)), name=name)
    except ValueError as exc:
        raise LayoutFileError(f"{where}: {exc}") from None


# Which layers have routed experts: the config keys that transformers' modeling code reads to choose
# (or that its config class builds the list it reads from). Keys giving the layers as a list: a
# list decides alone, as in transformers (Llama 4's moe_layers overrides interleave_moe_layer_step;
# mlp_layer_types is built from first_k_dense_replace and the like only when a config has none).
_LAYER_LISTS = (
    "mlp_layer_types",  # GLM-4.7-Flash, DeepSeek V3.2/V4, ...: "sparse", "moe", "hash_moe" or "dense"
    "moe_layers",  # Llama 4: the MoE layers' numbers
    "moe_layers_enum",  # Step 3.7: the same, as a list or a comma-separated string
    "layers_num_experts",
)  # Jamba (a property, in a dict made from the config): 1 for a dense layer
# Rules over the layer number: every one the config has must hold.
_LAYER_RULES = (
    "mlp_only_layers",
    "decoder_sparse_step",
    "interleave_moe_layer_step",
    "first_k_dense_replace",
    "moe_layer_freq",
    "num_dense_layers",
    "dense_mlp_idx",
    "expert_layer_period",
    "expert_layer_offset",
    "moe_layer_start_index",
    "moe_layer_end_index",
    "moe_layer_interval",
    "enable_moe_block",
)
# transformers' default for a rule key a config leaves out, where it is not the value that keeps every layer.
_RULE_DEFAULTS = {
    "jamba": {"expert_layer_period": 2, "expert_layer_offset": 1},
    "ernie4_5_moe": {"moe_layer_start_index": 1},
    "afmoe": {"num_dense_layers": 1},
    "lfm2_moe": {"num_dense_layers": 2},
}
# Keys that choose layers (or give them their own experts) by rules this reader does not implement.
_UNREAD_RULES = {
    "hybrid_override_pattern": "Nemotron-H's block pattern (each layer is Mamba, attention, an MLP or the experts, "
    "which have no gate: up_proj only, not the gate/up/down parts of a layout entry)",
    "layers_block_type": "Nemotron-H's block types (each layer is Mamba, attention, an MLP or the experts, which have "
    "no gate: up_proj only, not the gate/up/down parts of a layout entry)",
    "pyramid_num_routed": "dots.llm3's routed experts per layer (a number of its own for each layer)",
    "per_layer_config": "per-layer overrides of the keys read here (a heterogeneous model)",
}
# What a per-layer override may not touch: every key the reader reads.
_READ_KEYS = frozenset(
    (
        "num_hidden_layers",
        "hidden_size",
        "torch_dtype",
        "dtype",
        "quantization_config",
        *_EXPERT_KEYS,
        *_FFN_KEYS,
        *_LAYER_LISTS,
        *_LAYER_RULES,
        *_UNREAD_RULES,
    )
)


def _refuse_unread_rules(config, file: _File) -> None:
    """A LayoutFileError for a key of ``_UNREAD_RULES`` that the config uses."""
    for key, what in _UNREAD_RULES.items():
        value = config.get(key)
        if key == "layers_block_type" and isinstance(value, list) and "moe" not in value:
            continue  # Jamba's and GraniteMoeHybrid's: Mamba or attention, experts in every layer
        if key == "per_layer_config" and isinstance(value, Mapping):
            touched = sorted({k for v in value.values() if isinstance(v, Mapping) for k in v} & _READ_KEYS)
            if not touched:
                continue
            what = f"per-layer overrides of {', '.join(touched)} (a heterogeneous model)"
        if value not in (None, [], {}, ""):
            raise file.fail(
                key, f"{what}: this reader does not implement it; a layout file describes the model (docs/models.md)"
            )


def _routed_layers(config, model: str, num_layers: int, file: _File) -> frozenset[int]:
    """The layers with routed experts (see from_hf_config): by the config's layer list, else by
    its rules over the layer number."""
    lists = [
        (key, _listed_layers(config[key], key, num_layers, file)) for key in _LAYER_LISTS if config.get(key) is not None
    ]
    for other, theirs in lists[1:]:
        if theirs != lists[0][1]:
            shown = "; ".join(f"{k} gives {_spans(sorted(v)) or 'none'}" for k, v in (lists[0], (other, theirs)))
            raise LayoutFileError(
                f"{file.where}: the layers with routed experts differ by key ({shown}); which one "
                f"this {model} model's code reads depends on its family: a layout file describes "
                "it (docs/models.md)"
            )
    if lists:
        return lists[0][1]
    rules = {
        **_RULE_DEFAULTS.get(config.get("model_type"), {}),
        **{k: config[k] for k in _LAYER_RULES if config.get(k) is not None},
    }
    return _ruled_layers(rules, num_layers, file)


def _listed_layers(value, key: str, num_layers: int, file: _File) -> frozenset[int]:
    """The MoE layers a layer list (``_LAYER_LISTS``) gives."""
    if key == "moe_layers_enum" and isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
        value = [int(v) if v.isdigit() else v for v in value]
    if not isinstance(value, list):
        raise file.fail(key, f"expected a list, got {_shown(value)}")
    if key == "mlp_layer_types":
        kinds = {"sparse": True, "moe": True, "hash_moe": True, "dense": False}
        if any(not isinstance(v, str) or v not in kinds for v in value) or len(value) != num_layers:
            raise file.fail(
                key,
                f"expected one of {', '.join(map(repr, kinds))} for each of the {num_layers} layers, "
                f"got {_shown(value)}",
            )
        return frozenset(i for i, v in enumerate(value) if kinds[v])
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value):
        raise file.fail(key, f"expected whole numbers >= 0, got {_shown(value)}")
    if key == "layers_num_experts":
        if len(value) != num_layers:
            raise file.fail(key, f"expected one number for each of the {num_layers} layers, got {_shown(value)}")
        return frozenset(i for i, v in enumerate(value) if v > 1)
    if key == "moe_layers" and any(v >= num_layers for v in value):
        raise file.fail(key, f"expected layer numbers below {num_layers}, got {_shown(value)}")
    return frozenset(v for v in value if v < num_layers)  # Step 3.7 lists its MTP layers past the last one too


def _ruled_layers(rules: dict, num_layers: int, file: _File) -> frozenset[int]:
    """The MoE layers by the rules over the layer number (``_LAYER_RULES``) in ``rules``."""

    def whole(key: str, lowest: int, what: str) -> Optional[int]:
        if rules.get(key) is None:
            return None
        try:
            return checked_int(rules[key], key, lowest, MAX_PART_BYTES_LIMIT)
        except (TypeError, ArgumentRangeError):
            raise file.fail(key, f"expected a whole number >= {lowest} ({what}), got {_shown(rules[key])}") from None

    only = rules.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
        raise file.fail("mlp_only_layers", f"expected a list of layer numbers, got {_shown(only)}")
    freq = rules.get("moe_layer_freq")
    if isinstance(freq, list):  # dots.llm3, MiniMax-M3: a flag per layer
        if len(freq) != num_layers or any(not isinstance(f, (bool, int)) for f in freq):
            raise file.fail(
                "moe_layer_freq",
                f"expected a whole number, or a flag for each of the {num_layers} layers, got {_shown(freq)}",
            )
        flags = [bool(f) for f in freq]
    else:
        every = whole("moe_layer_freq", 1, "MoE every n-th layer") or 1
        flags = [i % every == 0 for i in range(num_layers)]
    enabled = rules.get("enable_moe_block", True)
    if not isinstance(enabled, bool):
        raise file.fail("enable_moe_block", f"expected true or false, got {_shown(enabled)}")
    step = whole("decoder_sparse_step", 1, "MoE every n-th layer") or 1
    interleave = whole("interleave_moe_layer_step", 1, "MoE every n-th layer") or 1
    first = max(
        whole(k, 0, "dense layers first") or 0 for k in ("first_k_dense_replace", "num_dense_layers", "dense_mlp_idx")
    )
    period = whole("expert_layer_period", 1, "MoE every n-th layer") or 1
    offset = whole("expert_layer_offset", 0, "the first MoE layer of each period") or 0
    if offset >= period:
        raise file.fail("expert_layer_offset", f"must be below expert_layer_period ({period}), got {offset}")
    start = whole("moe_layer_start_index", 0, "the first MoE layer") or 0
    end = None if rules.get("moe_layer_end_index") == -1 else whole("moe_layer_end_index", 0, "the last MoE layer")
    end = num_layers - 1 if end is None else end  # ERNIE's -1: up to the last layer
    interval = whole("moe_layer_interval", 1, "MoE every n-th layer") or 1
    return frozenset(
        i
        for i in range(num_layers)
        if enabled
        and i not in only
        and (i + 1) % step == 0
        and (i + 1) % interleave == 0
        and i >= first
        and flags[i]
        and i % period == offset
        and start <= i <= end
        and (i + 1) % interval == 0
    )


def _hf_types(config, quant, file: _File) -> tuple[str, str, str]:
    """The GGUF type of gate, up and down: ``quant``, else the config's (see from_hf_config)."""
    if isinstance(quant, Mapping):
        if sorted(quant) != sorted(_PARTS):
            raise ValueError(f"quant as a dict names gate, up and down, got {', '.join(map(str, quant))}")
        return tuple(quant_type(quant[p]) for p in _PARTS)
    if quant is not None:
        return (quant_type(quant),) * 3
    qconfig = config.get("quantization_config")
    method = qconfig.get("quant_method") if isinstance(qconfig, Mapping) else None
    if method == "mxfp4":
        return ("MXFP4",) * 3
    key = next((k for k in ("torch_dtype", "dtype") if config.get(k) is not None), None)
    if key is None:
        raise LayoutFileError(
            f"{file.where}: no 'torch_dtype' or 'dtype' key (the experts' type): give the type "
            "(quant=..., or --layout CONFIG.json:TYPE)"
        )
    try:
        dtype = quant_type(config[key])
    except (TypeError, ValueError) as exc:
        raise file.fail(key, str(exc)) from None
    if method is not None:
        warnings.warn(
            f"{file.where}: the weights are stored as {method} (quantization_config) but the layout has "
            f"{dtype} sizes ({key}); give the stored type (quant=..., or --layout CONFIG.json:TYPE)",
            stacklevel=4,
        )
    return (dtype,) * 3


# -- presets -----------------------------------------------------------------------------------

# The config.json numbers of well-known MoE models that from_hf_config reads (the files' other
# keys left out), each with its source. The presets give the type explicitly.
_MODEL_CONFIGS = {
    "mixtral-8x7b": (
        dict(
            model_type="mixtral", num_hidden_layers=32, num_local_experts=8, hidden_size=4096, intermediate_size=14336
        ),
        "https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json",
    ),
    "qwen3-30b-a3b": (
        dict(
            model_type="qwen3_moe",
            num_hidden_layers=48,
            num_experts=128,
            hidden_size=2048,
            moe_intermediate_size=768,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
        "https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json",
    ),
    "olmoe-1b-7b": (
        dict(model_type="olmoe", num_hidden_layers=16, num_experts=64, hidden_size=2048, intermediate_size=1024),
        "https://huggingface.co/allenai/OLMoE-1B-7B-0924/blob/main/config.json",
    ),
    "deepseek-v3": (
        dict(
            model_type="deepseek_v3",
            num_hidden_layers=61,
            n_routed_experts=256,
            hidden_size=7168,
            moe_intermediate_size=2048,
            first_k_dense_replace=3,
            moe_layer_freq=1,
        ),
        "https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json",
    ),
    "gpt-oss-20b": (
        dict(
            model_type="gpt_oss", num_hidden_layers=24, num_local_experts=32, hidden_size=2880, intermediate_size=2880
        ),
        "https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json",
    ),
}
# Preset name -> (model, type of every expert matrix).
_PRESETS = {
    "mixtral-8x7b-q4k": ("mixtral-8x7b", "Q4_K"),
    "qwen3-30b-a3b-bf16": ("qwen3-30b-a3b", "BF16"),
    "olmoe-1b-7b-bf16": ("olmoe-1b-7b", "BF16"),
    "deepseek-v3-q4k": ("deepseek-v3", "Q4_K"),
    "gpt-oss-20b-mxfp4": ("gpt-oss-20b", "MXFP4"),
}
#: Every name :meth:`ModelLayout.preset` takes.
PRESETS = ("q2", "q4", "mixed", "deepseek-v4-flash-q2", "deepseek-v4-flash-q4", "deepseek-v4-flash-mixed", *_PRESETS)
#: Where each preset's numbers come from.
PRESET_SOURCES = {
    **{
        n: "the antirez/ds4 engine's issue #503 and PR #504 (DeepSeek V4 Flash: 43 layers x 256 experts, "
        "[2048, 4096] gate/up, [4096, 2048] down)"
        for n in PRESETS[:6]
    },
    **{n: _MODEL_CONFIGS[model][1] for n, (model, _) in _PRESETS.items()},
}
