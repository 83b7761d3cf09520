"""The benchmark's engine model (expcache_bench/modes/engine.py) on the host backend: the settings,
the advice each decode call gets, every setting's bytes checked, and what prefetch and hints
change in the counters (times on the host mean nothing: no test looks at them)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import expcache_bench as bench
from expcache_bench import predict
from expcache_bench.modes import engine
from expcache_bench.workload import build_workload, decode_trace
from pyexpcache import ModelLayout


def test_settings_put_none_first_and_add_hints():
    names = [s.name for s in engine.settings(["cooc", "none", "oracle:0.5", "cooc"], hints=True)]
    assert names == ["none", "prefetch cooc", "prefetch oracle:0.5", "hint cooc", "hint oracle:0.5"]
    assert [s.simulated for s in engine.settings(["oracle:1"], hints=False)] == [False, True]
    with pytest.raises(ValueError, match="oracle"):
        engine.settings(["oracle:7"], hints=False)


def test_advice_is_the_previous_layers_prediction():
    trace = decode_trace("podA_b_json_full")
    layers = list(trace.layers)
    offsets, counts, ids = engine.advice_arrays([trace], layers, "oracle:1.0", top=6)
    calls = build_workload("decode", ["podA_b_json_full"], layers).calls
    assert len(offsets) == len(counts) == len(calls)
    preds = predict.predictions(trace, "oracle:1.0", top=6)
    for c, call in enumerate(calls[:200]):
        t, i = divmod(c, len(layers))
        got = ids[offsets[c] : offsets[c] + counts[c]].tolist()
        if i == 0:
            assert counts[c] == 0  # a token's first layer: nothing routed before it
        else:
            want = preds[t, i - 1]
            assert got == want[want >= 0].tolist()
            assert set(got) <= set(call.ids)  # oracle:1.0 names the call's own experts


@pytest.fixture(scope="module")
def host_bench():
    layout = ModelLayout.preset("mixed", scale=4096)
    b = bench.Bench(layout, backend="host", budget_bytes=(12 << 30) // 4096)
    yield b
    b.close()


@pytest.mark.parametrize("split", [False, True])
def test_every_setting_serves_the_right_bytes(host_bench, split):
    report = engine.run_engine(
        host_bench, traces=["podA_b_json_full"], prefetch=["cooc", "oracle:1.0"], hints=True, compute_us=20, split=split
    )
    assert [r.setting for r in report.results] == [
        "none",
        "prefetch cooc",
        "prefetch oracle:1.0",
        "hint cooc",
        "hint oracle:1.0",
    ]
    calls = 37 * 40
    for r in report.results:
        assert r.checksum_errors == 0 and r.experts_checked == calls * 6
        assert r.hits + r.misses > 0 and r.decode_seconds > 0
    by = {r.setting: r for r in report.results}
    none, oracle = by["none"], by["prefetch oracle:1.0"]
    assert none.prefetch.issued == 0 and none.prefetch.hints == 0
    # A perfect next-layer prediction, prefetched, turns demand misses into hits (how many depends on
    # how much the prefetch thread sends before the next select cancels it: on the host, the CPU).
    assert oracle.prefetch.issued > 0 and oracle.prefetch.used > 0
    assert oracle.misses < none.misses
    assert by["hint cooc"].prefetch.hints > 0 and by["hint cooc"].prefetch.issued == 0
    text = bench.format_report(report)
    assert "(simulated)" in text and "vs none" in text and "link busy" in text
    json.dumps(report.to_json())


def test_a_wrong_byte_is_caught(host_bench):
    saved = host_bench.expected.copy()
    try:
        host_bench.expected[4, :] ^= np.uint64(1)  # as if layer 4's experts had been served wrong
        report = engine.run_engine(host_bench, traces=["podA_b_json_full"], prefetch=["oracle:1.0"])
        assert all(r.checksum_errors > 0 for r in report.results)
    finally:
        host_bench.expected[:] = saved


def test_compute_us_is_checked(host_bench):
    with pytest.raises(ValueError, match="compute_us"):
        engine.run_engine(host_bench, traces=["podA_b_json_full"], compute_us=-1)
