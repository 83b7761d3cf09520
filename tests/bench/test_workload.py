"""Workloads of the benchmark (expcache_bench/workload.py): the bundled and synthetic traces
as the calls an engine makes, decode, prefill and turns."""

from __future__ import annotations

import pytest

import expcache_bench as bench
from expcache_bench.sim import BATCH, DECODE
from expcache_bench.traces import load_decode_trace


def test_decode_workload_is_token_major_over_model_layers():
    w = bench.build_workload("decode", ["podA_b_json_full"])
    trace = load_decode_trace("podA_b_json_full")
    assert w.decode_tokens == trace.num_tokens and w.prefill_tokens == 0
    assert len(w.calls) == trace.num_tokens * 40
    assert [c.layer for c in w.calls[:41]] == list(range(3, 43)) + [3]
    assert w.calls[40].ids == tuple(trace.ids[1, 0].tolist())


def test_prefill_workload_batches_every_layer_then_decodes():
    w = bench.build_workload("prefill", ["podA_b_json_full"])
    assert w.has_batches and w.prefill_tokens == 72 + 66 + 74 + 65 + 76 + 68 + 54 + 49 + 47 + 53
    first = w.calls[:43]
    assert all(c.kind == BATCH for c in first) and [c.layer for c in first] == list(range(43))
    assert len(first[0].ids) == 54 * 6  # the eval file sorts first; its first prompt has 54 tokens
    assert w.calls[43].kind == DECODE


def test_turns_workload_repeats_the_decode_after_a_prompt():
    w = bench.build_workload("turns", ["podA_b_json_full"])
    decode = [c for c in w.calls if c.kind == DECODE]
    n = 37 * 40
    assert decode[:n] == decode[-n:]


def test_synthetic_traces_in_workloads():
    w = bench.build_workload("decode", ["synthetic:50:3"])
    assert w.decode_tokens == 50 and len(w.calls) == 50 * 40
    assert w.calls == bench.build_workload("decode", ["synthetic:50:3"]).calls  # seeded
    assert w.calls != bench.build_workload("decode", ["synthetic:50:4"]).calls
    for bad in ("synthetic:", "synthetic:x", "synthetic:0", "synthetic:5:1:2"):
        with pytest.raises(ValueError, match="synthetic:TOKENS"):
            bench.build_workload("decode", [bad])
