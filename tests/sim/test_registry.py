"""Every policy through the simulator's entry points (expcache_bench/sim/registry.py: simulate_policy,
simulate_global, simulate): the driver's invariants on random streams, real-trace counters, shared
byte budgets, the weights a policy sees, and reference figures of LRU and Belady on a real trace."""

import random
import time

import numpy as np
import pytest

from expcache_bench.sim import (
    KEY_SHIFT,
    POLICIES,
    simulate,
    simulate_belady,
    simulate_global,
    simulate_lru,
    simulate_policy,
)

from support.sim_streams import D, counters, random_stream

# --------------------------------------------------------------------------- invariants of every policy


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_invariants_on_random_streams(name):
    """check=True asserts after every call: capacity respected, the victim is resident and not
    requested by the current call, the policy holds exactly the resident entries."""
    rng = random.Random(hash(name) & 0xFFFF)
    for _ in range(30):
        calls, layers = random_stream(rng)
        cls = [rng.randrange(2) for _ in range(layers)]
        cap = [rng.randint(0, 7), rng.randint(0, 7)]
        r = simulate_policy(calls, cap, cls, policy=name, check=True)
        assert (r.misses == r.inserts + r.appends + r.direct).all()
        want = sum(len(dict.fromkeys(c.ids)) for c in calls)
        assert r.requests == want
        assert (r.evictions <= r.inserts).all()
        lru = simulate_lru(calls, cap, cls)
        assert (r.appends == lru.appends).all()  # batches fill free slots the same way


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_the_misses_are_listed_in_the_order_they_are_read(name):
    """misses=: every miss's key (layer << KEY_SHIFT | expert), calls in order and each call's in
    first-appearance order, direct ones too: as many as the counters' misses."""
    rng = random.Random(hash(name) & 0xFFF)
    for _ in range(10):
        calls, layers = random_stream(rng)
        cls = [rng.randrange(2) for _ in range(layers)]
        keys = []
        r = simulate_policy(calls, [rng.randint(0, 5), rng.randint(0, 5)], cls, policy=name, misses=keys)
        assert len(keys) == r.misses.sum()
    # capacity 2, LRU: 1 2 | 3 (evicts 1) | 1 (evicts 2) 3 (hit) | layer 1's 1
    keys = []
    simulate_policy([D(0, 1, 2, 1), D(0, 3), D(0, 1, 3), D(1, 1)], 2, policy="lru", misses=keys)
    assert keys == [1, 2, 3, 1, 1 << KEY_SHIFT | 1]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_never_evicts_current_call(name):
    # Capacity 3; a call of 4 ids: 3 fill, the 4th must be served directly whatever the policy.
    calls = [D(0, 1, 2, 3, 4), D(0, 5), D(0, 6, 7, 8, 9, 10)]
    r = simulate_policy(calls, 3, policy=name, check=True)
    assert int(r.direct.sum()) >= 1 + 2
    assert counters(r)[1] == 10


@pytest.mark.parametrize("name", ["lru", "classlru", "oppclass", "hazard", "arc", "s3fifo"])
def test_policy_on_real_trace_counters(python_trace, name):
    cap = 1024
    r = simulate_policy(python_trace, cap, policy=name)
    assert r.requests == python_trace.num_requests  # decode ids are distinct within a call
    assert int(r.misses.sum()) == int((r.inserts + r.direct).sum())
    assert r.hit_rate <= simulate_belady(python_trace, cap).hit_rate + 1e-12


@pytest.mark.parametrize("name", ["lru", "classlru", "oppclass", "hazard", "arc", "s3fifo", "wtinylfu", "lrfu"])
def test_global_budget_invariants(name):
    rng = random.Random(7)
    sizes = [3, 5]
    for _ in range(20):
        calls, layers = random_stream(rng)
        cls = [rng.randrange(2) for _ in range(layers)]
        budget = rng.randint(0, 40)
        r = simulate_global(calls, budget, sizes, cls, policy=name, check=True)
        assert (r.misses == r.inserts + r.appends + r.direct).all()
        assert r.requests == sum(len(dict.fromkeys(c.ids)) for c in calls)


def test_global_budget_lru_one_class_equals_lru():
    # One class of size s and a budget of n * s bytes is an n-slot LRU.
    rng = random.Random(3)
    for _ in range(10):
        calls, layers = random_stream(rng, layers=2)
        a = simulate_lru(calls, 5)
        b = simulate_global(calls, 5 * 7, [7], [0] * layers, policy="lru", check=True)
        assert counters(a) == counters(b)


def test_weights_reach_the_policy(python_trace):
    seen = []

    class Spy(POLICIES["lru"]):
        def begin(self, ctx):
            if ctx.tick < 3:
                seen.append(dict(ctx.want))

    simulate_policy(python_trace, 100, policy=Spy)
    w = python_trace.weights
    first = seen[0]
    assert list(first) == [e for e in python_trace.ids[0, 0]]  # layer 0: keys are the ids
    assert list(first.values()) == pytest.approx(w[0, 0].tolist())


# --------------------------------------------------------------------------- real trace


# Reference figures for one cache over all (layer, expert) keys of the coffee
# trace (40 layers x 256 experts = 10240 keys): LRU vs Belady hit rate.
REFERENCE = {0.10: (0.649, 0.811), 0.25: (0.847, 0.906)}


@pytest.mark.parametrize("fraction", sorted(REFERENCE))
def test_coffee_reference_hit_rates(coffee, fraction):
    cap = round(fraction * 40 * 256)
    t0 = time.perf_counter()
    lru = simulate_lru(coffee, cap)
    t1 = time.perf_counter()
    opt = simulate_belady(coffee, cap)
    t2 = time.perf_counter()
    assert t1 - t0 < 2.0 and t2 - t1 < 2.0  # 72k requests: ~0.05 s and ~0.15 s measured
    ref_lru, ref_opt = REFERENCE[fraction]
    assert abs(lru.hit_rate - ref_lru) <= 0.02
    assert abs(opt.hit_rate - ref_opt) <= 0.02
    assert opt.hit_rate >= lru.hit_rate
    assert lru.requests == opt.requests == 299 * 40 * 6


def test_coffee_exact_counters(coffee):
    # Regression anchor for comparisons with libexpcache (one class, 1024 slots).
    assert counters(simulate_lru(coffee, 1024)) == (46587, 25173, 25173, 0, 0, 24149)
    assert counters(simulate_belady(coffee, 1024)) == (58196, 13564, 10040, 0, 3524, 9016)


def test_per_layer_classes_on_coffee(coffee):
    # 40 classes of 26 slots (10 % of a layer each): classes partition the counters,
    # Belady still bounds LRU, and every class sees 299 * 6 requests.
    lc = np.arange(40)
    lru = simulate_lru(coffee, 26, lc)
    opt = simulate_belady(coffee, 26, lc)
    assert lru.num_classes == 40
    assert np.all(lru.hits + lru.misses == 299 * 6)
    assert np.all(opt.hits >= lru.hits)
    assert simulate(coffee, 26, lc, policy="belady").hits.tolist() == opt.hits.tolist()
    with pytest.raises(ValueError):
        simulate(coffee, 26, policy="fifo")
