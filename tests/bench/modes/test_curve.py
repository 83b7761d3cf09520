"""The hit-rate curve (expcache_bench/modes/curve.py): each of the library's policies (its default
first) and Belady at fractions of each class's experts, from the offline simulator."""

from __future__ import annotations

import pytest

import expcache_bench as bench
from pyexpcache import ModelLayout, _lib


def test_hit_rate_curve_has_a_line_per_library_policy_under_belady():
    layout = ModelLayout.preset("q2", scale=4096)
    w = bench.build_workload("decode", ["podA_c_python_full"])
    curve = bench.hit_rate_curve(w, layout, [0.05, 0.10])
    assert list(curve["policies"]) == list(bench.policy_variants()) and curve["default"] == _lib.DEFAULT_POLICY
    lru, opp = curve["policies"]["lru"], curve["policies"]["oppclass"]
    for i, belady in enumerate(curve["belady"]):
        assert lru[i] < opp[i] < belady
        assert all(rates[i] <= belady for rates in curve["policies"].values())


def test_hit_rate_curve_plots_a_line_per_policy(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layout = ModelLayout.preset("q2", scale=4096)
    w = bench.build_workload("decode", ["podA_c_python_full"])
    curve = bench.hit_rate_curve(w, layout, [0.05, 0.10])
    drawn = []
    real = plt.subplots

    def subplots(*args, **kw):
        fig, ax = real(*args, **kw)
        drawn.append(ax)
        return fig, ax

    monkeypatch.setattr(plt, "subplots", subplots)
    bench.plot_curve(curve, str(tmp_path / "c.png"), "t")
    labels = [line.get_label() for line in drawn[0].get_lines()]
    assert labels == [n + (" (the default)" if n == _lib.DEFAULT_POLICY else "") for n in curve["policies"]] + [
        "Belady (optimum)"
    ]
