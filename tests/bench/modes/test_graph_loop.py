"""The graph loop (expcache_bench/modes/graph_loop.py) on the host backend, where it runs
eagerly: the same hits as the C loop's host select (both LRU), every expert read through the bank
checked against the source, the all-hit select timed, the same from the experts in a file (mapped
or read) with the disk's rate and the lower bound, and what it refuses (times on the host mean
nothing: no test looks at them)."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

import expcache_bench as bench
from expcache_bench import disk
from expcache_bench.modes import graph_loop
from expcache_bench.traces import MISSING, Trace, synthetic_trace
from pyexpcache import ModelLayout, _lib

from support.cache import CUDA_OK, CUDA_REASON


@pytest.fixture
def host_bench():
    layout = ModelLayout.preset("q2", scale=4096)
    b = bench.Bench(layout, backend="host", pinned=True, budget_bytes=(12 << 30) // 4096)
    yield b
    b.close()


def test_same_hits_as_the_c_loop_and_every_expert_checked(host_bench):
    report = graph_loop.run_graph_loop(host_bench, traces=["smoke_count64"], compute_us=1)
    c_loop, graph = report.results
    assert (graph.hits, graph.misses) == (c_loop.hits, c_loop.misses) and graph.misses > 0
    assert report.settings["same_hits_as_c_loop"] is True and report.settings["policy"] == _lib.DEFAULT_POLICY
    assert graph.checksum_errors == 0 and graph.experts_checked == c_loop.experts_checked > 0
    assert graph.decode_tokens == c_loop.decode_tokens - 1  # the first token binds, eagerly
    assert report.settings["all_hit_select_us"] > 0 and report.settings["capture"] is False
    assert report.settings["all_hit_select_wide_us"] > 0 and report.settings["all_hit_ids"] == 8
    assert "graph loop, select_device" in graph_loop.table(report)
    assert any("hits and misses equal" in line for line in graph_loop.describe(report))
    assert any(f"({report.settings['k']} ids)" in line and "(8 ids)" in line for line in graph_loop.describe(report))
    # a source in memory: no disk, no replay of the misses, and the report says so
    assert report.disk_replay is None and any("the source is not a file" in s for s in report.skipped)


def test_the_wide_all_hit_select_takes_the_ids_routed_last():
    """8 distinct ids per layer, latest first, from the last token back over the tokens that have
    the layer; the lowest unused ids when the traces route fewer; fewer only where a layer has."""
    ids = np.array(
        [
            [[1, 2, 3], [9, 8, 7]],
            [[4, 5, 1], [MISSING] * 3],
            [[6, 2, 7], [7, 6, 5]],
            [[9, 9, 9], [MISSING] * 3],  # after `last`: never read
        ],
        np.int32,
    )
    present = ids[:, :, 0] >= 0
    got = graph_loop._recent_ids(ids, present, 2, [16, 16])
    assert got.tolist() == [[6, 2, 7, 4, 5, 1, 3, 0], [7, 6, 5, 9, 8, 0, 1, 2]]
    assert graph_loop._recent_ids(ids, present, 2, [16, 5]).tolist() == [[6, 2, 7, 4, 5], [7, 6, 5, 9, 8]]


def holed(first_layer: int = 3, layers: int = 40, tokens: int = 24, seed: int = 4) -> Trace:
    """A DeepSeek-shaped synthetic trace with records missing: token 0 lacks two layers, the last
    token its last ten, others a layer here and there (the same layer twice in a row at one point)."""
    t = synthetic_trace(tokens, layers, 256, 6, seed=seed, first_layer=first_layer)
    ids = t.ids.copy()
    ids[0, [1, 7]] = MISSING
    ids[-1, layers - 10 :] = MISSING
    for token, layer in ((3, 5), (4, 5), (9, 0), (15, 22), (16, 39)):
        ids[token, layer] = MISSING
    return Trace(f"holed{seed}", ids, None, first_layer, t.positions, 256)


@pytest.mark.parametrize("policy", sorted(_lib.POLICIES))
def test_replays_a_trace_with_missing_records(host_bench, policy):
    """A missing (token, layer) record is no select in that token's step, as in the C loop: the same
    hits under each policy (the device's policy clock starts a token where the host's does), every
    expert of the records there checked. A step per set of layers a token has, each run once outside
    the timing (the first token of that set) before it is replayed."""
    trace = holed()
    report = graph_loop.run_graph_loop(host_bench, traces=[trace], policy=policy)
    assert report.settings["policy"] == policy
    c_loop, graph = report.results
    assert report.settings["same_hits_as_c_loop"] is True and graph.misses > 0
    assert graph.checksum_errors == c_loop.checksum_errors == 0
    assert graph.experts_checked == c_loop.experts_checked == trace.num_requests
    patterns = {tuple(row) for row in trace.present}
    assert graph.served_tokens == trace.num_tokens
    assert graph.decode_tokens == trace.num_tokens - len(patterns)  # each set's first token runs untimed
    assert report.settings["steps"] == len(patterns)


def test_replays_traces_of_different_layers(host_bench):
    """Two traces routing different layers (3-42, then 10-42) and one with a layer no token routes:
    one step's layers are every layer routed, each token selecting those it has."""
    a, b = holed(seed=5), synthetic_trace(8, 33, 256, 6, seed=6, first_layer=10, name="from10")
    report = graph_loop.run_graph_loop(host_bench, traces=[a, b])
    c_loop, graph = report.results
    assert report.settings["same_hits_as_c_loop"] is True and report.settings["layers"] == "3-42"
    assert graph.experts_checked == c_loop.experts_checked == a.num_requests + b.num_requests
    assert graph.checksum_errors == 0


def test_refuses_traces_of_different_k(host_bench):
    a, b = synthetic_trace(4, 40, 256, 6, first_layer=3), synthetic_trace(4, 40, 256, 4, first_layer=3)
    with pytest.raises(ValueError, match=r"different numbers of experts per layer \(\[4, 6\]\)"):
        graph_loop.run_graph_loop(host_bench, traces=[a, b])


@pytest.mark.skipif(not CUDA_OK, reason=CUDA_REASON or "no CUDA device")
def test_replays_missing_records_in_captured_graphs_on_cuda():
    """The same on the GPU: a graph captured per set of layers, replayed for the tokens that have it."""
    layout = ModelLayout.preset("q2", scale=4096)
    b = bench.Bench(layout, backend="cuda", pinned=True, budget_bytes=(12 << 30) // 4096)
    try:
        trace = holed()
        report = graph_loop.run_graph_loop(b, traces=[trace])
        c_loop, graph = report.results
        assert report.settings["capture"] is True and report.settings["same_hits_as_c_loop"] is True
        assert graph.checksum_errors == 0 and graph.experts_checked == trace.num_requests
        assert report.settings["steps"] == len({tuple(row) for row in trace.present})
    finally:
        b.close()


@pytest.mark.parametrize("kind,file_reads", [("mmap", "buffered"), ("file", "buffered"), ("file", "direct")])
def test_a_file_source_in_both_loops(tmp_path, kind, file_reads):
    """The generated experts written to a file and served from it, mapped or read, in both loops:
    every expert checked, the same hits; the disk's rate measured in the run, the bound the lower
    of link and disk, named in the table; the file's page-cache share after each loop."""
    layout = ModelLayout.preset("q2", scale=4096)
    b = bench.Bench(
        layout,
        backend="host",
        kind=kind,
        file_dir=str(tmp_path),
        budget_bytes=(12 << 30) // 4096,
        cache_options=dict(file_reads=file_reads),
    )
    try:
        assert b.kind == kind and not b.pinned
        report = graph_loop.run_graph_loop(b, traces=["smoke_count64"])
        c_loop, graph = report.results
        assert report.settings["same_hits_as_c_loop"] is True and graph.misses > 0
        assert graph.checksum_errors == c_loop.checksum_errors == 0
        assert graph.experts_checked == c_loop.experts_checked > 0
        assert report.source == kind and report.disk_bytes_per_s > 0 and "reads of the run's file" in report.disk_label
        # the C loop's own misses read again (as many as it had), the faster rate the disk's
        replay = report.disk_replay
        assert replay["misses"] == replay["of_misses"] == c_loop.misses == graph.misses
        assert f"replaying the run's own misses, its {c_loop.misses:,} misses" in replay["label"]
        assert f"as many as the C loop's {c_loop.misses:,}: checked" in replay["label"]
        assert replay["reads"] >= replay["misses"] and replay["bytes"] > 0
        assert report.disk_bytes_per_s == max(report.disk_cold_bytes_per_s, replay["bytes_per_s"])
        assert replay["bound"] == ("replay" if replay["bytes_per_s"] > report.disk_cold_bytes_per_s else "cold")
        assert c_loop.disk_bytes_per_s == graph.disk_bytes_per_s == report.disk_bytes_per_s
        by = "disk" if report.disk_bytes_per_s < report.link_bytes_per_s else "link"
        assert report.bound_by == graph.bound_by == by
        rate = min(report.link_bytes_per_s, report.disk_bytes_per_s)
        assert graph.bound_tokens_per_s == pytest.approx(graph.decode_tokens / (graph.bytes_h2d / rate))
        assert all(0.0 <= r.page_cache_after <= 1.0 for r in report.results)
        assert report.source_file["path"] == b.source.path and report.source_file["bytes"] == b.source.nbytes
        text = bench.format_report(report)
        named = f"disk ({replay['bound']})" if by == "disk" else "link"
        assert f"of {named} bound (emulated)" in text and f"the bounds are the {by}'s, the lower" in text
        assert f"GB/s cold ({report.disk_label}), " in text and "the disk bound uses" in text
        assert "the file in the page cache after each loop (dropped before it): C loop, host select: " in text
        reads = report.source_file["reads"]  # O_DIRECT asked for may be refused (tmpfs)
        assert (
            reads
            in {"mmap": ("mmap",), "buffered": ("buffered",), "direct": ("direct", "direct refused")}[
                "mmap" if kind == "mmap" else file_reads
            ]
        )
        if reads != "direct":  # the page cache may hold it: the line says whether it fits
            assert "fits in the page cache" in text or "does not fit in the page cache" in text
    finally:
        b.close()
    assert os.listdir(tmp_path) == []


def file_bench(tmp_path):
    layout = ModelLayout.preset("q2", scale=4096)
    return bench.Bench(
        layout,
        backend="host",
        kind="file",
        file_dir=str(tmp_path),
        budget_bytes=(12 << 30) // 4096,
        cache_options=dict(file_reads="direct"),
    )


def test_the_replay_reads_the_c_loops_misses_after_both_loops(tmp_path, monkeypatch):
    """The replay is given the simulator's misses, as many as the C loop's (and the graph
    loop's), after the graph loop ran; the JSON's counts are what it read."""
    seen, events = [], []
    real, recent = disk.replay, graph_loop._recent_ids

    def fake(path, places, misses, *, threads, **kw):
        events.append("replay")
        found = real(path, places, misses, threads=threads, **kw)  # read for real: the counts
        seen.append((list(misses), found))
        return found

    def graph_ran(*a, **kw):
        events.append("graph loop")
        return recent(*a, **kw)

    monkeypatch.setattr(disk, "replay", fake)
    monkeypatch.setattr(graph_loop, "_recent_ids", graph_ran)
    b = file_bench(tmp_path)
    try:
        report = graph_loop.run_graph_loop(b, traces=["smoke_count64"])
    finally:
        b.close()
    c_loop, graph = report.results
    ((misses, found),) = seen
    assert len(misses) == c_loop.misses == graph.misses > 0
    assert all(layer in b.layout.moe_layers for layer, _ in misses)
    replay = report.disk_replay
    assert replay["misses"] == found.misses == len(misses) and replay["bytes"] == found.read_bytes
    assert replay["reads"] == found.reads and events == ["graph loop", "replay"]


def test_the_bound_takes_the_larger_rate(tmp_path, monkeypatch):
    """A replay faster than the cold shapes bounds; a slower one does not (the cold one does)."""
    cold = 1e6  # far below the host link: the disk binds
    real, measure = disk.replay, disk.measure

    def measured(*a, **kw):
        return dataclasses.replace(measure(*a, **kw), bytes_per_s=cold)

    for factor, which in ((3.0, "replay"), (0.25, "cold")):

        def fake(path, places, misses, *, threads, _factor=factor, **kw):
            return dataclasses.replace(real(path, places, misses, threads=threads, **kw), bytes_per_s=_factor * cold)

        with monkeypatch.context() as m:
            m.setattr(disk, "replay", fake)
            m.setattr(disk, "measure", measured)
            b = file_bench(tmp_path)
            try:
                report = graph_loop.run_graph_loop(b, traces=["smoke_count64"])
            finally:
                b.close()
        replay = report.disk_replay
        assert report.disk_cold_bytes_per_s == 1e6 and replay["bytes_per_s"] == factor * 1e6
        assert replay["bound"] == which and report.disk_bytes_per_s == max(1e6, factor * 1e6)
        assert all(r.disk_bytes_per_s == report.disk_bytes_per_s for r in report.results)
        assert report.bound_by == "disk" and report.bound_name == f"disk ({which})"
        text = bench.format_report(report)
        assert f"of disk ({which}) bound (emulated)" in text
        named = "replay" if which == "replay" else "cold shapes"
        assert f"the disk bound uses {max(1e6, factor * 1e6) / 1e9:.1f} GB/s (the {named}" in text
        j = report.to_json()
        assert j["disk_replay"]["bound"] == which and j["disk_bytes_per_s"] == max(1e6, factor * 1e6)


def one_more_simulated_miss(monkeypatch):
    """The graph loop's simulator lists one more miss than the run had (its last one again)."""
    real = graph_loop.simulate_policy

    def one_more(*a, misses, **kw):
        got = real(*a, misses=misses, **kw)
        misses.append(misses[-1])
        return got

    monkeypatch.setattr(graph_loop, "simulate_policy", one_more)


def test_a_replay_of_other_misses_than_the_c_loops_is_refused(tmp_path, monkeypatch):
    """Where the simulator's misses are not as many as the C loop's nothing is replayed: the
    header says why, the JSON marks the mismatch (the command then fails), the cold rate bounds."""
    one_more_simulated_miss(monkeypatch)
    monkeypatch.setattr(disk, "replay", lambda *a, **kw: pytest.fail("replayed other misses"))
    b = file_bench(tmp_path)
    try:
        report = graph_loop.run_graph_loop(b, traces=["smoke_count64"])
    finally:
        b.close()
    c_loop = report.results[0]
    assert report.disk_replay["mismatch"] is True
    assert f"gives {c_loop.misses + 1:,} misses, the C loop had {c_loop.misses:,}" in report.disk_replay["skipped"]
    assert report.disk_bytes_per_s == report.disk_cold_bytes_per_s
    assert "the replay of the run's misses was skipped" in bench.format_report(report)


def test_the_command_fails_on_a_replay_of_other_misses(tmp_path, monkeypatch, capsys):
    """expcache bench graph exits 1 where the simulator's misses are not the C loop's (the report
    still printed), saying why on stderr."""
    from expcache_bench import cli

    one_more_simulated_miss(monkeypatch)
    argv = ["bench", "graph", "--backend", "host", "--source", "file", "--file-dir", str(tmp_path)]
    assert cli.main(argv + ["--layers", "3-6", "--traces", "smoke_count64", "--quiet"]) == 1
    out, err = capsys.readouterr()
    assert "graph loop, select_device" in out
    assert "FAILED: the replay of the run's misses was skipped: the simulator of the same policy" in err


def test_a_host_pool_between_the_file_and_the_gpu(tmp_path):
    """--host-budget-gib in both loops: each loop's pool counters, the disk bound over the bytes
    read from the file (the pool's misses) only, the link bound over every miss, the header's line."""
    layout = ModelLayout.preset("q2", scale=4096)
    b = bench.Bench(
        layout,
        backend="host",
        kind="file",
        file_dir=str(tmp_path),
        budget_bytes=(12 << 30) // 4096,
        cache_options=dict(file_reads="direct", host_budget_bytes=(6 << 30) // 4096),
    )
    try:
        report = graph_loop.run_graph_loop(b, traces=["smoke_count64"])
        for r in report.results:
            assert 0 < r.pool_hits < r.pool_lookups == r.misses
            assert r.disk_bytes == pytest.approx(r.bytes_h2d * (1 - r.pool_hits / r.pool_lookups))
            disk = r.decode_tokens / (r.disk_bytes / r.disk_bytes_per_s + r.compute_seconds)
            assert r.bound_tokens_per_s == pytest.approx(min(disk, r.link_bound_tokens_per_s))
        assert "host pool (--host-budget-gib): the share of each loop's misses it served" in bench.format_report(report)
    finally:
        b.close()
