"""The default policy's simulator twin (expcache_bench/sim/duel.py): LRU and OppClassLRU followed by
shadow-cache dueling. By hand: it is OppClassLRU until LRU's shadow wins; on real and shifting
traces: never far below LRU, and OppClassLRU's gain kept on a DeepSeek trace."""

import numpy as np

from expcache_bench.sim import Ctx, DuelPolicy, simulate_policy
from expcache_bench.traces import Trace, synthetic_trace


def _ctx(token, pos=0, layers=1):
    ctx = Ctx()
    ctx.token, ctx.pos, ctx.layers = token, pos, layers
    return ctx


def test_starts_with_oppclass_and_moves_by_shadow_requests_only():
    p = DuelPolicy(None, limit=2)
    assert p.follows == "oppclass"
    # Room grows with what is resident: two inserts, then a repeat of the first hits in both shadows.
    for t, key in enumerate((1, 2)):
        p.begin(_ctx(t))
        p.on_insert(key, False, _ctx(t))
    assert p.room == 2 and p.psel == 0
    p.begin(_ctx(2))
    p.on_hit(1, _ctx(2))
    assert p.psel == 0  # both shadows hit: no duel
    # Cold inserts and prefetches are not requests: the shadows do not see them.
    p.on_insert(3, True, _ctx(2))
    assert 3 not in p.shadows[0].od and 3 not in p.shadows[1].where


def test_a_request_only_one_shadow_hits_moves_the_counter_toward_it():
    p = DuelPolicy(None, limit=2)
    ctx = _ctx(0)
    p.begin(ctx)
    p.room = 1
    p.shadows[0].on_insert(7, False, ctx)  # only LRU's shadow holds 7
    p.resident = 0
    p._request(7, ctx)
    assert p.psel == -1 and p.follows == "lru"
    assert 7 in p.shadows[1].where  # the shadow that missed now holds it
    for _ in range(2):
        p.shadows[1].on_remove(7)
        p._request(7, ctx)
    assert p.psel == -2  # the bound: -limit


def _shifting(seed=10):
    parts = [synthetic_trace(100, seed=seed + i) for i in range(4)]
    ids = np.concatenate([t.ids for t in parts])
    return Trace("shift", ids, None, parts[0].first_layer, np.arange(len(ids)), parts[0].num_experts)


def test_follows_lru_where_popularity_shifts_and_oppclass_on_deepseek(python_trace):
    shift = _shifting()
    cap = int(0.1 * shift.num_layers * shift.num_experts)
    for partition in ("global", "layer"):
        lru = simulate_policy(shift, cap, policy="lru", partition=partition).hit_rate
        opp = simulate_policy(shift, cap, policy="oppclass", partition=partition).hit_rate
        duel = simulate_policy(shift, cap, policy="duel", partition=partition).hit_rate
        assert duel >= lru - 0.005, (partition, duel, lru, opp)
    lru = simulate_policy(python_trace, cap, policy="lru").hit_rate
    opp = simulate_policy(python_trace, cap, policy="oppclass").hit_rate
    duel = simulate_policy(python_trace, cap, policy="duel").hit_rate
    assert duel - lru >= 0.8 * (opp - lru) > 0
