"""The experts implementation that serves a layer's experts from the cache's slot bank.

Registered with transformers' ``ExpertsInterface`` under :data:`IMPLEMENTATION`. For the ids the
router chose (``top_k_index`` [T, k]), ``cache.select_device`` makes the experts resident and
gives their slots, with no host synchronization (a CUDA graph can hold it); the weights are
gathered from the bank by slot and the experts computed with the same operations, in the same
order, as transformers' ``batched_mm`` implementation computes them from the parameters by id:
one matrix product per (token, expert) pair, the k outputs weighted and summed per token. The
gathered weights are the parameters' bytes, so the result is bit-identical to ``batched_mm``'s.
"""

from __future__ import annotations

import torch

#: The name the implementation is registered under (``config.experts_implementation``).
IMPLEMENTATION = "expcache"


def _linear(x: torch.Tensor, weight: torch.Tensor, bias, transposed: bool) -> torch.Tensor:
    """Per row r: x[r] times expert weight[r] ([out, in], or [in, out] when transposed), plus bias[r]."""
    if transposed:
        out = torch.bmm(x.unsqueeze(1), weight).squeeze(1)
    else:
        out = torch.bmm(weight, x.unsqueeze(-1)).squeeze(-1)
    if bias is not None:
        out.add_(bias)
    return out


class LayerServer:
    """One layer's side of the implementation: its cache, layer and bank views (torch tensors
    over the bank, zero-copy). ``gate`` and ``up`` are [cap, half] (the first slab's halves),
    ``down`` [cap, *down slab shape]; ``first_shape`` is the first slab's shape."""

    def __init__(self, cache, layer: int, bank, first_shape: tuple[int, ...], name: str):
        self.cache, self.layer, self.name = cache, layer, name
        self.gate, self.up, self.down = (torch.from_dlpack(v) for v in bank.parts)
        self.first_shape = first_shape
        self.cap = bank.cap

    def __call__(self, module, hidden_states, top_k_index, top_k_weights):
        tokens, k = top_k_index.shape
        if k > self.cap:
            raise RuntimeError(f"{self.name}: the router chose {k} experts per token but the cache holds {self.cap}; "
                               "raise the budget")
        rows = self.cap // k  # a select of n rows needs n*k slots it may fill
        if tokens <= rows:
            return self._serve(module, hidden_states, top_k_index, top_k_weights)
        parts = [self._serve(module, hidden_states[i:i + rows], top_k_index[i:i + rows], top_k_weights[i:i + rows])
                 for i in range(0, tokens, rows)]
        return torch.cat(parts)

    def _serve(self, module, hidden_states, top_k_index, top_k_weights):
        tokens, k = top_k_index.shape
        slots = self.cache.select_device(self.layer, top_k_index.contiguous()).reshape(-1)
        pairs = tokens * k
        x = hidden_states.repeat_interleave(k, dim=0)
        ids = top_k_index.reshape(-1)
        first = torch.cat((self.gate.index_select(0, slots), self.up.index_select(0, slots)), dim=1)
        first = first.view(pairs, *self.first_shape)
        if module.has_bias:
            bias = (module.gate_up_proj_bias if module.has_gate else module.up_proj_bias)[ids]
        else:
            bias = None
        out = _linear(x, first, bias, module.is_transposed)
        out = module._apply_gate(out) if module.has_gate else module.act_fn(out)
        down = self.down.index_select(0, slots)
        out = _linear(out, down, module.down_proj_bias[ids] if module.has_bias else None, module.is_transposed)
        if module.has_post_expert_norm:
            out = module.post_expert_norm(out)
        out = out * top_k_weights.reshape(-1).unsqueeze(-1)
        return out.view(tokens, k, -1).sum(dim=1).to(hidden_states.dtype)


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
