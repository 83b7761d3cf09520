"""LRU in the offline simulator (expcache_bench/sim/lru.py and simulate_lru): exact counters on
hand-made streams, a literal model of the semantics on random streams, and the generic
simulator's LRU policy equal to simulate_lru."""

import random

import numpy as np
import pytest

from expcache_bench.sim import BATCH, DECODE, Call, prompt_stream, simulate_lru, simulate_policy
from expcache_bench.traces import load_prefill_trace

from support.sim_streams import B, D, counters, random_stream

# --------------------------------------------------------------------------- by hand


def test_lru_evicts_least_recently_used():
    # cap 2: [1,2] -> list 1,2; [1] hit -> 2,1; [3] evicts 2 -> 1,3; [1] hit; [2] evicts 3.
    # (FIFO would evict 1 at [3] and miss on the second [1].)
    r = simulate_lru([D(0, 1, 2), D(0, 1), D(0, 3), D(0, 1), D(0, 2)], 2)
    assert counters(r) == (2, 4, 4, 0, 0, 2)
    assert r.hit_rate == pytest.approx(2 / 6)
    assert r.requests == 6 and r.calls == 5


def test_lru_duplicates_served_once_and_hits_reordered_in_call_order():
    # cap 3: 1,2,3 -> [2,1,2] dedupes to 2,1 (two hits) -> list 3,2,1;
    # [4] evicts 3 -> 2,1,4; [3] evicts 2 -> 1,4,3; [1] hit.
    # Moving hits in another order, or keeping the last duplicate, gives 2 hits here.
    calls = [D(0, 1), D(0, 2), D(0, 3), D(0, 2, 1, 2), D(0, 4), D(0, 3), D(0, 1)]
    assert counters(simulate_lru(calls, 3)) == (3, 5, 5, 0, 0, 2)
    # Duplicates of a miss: one miss, one insert.
    assert counters(simulate_lru([D(0, 5, 5, 7, 5), D(0, 7, 7)], 4)) == (1, 2, 2, 0, 0, 0)


def test_lru_capacity_smaller_than_call_loads_directly():
    # cap 2, [1,2,3]: 1 and 2 inserted, then every resident entry is requested -> 3 direct.
    # [3]: 1 is not requested any more -> evicted; [2] hit.
    r = simulate_lru([D(0, 1, 2, 3), D(0, 3), D(0, 2)], 2)
    assert counters(r) == (1, 4, 3, 0, 1, 1)
    # cap 3 holding 1,2,3; [3,4,5,6]: 3 hit; 4 evicts 1; 5 evicts 2; 6 finds only
    # protected entries (3,4,5) -> direct.  Then [1] evicts 3 and [4] hits.
    calls = [D(0, 1), D(0, 2), D(0, 3), D(0, 3, 4, 5, 6), D(0, 1), D(0, 4)]
    assert counters(simulate_lru(calls, 3)) == (2, 7, 6, 0, 1, 3)


def test_lru_capacity_zero_is_all_direct():
    r = simulate_lru(np.array([[[1, 2]], [[1, 2]]]), 0)
    assert counters(r) == (0, 4, 0, 0, 4, 0)
    assert r.hit_rate == 0.0
    rb = simulate_lru([B(0, 1, 2, 1), D(0, 1)], 0)
    assert counters(rb) == (0, 3, 0, 0, 3, 0)


def test_lru_classes_do_not_interfere():
    calls = [D(0, 1), D(1, 1), D(1, 2), D(0, 1), D(1, 1), D(0, 2), D(0, 1)]
    r = simulate_lru(calls, [1, 2], layer_class=[0, 1])
    # Class 0 (cap 1): miss, hit, 2 evicts 1, 1 evicts 2.  Class 1 (cap 2): miss, miss, hit.
    assert counters(r, 0) == (1, 3, 3, 0, 0, 2)
    assert counters(r, 1) == (1, 2, 2, 0, 0, 0)
    assert r.class_hit_rates.tolist() == pytest.approx([1 / 4, 1 / 3])
    # One shared class of capacity 3 behaves differently: keys of both layers compete.
    shared = simulate_lru(calls, 3)
    assert counters(shared) == (3, 4, 4, 0, 0, 1)


def test_lru_keys_include_the_layer():
    # Expert 1 of layer 0 and expert 1 of layer 1 are different keys.
    r = simulate_lru([D(0, 1), D(1, 1), D(0, 1)], 1, layer_class=[0, 0])
    assert counters(r) == (0, 3, 3, 0, 0, 2)


def test_lru_int_capacity_applies_to_every_class():
    r = simulate_lru([D(0, 1), D(1, 1), D(0, 1), D(1, 1)], 1, layer_class=[0, 1])
    assert r.capacity == (1, 1)
    assert counters(r, 0) == counters(r, 1) == (1, 1, 1, 0, 0, 0)


def test_batch_appends_at_lru_end_and_never_evicts():
    # cap 3.  D[1] -> list 1.  Batch 2,3,(2),4: 2 appended at the LRU end -> 2,1;
    # 3 appended at the LRU end -> 3,2,1; the class is full, so 4 is direct.
    # D[5] evicts 3 (the last append is the oldest entry) -> 2,1,5; D[1], D[2]
    # hit; D[3] evicts 5.  Appending at the MRU end would evict 1 at D[5].
    calls = [D(0, 1), B(0, 2, 3, 2, 4), D(0, 5), D(0, 1), D(0, 2), D(0, 3)]
    r = simulate_lru(calls, 3)
    assert counters(r) == (2, 6, 3, 2, 1, 2)
    # A batch on a full class never evicts: everything missing is direct.
    r2 = simulate_lru([D(0, 1, 2), B(0, 7, 8, 1)], 2)
    assert counters(r2) == (1, 4, 2, 0, 2, 0)


def test_batch_hit_does_not_change_recency():
    # cap 2: 1,2 resident; the batch hits 1 without refreshing it, so D[3]
    # still evicts 1 and the final D[1] misses.  (Refreshing would evict 2.)
    calls = [D(0, 1), D(0, 2), B(0, 1), D(0, 3), D(0, 1)]
    assert counters(simulate_lru(calls, 2)) == (1, 4, 4, 0, 0, 2)


def test_counters_add_up_on_mixed_stream():
    rng = random.Random(1)
    calls = [
        Call(
            rng.choice([DECODE, DECODE, BATCH]),
            rng.randrange(4),
            tuple(rng.randrange(6) for _ in range(rng.randint(1, 5))),
        )
        for _ in range(300)
    ]
    r = simulate_lru(calls, [3, 2], layer_class=[0, 1, 0, 1])
    assert np.array_equal(r.misses, r.inserts + r.appends + r.direct)
    assert r.requests == sum(len(set(c.ids)) for c in calls)
    d = r.as_dict()
    assert d["hits"] + d["misses"] == r.requests and d["hit_rate"] == r.hit_rate


# --------------------------------------------------------------------------- against a literal model


def _reference_lru(calls, capacity, layer_class):
    """Literal transcription of the semantics: plain lists, victim found by scanning."""
    lists = {c: [] for c in set(layer_class)}  # LRU first
    stats = {c: [0] * 6 for c in lists}
    for call in calls:
        c = layer_class[call.layer]
        lst, st, cap = lists[c], stats[c], capacity[c]
        want = []
        for e in call.ids:
            if (call.layer, e) not in want:
                want.append((call.layer, e))
        if call.kind == DECODE:
            hits = [k for k in want if k in lst]
            for k in hits:
                st[0] += 1
                lst.remove(k)
                lst.append(k)
            for k in want:
                if k in hits:
                    continue
                st[1] += 1
                if len(lst) < cap:
                    lst.append(k)
                    st[2] += 1
                    continue
                victims = [v for v in lst if v not in want]
                if victims:
                    lst.remove(victims[0])
                    lst.append(k)
                    st[2] += 1
                    st[5] += 1
                else:
                    st[4] += 1
        else:
            for k in want:
                if k in lst:
                    st[0] += 1
                else:
                    st[1] += 1
                    if len(lst) < cap:
                        lst.insert(0, k)
                        st[3] += 1
                    else:
                        st[4] += 1
    return stats


@pytest.mark.parametrize("seed", range(20))
def test_lru_matches_literal_model_on_random_streams(seed):
    rng = random.Random(seed)
    layers = rng.randint(1, 4)
    layer_class = [rng.randrange(2) for _ in range(layers)]
    capacity = [rng.randint(0, 6), rng.randint(0, 6)]
    calls = [
        Call(
            DECODE if rng.random() < 0.75 else BATCH,
            rng.randrange(layers),
            tuple(rng.randrange(8) for _ in range(rng.randint(1, 6))),
        )
        for _ in range(200)
    ]
    r = simulate_lru(calls, capacity, layer_class)
    ref = _reference_lru(calls, capacity, layer_class)
    for c, st in ref.items():
        assert counters(r, c) == tuple(st)


# --------------------------------------------------------------------------- the LRU policy object equals simulate_lru


@pytest.mark.parametrize("fraction", [0.05, 0.10, 0.25])
def test_lru_policy_equals_simulate_lru_on_real_trace(coffee, fraction):
    cap = int(round(fraction * coffee.num_layers * coffee.num_experts))
    a = simulate_lru(coffee, cap)
    b = simulate_policy(coffee, cap, policy="lru")
    assert counters(a) == counters(b)
    assert b.calls == a.calls and b.capacity == a.capacity


def test_lru_policy_equals_simulate_lru_multi_class_and_prefill():
    # Real prefill prompts (batches, model layers 0..42) then their decode tokens, two classes.
    prompts = load_prefill_trace("pod12_prefill_eval")
    stream = [c for p in prompts for c in prompt_stream(p)]
    cls = [0] * 37 + [1] * 6
    for cap in ([300, 40], [1500, 200], [0, 5]):
        a = simulate_lru(stream, cap, cls)
        b = simulate_policy(stream, cap, cls, policy="lru")
        for c in range(2):
            assert counters(a, c) == counters(b, c)


@pytest.mark.parametrize("seed", range(25))
def test_lru_policy_equals_simulate_lru_on_random_streams(seed):
    rng = random.Random(seed)
    calls, layers = random_stream(rng)
    cls = [rng.randrange(2) for _ in range(layers)]
    cap = [rng.randint(0, 6), rng.randint(0, 6)]
    a = simulate_lru(calls, cap, cls)
    b = simulate_policy(calls, cap, cls, policy="lru", check=True)
    for c in range(2):
        assert counters(a, c) == counters(b, c)
