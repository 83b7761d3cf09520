"""Locality statistics of a trace (expcache_bench/traces/locality.py): by hand and on a bundled trace."""

import numpy as np
import pytest

from expcache_bench.traces import Trace, locality_stats


def test_locality_stats_by_hand():
    # One layer, k=2, 4 experts.  Tokens: {0,1} {1,2} {1,2} {3,0}
    ids = np.array([[[0, 1]], [[1, 2]], [[1, 2]], [[3, 0]]], dtype=np.int32)
    t = Trace("hand", ids, None, 0, np.arange(4), num_experts=4)
    s = locality_stats(t, top_fraction=0.25)  # top 1 of 4 experts
    # Overlaps with the previous token: 1 of 2, 2 of 2, 0 of 2 -> 3/6.
    assert s["reuse_previous"] == pytest.approx(0.5)
    # Counts: 0:2, 1:3, 2:2, 3:1 -> top expert takes 3 of 8 requests.
    assert s["top10_share"] == pytest.approx(3 / 8)
    assert s["chance_reuse"] == pytest.approx(0.5)
    assert s["distinct_share"] == pytest.approx(1.0)


def test_coffee_locality(coffee):
    s = locality_stats(coffee)
    # Measured: reuse_previous 0.387 (chance 0.023), top10_share 0.685.
    assert 0.35 <= s["reuse_previous"] <= 0.42
    assert 0.62 <= s["top10_share"] <= 0.75
    assert s["chance_reuse"] == pytest.approx(6 / 256)
