"""The torch decode loop (expcache_bench/modes/torch_loop.py) on the host backend: both modes side by
side on one cache setting, every kernel's result checked against the source's bytes (and the check
able to fail), one kernel per expert where the slot's parts touch and one per part where they do
not, and a report that renders and serializes."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch decode loop needs PyTorch (pip install torch)")

from expcache_bench import Bench, Report, build_workload, format_report  # noqa: E402
from expcache_bench.modes.torch_loop import expected_sums, run_torch_loop  # noqa: E402
from pyexpcache import ModelLayout  # noqa: E402

TRACES = ["synthetic:20"]
K = 6


@pytest.fixture(scope="module", params=[256, 4096], ids=["scale256-span", "scale4096-parts"])
def bench(request):
    # scale 256: part sizes multiples of 256 bytes, so a slot's parts touch (one kernel per expert);
    # scale 4096: 528/672-byte parts padded to 256-byte offsets (one kernel per part).
    layout = ModelLayout.preset("mixed", scale=request.param)
    b = Bench(layout, backend="host", budget_bytes=layout.total_bytes // 10)
    b.scale = request.param
    yield b
    b.close()


@pytest.fixture(scope="module")
def expected(bench):
    return expected_sums(bench, TRACES)


def test_every_mode_serves_the_source_bytes(bench, expected):
    calls = len(build_workload("decode", TRACES, bench.layout.moe_layers).calls)
    report = run_torch_loop(bench, traces=TRACES, compute_us=5, expected=expected)
    assert isinstance(report, Report) and report.backend == "host"
    assert [r.mode for r in report.results] == ["plain", "split", "slots"]
    plain, split, slots = report.results
    # By slot id: one index_select and one reduction per span and layer, whatever the k.
    spans = 1 if bench.scale == 256 else 3
    assert slots.kernels == 2 * spans * calls
    for r in (plain, split):
        assert r.kernels_per_expert == spans
    for r in report.results:
        assert r.checksum_errors == 0
        assert r.decode_calls == calls and r.experts_checked == calls * K
        assert r.decode_tokens == 20 and r.decode_seconds > 0 and r.tokens_per_s > 0
        assert 0 < r.serve_seconds < r.decode_seconds
        assert r.hits > 0 and r.misses > 0  # the budget is small enough for misses
        assert r.hits + r.misses == calls * K
    # Same policy, budget and calls: the same hits and misses, however the layer is served.
    assert (plain.hits, plain.misses) == (split.hits, split.misses) == (slots.hits, slots.misses)
    assert plain.hit_rate == split.hit_rate
    text = format_report(report)
    assert "torch loop: one torch kernel per expert over its view, a synchronize per layer" in text
    assert "host-emulated" in text and "vs plain" in text and f"0 bad / {calls * K} checked" in text
    data = json.loads(json.dumps(report.to_json()))
    assert data["results"][1]["mode"] == "split" and data["results"][0]["tokens_per_s"] > 0


def test_expected_sums_are_the_source_bytes(bench, expected):
    call = build_workload("decode", TRACES, bench.layout.moe_layers).calls[0]
    for e in call.ids[:2]:
        data = bench.source.expert_bytes(call.layer, e)
        assert int(expected[call.layer, e].sum()) == int(np.sum(data.view("<i4"), dtype=np.int64))


def test_a_corrupted_expectation_is_caught(bench, expected, capsys):
    call = build_workload("decode", TRACES, bench.layout.moe_layers).calls[0]
    bad = expected.copy()
    bad[call.layer, call.ids[0], 1] += 1  # as if the up part of that expert had been served wrong
    report = run_torch_loop(bench, traces=TRACES, expected=bad)
    for r in report.results:
        assert r.checksum_errors >= 1
    assert "CHECKSUM MISMATCH: torch plain" in capsys.readouterr().err
    assert f"{report.results[0].checksum_errors} bad" in format_report(report)


def test_arguments_are_checked(bench, expected):
    with pytest.raises(ValueError, match="unknown mode"):
        run_torch_loop(bench, traces=TRACES, modes=("plain", "fast"), expected=expected)
    with pytest.raises(ValueError, match="distinct"):
        run_torch_loop(bench, traces=TRACES, modes=("plain", "plain"), expected=expected)
    with pytest.raises(ValueError, match="compute_us"):
        run_torch_loop(bench, traces=TRACES, compute_us=-1, expected=expected)


def test_one_mode_and_progress(bench, expected):
    seen = []
    report = run_torch_loop(
        bench,
        traces=TRACES,
        modes=("split",),
        expected=expected,
        progress=lambda label, done, total: seen.append((label, done, total)),
    )
    assert [r.mode for r in report.results] == ["split"] and report.checksum_errors == 0
    assert seen and seen[-1] == ("torch split", 800, 800)
    assert "vs plain" in format_report(report)  # the ratio to the first when there is no plain
