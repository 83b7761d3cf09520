"""Tests for pyexpcache.sim: exact LRU/Belady counters on hand-made streams and the real traces."""

import functools
import random
import time

import numpy as np
import pytest

from pyexpcache.sim import (
    BATCH,
    DECODE,
    Call,
    SimResult,
    decode_stream,
    prompt_stream,
    simulate,
    simulate_belady,
    simulate_lru,
)
from pyexpcache.traces import load_decode_trace, load_prefill_trace


def D(layer, *ids):
    return Call(DECODE, layer, ids)


def B(layer, *ids):
    return Call(BATCH, layer, ids)


def counters(r: SimResult, c=0):
    """(hits, misses, inserts, appends, direct, evictions) of class c."""
    return tuple(int(getattr(r, n)[c]) for n in ("hits", "misses", "inserts", "appends", "direct", "evictions"))


@pytest.fixture(scope="module")
def coffee():
    return load_decode_trace("podA_a_coffee_full")


# --------------------------------------------------------------------------- LRU by hand


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
    calls = [Call(rng.choice([DECODE, DECODE, BATCH]), rng.randrange(4),
                  tuple(rng.randrange(6) for _ in range(rng.randint(1, 5)))) for _ in range(300)]
    r = simulate_lru(calls, [3, 2], layer_class=[0, 1, 0, 1])
    assert np.array_equal(r.misses, r.inserts + r.appends + r.direct)
    assert r.requests == sum(len(set(c.ids)) for c in calls)
    d = r.as_dict()
    assert d["hits"] + d["misses"] == r.requests and d["hit_rate"] == r.hit_rate


# --------------------------------------------------------------------------- LRU vs a literal model


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
    calls = [Call(DECODE if rng.random() < 0.75 else BATCH, rng.randrange(layers),
                  tuple(rng.randrange(8) for _ in range(rng.randint(1, 6)))) for _ in range(200)]
    r = simulate_lru(calls, capacity, layer_class)
    ref = _reference_lru(calls, capacity, layer_class)
    for c, st in ref.items():
        assert counters(r, c) == tuple(st)


# --------------------------------------------------------------------------- Belady


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


def _optimal_hits(calls, cap):
    """Most hits any policy with the same rules can get (one class): exhaustive search.

    Rules shared with the simulators: hits first, misses in call order, a miss
    is inserted when there is a free slot; with a full class it may replace any
    entry not requested by the current call, or be served directly.
    """
    plans = [list(dict.fromkeys((call.layer, e) for e in call.ids)) for call in calls]

    @functools.lru_cache(maxsize=None)
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


# --------------------------------------------------------------------------- streams


def test_decode_stream_order_and_layers(coffee):
    s = decode_stream(coffee)
    assert len(s) == 299 * 40
    assert s[0] == D(0, *coffee.ids[0, 0].tolist())
    assert s[41] == D(1, *coffee.ids[1, 1].tolist())  # token-major: token 1, layer index 1
    assert decode_stream(coffee, first_layer=3)[41].layer == 4
    # A Trace, its array and its stream give the same result.
    a = simulate_lru(coffee, 500)
    assert counters(simulate_lru(coffee.ids, 500)) == counters(a) == counters(simulate_lru(s, 500))


def test_prompt_stream_prefill_then_decode():
    p = load_prefill_trace("pod12_prefill_learn")[0]
    s = prompt_stream(p)
    assert [c.kind for c in s] == [BATCH] * 43 + [DECODE] * 40
    assert [c.layer for c in s] == list(range(43)) + list(range(3, 43))
    assert s[5].ids == tuple(p.prefill[5].ravel().tolist())  # token-major within the layer
    # Unbounded cache: prefill misses = distinct experts per layer; the decode
    # token hits exactly the experts its layer already saw in the prefill.
    r = simulate_lru(s, 43 * 256)
    distinct = sum(len(np.unique(p.prefill[layer])) for layer in range(43))
    seen = sum(len(set(p.decode.ids[0, i].tolist()) & set(p.prefill[i + 3].ravel().tolist())) for i in range(40))
    assert int(r.appends[0]) == distinct
    assert int(r.hits[0]) == seen and int(r.inserts[0]) == 240 - seen
    assert int(r.evictions[0]) == 0 and int(r.direct[0]) == 0
    # Layer filter and decode switch.
    s2 = prompt_stream(p, decode=False, layers=range(3, 43))
    assert [c.layer for c in s2] == list(range(3, 43)) and all(c.kind == BATCH for c in s2)


def test_layer_class_must_cover_stream():
    with pytest.raises(ValueError, match="layer_class"):
        simulate_lru([D(5, 1)], 2, layer_class=[0, 0])
    with pytest.raises(ValueError, match="capacity"):
        simulate_lru([D(1, 1)], [2], layer_class=[0, 1])
    with pytest.raises(ValueError):
        Call("prefill", 0, (1,))


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
