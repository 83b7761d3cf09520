"""The benchmark on routing traces of any model (expcache_bench/): loaded traces and generic files in
bench.run and on the command line, (token, layer) records missing, the check against the layout,
and the budget as a fraction of the experts' bytes; hit rates equal to the simulator's."""

from __future__ import annotations

import json
import re
import warnings

import numpy as np
import pytest

import expcache_bench as bench
from expcache_bench import cli, options
from expcache_bench.sim import decode_stream, simulate_lru
from expcache_bench.traces import (
    MISSING,
    Trace,
    TraceWarning,
    load_decode_trace,
    read_trace,
    synthetic_trace,
    write_trace,
)
from pyexpcache import ExpertCache, HostSource, ModelLayout
from pyexpcache.budget import class_targets, resolve_budget

SCALE = 4096


def holed_trace(tokens: int = 40, seed: int = 5) -> Trace:
    """A synthetic DeepSeek-shaped trace (layers 3..42, 256 experts) with records removed: one token
    misses its last layers, others a layer here and there."""
    t = synthetic_trace(tokens, seed=seed)
    ids = t.ids.copy()
    rng = np.random.default_rng(seed)
    for _ in range(15):
        ids[rng.integers(tokens), rng.integers(t.num_layers)] = MISSING
    ids[3, 20:] = MISSING
    return Trace("holed", ids, None, t.first_layer, t.positions, t.num_experts)


def library_lru_capacity(layout: ModelLayout, budget_bytes: int) -> int:
    """Slots of the one size class of ``layout`` at ``budget_bytes``: what the library makes of it."""
    with (
        HostSource(layout) as source,
        ExpertCache(layout, source, budget_bytes=budget_bytes, backend="host", policy="lru", log_level=0) as cache,
    ):
        cache.select(layout.moe_layers[0], [0])  # a class is made by its first call
        (cls,) = cache.classes()
        return cls.cap_experts


def simulated_lru_hit_rate(trace: Trace, layout: ModelLayout, budget_bytes: int) -> float:
    calls = decode_stream(trace, first_layer=trace.first_layer)
    return simulate_lru(calls, library_lru_capacity(layout, budget_bytes), [0] * layout.num_layers).hit_rate


def test_resolve_budget():
    layout = ModelLayout.preset("q2", scale=SCALE)
    assert resolve_budget(layout) == 12 << 30
    assert resolve_budget(layout, 1000) == 1000
    assert resolve_budget(layout, budget_fraction=0.25) == layout.total_bytes // 4
    assert resolve_budget(layout, budget_fraction=1) == layout.total_bytes
    with pytest.raises(ValueError, match="not both"):
        resolve_budget(layout, 1000, 0.5)
    for bad in (0, -0.1, 1.01, float("nan"), "0.5", True):
        with pytest.raises(ValueError, match=r"budget_fraction must be a number in \(0, 1\]"):
            resolve_budget(layout, budget_fraction=bad)


def test_bench_run_takes_loaded_traces_with_records_missing():
    layout = ModelLayout.preset("q2", scale=SCALE)
    trace = holed_trace()
    report = bench.run(
        layout,
        "decode",
        variants=["lru", "nocache"],
        traces=[trace],
        budget_fraction=0.25,
        backend="host",
        host_scale=SCALE,
    )
    lru = report.results[0]
    # The caches' budget keeps the slot count of the full-size run at a quarter of its bytes.
    assert report.traces == ["holed"] and report.full_budget_bytes == layout.total_bytes // 4 * SCALE
    assert (
        library_lru_capacity(layout, report.budget_bytes)
        == class_targets(ModelLayout.preset("q2"), report.full_budget_bytes)[0]
    )
    assert report.budget_fraction == pytest.approx(0.25)
    assert lru.experts_checked == trace.num_requests and report.checksum_errors == 0
    assert lru.decode_calls == int(trace.present.sum())
    assert lru.hit_rate == simulated_lru_hit_rate(trace, layout, report.budget_bytes)
    with pytest.raises(ValueError, match="not both"):
        bench.run(layout, "decode", traces=[trace], budget_bytes=1 << 20, budget_fraction=0.5, backend="host")


def test_bench_run_checks_the_trace_against_the_layout():
    layout = ModelLayout.preset("q2", scale=SCALE).with_experts(64)
    with pytest.raises(
        ValueError,
        match=r"trace holed layer 3 has expert id \d+ .*which layout .* does not have: "
        r"it gives that layer 64 experts",
    ):
        bench.run(layout, "decode", traces=[holed_trace()], backend="host")


def test_the_budget_options():
    parser = cli._mode_parser(bench.modes.by_name("variants"))
    args = parser.parse_args(["--budget-fraction", "0.25"])
    layout = ModelLayout.preset("q2", scale=SCALE)
    assert args.budget_gib is None and options.budget_bytes(args, layout, SCALE) == layout.total_bytes // 4
    assert options.budget_bytes(parser.parse_args([]), layout, SCALE) == (12 << 30) // SCALE
    assert options.budget_bytes(parser.parse_args(["--budget-gib", "2"]), layout, SCALE) == (2 << 30) // SCALE
    with pytest.raises(options.UsageError, match="--budget-gib and --budget-fraction are mutually exclusive"):
        options.budget_bytes(parser.parse_args(["--budget-gib", "12", "--budget-fraction", "0.5"]), layout, SCALE)


@pytest.mark.parametrize("value", ["0", "1.5", "-0.25", "nan", "x", "inf"])
def test_a_bad_budget_fraction_is_a_usage_error(capsys, value):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "--budget-fraction", value])
    assert exit_.value.code == 2
    assert f"--budget-fraction must be a number F with 0 < F <= 1, got '{value}'" in capsys.readouterr().err


def test_both_budgets_are_refused_before_the_run(capsys):
    assert cli.main(["bench", "--backend", "host", "--budget-gib", "1", "--budget-fraction", "0.5"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "expcache bench: --budget-gib and --budget-fraction are mutually exclusive: give one"


def test_cli_replays_a_generic_trace_with_records_missing(capsys, tmp_path):
    """The done-when command on the host backend: a generic trace with records removed, a quarter of
    the experts' bytes, LRU's hit rate equal to the simulator's on the same trace and budget."""
    trace = holed_trace()
    path = tmp_path / "routing.jsonl"
    write_trace(path, trace)
    out = tmp_path / "r.json"
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        rc = cli.main(
            [
                "bench",
                "--layout",
                "q2",
                "--scale",
                str(SCALE),
                "--backend",
                "host",
                "--traces",
                str(path),
                "--budget-fraction",
                "0.25",
                "--variants",
                "lru,oppclass",
                "--quiet",
                "--json",
                str(out),
            ]
        )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    notices = [line for line in captured.err.splitlines() if "records are missing" in line]
    assert len(notices) == 1 and f"{trace.missing_records} of {trace.num_tokens * 40}" in notices[0]
    assert "= 25.0 % of the experts' bytes" in captured.out
    (report,) = json.loads(out.read_text())
    layout = ModelLayout.preset("q2", scale=SCALE)
    assert report["full_budget_bytes"] == layout.total_bytes // 4 * SCALE
    assert report["budget_fraction"] == pytest.approx(0.25)
    assert report["traces"] == ["routing"]
    with pytest.warns(TraceWarning):
        loaded = read_trace(path, num_experts=256)
    lru = next(r for r in report["results"] if r["variant"] == "lru")
    assert lru["experts_checked"] == trace.num_requests
    assert lru["hit_rate"] == simulated_lru_hit_rate(loaded, layout, report["budget_bytes"])


@pytest.mark.parametrize(
    "records,message",
    [
        ([{"token": 0, "layer": 3, "experts": [300]}], r"layer 3 has expert id 300 .*gives that layer 256 experts"),
        ([{"token": 0, "layer": 50, "experts": [1]}], r"has layer 50, which layout .* does not have: .*43 layers"),
    ],
)
def test_cli_checks_a_trace_against_the_layout(capsys, tmp_path, records, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert cli.main(["bench", "--layout", "q2", "--backend", "host", "--traces", str(path), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.search(message, err), err


def test_cli_traces_take_several_files_and_names(tmp_path):
    a, b = tmp_path / "a.csv.gz", tmp_path / "b.npz"
    write_trace(a, synthetic_trace(3, seed=1))
    write_trace(b, synthetic_trace(4, seed=2))
    parser = cli._mode_parser(bench.modes.by_name("variants"))
    args = parser.parse_args(["--traces", str(a), str(b), "smoke_count64,synthetic:5"])
    assert args.traces == [str(a), str(b), "smoke_count64", "synthetic:5"]
    workload = bench.build_workload("decode", args.traces)
    assert workload.decode_tokens == 3 + 4 + load_decode_trace("smoke_count64").num_tokens + 5
