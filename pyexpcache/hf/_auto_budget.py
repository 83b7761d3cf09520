"""``budget="auto"``: the cache's budget sized from the device's free memory.

The cache takes the device memory left free once the model's resident weights are in place,
less the KV cache of ``max_len`` x ``batch`` positions (from the config), the activation peak
of one dry step (measured) and a margin. Everything here is shared by the calls that offload a
model (:func:`size_budget` takes the way to serve the model for the dry step as a function).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import weakref
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from .. import _lib
from ..budget import class_targets, least_budget
from ..cache import logger
from ..layout import GiB, ModelLayout

#: The margin's parts: a fixed amount and a share of the device's memory (allocator
#: fragmentation, a KV cache grown by concatenation, workspaces made later, a graph's pool).
MARGIN_FIXED_BYTES = GiB
MARGIN_FRACTION = 0.02
#: The dry step's cache: at most this share of what is left for the experts before it.
_PROVISIONAL_SHARE = 8


def _size(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class AutoBudget:
    """What ``budget="auto"`` chose and why (every term in bytes): ``budget_bytes`` is
    ``free_bytes - kv_bytes - activation_bytes - margin_bytes``, or ``experts_bytes`` (every
    expert) where that is less (``capped``). ``str()`` is the line offload logs."""

    device: str  #: where the model computes ("cuda:0"; "cpu": the host backend's emulated device)
    total_bytes: int  #: the device's memory (the host backend: its emulated capacity)
    resident_bytes: int  #: the model's weights and buffers where it computes, the experts' aside
    free_bytes: int  #: device memory free with them in place (CUDA: measured; host: total - resident)
    kv_bytes: int  #: the KV cache of max_len x batch positions (:func:`kv_cache_bytes`)
    max_len: int
    batch: int
    activation_bytes: int  #: the peak of one dry step's allocations (a forward of batch x max_len)
    margin_bytes: int
    experts_bytes: int  #: the budget that holds every expert (their bytes in slots)
    least_bytes: int  #: the smallest budget that serves a decode step (batch x top-k experts of each class)
    top_k: int
    budget_bytes: int

    @property
    def capped(self) -> bool:
        return self.budget_bytes == self.experts_bytes

    @property
    def fraction(self) -> float:
        """The budget as a fraction of every expert's bytes."""
        return self.budget_bytes / self.experts_bytes

    @property
    def reserve_bytes(self) -> int:
        """What a cache made at this budget is told to leave free (``reserve_bytes``): CUDA's free
        memory but the budget; the host backend's emulated device but the budget (the model's
        weights, KV cache and activations are in host memory)."""
        return (self.total_bytes if self.device == "cpu" else self.free_bytes) - self.budget_bytes

    @property
    def left_bytes(self) -> int:
        """free - KV cache - activation peak - margin (below 0: none)."""
        return self.free_bytes - self.kv_bytes - self.activation_bytes - self.margin_bytes

    def terms(self) -> str:
        emulated = ", the host backend's emulated device" if self.device == "cpu" else ""
        return (
            f"free device memory {_size(self.free_bytes)} of {_size(self.total_bytes)} ({self.device}{emulated}; "
            f"the model's resident weights, {_size(self.resident_bytes)}, already out of it) "
            f"- KV cache {_size(self.kv_bytes)} (max_len {self.max_len} x batch {self.batch}) "
            f"- activation peak {_size(self.activation_bytes)} (measured in a dry step of "
            f"{self.batch} x {self.max_len} tokens) - margin {_size(self.margin_bytes)} = {_size(self.left_bytes)}"
        )

    def __str__(self) -> str:
        chosen = f"budget='auto': {_size(self.budget_bytes)} for the experts, {self.fraction:.1%} of their " + (
            f"{_size(self.experts_bytes)}"
        )
        if self.capped:
            return f"{chosen} (every expert: they take less than what is left): {self.terms()}"
        return f"{chosen}: {self.terms()}"

    def refusal(self) -> str:
        return (
            f"budget='auto' leaves {_size(max(0, self.left_bytes))} for the experts, less than the "
            f"{_size(self.least_bytes)} that hold one decode step's experts (batch {self.batch} x top-{self.top_k} "
            f"in every size class): {self.terms()}. Lower max_len or batch, free device memory, or give "
            "budget_bytes or budget_fraction"
        )


def report(line: str) -> None:
    """A notice as the library's lines go: to the ``pyexpcache`` logger (INFO) when logging is
    configured, else to stderr."""
    if logger.hasHandlers():
        logger.info("%s", line)
    else:
        print(f"expcache: {line}", file=sys.stderr)


def default_max_len(model: torch.nn.Module) -> int:
    """The generation config's ``max_length`` when the model sets one, else the config's
    ``max_position_embeddings`` (ValueError when neither says: give max_len)."""
    generation = getattr(model, "generation_config", None)
    length = getattr(generation, "max_length", None)
    if isinstance(length, int) and length > 0 and length != 20:  # 20: GenerationConfig's own default
        return length
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    length = getattr(config, "max_position_embeddings", None)
    if not isinstance(length, int) or length <= 0:
        raise ValueError(
            "budget='auto' needs max_len: the model's configs give no max_length or max_position_embeddings"
        )
    return length


def kv_cache_bytes(config, max_len: int, batch: int, dtype: torch.dtype) -> int:
    """The bytes of transformers' KV cache for ``batch`` sequences of ``max_len`` positions, from
    the config: per layer and position, keys and values of ``num_key_value_heads`` x ``head_dim``
    (``hidden_size // num_attention_heads`` without one); multi-head latent attention
    (``kv_lora_rank``: DeepSeek-V3) caches its latent and rotary key, ``kv_lora_rank +
    qk_rope_head_dim``. A sliding or chunked layer (``layer_types``) holds its window at most."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    layers = config.num_hidden_layers
    if getattr(config, "kv_lora_rank", None):
        per_position = config.kv_lora_rank + config.qk_rope_head_dim
    else:
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        per_position = 2 * heads * head_dim
    windows = {
        "sliding_attention": getattr(config, "sliding_window", None),
        "chunked_attention": getattr(config, "attention_chunk_size", None),
    }
    types = getattr(config, "layer_types", None) or ["full_attention"] * layers
    positions = sum(min(max_len, windows.get(t) or max_len) for t in types[:layers])
    return positions * batch * per_position * torch.finfo(dtype).bits // 8


def top_k(model: torch.nn.Module) -> int:
    """The experts the router chooses per token, from the config (1 where it does not say)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for name in ("num_experts_per_tok", "experts_per_token", "num_experts_per_token", "moe_top_k", "top_k"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 1


def resident_bytes(model: torch.nn.Module, experts: set, device: torch.device) -> int:
    """The bytes of ``model``'s parameters and buffers on ``device``, those in ``experts`` (ids) aside."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in experts or t.device != device or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def emulated_capacity() -> int:
    """The host backend's emulated device size by default (``expcache_config_init``'s)."""
    import ctypes

    cfg = _lib.Config()
    _lib.lib.expcache_config_init(ctypes.byref(cfg))
    return int(cfg.device_capacity_bytes)


class _PeakAllocated(torch.utils._python_dispatch.TorchDispatchMode):
    """The CPU's ``torch.cuda.max_memory_allocated``: the peak of the bytes of the storages made
    while it is on and still alive (torch keeps no count of the CPU's allocations)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen: dict[int, weakref.finalize] = {}

    def _drop(self, key: int, size: int) -> None:
        self._seen.pop(key, None)
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # A view or an in-place result shares an input's storage: nothing allocated.
        inputs = {
            t.untyped_storage().data_ptr()
            for t in torch.utils._pytree.tree_iter((args, kwargs))
            if isinstance(t, torch.Tensor) and t.device.type == "cpu"
        }
        for t in torch.utils._pytree.tree_iter(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self._seen and key not in inputs:
                    size = storage.nbytes()
                    self._seen[key] = weakref.finalize(storage, self._drop, key, size)
                    self.live += size
                    self.peak = max(self.peak, self.live)
        return out


def dry_step(model: torch.nn.Module, compute: torch.device, max_len: int, batch: int) -> int:
    """The activation peak of one forward of ``batch`` x ``max_len`` tokens (the prefill of the
    longest prompt the KV cache holds; no KV cache kept, the last position's logits only, as
    ``generate`` asks): on CUDA ``torch.cuda.max_memory_allocated`` over what was allocated
    before, on the CPU the same count kept by :class:`_PeakAllocated`."""
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(vocab, (batch, max_len), generator=torch.Generator().manual_seed(0)).to(compute)
    kwargs = {"use_cache": False}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kwargs["logits_to_keep"] = 1
    with torch.no_grad():
        if compute.type == "cuda":
            torch.cuda.synchronize(compute)
            before = torch.cuda.memory_allocated(compute)
            torch.cuda.reset_peak_memory_stats(compute)
            model(input_ids=ids, **kwargs)
            torch.cuda.synchronize(compute)
            return max(0, torch.cuda.max_memory_allocated(compute) - before)
        with _PeakAllocated() as peak:
            model(input_ids=ids, **kwargs)
        return peak.peak


def device_memory(compute: torch.device, capacity: Optional[int], resident: int) -> tuple[int, int]:
    """(total, free) device memory with the model's resident weights in place: CUDA's, measured
    once torch's cache is emptied; the host backend's emulated device (``capacity``, default
    :func:`emulated_capacity`) less ``resident``."""
    if compute.type == "cuda":
        torch.cuda.synchronize(compute)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(compute)
        return int(total), int(free)
    total = emulated_capacity() if capacity is None else capacity
    return total, total - resident


def size_budget(
    model: torch.nn.Module,
    layout: ModelLayout,
    compute: torch.device,
    experts: set,
    serve: Callable[[int, int], contextlib.AbstractContextManager],
    *,
    max_len: Optional[int] = None,
    batch: int = 1,
    margin_bytes: Optional[int] = None,
    capacity: Optional[int] = None,
) -> AutoBudget:
    """The budget ``budget="auto"`` gives ``model`` (whose experts weights, ``experts``: their
    ids, are in host memory and the rest where it computes, ``compute``), logged with every term
    (:func:`report`). ``serve(budget, reserve)`` is a context manager under which the model's
    forward serves its experts from caches of ``budget`` bytes that leave ``reserve`` bytes of
    device memory free (:attr:`AutoBudget.reserve_bytes`): the dry step runs there, at a provisional
    budget (an eighth of what is left before it, at least :attr:`AutoBudget.least_bytes`, at most
    every expert).

    Raises:
        ValueError: an argument out of range; a budget that cannot serve one decode step
            (:meth:`AutoBudget.refusal`: every term, and what to change); a dry step that ran
            out of device memory.
    """
    for name, value in (("max_len", max_len), ("batch", batch), ("margin_bytes", margin_bytes)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if max_len == 0 or batch == 0:
        raise ValueError("budget='auto' needs max_len and batch of at least 1")
    max_len = default_max_len(model) if max_len is None else max_len
    resident = resident_bytes(model, experts, compute)
    total, free = device_memory(compute, capacity, resident)
    if margin_bytes is None:
        margin_bytes = MARGIN_FIXED_BYTES + int(MARGIN_FRACTION * total)
    k = top_k(model)
    every = class_targets(layout, 2 * layout.total_bytes + (1 << 30))
    experts_bytes = least_budget(layout, lambda t: t == every)
    least = least_budget(layout, lambda t: all(n >= min(batch * k, m) for n, m in zip(t, every)))
    terms = dict(
        device=str(compute),
        total_bytes=total,
        resident_bytes=resident,
        free_bytes=free,
        kv_bytes=kv_cache_bytes(model.config, max_len, batch, model.dtype),
        max_len=max_len,
        batch=batch,
        margin_bytes=margin_bytes,
        experts_bytes=experts_bytes,
        least_bytes=least,
        top_k=k,
    )
    before = AutoBudget(activation_bytes=0, budget_bytes=0, **terms)
    if before.left_bytes < least:  # short before any activation: no dry step
        raise ValueError(before.refusal().replace("activation peak 0 B (measured", "activation peak not measured ("))
    provisional = max(least, min(experts_bytes, before.left_bytes // _PROVISIONAL_SHARE))
    try:
        with serve(provisional, replace(before, budget_bytes=provisional).reserve_bytes):
            activation = dry_step(model, compute, max_len, batch)
    except torch.OutOfMemoryError as e:
        raise ValueError(
            f"budget='auto': the dry step (a forward of {batch} x {max_len} tokens, no KV cache kept) ran out of "
            f"device memory with a cache of {_size(provisional)}: its activations alone do not fit. Lower max_len or "
            f"batch. {before.terms()}"
        ) from e
    finally:
        if compute.type == "cuda":
            torch.cuda.empty_cache()
    sized = AutoBudget(activation_bytes=activation, budget_bytes=0, **terms)
    if sized.left_bytes < least:
        raise ValueError(sized.refusal())
    chosen = AutoBudget(activation_bytes=activation, budget_bytes=min(experts_bytes, sized.left_bytes), **terms)
    report(str(chosen))
    return chosen
