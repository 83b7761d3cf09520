"""The hit-rate curve (pyexpcache/bench/modes/curve.py): LRU, OppClassLRU and Belady at fractions of
each class's experts, from the offline simulator."""

from __future__ import annotations

from pyexpcache import ModelLayout
from pyexpcache import bench


def test_hit_rate_curve_orders_lru_oppclass_belady():
    layout = ModelLayout.preset("q2", scale=4096)
    w = bench.build_workload("decode", ["podA_c_python_full"])
    curve = bench.hit_rate_curve(w, layout, [0.05, 0.10])
    for lru, opp, belady in zip(curve["lru"], curve["oppclass"], curve["belady"]):
        assert lru < opp < belady
