"""Belady's MIN in the offline simulator (expcache_bench/sim/belady.py): exact counters on hand-made
streams, optimal against exhaustive search, and a literal model on random streams."""

import functools
import random

import numpy as np
import pytest

from expcache_bench.sim import simulate_belady, simulate_lru

from support.sim_streams import B, D, counters

# --------------------------------------------------------------------------- by hand


def test_belady_by_hand():
    calls = [D(0, 1), D(0, 2), D(0, 3), D(0, 1), D(0, 2), D(0, 3)]
    # cap 2.  At call 2, 3 is missing; candidates 1 (next use call 3) and 2 (call 4);
    # 3's own next use (call 5) is farther -> bypass (direct).  Calls 3, 4 hit.  At
    # call 5 nothing is used again: tie -> 3 replaces an entry.
    assert counters(simulate_belady(calls, 2)) == (2, 4, 3, 0, 1, 1)
    # Without bypass 3 replaces 2 (the farther one); 1 hits; 2 evicts 1 (never
    # used again); 3 hits.
    assert counters(simulate_belady(calls, 2, bypass=False)) == (2, 4, 4, 0, 0, 2)
    assert counters(simulate_lru(calls, 2))[0] == 0  # LRU thrashes on this loop


def test_belady_protects_current_call_and_capacity_zero():
    assert counters(simulate_belady([D(0, 1, 2, 3), D(0, 3), D(0, 2)], 2)) == (1, 4, 3, 0, 1, 1)
    assert counters(simulate_belady(np.array([[[1, 2]], [[1, 2]]]), 0)) == (0, 4, 0, 0, 4, 0)


def test_belady_classes_and_duplicates():
    calls = [D(0, 1, 1), D(1, 1), D(1, 2), D(0, 1), D(1, 1), D(0, 2), D(0, 1)]
    r = simulate_belady(calls, [1, 2], layer_class=[0, 1])
    # Class 0 (cap 1): 1 miss, 1 hit, 2 bypassed (1 is needed sooner), 1 hit.
    assert counters(r, 0) == (2, 2, 1, 0, 1, 0)
    assert counters(r, 1) == (1, 2, 2, 0, 0, 0)


def test_belady_rejects_batches():
    with pytest.raises(ValueError, match="decode calls only"):
        simulate_belady([D(0, 1), B(0, 2)], 2)


def test_belady_tie_inserts_as_specified():
    # The bypass rule is "own next use strictly farther than every candidate's".
    # cap 2 holding 1 (next use: call 3) and 2 (never again).  Call 1 misses 3
    # (never again) and 4 (call 2): 3 ties with 2 and replaces it, becoming
    # protected, so 4 must replace 1 and call 3 misses.  (Bypassing 3 would keep 1:
    # the greedy per-miss rule is not optimal with several misses per call.)
    calls = [D(0, 1, 2), D(0, 3, 4), D(0, 4), D(0, 1)]
    assert counters(simulate_belady(calls, 2)) == (1, 5, 5, 0, 0, 3)


# --------------------------------------------------------------------------- optimal, and against a literal model


def _optimal_hits(calls, cap):
    """Most hits any policy with the same rules can get (one class): exhaustive search.

    Rules shared with the simulators: hits first, misses in call order, a miss
    is inserted when there is a free slot; with a full class it may replace any
    entry not requested by the current call, or be served directly.
    """
    plans = [list(dict.fromkeys((call.layer, e) for e in call.ids)) for call in calls]

    @functools.cache
    def best(i, cache):
        if i == len(plans):
            return 0
        want = plans[i]
        hits = sum(1 for k in want if k in cache)
        missing = [k for k in want if k not in cache]
        protected = frozenset(want)

        def place(j, state):
            if j == len(missing):
                return best(i + 1, state)
            k = missing[j]
            if len(state) < cap:
                return place(j + 1, state | {k})
            options = [place(j + 1, state)]  # direct
            for v in state - protected:
                options.append(place(j + 1, (state - {v}) | {k}))
            return max(options)

        return hits + place(0, cache)

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(30))
def test_belady_is_optimal_for_single_id_calls(seed):
    # With one id per call the protection rule is vacuous and Belady with
    # bypass is the classic optimal policy: it must match exhaustive search.
    rng = random.Random(seed)
    cap = rng.randint(1, 3)
    calls = [D(rng.randrange(2), rng.randrange(4)) for _ in range(12)]
    opt = _optimal_hits(calls, cap)
    assert int(simulate_belady(calls, cap).hits[0]) == opt
    assert int(simulate_lru(calls, cap).hits[0]) <= opt


def _reference_belady(calls, capacity, layer_class, bypass=True):
    """Literal transcription: next uses found by scanning forward, victims by scanning."""
    resident = {c: set() for c in set(layer_class)}
    stats = {c: [0] * 6 for c in resident}

    def next_use(key, i):
        for j in range(i + 1, len(calls)):
            if calls[j].layer == key[0] and key[1] in calls[j].ids:
                return j
        return float("inf")

    for i, call in enumerate(calls):
        c = layer_class[call.layer]
        res, st, cap = resident[c], stats[c], capacity[c]
        want = list(dict.fromkeys((call.layer, e) for e in call.ids))
        st[0] += sum(1 for k in want if k in res)
        for k in [k for k in want if k not in res]:
            st[1] += 1
            if len(res) < cap:
                res.add(k)
                st[2] += 1
                continue
            cands = sorted((v for v in res if v not in want), key=lambda v: (-next_use(v, i), v))
            if not cands or (bypass and next_use(k, i) > next_use(cands[0], i)):
                st[4] += 1
            else:
                res.remove(cands[0])
                res.add(k)
                st[2] += 1
                st[5] += 1
    return stats


@pytest.mark.parametrize("seed", range(20))
def test_belady_matches_literal_model_on_random_streams(seed):
    rng = random.Random(100 + seed)
    layers = rng.randint(1, 4)
    layer_class = [rng.randrange(2) for _ in range(layers)]
    capacity = [rng.randint(0, 6), rng.randint(0, 6)]
    calls = [D(rng.randrange(layers), *[rng.randrange(8) for _ in range(rng.randint(1, 6))]) for _ in range(150)]
    for bypass in (True, False):
        r = simulate_belady(calls, capacity, layer_class, bypass=bypass)
        ref = _reference_belady(calls, capacity, layer_class, bypass)
        for c, st in ref.items():
            assert counters(r, c) == tuple(st)
