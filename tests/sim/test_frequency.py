"""ClassLRU (expcache_bench/sim/frequency.py) by hand: decayed use counts, classes of counts, cold
inserts first."""

import pytest

from expcache_bench.sim import ClassLRU, Ctx, simulate_lru, simulate_policy

from support.sim_streams import B, D, counters


def test_classlru_prefers_evicting_the_once_used_entry():
    # hl ~ infinite: counts are exact integers.  cap 2, one layer, one call per token:
    # t0 [1] miss -> count 1, class 0;  t1 [1] hit -> count 2, class 1 (last tick 1);
    # t2 [2] miss -> class 0 (last tick 2);  t3 [3]: heads: 2 scores (3-2+1)/1 = 2,
    # 1 scores (3-1+1)/2 = 1.5 -> evict 2 (LRU would evict 1);  t4 [1] hit.
    calls = [D(0, 1), D(0, 1), D(0, 2), D(0, 3), D(0, 1)]
    r = simulate_policy(calls, 2, policy=lambda c: ClassLRU(c, half_life=1e12), check=True)
    assert counters(r) == (2, 3, 3, 0, 0, 1)
    assert counters(simulate_lru(calls, 2)) == (1, 4, 4, 0, 0, 2)


def test_classlru_old_frequent_entry_eventually_goes():
    # Same start; key 1 (class 1, last tick 1) vs a fresh class-0 entry each token.
    # t3 [3]: evict 2 (2 > 1.5); t4 [4]: 3 scores 2/1 = 2, 1 scores 4/2 = 2 -> tie, the
    # lower class wins ties (3 goes); t5 [5]: 4 scores 2, 1 scores 5/2 = 2.5 -> 1 goes.
    calls = [D(0, 1), D(0, 1), D(0, 2), D(0, 3), D(0, 4), D(0, 5), D(0, 1)]
    r = simulate_policy(calls, 2, policy=lambda c: ClassLRU(c, half_life=1e12), check=True)
    assert counters(r) == (1, 6, 6, 0, 0, 4)  # the last [1] misses: 1 was evicted at t5


def test_classlru_decayed_count_and_classes():
    p = ClassLRU(4, half_life=2.0)
    ctx = Ctx()
    key = 7

    def use(token, hit):
        ctx.token = ctx.tick = token
        p.begin(ctx)
        if hit:
            p.on_hit(key, ctx)
        else:
            p.on_insert(key, False, ctx)

    use(0, False)
    assert p.count[key][0] == pytest.approx(1.0) and p.where[key] == 0
    use(2, True)  # 1 * 2^(-2/2) + 1 = 1.5 -> class 0
    assert p.count[key][0] == pytest.approx(1.5) and p.where[key] == 0
    use(2, True)  # 1.5 + 1 = 2.5 -> class 1
    assert p.count[key][0] == pytest.approx(2.5) and p.where[key] == 1
    use(3, True)  # 2.5 * 2^-0.5 + 1 = 2.768 -> class 1
    assert p.count[key][0] == pytest.approx(2.5 * 2**-0.5 + 1) and p.where[key] == 1
    for t in range(4, 10):
        use(t, True)  # converges to 1 / (1 - 2^-0.5) = 3.41 -> class 1
    assert p.where[key] == 1


def test_classlru_cold_insert_goes_first():
    # Batch appends are the first to go even against a once-used decode entry.
    calls = [D(0, 1), B(0, 5), D(0, 2)]
    r = simulate_policy(calls, 2, policy="classlru", check=True)
    assert counters(r) == (0, 3, 2, 1, 0, 1)
    calls2 = calls + [D(0, 1)]  # 1 survived: it was not the victim
    assert simulate_policy(calls2, 2, policy="classlru").hits.sum() == 1
