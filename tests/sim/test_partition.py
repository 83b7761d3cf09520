"""partition="layer" in the simulator (expcache_bench/sim/driver.py: layer_shares, LayerSlots; the
library's twin is ClassTable::acquire): the shares, the semantics by hand, every policy's
invariants on random streams, and the per-layer Belady."""

import random

import pytest

from expcache_bench.sim import POLICIES, simulate_belady, simulate_policy
from expcache_bench.sim.driver import layer_shares
from expcache_bench.sim.registry import simulate_belady_partitioned

from support.sim_streams import B, D, counters, random_stream


def test_shares_split_the_cap_in_proportion_to_experts_largest_remainders_first():
    # 10 slots over experts 4, 4, 2 (one class): 4, 4, 2 exactly.
    assert layer_shares([10], [0, 0, 0], [4, 4, 2]) == [4, 4, 2]
    # 10 over three equal layers: 3 each and the one left over to the lowest layer (equal remainders).
    assert layer_shares([10], [0, 0, 0], [8, 8, 8]) == [4, 3, 3]
    # 7 over experts 1, 2, 4: exact quotients 1, 2, 4.
    assert layer_shares([7], [0, 0, 0], [1, 2, 4]) == [1, 2, 4]
    # 5 over experts 3, 3, 1: 15/7, 15/7, 5/7 -> 2, 2, 0 and remainders 1, 1, 5: the last gets the spare.
    assert layer_shares([5], [0, 0, 0], [3, 3, 1]) == [2, 2, 1]
    # Two classes each split its own cap; a layer with no experts (dense) gets nothing.
    assert layer_shares([4, 3], [0, 1, 0, 1], [8, 8, 0, 8]) == [4, 2, 0, 1]
    assert layer_shares([0], [0, 0], [8, 8]) == [0, 0]


def test_a_layer_at_its_share_evicts_its_own_least_recent_entry():
    # Two layers of 4 experts, capacity 4: shares 2 and 2. Layer 0 fills its two, layer 1 one;
    # layer 0's third expert evicts layer 0's oldest, not layer 1's (older) entry.
    calls = [D(1, 0), D(0, 0), D(0, 1), D(0, 2), D(0, 0), D(1, 0)]
    r = simulate_policy(calls, 4, [0, 0], policy="lru", partition="layer", layer_experts=[4, 4], check=True)
    # hits: D(1, 0) at the end (layer 1 untouched); D(0, 0) was evicted by D(0, 2) -> a miss.
    assert counters(r) == (1, 5, 5, 0, 0, 1 + 1)
    g = simulate_policy(calls, 4, [0, 0], policy="lru")
    assert counters(g) == (2, 4, 4, 0, 0, 0)  # globally, four fit


def test_a_layer_with_no_share_serves_directly_and_batches_append_below_the_share():
    calls = [D(0, 1), D(1, 1), B(1, 2, 3, 4), D(1, 2)]
    # capacity 2 over experts 1 and 8: shares 0 (8*... remainders) -> [0, 2]
    assert layer_shares([2], [0, 0], [1, 8]) == [0, 2]
    r = simulate_policy(calls, 2, [0, 0], policy="lru", partition="layer", layer_experts=[1, 8], check=True)
    # D(0,1): direct. D(1,1): insert. Batch: 2 appended (share 2), 3 and 4 direct. D(1,2): hit.
    assert counters(r) == (1, 5, 1, 1, 3, 0)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_invariants_under_the_layer_partition(name):
    """check=True asserts after every call: no layer above its share, victims of the miss's own
    layer and not of the call, the policy holding exactly the resident entries."""
    rng = random.Random(hash(name) & 0xFFF)
    for _ in range(20):
        calls, layers = random_stream(rng)
        cls = [rng.randrange(2) for _ in range(layers)]
        experts = [rng.randint(1, 12) for _ in range(layers)]
        cap = [rng.randint(0, 9), rng.randint(0, 9)]
        r = simulate_policy(calls, cap, cls, policy=name, partition="layer", layer_experts=experts, check=True)
        assert (r.misses == r.inserts + r.appends + r.direct).all()


def test_lru_under_the_layer_partition_is_lru_per_layer(python_trace):
    """LRU keeps no state across keys, so the partition is one LRU per layer of its share."""
    cap = 1024
    shares = layer_shares([cap], [0] * python_trace.num_layers, [python_trace.num_experts] * python_trace.num_layers)
    a = simulate_policy(python_trace, cap, policy="lru", partition="layer")
    b = simulate_policy(python_trace, shares, list(range(python_trace.num_layers)), policy="lru")
    assert int(a.hits.sum()) == int(b.hits.sum()) and int(a.evictions.sum()) == int(b.evictions.sum())


def test_belady_per_layer_runs_within_each_share(python_trace):
    cap = 1024
    L = python_trace.num_layers
    shares = layer_shares([cap], [0] * L, [python_trace.num_experts] * L)
    a = simulate_belady_partitioned(python_trace, cap, partition="layer")
    b = simulate_belady(python_trace, shares, list(range(L)))
    assert int(a.hits.sum()) == int(b.hits.sum())
    assert simulate_belady_partitioned(python_trace, cap).hit_rate == simulate_belady(python_trace, cap).hit_rate
    lru = simulate_policy(python_trace, cap, policy="lru", partition="layer")
    assert lru.hit_rate <= a.hit_rate


def test_partition_arguments_are_checked():
    calls = [D(0, 1)]
    with pytest.raises(ValueError, match="partition must be one of"):
        simulate_policy(calls, 2, partition="layers")
    with pytest.raises(ValueError, match="needs layer_experts"):
        simulate_policy(calls, 2, partition="layer")
    with pytest.raises(ValueError, match="layer_experts has 0 entries"):
        simulate_policy(calls, 2, partition="layer", layer_experts=[])
