"""Layouts read from a model's Hugging Face ``config.json`` (no transformers needed): the keys
each model family's code reads for the layer count, the routed experts, the widths, the stored
type and which layers have experts (:meth:`~pyexpcache.ModelLayout.from_hf_config` says which)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Optional

from ._errors import ArgumentRangeError
from ._ints import checked_int
from ._lib import MAX_PART_BYTES_LIMIT
from .hf_quant import QUANT_METHODS, quantized_parts
from .layer_spec import PARTS, LayerSpec, layer_spans
from .layout_file import LayoutFile, LayoutFileError, shown
from .quant import matrix_bytes, quant_type

_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_FFN_KEYS = ("moe_intermediate_size", "intermediate_size")


def layout_from_hf(cls, config, where: str, quant, name: Optional[str], default_name: Optional[str]):
    """A ``cls`` (:class:`~pyexpcache.ModelLayout`) from a Hugging Face config's parsed contents
    ``config``, read from ``where`` (see :meth:`~pyexpcache.ModelLayout.from_hf_config`)."""
    if not isinstance(config, Mapping):
        raise LayoutFileError(f"{where}: expected a JSON object, got {shown(config)}")
    if not any(config.get(k) is not None for k in _EXPERT_KEYS) and isinstance(config.get("text_config"), Mapping):
        outer, config = config, config["text_config"]
        where = f"{where} (text_config)"
        config = dict(
            config,
            **{k: outer[k] for k in ("torch_dtype", "dtype", "quantization_config") if k in outer and k not in config},
        )
    model = config.get("model_type") or (config.get("architectures") or [None])[0] or "model"
    file = LayoutFile(where)
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
            raise file.fail(key, f"expected a whole number >= {lowest} ({what}), got {shown(config[key])}") from None

    _, num_layers = number(("num_hidden_layers",), "the number of layers")
    key, experts = number(_EXPERT_KEYS, "the routed experts per layer", lowest=0)
    if experts == 0:
        raise file.fail(key, "0 routed experts: not a mixture-of-experts model")
    _, hidden = number(("hidden_size",), "the model width")
    ffn_key, ffn = number(_FFN_KEYS, "an expert's FFN width")
    routed = _routed_layers(config, model, num_layers, file)
    qconfig = config.get("quantization_config")
    method = qconfig.get("quant_method") if isinstance(qconfig, Mapping) else None
    if quant is None and method in QUANT_METHODS:
        parts, label = quantized_parts(config, qconfig, hidden, ffn, ffn_key, file)
        spec = LayerSpec.of_parts(experts, parts)
    else:
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


def _refuse_unread_rules(config, file: LayoutFile) -> None:
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


def _routed_layers(config, model: str, num_layers: int, file: LayoutFile) -> frozenset[int]:
    """The layers with routed experts (see from_hf_config): by the config's layer list, else by
    its rules over the layer number."""
    lists = [
        (key, _listed_layers(config[key], key, num_layers, file)) for key in _LAYER_LISTS if config.get(key) is not None
    ]
    for other, theirs in lists[1:]:
        if theirs != lists[0][1]:
            given = "; ".join(f"{k} gives {layer_spans(sorted(v)) or 'none'}" for k, v in (lists[0], (other, theirs)))
            raise LayoutFileError(
                f"{file.where}: the layers with routed experts differ by key ({given}); which one "
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


def _listed_layers(value, key: str, num_layers: int, file: LayoutFile) -> frozenset[int]:
    """The MoE layers a layer list (``_LAYER_LISTS``) gives."""
    if key == "moe_layers_enum" and isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
        value = [int(v) if v.isdigit() else v for v in value]
    if not isinstance(value, list):
        raise file.fail(key, f"expected a list, got {shown(value)}")
    if key == "mlp_layer_types":
        kinds = {"sparse": True, "moe": True, "hash_moe": True, "dense": False}
        if any(not isinstance(v, str) or v not in kinds for v in value) or len(value) != num_layers:
            raise file.fail(
                key,
                f"expected one of {', '.join(map(repr, kinds))} for each of the {num_layers} layers, "
                f"got {shown(value)}",
            )
        return frozenset(i for i, v in enumerate(value) if kinds[v])
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value):
        raise file.fail(key, f"expected whole numbers >= 0, got {shown(value)}")
    if key == "layers_num_experts":
        if len(value) != num_layers:
            raise file.fail(key, f"expected one number for each of the {num_layers} layers, got {shown(value)}")
        return frozenset(i for i, v in enumerate(value) if v > 1)
    if key == "moe_layers" and any(v >= num_layers for v in value):
        raise file.fail(key, f"expected layer numbers below {num_layers}, got {shown(value)}")
    return frozenset(v for v in value if v < num_layers)  # Step 3.7 lists its MTP layers past the last one too


def _ruled_layers(rules: dict, num_layers: int, file: LayoutFile) -> frozenset[int]:
    """The MoE layers by the rules over the layer number (``_LAYER_RULES``) in ``rules``."""

    def whole(key: str, lowest: int, what: str) -> Optional[int]:
        if rules.get(key) is None:
            return None
        try:
            return checked_int(rules[key], key, lowest, MAX_PART_BYTES_LIMIT)
        except (TypeError, ArgumentRangeError):
            raise file.fail(key, f"expected a whole number >= {lowest} ({what}), got {shown(rules[key])}") from None

    only = rules.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
        raise file.fail("mlp_only_layers", f"expected a list of layer numbers, got {shown(only)}")
    freq = rules.get("moe_layer_freq")
    if isinstance(freq, list):  # dots.llm3, MiniMax-M3: a flag per layer
        if len(freq) != num_layers or any(not isinstance(f, (bool, int)) for f in freq):
            raise file.fail(
                "moe_layer_freq",
                f"expected a whole number, or a flag for each of the {num_layers} layers, got {shown(freq)}",
            )
        flags = [bool(f) for f in freq]
    else:
        every = whole("moe_layer_freq", 1, "MoE every n-th layer") or 1
        flags = [i % every == 0 for i in range(num_layers)]
    enabled = rules.get("enable_moe_block", True)
    if not isinstance(enabled, bool):
        raise file.fail("enable_moe_block", f"expected true or false, got {shown(enabled)}")
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


def _hf_types(config, quant, file: LayoutFile) -> tuple[str, str, str]:
    """The GGUF type of gate, up and down: ``quant``, else the config's (see from_hf_config)."""
    if isinstance(quant, Mapping):
        if sorted(quant) != sorted(PARTS):
            raise ValueError(f"quant as a dict names gate, up and down, got {', '.join(map(str, quant))}")
        return tuple(quant_type(quant[p]) for p in PARTS)
    if quant is not None:
        return (quant_type(quant),) * 3
    qconfig = config.get("quantization_config")
    method = qconfig.get("quant_method") if isinstance(qconfig, Mapping) else None
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
