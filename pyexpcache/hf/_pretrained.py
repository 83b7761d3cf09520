"""offload_pretrained(): a safetensors checkpoint loaded with its experts never in host memory,
served from the checkpoint's own files."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from typing import Optional

import torch

from .._ints import checked_int
from .._lib import MAX_HOST_BUDGET_BYTES
from ..file_source import FileSource
from ..layout import ModelLayout
from ..source import LayerPlacement
from ._caches import progress_bar
from ._checkpoint import Lazy, Range, Slice, Tensor, Unread, read_headers
from ._experts import ExpertsLayer, find_experts
from ._offload import Offloaded, check_arguments, serve

#: from_pretrained arguments offload_pretrained sets itself.
_OWN = ("state_dict", "device_map", "gguf_file", "pretrained_model_name_or_path", "tp_plan", "quantization_config")


def shards(path) -> list[str]:
    """The safetensors files of the checkpoint directory ``path``, in the index's order (ValueError: none)."""
    path = os.fspath(path)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = list(dict.fromkeys(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise ValueError(
        f"{path}: no safetensors checkpoint (model.safetensors or model.safetensors.index.json); "
        "offload_pretrained reads a local directory written by save_pretrained or downloaded from the Hub"
    )


def _expert_ranges(t: Unread, where: str, num_experts: int) -> list[list[Range]]:
    """Per expert, the byte ranges ``t`` (an experts parameter as loaded) was made of."""
    if t.refused:
        raise ValueError(f"{where}: {t.refused}")
    if t.experts is not None:
        return t.experts
    (whole,) = t.ranges  # a fused [E, ...] checkpoint tensor: one expert every nbytes / E
    stride = whole.nbytes // num_experts
    return [[Range(whole.name, whole.file, whole.offset + e * stride, stride)] for e in range(num_experts)]


def _cut(ranges: list[Range], start: int, nbytes: int, what: str) -> tuple[int, int]:
    """(file, offset) of bytes [start, start + nbytes) of the concatenated ``ranges``, which must lie in one."""
    pos = 0
    for r in ranges:
        if pos <= start and start + nbytes <= pos + r.nbytes:
            return r.file, r.offset + start - pos
        pos += r.nbytes
    names = ", ".join(r.name for r in ranges)
    raise ValueError(f"{what} is not one byte range of the checkpoint (bytes {start}..{start + nbytes} of {names})")


def _placement(e: ExpertsLayer, spec) -> LayerPlacement:
    """Where each part of ``e`` (gate, up and down; or each quantized tensor) is in the
    checkpoint, expert by expert."""
    n = e.num_experts
    ranges = {id(t): _expert_ranges(t, f"{e.name}.{name}", n) for name, t in zip(e.weight_names, e.weights)}
    cuts = [
        (ranges[id(t)], start, part.nbytes, part.name) for (t, start), part in zip(e.part_rows(e.weights), spec.parts)
    ]
    offsets, files = [], []
    for held, start, nbytes, part in cuts:
        where = [_cut(held[x], start, nbytes, f"{e.name}: expert {x}'s {part} part") for x in range(n)]
        files.append([f for f, _ in where])
        offsets.append([o for _, o in where])
    zeros = (0,) * len(cuts)
    return LayerPlacement(zeros, zeros, spec.class_key, tuple(offsets), tuple(files))


def _load(cls, config, tensors: dict[str, Tensor], paths: list[str], unread: set, bar, **kwargs):
    """``cls.from_pretrained`` over the checkpoint, the tensors named in ``unread`` standing as
    :class:`Unread` placeholders, the others read by transformers from their shards."""
    from safetensors import safe_open

    with contextlib.ExitStack() as stack:
        state = {}
        opened = {}
        loaded, lock = [0], threading.Lock()
        total = len(tensors) - len(unread)

        def counted(read_slice):
            def read(item):
                out = read_slice(item)
                with lock:
                    loaded[0] += 1
                    bar("non-expert weights", loaded[0], total)
                return out

            return read

        for name, t in tensors.items():
            if name in unread:
                state[name] = Lazy(t)
                continue
            if t.file not in opened:
                opened[t.file] = stack.enter_context(safe_open(paths[t.file], framework="pt"))
            state[name] = Slice(opened[t.file].get_slice(name), t.dtype, counted)
        if hasattr(cls, "_model_mapping"):  # an auto class: its from_pretrained wants a path, the model class does not
            cls = cls._model_mapping[type(config)]
        return cls.from_pretrained(None, config=config, state_dict=state, **kwargs)


def offload_pretrained(
    path,
    *,
    budget: Optional[str] = None,
    budget_bytes: Optional[int] = None,
    budget_fraction: Optional[float] = None,
    host_budget_bytes: Optional[int] = None,
    file_reads: str = "buffered",
    device=None,
    dtype=None,
    progress=None,
    model_class=None,
    max_len: Optional[int] = None,
    batch: int = 1,
    margin_bytes: Optional[int] = None,
    device_capacity_bytes: Optional[int] = None,
    policy: Optional[str] = None,
    **from_pretrained,
) -> Offloaded:
    """Load the safetensors checkpoint directory ``path`` with its routed experts never in host
    memory and serve them from the checkpoint's own files; returns :func:`offload`'s
    :class:`Offloaded` (the model is ``handle.model``).

    Everything but the experts' weights is loaded by transformers' ``from_pretrained`` as it
    loads it (its weight conversion, dtype, tied weights, generation config), on the host, then
    moved to ``device`` (as :func:`offload` moves it: no device_map, whose allocator warm-up
    would count the experts' bytes).
    The experts' tensors are handed to it as placeholders that are never read: each experts
    parameter is left on the meta device, and each expert's gate, up and down parts are located
    in the shards (their safetensors headers): a checkpoint that keeps each expert's tensors apart
    (``experts.E.gate_proj.weight`` ...) gives a (shard, offset) per expert and part, one whose
    experts are fused 3-D tensors a base and a stride. An ``ExpertCache(lookup="device")`` over a
    :class:`~pyexpcache.FileSource` of the shards then serves them as :func:`offload` does: the
    misses are read from the files by the library's threads inside the select, captured in a CUDA
    graph like any select. Tokens and logits are those of the checkpoint loaded whole.

    Args:
        path: a local directory with ``model.safetensors`` or ``model.safetensors.index.json``.
        budget, budget_bytes, budget_fraction, max_len, batch, margin_bytes, device_capacity_bytes,
            policy: as :func:`offload` takes them (one budget; ``budget="auto"`` sizes it).
        host_budget_bytes: bytes of the host pool, a tier of pinned host RAM between the files and
            the GPU (``ExpertCache(host_budget_bytes=...)``): the device's misses read the files
            only when the pool misses too. Shared between the caches as the budget is (in
            proportion to their experts' bytes); None or 0: no pool (misses read the files,
            through the page cache). Its counters: ``cache.pool_stats()`` of each of
            ``handle.caches``.
        file_reads: how the misses read the files: ``"buffered"`` (pread through the page cache)
            or ``"direct"`` (O_DIRECT, from the disk, reads widened to whole blocks: an SSD's
            parallel reads without the page cache's copy and memory).
        device: where the model computes (default: the CPU, expcache's host backend); the
            non-expert weights are moved there.
        dtype: ``from_pretrained``'s (default: as it decides, the config's). The experts are
            served in the checkpoint's dtype, unconverted: a dtype that would convert them is refused.
        progress: True for a bar on stderr while the non-expert weights load and the experts are
            located, or a callable ``progress(label, done, total)``; None shows the bar when
            stderr is a terminal.
        model_class: the class whose ``from_pretrained`` loads it (default
            ``transformers.AutoModelForCausalLM``).
        from_pretrained: further ``from_pretrained`` arguments (``attn_implementation``,
            ``experts_implementation``, ``trust_remote_code``, ``config``, ``generation_config``
            ...); ``state_dict``, ``device_map``, ``gguf_file``, ``tp_plan`` and
            ``quantization_config`` are offload_pretrained's own.

    Raises:
        ValueError: a budget missing, doubled or out of range (as :func:`offload`); no safetensors
            checkpoint in ``path``; an experts tensor whose bytes are not a byte range of a shard,
            naming the tensor and the reason: stored transposed or otherwise rearranged relative to
            the module (transformers' loading would transpose, split or interleave it), or of
            another dtype than the model's (the cache does not convert); a from_pretrained
            argument offload_pretrained sets itself.
    """
    import transformers

    host_budget_bytes = 0 if host_budget_bytes is None else host_budget_bytes
    host_budget_bytes = checked_int(host_budget_bytes, "host_budget_bytes", 0, MAX_HOST_BUDGET_BYTES)
    if file_reads not in ("buffered", "direct"):
        raise ValueError(f"file_reads must be 'buffered' or 'direct', got {file_reads!r}")
    check_arguments(budget, budget_bytes, budget_fraction, max_len, batch, margin_bytes, progress)
    own = sorted(set(from_pretrained) & set(_OWN))
    if own:
        raise ValueError(
            f"offload_pretrained sets {', '.join(own)} itself: leave {'it' if len(own) == 1 else 'them'} out"
        )
    paths = shards(path)
    tensors = read_headers(paths)
    cls = model_class or transformers.AutoModelForCausalLM
    trust = (
        {"trust_remote_code": from_pretrained["trust_remote_code"]} if "trust_remote_code" in from_pretrained else {}
    )
    config = from_pretrained.pop("config", None) or transformers.AutoConfig.from_pretrained(path, **trust)
    quant = getattr(config, "quantization_config", None)
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    if str(getattr(method, "value", method)).lower() == "mxfp4":
        raise ValueError(
            f"{path}: an MXFP4 checkpoint's experts are stored unswizzled and served swizzled (as the GPU's "
            "matmul reads them), so they cannot be read from its files: load it with from_pretrained on a GPU "
            "and serve it with pyexpcache.hf.offload"
        )
    if "generation_config" not in from_pretrained and os.path.isfile(os.path.join(path, "generation_config.json")):
        from_pretrained["generation_config"] = transformers.GenerationConfig.from_pretrained(path)
    if dtype is not None:
        from_pretrained["dtype"] = dtype
    bar = progress_bar(progress)

    # Every tensor a placeholder: which of them the experts' parameters are made of.
    shape = _load(
        cls, config, tensors, paths, set(tensors), lambda *a: None, **{**from_pretrained, "use_kernels": False}
    )
    unread = {n for e in find_experts(shape) for t in e.weights if isinstance(t, Unread) for n in t.names()}
    del shape
    model = _load(cls, config, tensors, paths, unread, bar, **from_pretrained)
    layers = find_experts(model)
    placements = {}
    for e in layers:
        for name, t in zip(e.weight_names, e.weights):
            if not isinstance(t, Unread):
                raise ValueError(f"{e.name}: {name} is not in the checkpoint (transformers initialized it)")
        spec = e.spec()
        placements[e.layer] = _placement(e, spec)
        for name in e.weight_names:
            p = getattr(e.module, name)  # on meta, as a plain parameter: no placeholder left in the model
            setattr(e.module, name, torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), False))

    def files(layout: ModelLayout, group: list[ExpertsLayer]) -> FileSource:
        return FileSource(paths, layout, {e.layer: placements[e.layer] for e in group})

    return serve(
        model,
        layers,
        files=files,
        budget=budget,
        budget_bytes=budget_bytes,
        budget_fraction=budget_fraction,
        max_len=max_len,
        batch=batch,
        margin_bytes=margin_bytes,
        device=device,
        device_capacity_bytes=device_capacity_bytes,
        policy=policy,
        progress=bar,
        host_budget_bytes=host_budget_bytes,
        file_reads=file_reads,
    )
