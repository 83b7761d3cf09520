"""Model layouts: how many MoE layers, how many experts each, and each expert's parts (gate, up
and down, or any 1..8 named parts with their byte sizes) (:class:`ModelLayout`, a :class:`LayerSpec` per layer).

A layout is described by a layout file (:meth:`ModelLayout.from_json`, written by
:meth:`ModelLayout.write_json`; :mod:`pyexpcache.layout_file`), read from a model's Hugging Face
``config.json`` (:meth:`ModelLayout.from_hf_config`; :mod:`pyexpcache.hf_config`) or from a GGUF
file (:func:`pyexpcache.gguf.layout_from_gguf`), or named as a preset of a well-known model
(:meth:`ModelLayout.preset`, :data:`PRESETS`; :mod:`pyexpcache.presets`, with the DeepSeek V4 Flash
sizes). :func:`matrix_bytes` gives the bytes of a matrix in any GGUF block type
(:mod:`pyexpcache.quant`). docs/models.md has the file format and the rules for each source.
The public names of those modules are importable from here too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Optional, Union

from ._lib import MAX_LAYERS_LIMIT
from .hf_config import layout_from_hf
from .layer_spec import LayerSpec, PartSpec, layer_spans
from .layout_file import LayoutFileError, layout_from_object, layout_to_object, read_json
from .presets import (
    FIRST_ROUTED_LAYER,
    MIXED_Q4_LAYERS,
    MODEL_CONFIGS,
    NUM_EXPERTS,
    NUM_LAYERS,
    PRESET_MODELS,
    PRESET_SOURCES,
    PRESETS,
    TOP_K,
    WEIGHTS_PER_MATRIX,
    deepseek_v4_flash_layers,
)
from .quant import matrix_bytes, quant_type, quant_types

__all__ = [
    "FIRST_ROUTED_LAYER",
    "MIXED_Q4_LAYERS",
    "NUM_EXPERTS",
    "NUM_LAYERS",
    "PRESETS",
    "PRESET_SOURCES",
    "TOP_K",
    "WEIGHTS_PER_MATRIX",
    "GiB",
    "LayerSpec",
    "LayoutFileError",
    "ModelLayout",
    "PartSpec",
    "PathLike",
    "matrix_bytes",
    "quant_type",
    "quant_types",
]

GiB = 1 << 30

PathLike = Union[str, "os.PathLike[str]"]


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
        layout = cls(tuple(deepseek_v4_flash_layers(quant)), name=f"deepseek-v4-flash-{quant}")
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
        if name not in PRESET_MODELS:
            raise ValueError(f"unknown preset {name!r}: the presets are {', '.join(PRESETS)}")
        model, quant = PRESET_MODELS[name]
        layout = cls.from_hf_config(MODEL_CONFIGS[model][0], quant, name=name)
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
        ``{"repeat": n, "layers": [...]}`` for a group of layers n times over. A layer whose
        experts have other parts lists them: ``{"experts": E, "parts": [{"name": ..., "bytes": n},
        {"name": ..., "dtype": "float32", "shape": [...]}, {"name": ..., "type": "Q4_K", "shape":
        [rows, cols]}]}`` (1..8, in slot order; :meth:`LayerSpec.of_parts`). ``"comment"`` is
        allowed in any object and ignored; any other unknown key is an error (a misspelt key
        would otherwise be lost). ``name`` defaults to the file's name without ``.json``.

        Raises :class:`LayoutFileError` (a ValueError) naming the file and the entry at fault;
        OSError when the file cannot be read. docs/models.md has examples.
        """
        if isinstance(source, Mapping):
            return layout_from_object(cls, source, "the layout", "custom")
        path = os.fspath(source)
        stem = os.path.basename(path)
        return layout_from_object(cls, read_json(path), path, stem[:-5] if stem.endswith(".json") else stem)

    def to_json(self) -> dict:
        """This layout as a layout file's contents (what :meth:`from_json` reads back equal):
        the name and each layer's byte sizes, a run of equal consecutive layers written as one
        ``{"repeat": n, "layer": ...}`` entry."""
        return layout_to_object(self)

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
        ``{"gate": ..., "up": ..., "down": ...}``: three parts); else, for ``quantization_config``'s
        ``quant_method`` ``"fp8"`` or ``"mxfp4"``, the checkpoint's stored tensors as parts, named,
        typed and shaped as transformers holds them (:mod:`pyexpcache.hf_quant`: FP8 weights and
        their block scales, MXFP4 blocks, scales and biases); else ``torch_dtype`` (or ``dtype``):
        bf16, fp16, fp32. Another ``quant_method`` warns that the sizes are the dtype's.

        ``name`` defaults to the model folder's name (or ``model_type``) and the type. Raises
        :class:`LayoutFileError` naming the missing or unusable key.
        """
        if isinstance(source, Mapping):
            config, where, default = dict(source), "the config", None
        else:
            where = os.fspath(source)
            config = read_json(where)
            parent = os.path.basename(os.path.dirname(os.path.abspath(where)))
            stem = os.path.basename(where)
            default = parent if stem == "config.json" and parent else stem.removesuffix(".json")
        return layout_from_hf(cls, config, where, quant, name, default)

    # -- derived layouts -------------------------------------------------
    def scaled(self, divisor: int) -> ModelLayout:
        """Every part size divided by ``divisor`` (which must divide each size); part names kept,
        dtypes and shapes dropped."""
        if divisor < 1:
            raise ValueError(f"scale divisor must be >= 1, got {divisor}")
        out = []
        for i, s in enumerate(self.layers):
            if s is None:
                out.append(None)
                continue
            if any(b % divisor for b in s.class_key):
                raise ValueError(f"layer {i}: part sizes {s.class_key} are not divisible by {divisor}")
            out.append(s if divisor == 1 else s.with_sizes(b // divisor for b in s.class_key))
        suffix = f"/{divisor}" if divisor != 1 else ""
        return ModelLayout(tuple(out), name=self.name + suffix)

    def with_experts(self, num_experts: int) -> ModelLayout:
        """The same layout with ``num_experts`` experts per layer."""
        return ModelLayout(
            tuple(s and s.with_experts(num_experts) for s in self.layers), name=f"{self.name}x{num_experts}"
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
            f"the layers with routed experts are {layer_spans(self.moe_layers)}"
        )

    @property
    def total_bytes(self) -> int:
        """Bytes of every expert of every layer."""
        return sum(s.num_experts * s.expert_bytes for s in self.layers if s is not None)

    def classes(self) -> dict[tuple[int, ...], list[int]]:
        """Size class key (every part's size) -> the layers in it, in first-appearance order."""
        out: dict[tuple[int, ...], list[int]] = {}
        for i, s in enumerate(self.layers):
            if s is not None:
                out.setdefault(s.class_key, []).append(i)
        return out

    def layer_class_index(self, layers: Iterable[int] | None = None) -> list[int]:
        """For each layer (or each of ``layers``), the index of its class in :meth:`classes` order."""
        keys = list(self.classes())
        pick = self.moe_layers if layers is None else layers
        return [keys.index(self.layers[i].class_key) for i in pick]
