"""record_routing(): a model's routing written as a generic trace, with its layout file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

from ..routing import FORMATS, TraceWriter, trace_format
from ._experts import find_experts, layout_of, refusal


def _layout_path(path: Path) -> Path:
    """``routing.jsonl.gz`` -> ``routing.layout.json`` beside it."""
    name = path.name[:-3] if path.name.lower().endswith(".gz") else path.name
    for suffix in FORMATS.values():
        if name.lower().endswith(suffix):
            name = name[: -len(suffix)]
            break
    return path.with_name(name + ".layout.json")


def _cache_is_empty(kwargs: dict) -> bool:
    for key in ("past_key_values", "cache"):
        cache = kwargs.get(key)
        if cache is not None and hasattr(cache, "get_seq_length"):
            return int(cache.get_seq_length()) == 0
    return True


class RoutingRecorder:
    """What :func:`record_routing` yields: ``trace_path``, ``layout_path``, ``layout`` and
    ``records`` (written so far). Tokens are numbered per sequence from 0 in the order the model
    sees them (padding included); each batch row of a forward that starts with an empty KV cache
    (or without one) is a new sequence (``seq``)."""

    def __init__(self, model, path, layout_path):
        self.model = model
        self.trace_path = Path(path)
        self.layout_path = Path(layout_path) if layout_path is not None else _layout_path(self.trace_path)
        self._layers = find_experts(model)
        refused = refusal(self._layers, "record")
        if refused:
            raise ValueError(f"{type(model).__name__}: {refused}")
        self.layout = layout_of(model, self._layers)
        self.records = 0
        self._writer: Optional[TraceWriter] = None
        self._handles = []
        self._next_seq = 0
        self._rows: list[tuple[int, int]] = []  # per batch row of the current forward: (seq, first token)
        self._counts: dict[int, int] = {}  # seq -> tokens seen
        self._tokens_per_row = 0

    def __enter__(self):
        self.layout.write_json(self.layout_path)
        self._writer = TraceWriter(self.trace_path)
        self._handles.append(self.model.register_forward_pre_hook(self._on_model, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(self._after_model, with_kwargs=True))
        for e in self._layers:
            self._handles.append(e.module.register_forward_pre_hook(self._on_experts(e.layer), with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _on_model(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if ids is None:
            raise ValueError("record_routing: the model was called without input_ids or inputs_embeds")
        rows, tokens = int(ids.shape[0]), int(ids.shape[1])
        if _cache_is_empty(kwargs) or len(self._rows) != rows:
            self._rows = [(self._next_seq + r, 0) for r in range(rows)]
            self._next_seq += rows
        else:
            self._rows = [(seq, self._counts[seq]) for seq, _ in self._rows]
        self._tokens_per_row = tokens

    def _after_model(self, module, args, kwargs, output):
        for seq, first in self._rows:
            self._counts[seq] = first + self._tokens_per_row

    def _on_experts(self, layer: int):
        def hook(module, args, kwargs):
            values = list(args) + [kwargs[k] for k in kwargs if k not in ("hidden_states",)]
            index, weights = values[1], values[2]
            experts = index.detach().to("cpu", torch.int64).tolist()
            gates = weights.detach().to("cpu", torch.float64).tolist()
            per_row = self._tokens_per_row
            if len(experts) != per_row * len(self._rows):
                raise RuntimeError(
                    f"record_routing: layer {layer} routed {len(experts)} tokens where the model's "
                    f"input has {len(self._rows)} rows of {per_row}"
                )
            for i, (ids, w) in enumerate(zip(experts, gates)):
                seq, first = self._rows[i // per_row]
                self._writer.write(first + i % per_row, layer, ids, weights=w, seq=seq)
                self.records += 1

        return hook


def record_routing(model: torch.nn.Module, path, *, layout_path=None) -> RoutingRecorder:
    """A context manager that writes ``model``'s routing while it runs: one record per (token,
    MoE layer) in the generic trace format at ``path`` (``.jsonl``, ``.csv`` or ``.npz``, each
    optionally ``.gz``; docs/traces.md), with the router's weights and a ``seq`` per sequence,
    and the model's layout file (default: ``<name>.layout.json`` beside the trace, e.g.
    ``routing.layout.json`` for ``routing.jsonl.gz``), written on entry. Replay them with
    ``expcache bench --layout routing.layout.json --traces routing.jsonl.gz``.

    Each MoE layer's ids are copied to the host as it runs (recording is for analysis, not for a
    captured graph). Works with or without :func:`offload`.

    Raises:
        ValueError: the model has no experts-interface MoE layer (naming its class), or the trace
            name has no known ending.
    """
    trace_format(os.fspath(path))  # the ending, checked before anything is written
    return RoutingRecorder(model, path, layout_path)
