"""The report's text (expcache_bench/report.py): a host run's times and link shares labelled as
emulation, a share above 100 % of a link bound marked and explained under the table, whatever the
backend; the budget line of a host run at divided sizes."""

from __future__ import annotations

import pytest

from expcache_bench import format_report
from expcache_bench.modes.graph_loop import GraphLoopResult
from expcache_bench.modes.variants import VariantResult
from expcache_bench.report import Report


def variants_report(backend: str) -> Report:
    """nocache twice as fast as its link bound and faster than resident: what a host run can print."""
    rows = [
        VariantResult("resident", decode_seconds=2.0, decode_tokens=100, hits=10, misses=0, experts_checked=10),
        VariantResult(
            "nocache",
            decode_seconds=1.0,
            decode_tokens=100,
            hits=0,
            misses=10,
            link_bound_tokens_per_s=50.0,
            decode_bytes_h2d=1,
            experts_checked=10,
        ),
    ]
    return Report(
        "variants",
        "decode",
        backend=backend,
        device="d",
        layout="L",
        budget_bytes=1 << 20,
        settings=dict(scenario="decode", decode_tokens=100, prefill_tokens=0, layer_sync=True),
        results=rows,
    )


def test_a_host_table_labels_its_times_as_emulation():
    text = format_report(variants_report("host"))
    table = text.split("\n\n", 1)[1].splitlines()
    assert "decode tok/s (emulated)" in table[0] and "of link bound (emulated)" in table[0]
    assert "link-bound tok/s (emulated)" in table[0] and "vs slab (emulated)" in table[0]
    assert "200 % †" in text
    assert any(
        line.startswith("host backend: the (emulated) columns are host emulation, not GPU measurements")
        for line in table
    )
    assert any(line.startswith("† above 100 %: the emulated link") for line in table)


def test_a_gpu_table_marks_a_share_above_the_bound_too():
    text = format_report(variants_report("cuda"))
    assert "(emulated)" not in text and "host backend" not in text
    assert "200 % †" in text
    assert text.splitlines()[-1] == "† above 100 %: the run moved its misses faster than the link measured before it"


@pytest.mark.parametrize("backend", ["host", "cuda"])
def test_the_graph_loops_share_of_the_bound_is_marked(backend):
    rows = [
        GraphLoopResult(
            "C loop, host select",
            decode_tokens=10,
            decode_seconds=1.0,
            served_tokens=10,
            bytes_h2d=4,
            link_bytes_per_s=1.0,
        )
    ]
    report = Report(
        "graph",
        "graph loop",
        backend=backend,
        results=rows,
        settings=dict(compute_us=0, policy="lru", layers="3-42", k=6, capture=backend == "cuda", all_hit_select_us=1.0),
    )
    text = format_report(report)
    assert "400.0 % †" in text and ("of link bound (emulated)" in text) == (backend == "host")


def test_a_share_within_the_bound_is_not_marked():
    report = variants_report("host")
    report.results[1].link_bound_tokens_per_s = 200.0
    text = format_report(report)
    assert "50 %" in text and "†" not in text
