"""Workloads: the calls a scenario replays (decode traces in a row, prompts' prefill
batches between them, conversation turns), in the form the C replay loop takes."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from pyexpcache.layout import ModelLayout
from pyexpcache.routing import Trace, is_generic_path, read_trace

from .replay import BATCH as C_BATCH, DECODE as C_DECODE, ReplayCall
from .sim import BATCH, DECODE, Call
from .traces import TOP_K, list_traces, load_decode_trace, load_prefill_trace, synthetic_trace
from .traces.bundled import is_route_csv
from .traces.synthetic import synthetic_trace_for

SCENARIOS = ("decode", "prefill", "turns")
DEFAULT_TRACES = (
    "podA_a_coffee_full",
    "podA_b2_json_long_full",
    "podA_c_python_full",
    "podA_b_json_full",
    "oracle50_k0w",
    "livemask_forensic_k0",
    "smoke_count64",
)


@dataclass
class Workload:
    """An ordered list of calls (decode: one token at one layer; batch: a prompt's layer)."""

    name: str
    calls: list[Call]
    decode_tokens: int
    prefill_tokens: int

    @property
    def has_batches(self) -> bool:
        return any(c.kind == BATCH for c in self.calls)

    def arrays(self):
        """The calls as the C replay loop takes them: a ctypes replay_call_t array and all ids."""

        calls = (ReplayCall * len(self.calls))()
        offset = 0
        for c, call in zip(calls, self.calls):
            c.kind = C_BATCH if call.kind == BATCH else C_DECODE
            c.layer, c.offset, c.count = call.layer, offset, len(call.ids)
            offset += len(call.ids)
        ids = np.fromiter((e for call in self.calls for e in call.ids), dtype=np.uint32, count=offset)
        return calls, ids


def _decode_calls(trace, layers: Optional[set]) -> list[Call]:
    """A call per (token, layer) record of ``trace``, token-major: a missing record makes none."""
    out = []
    ids = trace.ids.tolist()
    present = trace.present.tolist()
    for t in range(trace.num_tokens):
        for i, layer in enumerate(trace.layers):
            if present[t][i] and (layers is None or layer in layers):
                out.append(Call(DECODE, layer, tuple(ids[t][i])))
    return out


def _prefill_calls(prompt, layers: Optional[set]) -> list[Call]:
    return [
        Call(BATCH, layer, tuple(prompt.prefill[layer].ravel().tolist()))
        for layer in range(prompt.num_layers)
        if layers is None or layer in layers
    ]


TraceSpec = Union[str, "os.PathLike[str]", Trace]


def trace_label(trace: TraceSpec) -> str:
    """How a report names a trace: a loaded trace's name, else what was given."""
    return trace.name if isinstance(trace, Trace) else str(trace)


def decode_trace(name: TraceSpec, layout: Optional[ModelLayout] = None, k: Optional[int] = None) -> Trace:
    """A loaded :class:`~pyexpcache.routing.Trace` (returned as is); a generic routing-trace file
    (``*.jsonl``, ``*.csv``, ``*.npz``, each optionally ``.gz``: :func:`~pyexpcache.routing.read_trace`);
    a bundled trace or a route-CSV path (``*.route.csv``, or a ``*.csv`` starting with that format's
    header); or ``synthetic:TOKENS[:SEED]`` (fitted to the real traces' locality: per-layer
    popularity skew plus reuse of the previous token's experts), shaped by ``layout`` when given
    (its MoE layers and experts, ``k`` experts per token, default 6:
    :func:`~expcache_bench.traces.synthetic.synthetic_trace_for`; DeepSeek V4 Flash's layers 3-42
    without one, or for its layouts)."""
    if isinstance(name, Trace):
        return name
    if is_generic_path(name) and not is_route_csv(name):
        return read_trace(name)
    if isinstance(name, os.PathLike):
        return load_decode_trace(name)
    if not isinstance(name, str):
        raise TypeError(f"a trace is a Trace, a file path or a bundled trace's name, got {type(name).__name__}")
    if name.startswith("synthetic:"):
        fields = name.split(":")
        try:
            tokens = int(fields[1])
            seed = int(fields[2]) if len(fields) > 2 else 0
        except (IndexError, ValueError):
            raise ValueError(f"expected synthetic:TOKENS[:SEED], got {name!r}") from None
        if tokens <= 0 or len(fields) > 3:
            raise ValueError(f"expected synthetic:TOKENS[:SEED] with TOKENS > 0, got {name!r}")
        if layout is None:
            return synthetic_trace(tokens, k=TOP_K if k is None else k, seed=seed, name=name)
        return synthetic_trace_for(layout, tokens, k, seed=seed, name=name)
    return load_decode_trace(name)


def decode_workload(traces, layers: Optional[Sequence[int]] = None) -> Workload:
    """The ``decode`` scenario of already loaded :class:`~pyexpcache.routing.Trace` objects: their
    tokens one trace after another, each token's layers in order (``layers``: those kept)."""
    keep = set(layers) if layers is not None else None
    calls = [call for trace in traces for call in _decode_calls(trace, keep)]
    return Workload("decode", calls, sum(t.num_tokens for t in traces), 0)


def build_workload(
    scenario: str,
    traces: Sequence[TraceSpec] = DEFAULT_TRACES,
    layers: Optional[Sequence[int]] = None,
    layout: Optional[ModelLayout] = None,
) -> Workload:
    """The calls of a scenario, over ``traces`` (each as :func:`decode_trace` takes it: a loaded
    :class:`~pyexpcache.routing.Trace`, a file, a bundled name, or a synthetic trace shaped by
    ``layout``); ``layers``: the model layers kept.

    ``decode``: the decode traces one after another (a server answering requests).
    ``prefill``: each bundled prefill prompt's batches (layers 0-42) then its decode token,
    each followed by one of the decode traces, in turn: prompts never flush decode state.
    ``turns``: two conversation turns per decode trace: decode, the prefill of a new prompt,
    then the same decode again.
    """
    keep = set(layers) if layers is not None else None
    decode = [decode_trace(name, layout) for name in traces]
    calls: list[Call] = []
    dec_tokens = pre_tokens = 0

    def add_decode(trace):
        nonlocal dec_tokens
        calls.extend(_decode_calls(trace, keep))
        dec_tokens += trace.num_tokens

    def add_prompt(prompt):
        nonlocal pre_tokens
        calls.extend(_prefill_calls(prompt, keep))
        pre_tokens += prompt.num_prefill_tokens
        add_decode(prompt.decode)

    if scenario == "decode":
        return decode_workload(decode, layers)
    if scenario in ("prefill", "turns"):
        prompts = [p for info in list_traces() if info.kind == "prefill" for p in load_prefill_trace(info.name)]
        if scenario == "prefill":
            for i, prompt in enumerate(prompts):
                add_prompt(prompt)
                add_decode(decode[i % len(decode)])
        else:
            for i, trace in enumerate(decode):
                add_decode(trace)
                add_prompt(prompts[i % len(prompts)])
                add_decode(trace)
    else:
        raise ValueError(f"unknown scenario {scenario!r}: expected one of {SCENARIOS}")
    return Workload(scenario, calls, dec_tokens, pre_tokens)
