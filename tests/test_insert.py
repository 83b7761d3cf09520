"""Seeding (``cache.insert``; C: expcache_insert_async): an engine's hot list put into the cache
ahead of use, highest priorities kept, counted on the control path, on every cache."""

from __future__ import annotations

import pytest

from pyexpcache import InvalidArgumentError, testing

from support.cache import assert_served


@pytest.mark.parametrize("lookup", ["host", "device"])
def test_insert_keeps_the_highest_priorities(make_cache, policy, lookup):
    cache, source = make_cache(budget_experts=4, lookup=lookup, **({"pinned": True} if lookup == "device" else {}))
    layer = cache.layout.moe_layers[0]
    ids = [9, 2, 7, 5, 2, 11, 3]
    prio = [0.5, 0.1, 3.0, 2.0, 4.0, 1.0, -1.0]  # expert 2 twice: its higher priority (4.0) counts
    cache.insert(layer, ids, priorities=prio)
    cap = cache.classes()[0].cap_experts
    want = [e for e, _ in sorted({2: 4.0, 7: 3.0, 5: 2.0, 11: 1.0, 9: 0.5, 3: -1.0}.items(), key=lambda t: -t[1])][:cap]
    resident = [e for e in range(cache.layout[layer].num_experts) if testing.read_expert(cache, layer, e) is not None]
    assert sorted(resident) == sorted(want)
    for e in want:
        assert (testing.read_expert(cache, layer, e) == source.expert_bytes(layer, e)).all()
    stats = cache.stats()
    assert stats.path("decode").misses == 0 and stats.path("decode").hits == 0
    assert stats.path("control").misses == 6  # every distinct id went in once
    # The seeded experts are decode hits now.
    ptrs = cache.select(layer, want)
    assert_served(cache, source, layer, want, ptrs)
    assert cache.stats().path("decode").hits == len(want)


def test_insert_without_priorities_keeps_the_last(make_cache):
    cache, _ = make_cache(budget_experts=2)
    layer = cache.layout.moe_layers[0]
    cache.insert(layer, [1, 2, 3, 4])
    cap = cache.classes()[0].cap_experts
    resident = [e for e in range(1, 5) if testing.read_expert(cache, layer, e) is not None]
    assert resident == [1, 2, 3, 4][-cap:]


def test_insert_refuses_bad_input_whole(make_cache):
    cache, _ = make_cache(budget_experts=4)
    layer = cache.layout.moe_layers[0]
    with pytest.raises(InvalidArgumentError, match="priorities\\[1\\] is NaN"):
        cache.insert(layer, [1, 2], priorities=[1.0, float("nan")])
    with pytest.raises(InvalidArgumentError, match="expert id 100000"):
        cache.insert(layer, [1, 100000])
    with pytest.raises(ValueError, match="one value per id"):
        cache.insert(layer, [1, 2], priorities=[1.0])
    assert testing.read_expert(cache, layer, 1) is None  # nothing went in
    assert cache.stats().path("control").misses == 0
