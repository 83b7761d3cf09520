"""GPT-OSS's MXFP4 experts (transformers' ``Mxfp4GptOssExperts``) served from the cache's banks.

transformers keeps an MXFP4 experts module's weights as triton_kernels tensors: ``gate_up_proj``
and ``down_proj`` hold the packed FP4 values in the layout the GPU's matmul reads (swizzled for
Hopper's MMA), their scales are in ``*_precision_config.weight_scale`` (swizzled too), and the
float32 biases are plain parameters. The module is computed by triton_kernels' ``matmul_ogs``
from routing metadata (``RoutingData``, ``GatherIndx``, ``ScatterIndx``) that the MLP builds
from the router, outside transformers' experts interface.

Every one of the six tensors keeps an expert's elements in one dense block at ``expert *
stride(0)`` (the layouts swizzle within an expert), so each is a part of the slot, its bytes
as the GPU holds them: :class:`Mxfp4Layer` describes them. :class:`Mxfp4Server` takes the place
of the module's routed forward: it reads the router's expert per route from the routing
metadata, has ``select_device`` make them resident and give their slots, gives the matmul the
same metadata over the slots, and runs the module's own forward on triton tensors over the
bank: the same kernels on the same bytes, so the result is bit-identical to the unmodified
model's. When the bank has a slot for every route (a decode step), the metadata's per-expert
tables are moved to the slots by one kernel (``_mxfp4_routing``) and the routes, their order and
the matmul's tiles stay as they are. A forward of more routes (a prefill at a small budget) is
served in parts of ``cap // k`` tokens, each part's metadata built anew with its routes sorted by
slot (an expert's in the order they had, every route keeping its number, so every token's
outputs are summed in the same order) and the tiling and grid of the whole forward.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from dataclasses import dataclass

import torch

from ..layer_spec import LayerSpec, PartSpec

#: The experts module this file serves, by class name.
MODULE = "Mxfp4GptOssExperts"
#: The module's tensors each expert has, in slot order.
TENSORS = ("gate_up_proj", "gate_up_proj_scale", "gate_up_proj_bias", "down_proj", "down_proj_scale", "down_proj_bias")


def is_mxfp4_experts(module: torch.nn.Module) -> bool:
    return type(module).__name__ == MODULE


def _hub(module: torch.nn.Module):
    """The triton_kernels package the module's class computes with (transformers loads it from
    the hub into its integration module's ``triton_kernels_hub``)."""
    return getattr(sys.modules[type(module).__module__], "triton_kernels_hub", None)


def _storage(module: torch.nn.Module, name: str) -> torch.Tensor:
    """The torch tensor holding tensor ``name`` of :data:`TENSORS`."""
    if name.endswith("_bias"):
        return getattr(module, name)
    if name.endswith("_scale"):
        return getattr(module, name.removesuffix("_scale") + "_precision_config").weight_scale.storage.data
    return getattr(module, name).storage.data


def _set_storage(module: torch.nn.Module, name: str, data: torch.Tensor) -> None:
    """Weight or scale ``name`` of :data:`TENSORS` made to hold ``data`` (its format)."""
    if name.endswith("_scale"):
        getattr(module, name.removesuffix("_scale") + "_precision_config").weight_scale.storage.data = data
    else:
        getattr(module, name).storage.data = data


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one block of memory with no gap or overlap, in any order."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _expert_bytes(data: torch.Tensor, experts: int, what: str) -> torch.Tensor:
    """``data``'s memory as ``[experts, nbytes]`` bytes, expert e's row its elements' block.
    ValueError where an expert's elements are not one dense block at ``e * stride(0)``."""
    if data.dim() < 1 or data.shape[0] != experts:
        raise ValueError(f"{what}: {list(data.shape)} does not lead with the {experts} experts")
    per = data[0].numel() * data.element_size()
    if data.stride(0) * data.element_size() != per or not _dense(data[0]):
        raise ValueError(
            f"{what}: an expert's elements (strides {list(data.stride())}, shape {list(data.shape)}) are not one "
            "dense block at expert * stride(0), so no slot can hold them as the kernel reads them"
        )
    rows = torch.empty(0, dtype=torch.uint8, device=data.device)
    rows.set_(data.untyped_storage(), data.storage_offset() * data.element_size(), (experts, per), (per, 1))
    return rows


def _like(data: torch.Tensor, rows: torch.Tensor, count: int) -> torch.Tensor:
    """``data``'s format (dtype, per-expert shape and strides) over byte rows ``rows`` ``[>=count,
    nbytes]`` (any row stride that is a multiple of the dtype's size): ``[count, ...]``."""
    typed = rows.view(data.dtype)
    return typed.as_strided((count, *data.shape[1:]), (typed.stride(0), *data.stride()[1:]))


@dataclass(frozen=True)
class Mxfp4Layer:
    """One MoE layer's ``Mxfp4GptOssExperts``, as :class:`~pyexpcache.hf.ExpertsLayer` describes an
    experts-interface module: its layer number, name, module, and the six tensors of
    :data:`TENSORS` as the parts of a slot (bytes, as the GPU holds them)."""

    layer: int
    name: str
    module: torch.nn.Module

    quantized = True
    weight_names = TENSORS
    #: Computed by triton_kernels' matmul over routing metadata, outside the experts interface.
    interface = False

    def check(self) -> None:
        """Checked when made (``__post_init__``)."""

    def server(self, cache_key: int, bank, inner: tuple, compute: torch.device) -> Mxfp4Server:
        return Mxfp4Server(cache_key, self, bank)

    def refusal(self, what: str):
        if what == "refresh":
            return (
                "MXFP4 experts are served from copies of their swizzled tensors, which refresh cannot make "
                "from edited parameters: close the handle and offload the model again"
            )
        if what == "record":
            return (
                "MXFP4 experts are routed by triton_kernels' routing data, which record_routing does not read "
                "yet: record the model loaded dequantized (transformers.Mxfp4Config(dequantize=True)), whose "
                "routing is the same"
            )
        return None

    def __post_init__(self):
        m = self.module
        if getattr(m, "gate_up_proj_precision_config", None) is None or not hasattr(m.gate_up_proj, "storage"):
            raise ValueError(
                f"{self.name}: {MODULE} holds no MXFP4 weights yet (no triton tensors and scales): load the "
                "checkpoint with its quantization (on a GPU) before offloading it"
            )
        if getattr(m, "_is_hooked", False):
            raise ValueError(f"{self.name}: expert-parallel experts (each rank holding some) are not supported")
        rows = tuple(_expert_bytes(_storage(m, n), self.num_experts, f"{self.name}.{n}") for n in TENSORS)
        object.__setattr__(self, "_rows", rows)

    @property
    def num_experts(self) -> int:
        return int(self.module.num_experts)

    @property
    def weights(self) -> tuple[torch.Tensor, ...]:
        """Each tensor's bytes, ``[experts, nbytes]`` uint8 over its memory (host memory once placed)."""
        return self._rows

    def spec(self) -> LayerSpec:
        return LayerSpec.of_parts(
            self.num_experts, [PartSpec(n, r.shape[1], "uint8", (r.shape[1],)) for n, r in zip(TENSORS, self._rows)]
        )

    def part_rows(self, weights: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, int]]:
        return [(t, 0) for t in weights]

    def placed(self, held: tuple[torch.Tensor, ...]) -> None:
        """The module's weights and scales made to hold the host copies ``held`` (its rows, placed),
        so that their device memory is freed (triton tensors are not parameters: nothing else
        frees it); the biases stay where the model computes."""
        m = self.module
        for name, rows in zip(TENSORS, held):
            if name.endswith("_bias"):
                continue
            _set_storage(m, name, _like(_storage(m, name), rows, self.num_experts))

    def restore(self) -> None:
        """The weights and scales moved back where the biases are (where the model computes), in
        their layouts: the module computes by itself again (``Offloaded.close``)."""
        m = self.module
        device = m.gate_up_proj_bias.device
        for name in TENSORS:
            data = _storage(m, name)
            if name.endswith("_bias") or data.device == device:
                continue
            moved = torch.empty_strided(data.shape, data.stride(), dtype=data.dtype, device=device)
            moved.copy_(data)
            _set_storage(m, name, moved)


def _slot_routing(hub):
    """triton_kernels' ``RoutingData`` over slots: ``n_expts_tot`` the bank's slots (or the model's
    experts, if more), and the grid bound (``n_blocks``) the model's, for its expert count and all
    its routes (``model_routes``; a forward served in parts gives each part the whole's grid):
    it holds every route as it did (a slot has the routes its expert had), and the matmul chooses
    its tiling and grid, so the order of its sums, as for the model."""
    base = hub.routing.RoutingData
    cached = getattr(hub, "_expcache_slot_routing", None)
    if cached is not None and cached.__bases__[0] is base:
        return cached

    class SlotRouting(base):
        model_experts = 0
        model_routes = 0

        def n_blocks(self, n_rows, block_m):
            e, n = self.model_experts, max(n_rows, self.model_routes)
            return n if n <= e else -(-max(n - e + 1, 0) // block_m) + e - 1

    hub._expcache_slot_routing = SlotRouting
    return SlotRouting


class _BankExperts:
    """The module as its forward reads it, its six tensors the bank's: every other attribute is
    the module's."""

    def __init__(self, module: torch.nn.Module, tensors: dict):
        self._module = module
        for name, value in tensors.items():
            setattr(self, name, value)

    def __getattr__(self, name):
        return getattr(self._module, name)


class Mxfp4Server:
    """One layer's MXFP4 experts served from the bank: installed as the module's routed forward
    (``forward_routed`` where the class has one, else ``forward``) until :meth:`detach`."""

    inner_name = "mxfp4"

    def __init__(self, cache_key: int, e: Mxfp4Layer, bank):
        from ._serve import _CACHES

        m = e.module
        self._caches = _CACHES
        self.cache_key, self.layer, self.name = cache_key, e.layer, e.name
        self.num_experts, self.cap = e.num_experts, bank.cap
        self.hub = _hub(m)
        if self.hub is None:
            raise ValueError(f"{e.name}: transformers' MXFP4 integration has no triton_kernels loaded")
        self.routing_class = _slot_routing(self.hub)
        from . import _mxfp4_routing  # Triton: there with triton_kernels

        self.by_slot = _mxfp4_routing
        if self.cap > 0xFFFF:
            raise ValueError(f"{e.name}: triton_kernels' tile map holds slot ids below 65536; the bank has {self.cap}")
        rows = {n: torch.from_dlpack(bank.part(n, dtype="uint8")) for n in TENSORS}
        tensors = {}
        for name in ("gate_up_proj", "down_proj"):
            weight, config = getattr(m, name), getattr(m, name + "_precision_config")
            tensors[name] = self._over(weight, rows[name])
            scale = self._over(config.weight_scale, rows[name + "_scale"])
            tensors[name + "_precision_config"] = dataclasses.replace(config, weight_scale=scale)
            tensors[name + "_bias"] = _like(getattr(m, name + "_bias"), rows[name + "_bias"], self.cap)
        self.experts = _BankExperts(m, tensors)
        self.entry = "forward_routed" if hasattr(type(m), "forward_routed") else "forward"
        self.routed = inspect.unwrap(getattr(type(m), self.entry))
        setattr(m, self.entry, self.forward_routed)

    def _over(self, tensor, rows: torch.Tensor):
        """triton tensor ``tensor`` (its layout, dtype and shape) over the bank's ``rows``, ``cap`` experts."""
        data = tensor.storage.data
        storage = type(tensor.storage)(_like(data, rows, self.cap), tensor.storage.layout)
        return dataclasses.replace(
            tensor, storage=storage, shape=[self.cap, *tensor.shape[1:]], shape_max=[self.cap, *tensor.shape_max[1:]]
        )

    def detach(self, module: torch.nn.Module) -> None:
        module.__dict__.pop(self.entry, None)

    def forward_routed(self, hidden_states, routing_data, gather_idx, scatter_idx=None):
        k, experts = routing_data.n_expts_act, self.num_experts
        if routing_data.n_expts_tot != experts:
            raise RuntimeError(f"{self.name}: routed over {routing_data.n_expts_tot} experts; the module has {experts}")
        if k > self.cap:
            raise RuntimeError(
                f"{self.name}: the router chose {k} experts per token but the cache holds {self.cap}; raise the budget"
            )
        n = gather_idx.src_indx.shape[0]  # routes, token-major (token * k + j)
        # The metadata sorts the routes by expert: route r's place is gate[r], and the places of
        # expert e are token_offs_raw[e] .. token_offs_raw[e + 1].
        gate = gather_idx.dst_indx
        ends = routing_data.expt_data.token_offs_raw[1:]
        ids = torch.searchsorted(ends, gate, right=True, out_int32=True).view(-1, k)
        expected = routing_data.expected_tokens_per_expt or max(1, n // experts)
        if n <= self.cap and self.by_slot.movable(routing_data.expt_data):
            # One select; the metadata moved to the slots, the routes as they are.
            slots = self._caches[self.cache_key].select_device(self.layer, ids).reshape(-1)
            moved = self.by_slot.to_slots(self.hub, routing_data.expt_data, gather_idx.src_indx, slots, self.cap)
            data = self.routing_class(routing_data.gate_scal, moved.hist, self.cap, k, moved, expected)
            data.model_experts, data.model_routes = experts, n
            return self.routed(self.experts, hidden_states, data, gather_idx, scatter_idx)
        scale = routing_data.gate_scal[gate].view(-1, k)
        tokens, rows = ids.shape[0], self.cap // k  # a select of t tokens needs t * k slots it may fill
        parts = [
            self._routed(hidden_states[i : i + rows], ids[i : i + rows], scale[i : i + rows], n, expected, scatter_idx)
            for i in range(0, tokens, rows)
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _routed(self, hidden_states, ids, scale, n: int, expected: int, scatter_idx):
        """The module's routed forward of some tokens (their routes' experts ``ids`` [t, k] and
        weights ``scale``) over the bank, tiled as the model's forward of all ``n`` routes is."""
        hub, k = self.hub, ids.shape[1]
        slots = self._caches[self.cache_key].select_device(self.layer, ids).reshape(-1)
        routes = torch.arange(slots.shape[0], device=slots.device, dtype=torch.int32)
        # The same metadata over the slots: the routes sorted by slot (an expert's in the order
        # they had), each route keeping its number. Over at least the model's expert count, so
        # that the tile map holds the model's grid.
        total = max(self.cap, self.num_experts)
        order = torch.argsort(slots, stable=True).to(torch.int32)
        place = torch.empty_like(order)
        place[order.long()] = routes
        hist = torch.zeros(total, dtype=torch.int32, device=slots.device)
        hist.index_add_(0, slots, torch.ones_like(slots))
        data = self.routing_class(
            scale.reshape(-1)[order.long()], hist, total, k, hub.routing.compute_expt_data(hist, total, n), expected
        )
        data.model_experts, data.model_routes = self.num_experts, n
        gather = hub.routing.GatherIndx(src_indx=order, dst_indx=place)
        scatter = None if scatter_idx is None else hub.routing.ScatterIndx(src_indx=place, dst_indx=order)
        return self.routed(self.experts, hidden_states, data, gather, scatter)
