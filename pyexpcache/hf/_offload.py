"""offload(): a transformers MoE model's experts served by an ExpertCache."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .. import _cuda
from ..budget import resolve_budget
from ..cache import ExpertCache
from ..layout import ModelLayout
from ..progress import Progress
from ..stats import PathStats
from . import _serve
from ._experts import ExpertsLayer, find_experts, layout_of
from ._serve import IMPLEMENTATION, LayerServer, forget_cache, inner_implementation, register, serve_cache
from ._source import ParameterSource


class _HostRegistration:
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


def _compute_device(model: torch.nn.Module, layers: list[ExpertsLayer], device) -> torch.device:
    if device is not None:
        return torch.device(device)
    experts = {id(p) for e in layers for p in e.module.parameters(recurse=False)}
    for p in model.parameters():
        if id(p) not in experts:
            return p.device
    return torch.device("cpu")


def _to_host(param: torch.nn.Parameter, cuda: bool, registration: _HostRegistration) -> tuple[torch.Tensor, bool]:
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


def _move_the_rest(model: torch.nn.Module, layers: list[ExpertsLayer], compute: torch.device) -> None:
    """Every parameter and buffer in host memory but the experts' weights moved to ``compute``: a
    model loaded on the host runs on the GPU, its experts served by the cache."""
    if compute.type == "cpu":
        return
    experts = {id(e.first) for e in layers} | {id(e.down) for e in layers}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) not in experts and p.device.type == "cpu":
                p.data = p.data.to(compute)
        for name, b in module.named_buffers(recurse=False):
            if b.device.type == "cpu":
                setattr(module, name, b.to(compute))


class Offloaded:
    """What :func:`offload` returns: the caches serving the model's experts, and the way back.

    Attributes:
        caches: the :class:`~pyexpcache.ExpertCache` objects (``lookup="device"``), one per group
            of consecutive MoE layers: one, unless transformers' grouped_mm computes the experts
            and the budget holds more slots than one grouped product takes (1023): then each
            group's bank holds fewer (see :func:`offload`).
        cache: the cache, when there is one (else ValueError: use ``caches``, ``total_stats()``).
        layout: the :class:`~pyexpcache.ModelLayout` built from the experts modules (every group's).
        sources: the :class:`ParameterSource` of each cache, over the experts' host tensors.
        layers: model layer number -> the experts module's name.
        computed_by: the experts implementation that computes each layer from the bank: the one
            the model had (``"grouped_mm"``, transformers' default, ``"batched_mm"`` or ``"eager"``).

    The experts' parameters hold the host tensors the caches read, and each slot a copy made at
    the expert's miss: after editing the experts' weights (a merged adapter, ``load_state_dict``,
    a new Parameter), call :meth:`refresh`. Until then a forward raises RuntimeError where the
    parameters show the edit (a new tensor, or a new version from an in-place operation on the
    parameter; an edit through ``.data`` does not show). Biases are read from the module at
    each forward, as they are.

    :meth:`close` (idempotent; also on leaving a ``with`` block) restores the model's previous
    experts implementation and closes the caches. The experts' weights stay in host memory: on a
    GPU, move them back (``model.to("cuda")``) before running the model without expcache.
    """

    def __init__(
        self,
        model,
        layout: ModelLayout,
        served: list,
        layers: list[ExpertsLayer],
        previous: list,
        registration: _HostRegistration,
        computed_by: str,
    ):
        self.model, self.layout, self.computed_by = model, layout, computed_by
        self.caches = [cache for cache, _, _ in served]
        self.sources = [source for _, source, _ in served]
        self._keys = [key for _, _, key in served]
        self.layers = {e.layer: e.name for e in layers}
        self._experts = layers
        self._modules = [e.module for e in layers]
        self._previous = previous
        self._registration = registration
        self._closed = False

    @property
    def cache(self) -> ExpertCache:
        if len(self.caches) != 1:
            raise ValueError(
                f"this model's experts are served by {len(self.caches)} caches, one per group of layers: "
                "see .caches, or .total_stats() for their counters together"
            )
        return self.caches[0]

    def total_stats(self) -> PathStats:
        """Every cache's counters, summed (hits, misses, evictions, bytes over the link, ...)."""
        out = PathStats()
        for cache in self.caches:
            out = out + cache.stats().total
        return out

    def refresh(self) -> None:
        """Serve the experts' weights as they are now, after an edit: each cache is emptied (every
        expert's next select copies it anew), and an experts parameter that no longer holds the
        tensor served (a new Parameter, or one moved to another device) is copied into that tensor
        and made to hold it again: a weight stays in host memory (page-locked where it was), a
        bias where the model computes. Neither the banks' nor the biases' addresses change, so a
        graph captured before (:class:`GraphDecoder`) replays with the new values. Synchronizes
        the device.

        Raises:
            ValueError: the handle is closed, or a weight's shape or dtype is not the one offloaded
                (the layout was made for it: close and offload again).
        """
        if self._closed:
            raise ValueError("this handle is closed: offload the model again to serve its experts")
        sources = {layer: source for source in self.sources for layer in source.layout.moe_layers}
        served = []  # (module's name, module, parameter name, the tensor served)
        for e in self._experts:
            names = ("gate_up_proj" if e.module.has_gate else "up_proj", "down_proj")
            served += [(e.name, e.module, n, t) for n, t in zip(names, sources[e.layer].tensors(e.layer))]
            served += [(e.name, e.module, n, t) for n, t in e.module._expcache_server.bias_tensors.items()]
        for where, module, name, kept in served:
            p = getattr(module, name)
            if p.shape != kept.shape or p.dtype != kept.dtype:
                raise ValueError(
                    f"{where}.{name} is now {p.dtype} {list(p.shape)}; it was offloaded as "
                    f"{kept.dtype} {list(kept.shape)}: close the handle and offload again"
                )
        for cache in self.caches:  # waits for the device: no copy reads the host tensors while they are written
            cache.release_all()
        for _where, module, name, kept in served:
            p = getattr(module, name)
            if p.data_ptr() != kept.data_ptr() or p.device != kept.device:
                kept.copy_(p.detach())
                p.data = kept
        for e in self._experts:
            e.module._expcache_server.remember_weights(e.module)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for config, value in self._previous:
            config._experts_implementation_internal = value
        for module in self._modules:
            if hasattr(module, "_expcache_server"):
                del module._expcache_server
        self.model.__dict__.pop("_optimize_model_for_decode", None)
        for key, cache in zip(self._keys, self.caches):
            forget_cache(key)
            cache.close()
        self._registration.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return (
            f"Offloaded({type(self.model).__name__}, {len(self.layers)} MoE layers, {len(self.caches)} "
            f"cache{'s' if len(self.caches) > 1 else ''}, {self.caches[0].backend} backend"
            f"{', closed' if self._closed else ''})"
        )


def offload(
    model: torch.nn.Module,
    *,
    budget_bytes: Optional[int] = None,
    budget_fraction: Optional[float] = None,
    device=None,
    policy: Optional[str] = None,
    progress: Optional[bool] = None,
) -> Offloaded:
    """Serve ``model``'s routed experts from an expcache slot bank; returns an :class:`Offloaded`.

    Every experts module of transformers' experts interface (transformers >= 5: Mixtral,
    Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, GPT-OSS and the other families that have one) gets
    its weights in host memory: those already there are used in place (page-locked in place when
    the model runs on a GPU, or copied into pinned memory where they cannot be), those on a GPU
    are copied once into pinned memory and their device memory freed. Every other parameter and
    buffer in host memory moves to ``device``, so a checkpoint loaded on the host runs on the GPU
    with its experts never there but through the cache. A layout and a source are built from the
    modules, an ``ExpertCache(lookup="device")`` over them, and the model's experts implementation
    is set to ``"expcache"``: each layer turns the router's ids into slot ids on the device
    (``select_device``), and the implementation the model had (``grouped_mm`` by default,
    ``batched_mm`` or ``eager``: set it before offloading to choose) computes the layer from the
    bank, bit-identical to the unmodified model. ``model.generate()`` then works as before, and
    a static-cache decode step can be captured in a CUDA graph (:class:`GraphDecoder`).

    The slots hold copies of the experts' weights, made at each miss: after editing the weights,
    call :meth:`Offloaded.refresh` (a forward raises RuntimeError until then, where the edit shows
    on the parameters). The served experts are inference-only: their weights get no gradient, and
    a backward that would give them one (they ``requires_grad``) raises RuntimeError naming the
    layer. Frozen (``requires_grad_(False)``), the rest of the model trains as it would.

    Args:
        model: a transformers model (``PreTrainedModel``) with experts-interface MoE layers.
        budget_bytes: the cache's budget over all experts; or
        budget_fraction: the budget as a fraction (0 < F <= 1) of every expert's bytes. One of the two.
        device: where the model computes (default: where its first non-expert parameter is): a
            CUDA device gives a CUDA cache, the CPU expcache's host backend.
        policy: the caches' eviction policy, run by the device lookup: ``None`` (the library's
            default, ``"duel"``) or a name of ``pyexpcache._lib.POLICIES``.
        progress: a bar on stderr while the experts are placed in host memory (for a real
            checkpoint, tens of GB page-locked or copied: seconds to minutes); ``None`` shows it
            when stderr is a terminal.

    Raises:
        ValueError: no experts-interface MoE layer (naming the model's class), a budget missing,
            doubled or out of range, experts of a dtype other than float32/float16/bfloat16.
        RuntimeError: a budget too small for one expert per layer (from the cache); later, from a
            forward, experts edited since (call refresh()), or from a backward, experts that ask
            for a gradient.
    """
    layers = find_experts(model)
    inner = [inner_implementation(e.module) for e in layers]  # before ours is set; refuses a second offload
    if budget_bytes is None and budget_fraction is None:
        raise ValueError("give budget_bytes or budget_fraction")
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"progress must be None, True or False, got {type(progress).__name__}")
    compute = _compute_device(model, layers, device)
    if compute.type not in ("cpu", "cuda"):
        raise ValueError(f"the model computes on {compute}: expcache serves CUDA devices and the CPU (host backend)")
    cuda = compute.type == "cuda"
    layout = layout_of(model, layers)
    budget = resolve_budget(layout, budget_bytes, budget_fraction)
    register()
    registration = _HostRegistration()
    served = []  # (cache, source, key) per group of layers
    functions = {e.layer: (name, function) for e, (name, function) in zip(layers, inner)}
    try:
        _move_the_rest(model, layers, compute)
        tensors, pinned = {}, True
        bar = Progress(progress)
        for i, e in enumerate(layers):
            first, first_pinned = _to_host(e.first, cuda, registration)
            down, down_pinned = _to_host(e.down, cuda, registration)
            tensors[e.layer] = (first, down)
            pinned = pinned and first_pinned and down_pinned
            for name in ("gate_up_proj_bias", "up_proj_bias", "down_proj_bias"):  # small: kept where the model computes
                bias = getattr(e.module, name, None)
                if isinstance(bias, torch.Tensor) and bias.device != compute:
                    bias.data = bias.data.to(compute)
            bar("experts in host memory", i + 1, len(layers))
        total = layout_bytes(layout)
        for group in _groups(layers, layout, budget, [name for name, _ in inner]):
            group_layout = ModelLayout(
                tuple(spec if any(e.layer == i for e in group) else None for i, spec in enumerate(layout.layers)),
                name=layout.name,
            )
            share = sum(group_layout[e.layer].expert_bytes * e.num_experts for e in group)
            source = ParameterSource(group_layout, group, {e.layer: tensors[e.layer] for e in group}, pinned)
            cache = ExpertCache(
                group_layout,
                source,
                budget_bytes=budget * share // total,
                backend="cuda" if cuda else "host",
                device=compute.index or 0,
                lookup="device",
                policy=policy,
            )
            served.append((cache, source, serve_cache(cache)))
            for e in group:
                spec, size = layout[e.layer], e.first.element_size()
                bank = cache.bank(
                    e.layer,
                    dtype=e.dtype_name,
                    shapes=((spec.gate_bytes // size,), (spec.up_bytes // size,), tuple(e.down.shape[1:])),
                )
                e.module._expcache_server = LayerServer(
                    served[-1][2], e.layer, bank, e.module, *functions[e.layer], e.name, compute
                )
        previous = _set_implementation(model, layers)
        _decode_like_transformers(model, layers, compute)
    except BaseException:
        for e in layers:
            if hasattr(e.module, "_expcache_server"):
                del e.module._expcache_server
        for cache, _, key in served:
            forget_cache(key)
            cache.close()
        registration.close()
        raise
    return Offloaded(model, layout, served, layers, previous, registration, inner[0][0])


def layout_bytes(layout: ModelLayout) -> int:
    return sum(s.expert_bytes * s.num_experts for s in layout.layers if s is not None)


def _groups(layers: list[ExpertsLayer], layout: ModelLayout, budget: int, implementations: list[str]):
    """The layers split into groups of consecutive layers, one cache each. One group, unless
    transformers' grouped_mm computes the experts and the bank would hold more slots than one
    grouped product takes (``GROUPED_MM_GROUPS``): then groups whose banks hold fewer, each
    with its layers' share of the budget (a layer alone over the limit is served over windows)."""
    fraction = budget / layout_bytes(layout)
    if (
        any(name != "grouped_mm" for name in implementations)
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


def _decode_like_transformers(model, layers: list[ExpertsLayer], compute: torch.device) -> None:
    """transformers' ``generate`` decodes with ``batched_mm`` where the model has ``grouped_mm``
    (on a GPU: faster for a few tokens; ``_optimize_model_for_decode``). The served layers, whose
    implementation is expcache's, would not switch: the model's method is wrapped (on the instance,
    until close) to switch theirs alike, so that each phase runs the unmodified model's kernels."""
    original = getattr(model, "_optimize_model_for_decode", None)
    servers = [e.module._expcache_server for e in layers]
    if original is None or compute.type == "cpu" or not any(s.inner_name == "grouped_mm" for s in servers):
        return
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    @contextlib.contextmanager
    def optimize_model_for_decode():
        with original():
            for server in servers:
                if server.inner_name == "grouped_mm":
                    server.decode_inner = ALL_EXPERTS_FUNCTIONS["batched_mm"]
            try:
                yield
            finally:
                for server in servers:
                    server.decode_inner = None

    model._optimize_model_for_decode = optimize_model_for_decode


def _set_implementation(model, layers: list[ExpertsLayer]) -> list:
    """Set every experts module's config to the implementation; returns (config, previous value) pairs."""
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
