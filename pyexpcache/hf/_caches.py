"""The caches that serve a transformers model's experts: the experts' weights placed in host
memory once, a cache per group of layers built over them at a budget, closed and built again."""

from __future__ import annotations

import contextlib
import gc
from typing import Optional

import torch

from .. import _cuda
from ..cache import ExpertCache
from ..layout import ModelLayout
from ..progress import Progress
from . import _serve
from ._experts import ExpertsLayer
from ._serve import IMPLEMENTATION, forget_cache, serve_cache, unserve
from ._source import ParameterSource


class HostRegistration:
    """Host tensors page-locked in place (cudaHostRegister), unregistered by :meth:`close`. The
    calls go through cuda-python's runtime, not torch's: a refused registration then leaves no
    error behind for torch's next launch check to find."""

    def __init__(self):
        self._pointers: list[int] = []

    def pin(self, tensor: torch.Tensor) -> bool:
        """Page-locks ``tensor``'s memory in place; False where it cannot be (memory mapped from a
        file, for one: the caller copies it into pinned memory then)."""
        rt = _cuda.runtime()
        # Portable (1) and mapped (2): pinned for every device, and the GPU's lookup reads misses through it.
        result = rt.cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 3)
        if int(result[0]) != 0:
            rt.cudaGetLastError()
            return False
        self._pointers.append(tensor.data_ptr())
        return True

    def close(self) -> None:
        while self._pointers:
            _cuda.runtime().cudaHostUnregister(self._pointers.pop())


def _to_host(param: torch.nn.Parameter, cuda: bool, registration: HostRegistration) -> tuple[torch.Tensor, bool]:
    """The parameter's data in host memory (pinned when ``cuda`` and possible), the parameter
    made to hold it: a GPU tensor is copied once into pinned memory (its device memory freed),
    a host tensor is used where it is (page-locked in place for CUDA; on the host backend, whose
    device selects read pinned sources only as a GPU's do, the page-locking is emulated).
    Returns (tensor, pinned)."""
    data = param.data
    if data.device.type == "cpu":
        if not data.is_contiguous():
            data = data.contiguous()
        if not cuda or data.is_pinned() or registration.pin(data):
            param.data = data
            return data, True
    elif data.device.type != "cuda":
        raise ValueError(f"experts on {data.device} cannot be offloaded: they must be in host or CUDA memory")
    host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
    host.copy_(data)
    param.data = host
    return host, True


class Caches:
    """The caches that serve a model's experts, one per group of layers (:func:`_groups`), and
    each layer's :class:`LayerServer`: built at a budget (:meth:`build`), closed (:meth:`close`)
    and built again, over the experts' host tensors placed once (:meth:`place`)."""

    def __init__(
        self,
        layers,
        layout,
        compute,
        functions,
        policy,
        capacity,
        files=None,
        host_budget_bytes=0,
        file_reads="buffered",
    ):
        self.layers, self.layout, self.compute = layers, layout, compute
        self.functions = functions  # layer -> (implementation's name, function)
        self.policy, self.capacity = policy, capacity
        self.files = files  # None, or (group layout, group's layers) -> its FileSource
        self.host_budget_bytes = host_budget_bytes  # the host pools', shared between groups as the budget is
        self.file_reads = file_reads  # how misses read the files (files only)
        self.tensors, self.pinned = {}, True
        self.served = []  # (cache, source, key) per group of layers

    def place(self, registration: HostRegistration, progress) -> None:
        """The experts' weights in host memory (:func:`_to_host`; not for experts read from files),
        their biases where the model computes."""
        bar = progress_bar(progress)
        cuda = self.compute.type == "cuda"
        for i, e in enumerate(self.layers):
            if self.files is None:
                placed = [_to_host(w, cuda, registration) for w in e.weights]
                self.tensors[e.layer] = tuple(t for t, _ in placed)
                e.placed(self.tensors[e.layer])
                self.pinned = self.pinned and all(pinned for _, pinned in placed)
            for name in ("gate_up_proj_bias", "up_proj_bias", "down_proj_bias"):  # small: kept where the model computes
                bias = getattr(e.module, name, None)
                if isinstance(bias, torch.Tensor) and bias.device != self.compute:
                    bias.data = bias.data.to(self.compute)
            bar("experts in host memory" if self.files is None else "experts in files", i + 1, len(self.layers))

    def build(self, budget: int, reserve: Optional[int] = None) -> None:
        """A cache per group with its share of ``budget``, and every layer's server; each cache
        leaves ``reserve`` bytes of device memory free (None: the library's default)."""
        layout, layers = self.layout, self.layers
        total = layout_bytes(layout)
        cuda = self.compute.type == "cuda"
        for group in _groups(layers, layout, budget, [function for _, function in self.functions.values()]):
            group_layout = ModelLayout(
                tuple(spec if any(e.layer == i for e in group) else None for i, spec in enumerate(layout.layers)),
                name=layout.name,
            )
            share = sum(group_layout[e.layer].expert_bytes * e.num_experts for e in group)
            if self.files is not None:
                source = self.files(group_layout, group)
            else:
                source = ParameterSource(
                    group_layout, group, {e.layer: self.tensors[e.layer] for e in group}, self.pinned
                )
            group_budget = budget * share // total
            group_reserve = reserve
            if reserve is not None and cuda and self.served:
                # The caches made before took their shares and what comes with them (each bank's
                # rounding, staging rows, lookup tables): this one may take its share of what is free
                # now, whatever the reserve measured before the first.
                free_now = torch.cuda.mem_get_info(self.compute)[0]
                group_reserve = max(0, min(reserve, free_now - group_budget))
            cache = ExpertCache(
                group_layout,
                source,
                budget_bytes=group_budget,
                reserve_bytes=group_reserve,
                backend="cuda" if cuda else "host",
                device=self.compute.index or 0,
                device_capacity_bytes=self.capacity,
                lookup="device",
                policy=self.policy,
                host_budget_bytes=self.host_budget_bytes * share // total,
                file_reads=self.file_reads,
                # Quantized experts part-major: each tensor its own contiguous [cap, ...] view, as
                # kernels over [E, N, K] weights want; float experts slot-major (the fused gate_up view).
                bank_arrangement="parts" if all(e.quantized for e in group) else "slots",
            )
            self.served.append((cache, source, serve_cache(cache)))
            for e in group:
                e.module._expcache_server = e.server(
                    self.served[-1][2], cache.bank(e.layer), self.functions[e.layer], self.compute
                )

    def close(self) -> None:
        """Every layer's server and cache gone: the model's experts are served no more."""
        for e in self.layers:
            unserve(e.module)
        while self.served:
            cache, _, key = self.served.pop()
            forget_cache(key)
            cache.close()

    @contextlib.contextmanager
    def serving(self, model, budget: int, reserve: int):
        """``model`` serving its experts from caches of ``budget`` while the block runs (the
        automatic budget's dry step), then neither caches nor the implementation left."""
        self.build(budget, reserve)
        previous = set_implementation(model, self.layers)
        try:
            yield
        finally:
            for config, value in previous:
                config._experts_implementation_internal = value
            self.close()
            gc.collect()  # the servers' bank views (a CPU server is in a cycle): the banks' memory goes now


def progress_bar(progress):
    """A ``progress`` argument as a function of (label, done, total): a callable as it is, else
    a :class:`~pyexpcache.progress.Progress` bar (None: shown when stderr is a terminal)."""
    return progress if callable(progress) else Progress(progress)


def layout_bytes(layout: ModelLayout) -> int:
    return sum(s.expert_bytes * s.num_experts for s in layout.layers if s is not None)


def _groups(layers: list[ExpertsLayer], layout: ModelLayout, budget: int, functions: list):
    """The layers split into groups of consecutive layers, one cache each. One group, unless
    transformers' grouped_mm computes the experts and the bank would hold more slots than one
    grouped product takes (``GROUPED_MM_GROUPS``): then groups whose banks hold fewer, each
    with its layers' share of the budget (a layer alone over the limit is served over windows)."""
    from transformers.integrations import moe

    fraction = budget / layout_bytes(layout)
    if (
        any(function is not moe.grouped_mm_experts_forward for function in functions)
        or fraction * sum(e.num_experts for e in layers) <= _serve.GROUPED_MM_GROUPS * 0.9
    ):
        return [layers]
    groups, slots = [[]], 0.0
    for e in layers:
        wanted = fraction * e.num_experts
        if groups[-1] and slots + wanted > _serve.GROUPED_MM_GROUPS * 0.9:  # a margin for the slots' rounding
            groups.append([])
            slots = 0.0
        groups[-1].append(e)
        slots += wanted
    return groups


def set_implementation(model, layers: list[ExpertsLayer]) -> list:
    """Set every experts module's config to the implementation; returns (config, previous value) pairs."""
    layers = [e for e in layers if e.interface]
    if not layers:
        return []
    previous = []
    for e in layers:
        config = e.module.config
        if all(config is not c for c, _ in previous):
            previous.append((config, config._experts_implementation))
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(IMPLEMENTATION)
    for config, _ in previous:  # a module whose config the model's call did not reach
        if config._experts_implementation != IMPLEMENTATION:
            config._experts_implementation_internal = IMPLEMENTATION
    return previous
