"""offload(): a transformers MoE model's experts served by an ExpertCache."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from ..budget import resolve_budget
from ..cache import ExpertCache
from ..layout import ModelLayout
from ..stats import PathStats
from ._auto_budget import AutoBudget, size_budget
from ._caches import Caches, HostRegistration, set_implementation
from ._experts import ExpertsLayer, find_experts, layout_of, refusal
from ._serve import experts_interface, forget_cache, inner_implementation, register, unserve


def _compute_device(model: torch.nn.Module, layers: list[ExpertsLayer], device) -> torch.device:
    if device is not None:
        return torch.device(device)
    experts = {id(p) for e in layers for p in e.module.parameters(recurse=False)}
    for p in model.parameters():
        if id(p) not in experts:
            return p.device
    return torch.device("cpu")


def _check_contiguous_views(e: ExpertsLayer, name: str, layers: list[ExpertsLayer]) -> None:
    """transformers' FP8 ``batched_mm`` and ``grouped_mm`` run Triton kernels that assert contiguous
    ``[E, N, K]`` weights: a quantized model's caches keep part-major banks (each part its own
    ``[cap, ...]`` region, rows 256-byte aligned), whose view of a weight is contiguous when an
    expert's weight is a whole number of 256-byte rows. ValueError with the way out otherwise."""
    eager = "serve these experts with the eager implementation (model.set_experts_implementation('eager'))"
    if not all(other.quantized for other in layers):
        raise ValueError(
            f"{e.name}: transformers' FP8 {name} needs each weight's bank view contiguous, which part-major "
            f"banks give; this model mixes float and quantized experts, whose caches keep slot-major banks "
            f"(float experts' fused gate_up view): {eager}"
        )
    for weight, t in zip(e.weight_names, e.weights):
        nbytes = t[0].numel() * t.element_size()
        if not weight.endswith(("_scale_inv", "_activation_scale")) and nbytes % 256:
            raise ValueError(
                f"{e.name}.{weight}: an expert's {nbytes} B are not a whole number of 256-byte rows, so "
                f"its bank view strides past them and transformers' FP8 {name} kernels (which assert "
                f"contiguous weights) cannot read it: {eager}"
            )


def served_ids(layers: list[ExpertsLayer]) -> set[int]:
    """The ids of the experts' weights the caches serve (every other parameter is the model's own)."""
    return {id(w) for e in layers for w in e.weights}


def _move_the_rest(model: torch.nn.Module, layers: list[ExpertsLayer], compute: torch.device) -> None:
    """Every parameter and buffer in host memory but the experts' weights moved to ``compute``: a
    model loaded on the host runs on the GPU, its experts served by the cache."""
    if compute.type == "cpu":
        return
    experts = served_ids(layers)
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
            the model had (``"grouped_mm"``, transformers' default, ``"batched_mm"`` or ``"eager"``),
            or ``"mxfp4"`` for GPT-OSS's MXFP4 experts (the module's own forward, triton_kernels).
        auto_budget: with ``budget="auto"``, the :class:`AutoBudget` chosen, with every term (free
            memory, resident weights, KV cache, activation peak, margin); else None.

    The experts' parameters hold the host tensors the caches read, and each slot a copy made at
    the expert's miss: after editing the experts' weights (a merged adapter, ``load_state_dict``,
    a new Parameter), call :meth:`refresh`. Until then a forward raises RuntimeError where the
    parameters show the edit (a new tensor, or a new version from an in-place operation on the
    parameter; an edit through ``.data`` does not show). Biases are read from the module at
    each forward, as they are.

    :meth:`close` (idempotent; also on leaving a ``with`` block) restores the model's previous
    experts implementation and closes the caches. The experts' weights stay in host memory: on a
    GPU, move them back (``model.to("cuda")``) before running the model without expcache. MXFP4
    experts' weights and scales (triton_kernels tensors, which ``model.to`` does not move) are
    moved back by :meth:`close`.
    """

    def __init__(
        self,
        model,
        layout: ModelLayout,
        served: list,
        layers: list[ExpertsLayer],
        previous: list,
        registration: HostRegistration,
        computed_by: str,
        auto_budget: Optional[AutoBudget] = None,
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
        self.auto_budget = auto_budget
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
        refused = refusal(self._experts, "refresh")
        if refused:
            raise ValueError(refused)
        if not all(hasattr(source, "tensors") for source in self.sources):
            raise ValueError(
                "these experts are served from the checkpoint's files (offload_pretrained): there are no "
                "host weights to refresh; write the edited checkpoint and load it again"
            )
        sources = {layer: source for source in self.sources for layer in source.layout.moe_layers}
        served = []  # (module's name, module, parameter name, the tensor served)
        for e in self._experts:
            served += [(e.name, e.module, n, t) for n, t in zip(e.weight_names, sources[e.layer].tensors(e.layer))]
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
            unserve(module)
        for e in self._experts:
            e.restore()
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
    budget: Optional[str] = None,
    budget_bytes: Optional[int] = None,
    budget_fraction: Optional[float] = None,
    max_len: Optional[int] = None,
    batch: int = 1,
    margin_bytes: Optional[int] = None,
    device=None,
    device_capacity_bytes: Optional[int] = None,
    policy: Optional[str] = None,
    progress: Optional[bool] = None,
) -> Offloaded:
    """Serve ``model``'s routed experts from an expcache slot bank; returns an :class:`Offloaded`.

    Every experts module of transformers' experts interface (transformers >= 5: Mixtral,
    Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, GPT-OSS and the other families that have one;
    quantized ones such as ``FP8Experts``) and every ``Mxfp4GptOssExperts`` (GPT-OSS's MXFP4
    experts, computed by triton_kernels on CUDA; see ``docs/hf.md``) gets
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
        budget: ``"auto"``: the budget sized from the device's memory (the other two then not
            given): the free memory with the model's resident weights in place, less the KV cache
            of ``max_len`` x ``batch`` positions (from the config: layers, key-value heads, head
            size, dtype), less the activation peak of one dry step (a forward of ``batch`` x
            ``max_len`` tokens, measured: ``torch.cuda.max_memory_allocated`` on CUDA, the same
            count kept by a dispatch mode on the CPU), less ``margin_bytes``; every expert where
            that is more. The line with every term is logged (the ``pyexpcache`` logger at INFO,
            else stderr) and kept as ``handle.auto_budget``. On the CPU the device is the host
            backend's emulated one (``device_capacity_bytes``).
        budget_bytes: the cache's budget over all experts; or
        budget_fraction: the budget as a fraction (0 < F <= 1) of every expert's bytes. One of the three.
        max_len: ``budget="auto"``: the longest sequence (prompt and new tokens) the KV cache
            holds and the dry step's length. Default: the generation config's ``max_length``
            when the model sets one, else the config's ``max_position_embeddings``.
        batch: ``budget="auto"``: the sequences decoded together (default 1).
        margin_bytes: ``budget="auto"``: device memory left beyond the terms (default 1 GiB and
            2 % of the device's memory: the allocator's fragmentation, a KV cache grown by
            concatenation, workspaces made later, a CUDA graph's pool).
        device: where the model computes (default: where its first non-expert parameter is): a
            CUDA device gives a CUDA cache, the CPU expcache's host backend.
        device_capacity_bytes: on the CPU only, the host backend's emulated device size (default
            64 GiB), which ``budget="auto"`` sizes the cache to as to a GPU's memory.
        policy: the caches' eviction policy, run by the device lookup: ``None`` (the library's
            default, ``"duel"``) or a name of ``pyexpcache._lib.POLICIES``.
        progress: a bar on stderr while the experts are placed in host memory (for a real
            checkpoint, tens of GB page-locked or copied: seconds to minutes); ``None`` shows it
            when stderr is a terminal; or a callable ``progress(label, done, total)``.

    Raises:
        ValueError: no experts-interface MoE layer (naming the model's class), a budget missing,
            doubled or out of range, experts of a dtype other than float32/float16/bfloat16;
            ``budget="auto"`` leaving less than one decode step's experts (batch x top-k of each
            size class), naming every term and what to change, or a dry step out of memory.
        RuntimeError: a budget too small for one expert per layer (from the cache); later, from a
            forward, experts edited since (call refresh()), or from a backward, experts that ask
            for a gradient.
    """
    check_arguments(budget, budget_bytes, budget_fraction, max_len, batch, margin_bytes, progress)
    return serve(
        model,
        find_experts(model),
        budget=budget,
        budget_bytes=budget_bytes,
        budget_fraction=budget_fraction,
        max_len=max_len,
        batch=batch,
        margin_bytes=margin_bytes,
        device=device,
        device_capacity_bytes=device_capacity_bytes,
        policy=policy,
        progress=progress,
    )


def check_arguments(budget, budget_bytes, budget_fraction, max_len, batch, margin_bytes, progress) -> None:
    """offload's budget and progress arguments checked: ValueError or TypeError with the reason."""
    given = [
        name
        for name, value in (("budget", budget), ("budget_bytes", budget_bytes), ("budget_fraction", budget_fraction))
        if value is not None
    ]
    if len(given) != 1:
        raise ValueError(
            "give budget='auto', budget_bytes or budget_fraction" + (f", not {' and '.join(given)}" if given else "")
        )
    if budget is not None and budget != "auto":
        raise ValueError(f"budget must be 'auto' (or give budget_bytes or budget_fraction), got {budget!r}")
    if budget is None and (max_len is not None or batch != 1 or margin_bytes is not None):
        raise ValueError("max_len, batch and margin_bytes size budget='auto': give them with it")
    if progress is not None and not isinstance(progress, bool) and not callable(progress):
        raise TypeError(f"progress must be None, True, False or a callable, got {type(progress).__name__}")


def serve(model, layers: list[ExpertsLayer], *, files=None, **options) -> Offloaded:
    """``model``'s ``layers`` served as :func:`offload` serves them (its arguments checked):
    from their host tensors, or, with ``files`` (a function of a group's layout and layers
    giving its :class:`~pyexpcache.FileSource`), from a checkpoint's files."""
    budget, budget_bytes, budget_fraction = options["budget"], options["budget_bytes"], options["budget_fraction"]
    max_len, batch, margin_bytes = options["max_len"], options["batch"], options["margin_bytes"]
    device, device_capacity_bytes, progress = options["device"], options["device_capacity_bytes"], options["progress"]
    # before ours is set; refuses a second offload
    inner = [inner_implementation(e.module) if e.interface else ("mxfp4", None) for e in layers]
    if any(hasattr(e.module, "_expcache_server") for e in layers):
        raise ValueError(f"{layers[0].name} is already served by expcache: close its handle first")
    compute = _compute_device(model, layers, device)
    if compute.type not in ("cpu", "cuda"):
        raise ValueError(f"the model computes on {compute}: expcache serves CUDA devices and the CPU (host backend)")
    cuda = compute.type == "cuda"
    for e, (name, function) in zip(layers, inner):
        if cuda and e.quantized and name not in ("eager", "mxfp4") and function.__module__.endswith("finegrained_fp8"):
            _check_contiguous_views(e, name, layers)
    if cuda and device_capacity_bytes is not None:
        raise ValueError(
            f"device_capacity_bytes is the host backend's emulated device size; the model computes on {compute}"
        )
    layout = layout_of(model, layers)
    fixed = None if budget == "auto" else resolve_budget(layout, budget_bytes, budget_fraction)
    register([e.module for e in layers if e.interface])
    registration = HostRegistration()
    functions = {e.layer: (name, function) for e, (name, function) in zip(layers, inner)}
    caches = Caches(
        layers,
        layout,
        compute,
        functions,
        options["policy"],
        device_capacity_bytes,
        files,
        options.get("host_budget_bytes", 0),
        options.get("file_reads", "buffered"),
    )
    try:
        _move_the_rest(model, layers, compute)
        caches.place(registration, progress)
        sized = None
        if fixed is None:
            sized = size_budget(
                model,
                layout,
                compute,
                served_ids(layers),
                lambda size, reserve: caches.serving(model, size, reserve),
                max_len=max_len,
                batch=batch,
                margin_bytes=margin_bytes,
                capacity=device_capacity_bytes,
            )
        caches.build(*((fixed, None) if sized is None else (sized.budget_bytes, sized.reserve_bytes)))
        previous = set_implementation(model, layers)
        _decode_like_transformers(model, layers, compute)
    except BaseException:
        caches.close()
        registration.close()
        raise
    return Offloaded(model, layout, caches.served, layers, previous, registration, inner[0][0], sized)


def _decode_like_transformers(model, layers: list[ExpertsLayer], compute: torch.device) -> None:
    """transformers' ``generate`` decodes with ``batched_mm`` where the model has ``grouped_mm``
    (on a GPU: faster for a few tokens; ``_optimize_model_for_decode``). The served layers, whose
    implementation is expcache's, would not switch: the model's method is wrapped (on the instance,
    until close) to switch theirs alike, so that each phase runs the unmodified model's kernels."""
    original = getattr(model, "_optimize_model_for_decode", None)
    servers = [e.module._expcache_server for e in layers]
    if original is None or compute.type == "cpu" or not any(s.inner_name == "grouped_mm" for s in servers):
        return
    interfaces = [experts_interface(e.module) for e in layers]

    @contextlib.contextmanager
    def optimize_model_for_decode():
        with original():
            for server, interface in zip(servers, interfaces):
                if server.inner_name == "grouped_mm":
                    server.decode_inner = interface["batched_mm"]
            try:
                yield
            finally:
                for server in servers:
                    server.decode_inner = None

    model._optimize_model_for_decode = optimize_model_for_decode
