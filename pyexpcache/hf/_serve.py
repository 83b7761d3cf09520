"""The experts implementation that serves a layer's experts from the cache's slot bank.

Registered with transformers' ``ExpertsInterface`` under :data:`IMPLEMENTATION`. For the ids the
router chose (``top_k_index`` [T, k]), ``cache.select_device`` makes the experts resident and
gives their slots, with no host synchronization (a CUDA graph can hold it). The layer is then
computed by the implementation the model had before (transformers' ``grouped_mm`` by default,
or ``batched_mm``, or the module's own ``eager`` loop), called with the slots for ids and with
the module seen through :class:`BankExperts`: its weights are the bank's ``[cap, ...]`` views,
which hold, at each slot, the bytes of the expert the slot was given. The same kernels run on the
same bytes, so the result is bit-identical to the unmodified model's.
"""

from __future__ import annotations

from typing import Callable

import torch

#: The name the implementation is registered under (``config.experts_implementation``).
IMPLEMENTATION = "expcache"


def inner_implementation(module: torch.nn.Module) -> tuple[str, Callable]:
    """The implementation ``module`` runs now (by its config), as (name, function of (module,
    hidden_states, top_k_index, top_k_weights)): a registered one, or the module's own forward
    for ``"eager"``."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    name = module.config._experts_implementation
    if name == IMPLEMENTATION:
        raise ValueError(f"{type(module).__name__} is already served by expcache: close its handle first")
    if name in (None, "eager"):
        return "eager", type(module).forward.__wrapped__  # the forward use_experts_implementation wrapped
    return name, ALL_EXPERTS_FUNCTIONS[name]


class SlotIndexed:
    """Per-expert rows (a bias) seen by slot: ``rows_by_slot[slots]`` is ``rows[experts]``, for the
    experts the slots were last given (``slot_expert``, written by each select)."""

    def __init__(self, rows: torch.Tensor, slot_expert: torch.Tensor):
        self.rows, self.slot_expert = rows, slot_expert

    def __getitem__(self, slots):
        return self.rows[self.slot_expert[slots]]


class BankExperts:
    """An experts module as an experts implementation sees it, served from a bank: every attribute
    is the module's, except ``gate_up_proj`` (or ``up_proj``) and ``down_proj``, the bank's
    ``[cap, ...]`` views with the parameters' shapes, ``num_experts`` (``cap``: ids are slots)
    and the biases, indexed by slot."""

    def __init__(self, module: torch.nn.Module, first: torch.Tensor, down: torch.Tensor, cap: int,
                 slot_expert: torch.Tensor | None):
        self._module = module
        first_name = "gate_up_proj" if module.has_gate else "up_proj"
        setattr(self, first_name, first)
        self.down_proj = down
        self.num_experts = cap
        if slot_expert is not None:
            setattr(self, first_name + "_bias", SlotIndexed(getattr(module, first_name + "_bias"), slot_expert))
            self.down_proj_bias = SlotIndexed(module.down_proj_bias, slot_expert)

    def __getattr__(self, name):  # everything not replaced is the module's
        return getattr(self._module, name)


class LayerServer:
    """One layer's side of the implementation: its cache, layer, the bank seen as the module's
    weights (:class:`BankExperts`), and the implementation that computes it (``inner``)."""

    def __init__(self, cache, layer: int, bank, module: torch.nn.Module, inner: Callable, name: str, device):
        self.cache, self.layer, self.name, self.inner = cache, layer, name, inner
        self.cap = bank.cap
        first = module.gate_up_proj if module.has_gate else module.up_proj
        self.first = torch.from_dlpack(bank.gate_up(shape=tuple(first.shape[1:])))
        self.down = torch.from_dlpack(bank.down)
        # Biases are small and stay on the compute device: each select records which expert each
        # slot was given, and the biases are read by that.
        slot_expert = torch.zeros(self.cap, dtype=torch.long, device=device) if module.has_bias else None
        self.slot_expert = slot_expert
        self.experts = BankExperts(module, self.first, self.down, self.cap, slot_expert)

    def __call__(self, module, hidden_states, top_k_index, top_k_weights):
        tokens, k = top_k_index.shape
        if k > self.cap:
            raise RuntimeError(f"{self.name}: the router chose {k} experts per token but the cache holds {self.cap}; "
                               "raise the budget")
        rows = self.cap // k  # a select of n rows needs n*k slots it may fill
        if tokens <= rows:
            return self._serve(hidden_states, top_k_index, top_k_weights)
        parts = [self._serve(hidden_states[i:i + rows], top_k_index[i:i + rows], top_k_weights[i:i + rows])
                 for i in range(0, tokens, rows)]
        return torch.cat(parts)

    def _serve(self, hidden_states, top_k_index, top_k_weights):
        slots = self.cache.select_device(self.layer, top_k_index.contiguous()).to(top_k_index.dtype)
        if self.slot_expert is not None:
            self.slot_expert[slots.reshape(-1)] = top_k_index.reshape(-1)
        return self.inner(self.experts, hidden_states, slots, top_k_weights)


def experts_forward(module, hidden_states, top_k_index, top_k_weights):
    """The registered implementation: the module's :class:`LayerServer` serves it."""
    server = getattr(module, "_expcache_server", None)
    if server is None:
        raise RuntimeError(f"{type(module).__name__} runs the {IMPLEMENTATION!r} experts implementation but is not "
                           "offloaded (pyexpcache.hf.offload), or its handle was closed")
    return server(module, hidden_states, top_k_index, top_k_weights)


def register() -> None:
    """Register :func:`experts_forward` with transformers (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, experts_forward)
