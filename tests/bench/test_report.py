"""The report's text (expcache_bench/report.py): a host run's times and link shares labelled as
emulation, a share above 100 % of a link bound marked and explained under the table, whatever the
backend; the budget line of a host run at divided sizes; a file source's bound, the lower of link
and disk, named, and its line on the page cache."""

from __future__ import annotations

import pytest

from expcache_bench import format_report
from expcache_bench.modes.graph_loop import GraphLoopResult
from expcache_bench.modes.variants import VariantResult
from expcache_bench.report import Report, bound, file_line


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


@pytest.mark.parametrize("disk, by", [(None, "link"), (2e9, "disk"), (9e9, "link")])
def test_the_bound_is_the_lower_of_link_and_disk_and_named(disk, by):
    assert bound(5e9, disk) == (min(5e9, disk or 5e9), by)
    report = variants_report("cuda")
    report.link_bytes_per_s, report.link_label = 5e9, "pinned"
    report.disk_bytes_per_s, report.disk_label = disk, "O_DIRECT reads" if disk else None
    report.results[1].link_bound_tokens_per_s = 200.0
    report.results[1].disk_bound_tokens_per_s = 200.0 * disk / 5e9 if disk else None
    assert report.bound_by == by
    text = format_report(report)
    assert f"{by}-bound tok/s" in text and f"of {by} bound" in text
    assert ("the bounds are the disk's, the lower" in text) == (by == "disk")
    assert ("the bounds are the link's, the lower" in text) == (disk is not None and by == "link")
    assert report.results[1].bound_tokens_per_s == min(200.0, 200.0 * (disk or 5e9) / 5e9)


@pytest.mark.parametrize(
    "reads, available, says",
    [
        ("direct", 1 << 40, "misses read with O_DIRECT (the page cache bypassed: every miss reads the disk)"),
        ("mmap", 1 << 40, "it fits in the page cache (1024.00 GiB of memory available): the bench drops it"),
        ("buffered", 1 << 20, "it does not fit in the page cache (1 MiB of memory available)"),
        ("direct refused", None, "(the file system refuses O_DIRECT); whether the page cache can hold it is not known"),
    ],
)
def test_a_file_sources_line_says_what_the_page_cache_may_hold(reads, available, says):
    line = file_line(dict(path="/d/f", bytes=1 << 30, reads=reads, memory_available=available, dropped=True))
    assert line.startswith("file /d/f (1.00 GiB): ") and says in line
