"""Prefetch, hints and the split select, on every backend and policy: what is queued, used,
wasted or cancelled, what a prefetch may never evict, and that every expert served equals its
source bytes. Timing-dependent outcomes are made certain: a paused prefetch thread (the
testing hook) leaves its queue to be cancelled; after wait_prefetch everything queued landed."""

from __future__ import annotations

import numpy as np
import pytest

from pyexpcache import ExpertCache, HostSource, InvalidArgumentError, InvalidStateError, ModelLayout, testing

from support.cache import assert_served


def _first_layer(cache) -> int:
    return next(i for i, spec in enumerate(cache.layout.layers) if spec is not None)


def _resident(cache, layer, ids):
    return [testing.read_expert(cache, layer, e) is not None for e in ids]


def test_a_waited_prefetch_is_served_as_hits(make_cache):
    cache, source = make_cache(budget_experts=16)
    L = _first_layer(cache)
    assert cache.prefetch(L, [5, 6, 7]) == 3
    cache.wait_prefetch()
    assert _resident(cache, L, [5, 6, 7]) == [True] * 3
    ptrs = cache.select(L, [5, 6, 8])
    assert_served(cache, source, L, [5, 6, 8], ptrs)
    d = cache.stats().path("decode")
    assert (d.hits, d.misses) == (2, 1)
    p = cache.prefetch_stats()
    spec = cache.layout[L]
    assert (p.calls, p.issued, p.used, p.wasted, p.cancelled) == (1, 3, 2, 0, 0)
    assert p.bytes_issued == p.bytes_sent == 3 * spec.expert_bytes
    assert p.bytes_used == 2 * spec.expert_bytes
    assert p.pieces >= 3 and p.accuracy == pytest.approx(2 / 3)


def test_a_serving_call_cancels_what_is_still_queued(make_cache):
    cache, source = make_cache(budget_experts=16)
    L = _first_layer(cache)
    testing.pause_prefetch(cache)
    assert cache.prefetch(L, [1, 2, 3]) == 3
    ptrs = cache.select(L, [1, 4])  # pre-empts the queue: 2, 3 freed; 1 a miss the select finishes in place
    testing.pause_prefetch(cache, False)
    assert_served(cache, source, L, [1, 4], ptrs)
    p = cache.prefetch_stats()
    assert (p.issued, p.cancelled, p.used, p.late, p.bytes_sent) == (3, 2, 0, 1, 0)
    assert (p.bytes_used, p.bytes_late_sent) == (0, 0)
    assert cache.stats().path("decode").bytes_h2d == 2 * cache.layout[L].expert_bytes
    assert cache.stats().path("decode").misses == 2
    assert _resident(cache, L, [1, 2, 3, 4]) == [True, False, False, True]
    assert sum(c.resident_experts for c in cache.classes()) == 2


def test_queued_prefetches_are_never_read_as_resident(make_cache):
    cache, source = make_cache(budget_experts=16)
    L = _first_layer(cache)
    testing.pause_prefetch(cache)
    cache.prefetch(L, [9])
    assert testing.read_expert(cache, L, 9) is None  # its slot is taken, its bytes not sent
    testing.pause_prefetch(cache, False)
    cache.wait_prefetch()
    assert (testing.read_expert(cache, L, 9) == source.expert_bytes(L, 9)).all()


def test_resident_ids_are_skipped_and_the_layer_limit_drops_the_rest(make_cache):
    cache, _ = make_cache(budget_experts=32, prefetch_max_per_layer=2)
    L = _first_layer(cache)
    cache.select(L, [0])
    assert cache.prefetch(L, [0, 1, 2, 3, 3]) == 2  # 0 resident, 1 and 2 queued, 3 over the limit
    cache.wait_prefetch()
    p = cache.prefetch_stats()
    assert (p.issued, p.skipped, p.dropped) == (2, 1, 1)
    assert cache.prefetch(L, [4]) == 0  # two of the layer prefetched since its last select
    cache.select(L, [1])  # a select of the layer: a new limit
    assert cache.prefetch(L, [4, 5, 6]) == 2


def test_prefetch_off(make_cache):
    cache, _ = make_cache(budget_experts=8, prefetch_max_per_layer=0)
    L = _first_layer(cache)
    assert cache.prefetch(L, [1, 2]) == 0
    assert cache.prefetch_stats().dropped == 2


@pytest.mark.parametrize("policy", ["lru"])  # which slot is the victim depends on the policy's order
def test_a_prefetch_never_evicts_the_current_or_previous_call(make_cache, policy):
    cache, source = make_cache(budget_experts=4)
    L = _first_layer(cache)
    cache.select(L, [0, 1])
    cache.select(L, [2, 3])  # full; previous call: 0, 1 (protected); current: 2, 3 (protected)
    assert cache.prefetch(L, [4, 5]) == 0
    assert cache.prefetch_stats().dropped == 2
    cache.select(L, [2])  # now 0 and 1 were used two calls ago
    assert cache.prefetch(L, [4, 5, 6]) == 2
    cache.wait_prefetch()
    assert _resident(cache, L, [0, 1, 2, 3, 4, 5]) == [False, False, True, True, True, True]
    ptrs = cache.select(L, [4, 5])
    assert_served(cache, source, L, [4, 5], ptrs)


def test_a_prefetch_never_evicts_what_a_batch_holds(make_cache):
    cache, _ = make_cache(budget_experts=2)
    L = _first_layer(cache)
    with cache.prepare_batch(L, [[0, 1]]):
        cache.select(L, [0])
        cache.select(L, [1])
        cache.select(L, [0])
        assert cache.prefetch(L, [2]) == 0  # both slots held
    cache.select(L, [0])
    cache.select(L, [0])
    assert cache.prefetch(L, [2]) == 1  # 1 is no longer held nor recent


def test_an_unused_prefetch_evicted_is_wasted(make_cache):
    cache, source = make_cache(budget_experts=3)
    L = _first_layer(cache)
    cache.prefetch(L, [7])
    cache.wait_prefetch()
    for ids in ([0], [1], [2], [3]):  # misses evict the coldest first: the unused prefetch
        cache.select(L, ids)
    p = cache.prefetch_stats()
    assert (p.issued, p.used, p.wasted) == (1, 0, 1)
    assert p.bytes_wasted == cache.layout[L].expert_bytes
    assert testing.read_expert(cache, L, 7) is None


def test_release_all_counts_unused_prefetches_as_wasted(make_cache):
    cache, _ = make_cache(budget_experts=8)
    L = _first_layer(cache)
    cache.prefetch(L, [1, 2])
    cache.wait_prefetch()
    cache.release_all()
    p = cache.prefetch_stats()
    assert (p.wasted, p.cancelled) == (2, 0)
    testing.pause_prefetch(cache)
    cache.prefetch(L, [3])
    cache.release_all()  # cancels the queued one before freeing its slot
    assert cache.prefetch_stats().cancelled == 1


def test_prefetch_of_many_pieces_while_selects_run(make_cache):
    """Pieces smaller than an expert, prefetches of the next layer between selects, with and
    without time for them to finish: every expert served equals its source."""
    cache, source = make_cache(budget_experts=24, prefetch_piece_bytes=4096)
    layers = [i for i, s in enumerate(cache.layout.layers) if s is not None][:4]
    rng = np.random.default_rng(3)
    for token in range(30):
        for j, L in enumerate(layers):
            ids = rng.choice(64, size=6, replace=False)
            ptrs = cache.select(L, ids)
            assert_served(cache, source, L, ids, ptrs)
            nxt = layers[(j + 1) % len(layers)]
            cache.prefetch(nxt, rng.choice(64, size=6, replace=False))
            if token % 3 == 0:
                cache.wait_prefetch()
    p = cache.prefetch_stats()
    outstanding = p.issued - p.used - p.late - p.wasted - p.cancelled  # resident, not used yet
    assert p.used > 0 and 0 <= outstanding <= 24
    assert p.bytes_used + p.bytes_late_sent <= p.bytes_sent <= p.bytes_issued


@pytest.mark.parametrize("policy", ["lru"])  # the refresh is visible in LRU's victim
def test_a_hint_refreshes_resident_experts_without_a_copy(make_cache, policy):
    cache, _ = make_cache(budget_experts=2)
    L = _first_layer(cache)
    cache.select(L, [0])
    cache.select(L, [1])
    before = cache.stats().total.bytes_h2d
    cache.hint(L, [0, 5, 0])
    assert cache.stats().total.bytes_h2d == before
    cache.select(L, [2])  # evicts 1, not the hinted 0
    assert _resident(cache, L, [0, 1, 2]) == [True, False, True]
    p = cache.prefetch_stats()
    assert (p.hints, p.hint_refreshes) == (2, 1)


def test_a_hint_on_an_unbound_layer_does_nothing(make_cache):
    cache, _ = make_cache(budget_experts=2)
    L = _first_layer(cache)
    cache.hint(L, [1])
    assert cache.prefetch_stats().hint_refreshes == 0


def test_split_select_says_which_were_resident(make_cache):
    cache, source = make_cache(budget_experts=16)
    L = _first_layer(cache)
    first = cache.select_split(L, [3, 4])
    assert first.resident.tolist() == [False, False] and first.misses.tolist() == [0, 1]
    first.wait()
    assert_served(cache, source, L, [3, 4], first.pointers)
    sel = cache.select_split(L, [4, 9, 3, 9])
    assert sel.resident.tolist() == [True, False, True, False]
    assert sel.hits.tolist() == [0, 2]
    if cache.backend == "host":
        assert sel.ready == 0  # its copies finished before the call returned
    else:
        assert sel.ready != 0
    sel.wait()
    assert_served(cache, source, L, [4, 9, 3, 9], sel.pointers)
    all_hits = cache.select_split(L, [3, 4])
    assert all_hits.ready == 0 and all_hits.resident.all()
    d = cache.stats().path("decode")
    assert (d.calls, d.hits, d.misses) == (3, 4, 3)


def test_split_select_with_overflow(make_cache):
    cache, source = make_cache(budget_experts=2)
    L = _first_layer(cache)
    sel = cache.select_split(L, [0, 1, 2, 3])  # two served from staging
    sel.wait()
    assert_served(cache, source, L, [0, 1, 2, 3], sel.pointers)


def test_wait_ready_refuses_a_foreign_event(make_cache):
    cache, _ = make_cache(budget_experts=2)
    with pytest.raises(InvalidArgumentError, match="not an event of this cache"):
        cache.wait_ready(0x1234)


def test_close_with_prefetches_queued_or_in_flight(make_cache):
    for paused in (True, False):
        cache, _ = make_cache(budget_experts=64, prefetch_piece_bytes=4096)
        L = _first_layer(cache)
        if paused:
            testing.pause_prefetch(cache)
        cache.prefetch(L, list(range(8)))
        cache.close()  # stops the thread; nothing is sent into freed slots
        assert cache.closed


def test_prefetch_arguments_are_checked(make_cache):
    cache, _ = make_cache(budget_experts=2)
    L = _first_layer(cache)
    with pytest.raises(InvalidArgumentError, match="expert id 999"):
        cache.prefetch(L, [1, 999])
    with pytest.raises(ValueError, match="layer must be"):
        cache.prefetch(2**32, [1])
    with pytest.raises(InvalidArgumentError, match="n must be"):
        cache.hint(L, [])
    assert cache.prefetch_stats().issued == 0


def test_prefetch_config_is_checked():
    from pyexpcache import HostSource, ModelLayout

    layout = ModelLayout.preset("q2", scale=4096)
    with HostSource(layout) as source:
        with pytest.raises(InvalidArgumentError, match="prefetch_piece_bytes"):
            ExpertCache(layout, source, budget_experts=2, backend="host", prefetch_piece_bytes=1000)
        with pytest.raises(ValueError, match="prefetch_max_per_layer"):
            ExpertCache(layout, source, budget_experts=2, backend="host", prefetch_max_per_layer=-1)


def test_a_failed_finish_in_place_frees_the_slot(make_cache):
    """The select that lists a queued prefetch sends the rest of its bytes; when that copy fails
    the select fails, the expert is not resident and the prefetch counts as cancelled."""
    from pyexpcache import CudaError

    cache, source = make_cache(budget_experts=8)
    L = _first_layer(cache)
    testing.pause_prefetch(cache)
    cache.prefetch(L, [3])
    testing.fail_copy_after(cache, 0)
    with pytest.raises(CudaError, match="injected copy failure"):
        cache.select(L, [3])
    testing.pause_prefetch(cache, False)
    assert testing.read_expert(cache, L, 3) is None
    p = cache.prefetch_stats()
    assert (p.issued, p.used, p.late, p.cancelled) == (1, 0, 0, 1)
    ptrs = cache.select(L, [3])
    assert_served(cache, source, L, [3], ptrs)


def assert_counted_once(cache, expert_bytes, prefetched_listed):
    """The accounting rule: a prefetched expert a select listed is either a hit and ``used`` (all
    its bytes sent by the prefetch) or a miss and ``late`` (the prefetch's share in
    bytes_late_sent, the rest in the decode path's bytes_h2d), never both; no more bytes count as
    used or late than the prefetch thread sent."""
    p, d = cache.prefetch_stats(), cache.stats().path("decode")
    assert p.used + p.late == prefetched_listed, (p, d)
    assert (p.used, p.bytes_used) == (d.hits, d.hits * expert_bytes), (p, d)
    assert p.late == d.misses, (p, d)
    assert p.bytes_late_sent + d.bytes_h2d == p.late * expert_bytes, (p, d)
    assert p.bytes_used <= p.bytes_sent and p.bytes_used + p.bytes_late_sent <= p.bytes_sent, (p, d)


ISSUE_26 = ModelLayout.preset("q2", scale=256)  # 27,648-byte experts: 14 transfers of 2 KiB each


def _issue_26_runs(backend, runs=20):
    """Fresh caches over one source (made once: it is 300 MB), as the issue's runs were."""
    with HostSource(ISSUE_26, pinned=backend == "cuda") as source:
        for _ in range(runs):
            with ExpertCache(
                ISSUE_26,
                source,
                backend=backend,
                policy="lru",
                log_level=2,
                budget_experts=16,
                prefetch_piece_bytes=4096,
            ) as cache:
                yield cache, source


def test_a_select_racing_its_prefetch_counts_each_expert_once(backend):
    """Issue 26: prefetch(6, [10, 11]); synchronize(); select(6, [10]). The thread has sent all,
    part or none of expert 10 when the select takes the queue back; whichever it was, 10 is a
    hit and used or a miss and late, and the bytes add up."""
    for cache, source in _issue_26_runs(backend):
        assert cache.prefetch(6, [10, 11]) == 2
        cache.synchronize()
        ptrs = cache.select(6, [10])
        assert_served(cache, source, 6, [10], ptrs)
        assert_counted_once(cache, ISSUE_26[6].expert_bytes, 1)


def test_a_select_after_wait_prefetch_is_a_hit_and_the_prefetch_used(backend):
    """Issue 26 with the wait: prefetch(6, [10, 11]); wait_prefetch(); select(6, [10]) is a hit
    and the prefetch of 10 used, in every run."""
    size = ISSUE_26[6].expert_bytes
    for cache, source in _issue_26_runs(backend):
        assert cache.prefetch(6, [10, 11]) == 2
        cache.wait_prefetch()
        assert _resident(cache, 6, [10, 11]) == [True, True]
        ptrs = cache.select(6, [10])
        assert_served(cache, source, 6, [10], ptrs)
        d, p = cache.stats().path("decode"), cache.prefetch_stats()
        assert (d.hits, d.misses, d.bytes_h2d) == (1, 0, 0)
        assert (p.used, p.late, p.bytes_used, p.bytes_sent) == (1, 0, size, 2 * size)
        assert_counted_once(cache, size, 1)


def test_wait_prefetch_while_paused_refuses_and_leaves_the_queue(make_cache):
    cache, source = make_cache(budget_experts=8)
    L = _first_layer(cache)
    cache.wait_prefetch()  # nothing was ever queued
    testing.pause_prefetch(cache)
    cache.wait_prefetch()  # paused, nothing queued: nothing to wait for
    cache.prefetch(L, [2, 3])
    with pytest.raises(InvalidStateError, match="paused.*2 prefetches stay queued"):
        cache.wait_prefetch()
    assert _resident(cache, L, [2, 3]) == [False, False]
    assert cache.prefetch_stats().bytes_sent == 0
    testing.pause_prefetch(cache, False)
    cache.wait_prefetch()
    assert _resident(cache, L, [2, 3]) == [True, True]
    p = cache.prefetch_stats()
    assert (p.issued, p.cancelled, p.bytes_sent) == (2, 0, 2 * cache.layout[L].expert_bytes)
