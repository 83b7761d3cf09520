"""The graph loop (pyexpcache/bench/modes/graph_loop.py) on the host backend, where it runs
eagerly: the same hits as the C loop's host select (both LRU), every expert read through the bank
checked against the source, the all-hit select timed, and what it refuses (times on the host mean
nothing: no test looks at them)."""

from __future__ import annotations

import numpy as np
import pytest

from pyexpcache import ModelLayout
from pyexpcache import bench
from pyexpcache.bench.modes import graph_loop
from pyexpcache.traces import Trace


@pytest.fixture
def host_bench():
    layout = ModelLayout.preset("q2", scale=4096)
    b = bench.Bench(layout, backend="host", budget_bytes=(12 << 30) // 4096)
    yield b
    b.close()


def test_same_hits_as_the_c_loop_and_every_expert_checked(host_bench):
    report = graph_loop.run_graph_loop(host_bench, traces=["smoke_count64"], compute_us=1)
    c_loop, graph = report.results
    assert (graph.hits, graph.misses) == (c_loop.hits, c_loop.misses) and graph.misses > 0
    assert report.settings["same_hits_as_c_loop"] is True
    assert graph.checksum_errors == 0 and graph.experts_checked == c_loop.experts_checked > 0
    assert graph.decode_tokens == c_loop.decode_tokens - 1  # the first token binds, eagerly
    assert report.settings["all_hit_select_us"] > 0 and report.settings["capture"] is False
    assert "graph loop, select_device" in graph_loop.table(report)
    assert any("hits and misses equal" in line for line in graph_loop.describe(report))


def test_refuses_a_trace_with_missing_records(host_bench):
    ids = np.zeros((3, 40, 6), np.int32)
    ids[:, :, :] = np.arange(6)
    ids[1, 5, :] = -1  # no record of token 1 at layer 8
    trace = Trace("holes", ids=ids, weights=None, first_layer=3, positions=np.arange(3))
    with pytest.raises(ValueError, match="misses 1 .* records: a captured step replays the same layers"):
        graph_loop.run_graph_loop(host_bench, traces=[trace])

