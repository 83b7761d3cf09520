"""Finding a transformers model's experts modules and describing them as a layout.

transformers 5 marks each MoE family's experts module with ``@use_experts_implementation``: the
decorator gives the instance ``has_gate``, ``has_bias``, ``is_transposed`` and ``is_concatenated``
and routes ``forward`` through ``ExpertsInterface`` by ``config._experts_implementation``. Its
weights are two 3-D parameters: ``gate_up_proj`` [E, 2I, H] (or ``up_proj`` [E, I, H] without a
gate) and ``down_proj`` [E, H, I]; transposed ([E, H, 2I], [E, I, H]) where ``is_transposed``.

An expert's first weight (gate_up or up) is one slab; the cache's slot holds it as two parts,
``gate`` then ``up``, and ``down_proj``'s slab as ``down``. The split is at half the slab's bytes
(for the common concatenated layout, exactly the gate and the up matrices) rounded down to the
slot alignment (256 B), so that up starts where gate ends and the slot's first two parts are the
slab itself (``ExpertBank.gate_up``): the bank is then ``gate_up_proj`` indexed by slot.

A quantized experts module (transformers' ``FP8Experts``: FP8 or FP4 weights with their inverse
scales ``*_scale_inv`` and, for static activations, ``*_activation_scale``) has more per-expert
tensors: each is a part of its own, named after its parameter, in the dtype and shape it has
(:attr:`ExpertsLayer.weight_names`). The module's own implementation reads them by slot.

GPT-OSS's MXFP4 experts (transformers' ``Mxfp4GptOssExperts``) are not of the experts
interface: :func:`find_experts` describes them as :class:`~pyexpcache.hf._mxfp4.Mxfp4Layer`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch

from ..layer_spec import LayerSpec, PartSpec
from ..layout import ModelLayout
from ._mxfp4 import Mxfp4Layer, is_mxfp4_experts
from ._serve import LayerServer

_LAYER_NUMBER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
#: torch dtypes the bank views can take, by the name ExpertCache.bank's ``dtype`` takes.
_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
#: The stored dtypes of quantized experts' tensors (weights, scales), by the names parts take.
_QUANTIZED_DTYPES = {
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
    torch.int8: "int8",
    torch.uint8: "uint8",
    **({torch.float8_e8m0fnu: "float8_e8m0fnu"} if hasattr(torch, "float8_e8m0fnu") else {}),
    **_DTYPES,
}
_ALIGN = 256  # where each part of a slot starts (the library's slot alignment)


def is_experts_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an experts module of transformers' experts interface."""
    return (
        hasattr(module, "is_transposed")
        and hasattr(module, "has_gate")
        and hasattr(module, "_apply_gate")
        and isinstance(getattr(module, "down_proj", None), torch.Tensor)
        and isinstance(getattr(module, "gate_up_proj" if module.has_gate else "up_proj", None), torch.Tensor)
    )


@dataclass(frozen=True)
class ExpertsLayer:
    """One MoE layer's experts module: its model layer number, its name in the model and the module.

    Every kind of layer :func:`find_experts` gives (this one, and
    :class:`~pyexpcache.hf._mxfp4.Mxfp4Layer` for experts outside the interface) answers the same
    questions, so the offloading code asks them and never which kind it holds: :attr:`interface`,
    :meth:`check`, :meth:`placed`, :meth:`server`, :meth:`restore` and :meth:`refusal`."""

    layer: int
    name: str
    module: torch.nn.Module

    #: Computed through transformers' experts interface (its implementation set by the config).
    interface = True

    def check(self) -> None:
        """ValueError for weights this package cannot serve (a dtype it does not know, gate_up and
        down of different dtypes, expert parallelism), naming them."""
        for name, t in zip(self.weight_names, self.weights):
            if t.dtype not in _QUANTIZED_DTYPES:
                raise ValueError(
                    f"{self.name}.{name} is {t.dtype}; pyexpcache.hf serves experts in "
                    f"{', '.join(sorted(_QUANTIZED_DTYPES.values()))} (load the checkpoint dequantized, "
                    "e.g. dtype=torch.bfloat16, to serve it)"
                )
        if not self.quantized and self.first.dtype != self.down.dtype:
            raise ValueError(
                f"{self.name}: gate_up and down weights differ in dtype ({self.first.dtype}, {self.down.dtype})"
            )
        if getattr(self.module, "_is_expert_parallel", False):
            raise ValueError(f"{self.name}: expert-parallel experts (each rank holding some) are not supported")

    def placed(self, held: tuple[torch.Tensor, ...]) -> None:
        """Its weights were copied to host memory as ``held``: nothing more (the server reads them
        through the bank; the parameters are set aside by the caller)."""

    def server(self, cache_key: int, bank, inner: tuple, compute: torch.device):
        """What computes it from ``bank``: the implementation ``inner`` ((name, function)) over the
        bank seen as the module's weights."""
        return LayerServer(cache_key, self, bank, *inner, compute)

    def restore(self) -> None:
        """The handle closes: nothing to move back (``model.to`` moves parameters)."""

    def refusal(self, what: str) -> Optional[str]:
        """Why ``what`` (``"refresh"``, ``"record"``) cannot serve this layer; None: it can."""
        return None

    @property
    def first(self) -> torch.Tensor:
        """The first weight: ``gate_up_proj`` (or ``up_proj`` without a gate), [E, ...]."""
        return self.module.gate_up_proj if self.module.has_gate else self.module.up_proj

    @property
    def down(self) -> torch.Tensor:
        return self.module.down_proj

    @property
    def num_experts(self) -> int:
        return int(self.first.shape[0])

    @property
    def dtype_name(self) -> str:
        return _DTYPES[self.first.dtype]

    @property
    def quantized(self) -> bool:
        """Whether the module keeps its experts quantized: weights of a dtype other than
        float32/float16/bfloat16, or per-expert tensors beside the weights (scales)."""
        return self.first.dtype not in _DTYPES or len(self.weight_names) > 2

    @property
    def weight_names(self) -> tuple[str, ...]:
        """The module's parameters the bank serves, in slot order: the first weight and
        ``down_proj``; for a quantized module every per-expert parameter ([E, ...]) but the biases
        (its weights, their scales, static activation scales), in the module's order."""
        first = "gate_up_proj" if self.module.has_gate else "up_proj"
        experts = self.first.shape[0]
        names = tuple(
            name
            for name, p in self.module.named_parameters(recurse=False)
            if p.dim() >= 1 and p.shape[0] == experts and not name.endswith("_bias")
        )
        if self.first.dtype in _DTYPES and not set(names) - {first, "down_proj"}:
            return (first, "down_proj")
        return names

    @property
    def weights(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self.module, name) for name in self.weight_names)

    def spec(self) -> LayerSpec:
        """Its layer in the layout: the first slab split into gate and up (:func:`split`), down the
        second's; for a quantized module each weight a part of its name, dtype and shape."""
        if self.quantized:
            return LayerSpec.of_parts(
                self.num_experts,
                [
                    PartSpec(name, t[0].numel() * t.element_size(), _QUANTIZED_DTYPES[t.dtype], tuple(t.shape[1:]))
                    for name, t in zip(self.weight_names, self.weights)
                ],
            )
        first = self.first[0].numel() * self.first.element_size()
        down = self.down[0].numel() * self.down.element_size()
        gate = split(first)
        return LayerSpec(self.num_experts, gate, first - gate, down)

    def part_rows(self, weights: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, int]]:
        """Where each part of :meth:`spec` is in ``weights`` (tensors of :attr:`weights`' shapes,
        in their order): (the tensor holding it, the part's byte offset in an expert's row)."""
        if self.quantized:
            return [(t, 0) for t in weights]
        first, down = weights
        return [(first, 0), (first, self.spec().gate_bytes), (down, 0)]


def split(first_bytes: int) -> int:
    """The gate part's bytes of a first slab of ``first_bytes``: half, rounded down to the slot
    alignment, so that the up part follows it with no gap. ValueError for a slab of 256 B or less."""
    if first_bytes <= _ALIGN:
        raise ValueError(
            f"an expert's gate_up slab of {first_bytes} B cannot be served: it must be over {_ALIGN} B "
            "(the slot alignment)"
        )
    return max(_ALIGN, first_bytes // 2 // _ALIGN * _ALIGN)


#: Experts modules transformers ships outside the experts interface, and why none is served.
_EVERY_EXPERT_EVERY_TOKEN = (
    "runs every expert on every token (the router only scales their inputs), so each step reads all of "
    "them: there is no subset a cache could hold"
)
_UNSERVED = {"Llama4TextExperts": _EVERY_EXPERT_EVERY_TOKEN, "FbgemmFp8Llama4TextExperts": _EVERY_EXPERT_EVERY_TOKEN}


def _why_not_served(model: torch.nn.Module) -> str:
    """The experts modules ``model`` has outside the interface (classes named ``*Experts``), named
    with the first one's place and why they are not served; empty when it has none."""
    kinds: dict[str, list[str]] = {}
    for name, m in model.named_modules():
        if type(m).__name__.endswith("Experts"):
            kinds.setdefault(type(m).__name__, []).append(name)
    return "".join(
        f"; its {kind} ({names[0]}{f' and {len(names) - 1} more' if len(names) > 1 else ''}) "
        + _UNSERVED.get(kind, "computes outside that interface, where the library cannot take its place")
        for kind, names in kinds.items()
    )


def find_experts(model: torch.nn.Module) -> list[ExpertsLayer]:
    """Every experts module of ``model`` (of the experts interface, or MXFP4 experts), in model
    order, each with its layer number.

    The number is the one after ``layers.`` in the module's name (``model.layers.3.mlp.experts``
    is layer 3), so dense layers keep their numbers; a model whose names do not give distinct
    numbers is numbered 0, 1, ... in module order.

    Raises:
        ValueError: no such module, naming the model's class; or weights this package cannot
            serve (a dtype it does not know, expert parallelism), naming them.
    """
    found = [(name, m) for name, m in model.named_modules() if is_experts_module(m) or is_mxfp4_experts(m)]
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no MoE layer served through transformers' experts interface "
            "(an *Experts module marked @use_experts_implementation, with gate_up_proj and down_proj); "
            "pyexpcache.hf serves the MoE families of transformers >= 5 that have one" + _why_not_served(model)
        )
    numbers = []
    for name, _ in found:
        match = _LAYER_NUMBER.search(name)
        numbers.append(int(match.group(1)) if match else None)
    if None in numbers or len(set(numbers)) != len(numbers):
        numbers = list(range(len(found)))
    layers = [(Mxfp4Layer if is_mxfp4_experts(m) else ExpertsLayer)(n, name, m) for n, (name, m) in zip(numbers, found)]
    for e in layers:
        e.check()
    return layers


def refusal(layers, what: str) -> Optional[str]:
    """The first of ``layers``' reasons why ``what`` (``"refresh"``, ``"record"``) cannot serve it
    (:meth:`ExpertsLayer.refusal`); None when every layer can be."""
    return next((why for why in (e.refusal(what) for e in layers) if why), None)


def layout_of(model: torch.nn.Module, layers: list[ExpertsLayer]) -> ModelLayout:
    """The layout of ``layers``: one entry per model layer up to the last MoE one, None for the others."""
    specs = [None] * (max(e.layer for e in layers) + 1)
    for e in layers:
        specs[e.layer] = e.spec()
    config = getattr(model, "config", None)
    name = getattr(config, "model_type", None) or type(model).__name__
    return ModelLayout(tuple(specs), name=name)
