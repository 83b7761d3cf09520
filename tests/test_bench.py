"""The main job: workloads, the simulators against the library's counters,
and the CLI end to end on the host backend."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from pyexpcache import ExpertCache, HostSource, ModelLayout
from pyexpcache import bench
from pyexpcache.sim import BATCH, DECODE, Call, simulate_lru
from pyexpcache.traces import load_decode_trace

from conftest import CUDA_OK, CUDA_REASON, SCALE


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


def _replay_and_simulate(cache, layout, workload, policy):
    """Replay a workload through the cache, then the same calls through the offline simulator of
    `policy` at the cache's runtime caps."""
    from pyexpcache.sim import simulate_policy

    for call in workload.calls:
        if call.kind == DECODE:
            cache.select(call.layer, call.ids)
        else:
            cache.prepare_batch(call.layer, call.ids).finish()
    layer_class = [cache.layer_class(i) if layout[i] else 0 for i in range(layout.num_layers)]
    caps = [c.cap_experts for c in sorted(cache.classes(), key=lambda c: c.index)]
    if policy == "lru":
        return simulate_lru(workload.calls, caps, layer_class), caps, layer_class
    return (simulate_policy(workload.calls, caps, layer_class, policy=policy, layers=layout.moe_layers),
            caps, layer_class)


@pytest.mark.parametrize("policy", ["lru", "oppclass"])
@pytest.mark.parametrize("quant,budget_fraction,first", [("mixed", 0.05, 0), ("mixed", 0.15, 3), ("q2", 0.10, 0),
                                                         ("q2", 0.05, 3)])
def test_simulator_equals_library_counters(backend, make_cache, policy, quant, budget_fraction, first):
    """The library and the offline simulator of the same policy agree count for count, with the
    layers 0-2 that the decode traces never route registered or not."""
    full = ModelLayout.preset(quant, scale=SCALE)
    layout = ModelLayout(tuple(s if i >= first else None for i, s in enumerate(full.layers)), name="registered")
    cache, _ = make_cache(layout, budget_bytes=int(layout.total_bytes * budget_fraction), policy=policy)
    w = bench.build_workload("decode", ["podA_c_python_full", "podA_b_json_full"])
    sim, caps, layer_class = _replay_and_simulate(cache, layout, w, policy)
    for c in cache.stats().classes:
        d = c.paths["decode"]
        i = c.info.index
        assert (d.hits, d.misses, d.evictions, d.direct_loads) == (
            sim.hits[i], sim.misses[i], sim.evictions[i], sim.direct[i])
    assert cache.stats().hit_rate == sim.hit_rate
    if policy == "oppclass":  # and it earns its keep on these traces
        assert sim.hit_rate > simulate_lru(w.calls, caps, layer_class).hit_rate


@pytest.mark.parametrize("policy", ["lru", "oppclass"])
def test_simulator_equals_library_with_prefill_batches(make_cache, policy):
    layout = ModelLayout.preset("mixed", scale=SCALE)
    cache, _ = make_cache(layout, budget_bytes=layout.total_bytes // 8, policy=policy)
    w = bench.build_workload("prefill", ["podA_b_json_full"])
    sim, _, _ = _replay_and_simulate(cache, layout, w, policy)
    st = cache.stats()
    assert st.total.hits == sim.hits.sum() and st.total.misses == sim.misses.sum()
    assert st.path("batch").appends == sim.appends.sum()
    assert st.path("decode").evictions == sim.evictions.sum()


def test_bench_run_host_reports_every_variant():
    layout = ModelLayout.preset("mixed", scale=4096)
    report = bench.run(layout, "decode", traces=["podA_b_json_full"], budget_bytes=(12 << 30) // 4096,
                       backend="host", host_scale=4096)
    names = [r.variant for r in report.results]
    assert names == list(bench.VARIANTS)
    r = {x.variant: x for x in report.results}
    assert report.checksum_errors == 0 and r["expcache"].experts_checked == 37 * 40 * 6
    assert r["resident"].hit_rate == 1.0 and r["nocache"].hit_rate == 0.0
    assert r["slab"].hit_rate < r["expcache"].hit_rate <= r["expcache"].belady_hit_rate + 0.02
    assert r["slab"].releases > 37  # the old design released at every size change
    assert r["expcache"].decode_bytes_h2d == r["expcache"].bytes_h2d > 0  # decode only: every byte is decode's
    for x in report.results:  # the serving calls' share of the decode time
        assert x.decode_calls == 37 * 40
        assert 0 < x.decode_serve_seconds < x.decode_seconds
        assert x.serve_us_per_call > 0 and x.after_serve_us_per_call > 0
    text = bench.format_report(report)
    assert "host-emulated" in text and "Belady" in text
    json.dumps(report.to_json())


def test_bench_detects_corrupted_bytes(monkeypatch):
    layout = ModelLayout.preset("q2", scale=4096)
    b = bench.Bench(layout, backend="host", budget_bytes=layout.total_bytes // 10)
    try:
        b.expected[5, 7] ^= np.uint64(1)  # as if expert (5, 7) had been served wrong
        w = bench.Workload("t", [Call(DECODE, 5, (7, 8))], 1, 0)
        r = b.run_variant("expcache", w)
        assert r.checksum_errors == 1
    finally:
        b.close()


def test_cli_bench_host_end_to_end(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pyexpcache", "bench", "--backend", "host", "--traces", "podA_b_json_full",
         "--layers", "3-12", "--scenario", "all", "--json", str(out), "--quiet"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("expcache bench") == 3
    data = json.loads(out.read_text())
    assert [d["scenario"] for d in data] == ["decode", "prefill", "turns"]
    assert all(r["checksum_errors"] == 0 for d in data for r in d["results"])


def test_cli_rejects_bad_arguments():
    proc = subprocess.run([sys.executable, "-m", "pyexpcache", "bench", "--variants", "nope"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "expected a comma list" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "pyexpcache", "bench", "--layers", "40-50", "--backend", "host"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "not in 0..42" in proc.stderr


def test_prefill_bytes_are_not_charged_to_decode():
    layout = ModelLayout.preset("q2", scale=4096)
    report = bench.run(layout, "turns", variants=["expcache"], traces=["podA_b_json_full"],
                       budget_bytes=layout.total_bytes // 10, backend="host")
    r = report.results[0]
    assert 0 < r.decode_bytes_h2d < r.bytes_h2d
    assert r.link_bound_tokens_per_s == pytest.approx(
        r.decode_tokens / (r.decode_bytes_h2d / report.link_bytes_per_s))


def test_synthetic_traces_in_workloads():
    w = bench.build_workload("decode", ["synthetic:50:3"])
    assert w.decode_tokens == 50 and len(w.calls) == 50 * 40
    assert w.calls == bench.build_workload("decode", ["synthetic:50:3"]).calls  # seeded
    assert w.calls != bench.build_workload("decode", ["synthetic:50:4"]).calls
    for bad in ("synthetic:", "synthetic:x", "synthetic:0", "synthetic:5:1:2"):
        with pytest.raises(ValueError, match="synthetic:TOKENS"):
            bench.build_workload("decode", [bad])


def test_cli_plot_hit_rate_curve(tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib, an optional dependency")
    png = tmp_path / "curve.png"
    proc = subprocess.run([sys.executable, "-m", "pyexpcache", "bench", "--backend", "host", "--traces",
                           "podA_b_json_full", "--variants", "expcache", "--layers", "3-8", "--plot", str(png),
                           "--quiet"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_hit_rate_curve_orders_lru_oppclass_belady():
    layout = ModelLayout.preset("q2", scale=4096)
    w = bench.build_workload("decode", ["podA_c_python_full"])
    curve = bench.hit_rate_curve(w, layout, [0.05, 0.10])
    for lru, opp, belady in zip(curve["lru"], curve["oppclass"], curve["belady"]):
        assert lru < opp < belady


@pytest.mark.parametrize("variant", ["expcache", "nocache"])
def test_no_layer_sync_serves_the_same_bytes_and_counts(variant):
    """One wait per token instead of per layer: the same hits, misses and checksums, and a
    corrupted expectation is still caught."""
    layout = ModelLayout.preset("mixed", scale=4096)
    w = bench.build_workload("decode", ["podA_b_json_full"])
    results = {}
    for sync in (True, False):
        b = bench.Bench(layout, backend="host", budget_bytes=layout.total_bytes // 10, layer_sync=sync)
        try:
            results[sync] = b.run_variant(variant, w)
            b.expected[5, int(w.calls[2].ids[0])] ^= np.uint64(1)  # layer 5 of the first token, its first expert
            bad = b.run_variant(variant, w)
        finally:
            b.close()
        assert results[sync].checksum_errors == 0
        assert bad.checksum_errors >= 1
    a, b_ = results[True], results[False]
    assert (a.hits, a.misses, a.experts_checked, a.decode_bytes_h2d, a.decode_calls) == (
        b_.hits, b_.misses, b_.experts_checked, b_.decode_bytes_h2d, b_.decode_calls)
    assert 0 < b_.decode_serve_seconds < b_.decode_seconds


# ---------------------------------------------------------------------------
# expcache transfer


def test_transfer_size_lists_parse():
    import argparse

    from pyexpcache.cli import _sizes

    assert _sizes("256K,1M,2MiB,4096") == [256 << 10, 1 << 20, 2 << 20, 4096]
    for bad in ("", "x", "1M,,2M", "1Q"):
        with pytest.raises(argparse.ArgumentTypeError):
            _sizes(bad)


def test_transfer_cli_sizes_are_the_benchmarks():
    from pyexpcache import cli
    from pyexpcache.bench import transfer

    parser = cli._parser()
    assert {f"{s} MiB" for s in parser.parse_args(["transfer"]).sizes} == set(transfer.SIZES)
    assert parser.parse_args(["transfer", "--sizes", "0.5,13.5"]).sizes == ["0.5", "13.5"]
    with pytest.raises(SystemExit):
        parser.parse_args(["transfer", "--sizes", "0.7"])


def test_host_copy_rate_copies_and_refuses_bad_pieces():
    from pyexpcache.bench import transfer

    buffer = np.arange(8 << 20, dtype=np.uint8)
    rates = transfer.host_copy_rates([1, 2], piece=64 << 10, buffer_bytes=8 << 20, total=16 << 20)
    assert list(rates) == [1, 2] and all(r > 0 for r in rates.values())
    assert transfer.host_copy_gb_s(buffer, 64 << 10, 2, total=4 << 20) > 0
    for threads, piece in ((0, 4096), (1, 0), (1, 8 << 20)):
        with pytest.raises(ValueError, match="host_copy_gb_s"):
            transfer.host_copy_gb_s(buffer, piece, threads)


def test_transfer_cli_detail_prints_the_host_copy_rate(monkeypatch, capsys):
    # The CLI's printing, without a GPU: the table's rows stand in for a run's.
    from pyexpcache import bench, cli
    from pyexpcache.bench import transfer

    rows = [transfer.TransferRow("pinned", 0, 0, "0.5 MiB", "tensor", 50.0, 42.0, 42.0, 1 << 20),
            transfer.TransferRow("pageable", 4, 1 << 20, "0.5 MiB", "expert", 21.0, 14.0, 42.0, 1 << 20)]
    asked = {}
    monkeypatch.setattr(cli, "_has_cuda_python", lambda: True)
    monkeypatch.setattr(bench, "resolve_backend", lambda *a: "cuda")
    monkeypatch.setattr(transfer, "run", lambda **kw: asked.update(kw) or rows)
    real = transfer.host_copy_rates
    monkeypatch.setattr(transfer, "host_copy_rates",
                        lambda counts: real(counts, piece=64 << 10, buffer_bytes=8 << 20, total=8 << 20))
    assert cli.main(["transfer", "--sizes", "0.5", "--sources", "pinned,pageable", "--detail"]) == 0
    out = capsys.readouterr().out
    assert asked["sizes"] == ["0.5 MiB"] and asked["sources"] == ["pinned", "pageable"]
    assert "119 %" in out and "50 %" in out
    assert re.search(r"host copy, 512 KiB pieces .*: 1 thread [0-9.]+, 4 threads [0-9.]+$", out.strip())


def test_transfer_refuses_unknown_sources():
    from pyexpcache.bench import transfer

    with pytest.raises(ValueError, match="unknown sources"):
        transfer.run(sources=("pinned", "nvme"))


def test_transfer_table_formats_rows_and_says_what_raw_means():
    from pyexpcache import StagingStats
    from pyexpcache.bench import transfer

    staged = StagingStats(calls=2, pieces=8, bytes=8 << 20, caller_fills=2, fill_ns=800_000, wait_ns=100_000,
                          send_ns=24_000, sends=4, span_ns=400_000, first_fill_ns=20_000)
    rows = [transfer.TransferRow("pinned", 0, 0, "0.5 MiB", "tensor", 50.0, 42.0, 42.0, 1 << 20),
            transfer.TransferRow("pageable", 8, 1 << 20, "0.5 MiB", "expert", 21.0, 14.0, 42.0, 1 << 20, staged)]
    text = transfer.format_rows(rows, detail=True)
    lines = text.splitlines()
    assert "119 %" in lines[2] and "50 %" in lines[3]          # library / raw pinned, per row
    # the call (4 MiB at 21 GB/s); pieces per call and per send; its span, first piece, wait;
    # threads filling; fill, send per piece; caller fills
    assert lines[3].split()[-11:] == ["199.7", "4.0", "2.0", "200.0", "10.0", "50.0", "2.0", "100.0", "3.00",
                                      "25", "%"]
    assert lines[2].split()[-10:] == ["—"] * 10                 # a pinned source stages nothing
    assert "cudaMemcpyBatchAsync" in text and "one expert at a time" in text


@pytest.mark.skipif(not CUDA_OK, reason=CUDA_REASON)
def test_transfer_table_moves_every_byte_from_every_source(tmp_path):
    from pyexpcache.bench import transfer

    rows = transfer.run(sizes=["0.5 MiB"], total_bytes=64 << 20, copy_threads=(1, 4), chunks=(256 << 10,),
                        file_dir=str(tmp_path))
    assert sorted({r.source for r in rows}) == sorted(transfer.SOURCES)
    for r in rows:
        assert r.library_gb_s > 0 and r.raw_pinned_gb_s > 0
        assert r.bytes_moved == 128 * sum(transfer.SIZES["0.5 MiB"])  # every expert of layer 1 once
    text = transfer.format_rows(rows)
    assert "file-direct" in text and "256 KiB" in text
    for r in rows:  # staged sources say where their time went; pinned ones stage nothing
        assert (r.staging is None) == (r.source == "pinned")
        if r.staging is not None:
            assert r.staging.bytes == r.bytes_moved
    assert "caller wait" in transfer.format_rows(rows, detail=True)


def _staging_trace_module():
    """benchmarks/staging_trace.py, loaded by path (the benchmarks folder is not a package on the path)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "staging_trace.py"
    spec = importlib.util.spec_from_file_location("staging_trace", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


def test_staging_trace_notes_every_piece_and_summarizes_it(tmp_path, monkeypatch, capsys):
    from pyexpcache.layout import LayerSpec

    staging_trace = _staging_trace_module()
    path = tmp_path / "trace.csv"
    monkeypatch.setenv("EXPCACHE_STAGING_TRACE", str(path))  # read when the cache makes its ring
    layout = ModelLayout((LayerSpec(16, 300_000, 300_000, 400_000),), name="traced")
    with HostSource(layout, pinned=False) as source:
        cache = ExpertCache(layout, source, backend="host", budget_bytes=16 * layout[0].expert_bytes,
                            copy_threads=4, staging_bytes=4 << 20, staging_chunk_bytes=256 << 10, log_level=2)
        calls = ([0, 1, 2], [3, 4, 0], [5, 6, 7, 8], [1, 2])  # all fit; the last call hits: it stages nothing
        for ids in calls:
            ptrs = cache.select(0, ids)
            assert cache.checksum(0, ptrs).tolist() == [source.expected_checksum(0, e) for e in ids]
        stats = cache.staging_stats()
        cache.close()  # the ring writes its trace when it is destroyed
    rings = staging_trace.read(str(path))
    assert len(rings) == 1 and "4 copy threads, 262144-byte chunks" in rings[0].title
    ring = rings[0]
    assert len(ring.calls) == stats.calls == 3
    assert sum(p[1] for p in ring.pieces) == stats.bytes == 9 * layout[0].expert_bytes
    assert [p[0] for p in ring.pieces] == list(range(len(ring.pieces))) and len(ring.pieces) == stats.pieces
    for seq, size, queued, taken, filled, sent, send, filler in ring.pieces:
        assert 0 < queued <= taken <= filled <= sent and 1 <= send <= stats.sends and 0 <= filler < 4
    for (begun, finishing, finished), pieces in zip(ring.calls, ring.pieces_by_call()):
        assert begun <= finishing <= finished and pieces
        assert all(begun <= p[2] <= finishing and p[5] <= finished for p in pieces)
    assert [sum(p[1] for p in ps) for ps in ring.pieces_by_call()] == [n * layout[0].expert_bytes for n in (3, 2, 4)]
    assert staging_trace.main([str(path), "--ring", "0", "--calls", "0,2"]) == 0
    out = capsys.readouterr().out
    assert out.count("4 copy threads") == 1 and "first sent µs" in out and "filler" in out
    assert sum(1 for line in out.splitlines() if line.startswith(("0 ", "2 "))) == len(ring.pieces_by_call()[0]) + \
        len(ring.pieces_by_call()[2])


def test_staging_trace_refuses_what_is_not_a_trace(tmp_path, capsys):
    staging_trace = _staging_trace_module()
    bad = tmp_path / "bad.csv"
    bad.write_text("# ring 0x1: 2 copy threads, 4096-byte chunks\npiece,0,0,12,x,2,3,4,1,1\n")
    assert staging_trace.main([str(bad)]) == 2
    assert "bad.csv:2: not a trace line" in capsys.readouterr().err
    assert staging_trace.main([str(tmp_path / "missing.csv")]) == 2
    assert "No such file" in capsys.readouterr().err
