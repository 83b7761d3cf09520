"""The host pool (``host_budget_bytes``): a tier of pinned host RAM between a pageable or file
source and the device cache, read-through, for the host-side calls' misses and a device select's
feed, ordered by the cache's eviction policy. Every served expert is checked byte for byte against
the source; the tiers' counters against their sum rules: each device miss of such a source is a
pool hit or a source read, and each source read through a pool is entered, failed or read past
it."""

from __future__ import annotations

import contextlib
from collections import OrderedDict

import numpy as np
import pytest

from pyexpcache import ArgumentRangeError, ExpcacheWarning, ExpertCache, GGUFSource, HostSource, ModelLayout, testing

from support.cache import SCALE, assert_served, bank_rows, device_ids, to_numpy

LOOKUPS = ["host", "device"]
_nothing = contextlib.nullcontext


def _layout():
    return ModelLayout.preset("q2", scale=SCALE)


def _slot_bytes(spec):
    """Bytes an expert takes in the pool: each part 64-byte aligned."""
    return sum(-(-b // 64) * 64 for b in spec.class_key)


def _pool_of(spec, slots: int) -> int:
    """A host budget of exactly ``slots`` pool slots of ``spec``'s experts."""
    return slots * _slot_bytes(spec) + 63


@contextlib.contextmanager
def _pooled(layout, layer, *, device_experts: int, pool_slots: int, **options):
    """A pageable source of ``layout`` and a cache of ``device_experts`` slots over a pool of
    ``pool_slots`` of ``layer``'s experts: (source, cache)."""
    with (
        HostSource(layout, pinned=False) as source,
        ExpertCache(
            layout,
            source,
            budget_experts=device_experts,
            host_budget_bytes=_pool_of(layout[layer], pool_slots),
            **options,
        ) as cache,
    ):
        yield source, cache


def _select(cache, source, layer, ids):
    """One select of ``ids`` on either lookup, its experts checked against the source; the slots
    (device) or addresses (host) it gave."""
    if cache.lookup == "device":
        slots = to_numpy(cache.select_device(layer, device_ids(cache, ids)))
        cache.synchronize()
        served = [e for e, s in zip(ids, slots) if s >= 0]
        rows = bank_rows(cache.bank(layer), [s for s in slots if s >= 0])
        assert_served(cache, source, layer, served, rows)
        return slots
    ptrs = cache.select(layer, ids)
    assert_served(cache, source, layer, ids, ptrs)
    return ptrs


def _misses(cache):
    return cache.stats().path("device" if cache.lookup == "device" else "decode").misses


def _check_sums(cache):
    st = cache.stats()
    pool = st.pool
    assert _misses(cache) == pool.hits + pool.source_reads == pool.lookups
    if pool.budget_bytes:
        assert pool.source_reads == pool.inserts + pool.failed + pool.bypassed
        assert pool.resident <= pool.slots
        assert pool.resident == pool.inserts - pool.evictions
    return pool


def _trace(layout, steps, seed=3):
    rng = np.random.default_rng(seed)
    for step in range(steps):
        layer = layout.moe_layers[step % 3]
        yield layer, rng.choice(layout[layer].num_experts, [3, 6, 10, 1][step % 4], replace=False)


@pytest.mark.arrangements
@pytest.mark.parametrize("lookup", LOOKUPS)
@pytest.mark.parametrize("copy_threads", [0, 3])
def test_every_expert_served_through_the_pool_is_the_sources(backend, policy, lookup, copy_threads, bank_arrangement):
    """A trace over three layers, a device cache of 12 experts and a pool of 40 (so both evict):
    every select's experts are the source's bytes, the pool serves some of the device's misses,
    and the counters add up."""
    layout = _layout()
    spec = layout[layout.moe_layers[0]]
    with (
        HostSource(layout, pinned=False) as source,
        ExpertCache(
            layout,
            source,
            budget_experts=12,
            backend=backend,
            lookup=lookup,
            policy=policy,
            copy_threads=copy_threads,
            host_budget_bytes=40 * _slot_bytes(spec),
            bank_arrangement=bank_arrangement,
        ) as cache,
    ):
        for layer, ids in _trace(layout, 40):
            _select(cache, source, layer, ids)
        pool = _check_sums(cache)
        assert pool.slots == 40 and pool.slot_bytes == _slot_bytes(spec)
        assert pool.hits > 0 and pool.evictions > 0 and pool.failed == pool.bypassed == 0
        assert pool.bytes_hit == pool.hits * spec.expert_bytes
        assert pool.bytes_source == pool.source_reads * spec.expert_bytes
        assert cache.stats().path("device" if lookup == "device" else "decode").evictions > 0


@pytest.mark.parametrize("lookup", LOOKUPS)
@pytest.mark.parametrize("file_reads", ["buffered", "direct"])
def test_a_gguf_file_read_through_the_pool(tmp_path, backend, lookup, file_reads):
    """A GGUF file read with pread (through the page cache or O_DIRECT) of two size classes: the
    pool's slots hold the larger experts, every expert served is the file's."""
    pytest.importorskip("gguf", reason="a GGUF file source needs the gguf package")
    from support.gguf_files import Q2_LIKE, Q4, write_model

    path = write_model(tmp_path / "m.gguf", [None, Q2_LIKE, Q4, Q2_LIKE])
    with GGUFSource(path, reads="file") as src:
        layout = src.layout
        biggest = max(_slot_bytes(layout[i]) for i in layout.moe_layers)
        with ExpertCache(
            layout,
            src,
            budget_experts=3,
            backend=backend,
            lookup=lookup,
            file_reads=file_reads,
            host_budget_bytes=64 * biggest,
        ) as cache:
            rng = np.random.default_rng(5)
            for step in range(24):
                layer = layout.moe_layers[step % 3]
                _select(cache, src, layer, rng.choice(layout[layer].num_experts, 3, replace=False))
            pool = _check_sums(cache)
            assert pool.slot_bytes == biggest and pool.hits > 0


@pytest.mark.parametrize("lookup", LOOKUPS)
def test_an_expert_evicted_from_the_device_is_a_pool_hit(backend, lookup):
    """Selected again after the device evicted it, an expert comes from the pool, the source not
    read."""
    layout = _layout()
    layer = layout.moe_layers[0]
    spec = layout[layer]
    with (
        HostSource(layout, pinned=False) as source,
        ExpertCache(
            layout, source, budget_experts=2, backend=backend, lookup=lookup, policy="lru", host_budget_bytes=1 << 20
        ) as cache,
    ):
        for ids in ([0, 1], [2, 3], [0, 1]):
            _select(cache, source, layer, ids)
        pool = _check_sums(cache)
        assert (pool.hits, pool.source_reads, pool.inserts, pool.resident) == (2, 4, 4, 4)
        assert (pool.bytes_hit, pool.bytes_source) == (2 * spec.expert_bytes, 4 * spec.expert_bytes)
        assert _misses(cache) == 6
        cache.reset_stats()
        st = cache.pool_stats()
        assert (st.hits, st.source_reads, st.inserts) == (0, 0, 0) and st.resident == 4


def _pool_trace(cache, source, layer, experts):
    """One select per expert of ``experts``: whether the pool served it ("hit"), it was read
    from the source ("read") or the device cache held it ("device")."""
    seen = []
    for e in experts:
        before = cache.pool_stats()
        _select(cache, source, layer, [e])
        after = cache.pool_stats()
        seen.append(
            "hit" if after.hits > before.hits else "read" if after.source_reads > before.source_reads else "device"
        )
    return seen


@pytest.mark.parametrize("lookup", LOOKUPS)
@pytest.mark.parametrize("policy", ["lru"])
def test_a_full_pool_evicts_its_least_recently_used(backend, lookup, policy):
    """A pool of two experts under a device cache of one, under LRU: a pool hit refreshes its
    expert, a pool miss evicts the least recently used one, which is read from the source again."""
    layout = _layout()
    layer = layout.moe_layers[0]
    pooled = _pooled(layout, layer, device_experts=1, pool_slots=2, backend=backend, lookup=lookup, policy=policy)
    with pooled as (source, cache):
        seen = _pool_trace(cache, source, layer, (0, 1, 0, 2, 1, 0))
        # 0, 1 read; 0 a hit (now the most recent); 2 evicts 1; 1 read again, evicting 0; 0 read.
        assert seen == ["read", "read", "hit", "read", "read", "read"]
        pool = _check_sums(cache)
        assert (pool.slots, pool.resident, pool.evictions) == (2, 2, 3)


def _lru_tiers(experts, device_slots, pool_slots, pool_recency=True):
    """Two LRU tiers of single-expert requests, modelled: per request "device" (a device hit),
    "hit" (a pool hit) or "read" (from the source, entered into the pool); the pool's evictions.
    ``pool_recency`` False: a pool hit leaves its expert where it was (the pool is FIFO)."""
    device, pool, seen, evictions = OrderedDict(), OrderedDict(), [], 0
    for e in experts:
        if e in device:
            device.move_to_end(e)
            seen.append("device")
            continue
        if len(device) == device_slots:
            device.popitem(last=False)
        device[e] = True
        if e in pool:
            if pool_recency:
                pool.move_to_end(e)
            seen.append("hit")
            continue
        if len(pool) == pool_slots:
            pool.popitem(last=False)
            evictions += 1
        pool[e] = True
        seen.append("read")
    return seen, evictions


def _requests(num_experts, steps, seed, repeats=True):
    """``steps`` random experts of ``num_experts``; with ``repeats`` False none follows itself."""
    rng = np.random.default_rng(seed)
    experts = [int(e) for e in rng.integers(0, num_experts, steps)]
    return experts if repeats else [e for i, e in enumerate(experts) if i == 0 or e != experts[i - 1]]


@pytest.mark.parametrize("lookup", LOOKUPS)
@pytest.mark.parametrize("policy", ["lru"])
def test_under_lru_the_pool_is_an_lru_of_its_slots(backend, lookup, policy):
    """Under LRU, a device cache of two experts over a pool of three: every select's outcome
    (device hit, pool hit, source read) and the pool's counters are those of two LRU tiers of
    that many slots, modelled in Python."""
    layout = _layout()
    layer = layout.moe_layers[0]
    experts = _requests(7, 80, seed=7)
    want, evictions = _lru_tiers(experts, device_slots=2, pool_slots=3)
    # The trace exercises all three outcomes, and a pool hit's refresh changes them.
    assert 0 < want.count("hit") and 0 < want.count("device") and evictions > 0
    assert want != _lru_tiers(experts, device_slots=2, pool_slots=3, pool_recency=False)[0]
    pooled = _pooled(layout, layer, device_experts=2, pool_slots=3, backend=backend, lookup=lookup, policy=policy)
    with pooled as (source, cache):
        assert _pool_trace(cache, source, layer, experts) == want
        pool = _check_sums(cache)
        assert (pool.slots, pool.hits, pool.source_reads) == (3, want.count("hit"), want.count("read"))
        assert (pool.inserts, pool.evictions, pool.resident) == (want.count("read"), evictions, 3)


def test_the_pool_orders_as_the_caches_policy_orders_a_device_cache(backend, policy):
    """The pool's order is the cache's policy: a pool of three slots under a device cache of one,
    whose every select misses the device, sees what a device cache of three sees, with the same
    clock (a host-side call each), so its hits are that cache's, under every policy."""
    layout = _layout()
    layer = layout.moe_layers[0]
    experts = _requests(8, 120, seed=7, repeats=False)
    with HostSource(layout, pinned=False) as source:
        with ExpertCache(layout, source, budget_experts=3, backend=backend, policy=policy) as device:
            want = []
            for e in experts:
                before = device.stats().path("decode").hits
                _select(device, source, layer, [e])
                want.append("hit" if device.stats().path("decode").hits > before else "read")
        with ExpertCache(
            layout,
            source,
            budget_experts=1,
            backend=backend,
            policy=policy,
            host_budget_bytes=_pool_of(layout[layer], 3),
        ) as cache:
            assert _pool_trace(cache, source, layer, experts) == want
            pool = _check_sums(cache)
            assert pool.hits == want.count("hit") > 0 and pool.evictions > 0


@pytest.mark.parametrize("lookup", LOOKUPS)
@pytest.mark.parametrize("policy,last", [("lru", "read"), ("oppclass", "hit")])
def test_the_pools_victim_is_the_policys(backend, lookup, policy, last):
    """The sequence of the LRU test above under OppClassLRU: expert 0, used twice, is in a higher
    class than 1 and 2, used once, so 2 evicts 1 and 1 evicts 2, and 0 is a pool hit at the end
    (LRU evicted it)."""
    layout = _layout()
    layer = layout.moe_layers[0]
    pooled = _pooled(layout, layer, device_experts=1, pool_slots=2, backend=backend, lookup=lookup, policy=policy)
    with pooled as (source, cache):
        assert _pool_trace(cache, source, layer, (0, 1, 0, 2, 1, 0)) == ["read", "read", "hit", "read", "read", last]


def test_a_slot_being_read_is_never_evicted(backend, policy):
    """A pool of two slots, one select of four misses: the first two are filled and stay pinned
    until the call's uploads have read them, so the other two find no slot free of readers and
    are read past the pool (nothing evicted), under every policy. The next call evicts."""
    layout = _layout()
    layer = layout.moe_layers[0]
    with _pooled(layout, layer, device_experts=4, pool_slots=2, backend=backend, policy=policy) as (source, cache):
        _select(cache, source, layer, [0, 1, 2, 3])
        pool = _check_sums(cache)
        assert (pool.slots, pool.inserts, pool.bypassed, pool.evictions, pool.resident) == (2, 2, 2, 0, 2)
        _select(cache, source, layer, [4])
        pool = _check_sums(cache)
        assert (pool.inserts, pool.bypassed, pool.evictions, pool.resident) == (3, 2, 1, 2)


def test_a_failed_read_is_not_entered_into_the_pool_host(tmp_path, backend, policy):
    """A host-side select whose file ends early fails; the expert that could not be read is
    neither resident nor in the pool (counted failed), the one read before it is both (its bytes
    are whole). Once the file is whole, the failed expert is read from the file again."""
    from pyexpcache import SourceIOError

    pytest.importorskip("gguf", reason="a GGUF file source needs the gguf package")
    from support.gguf_files import end_early, shrinking_model

    path, whole = shrinking_model(tmp_path)
    with GGUFSource(path, reads="file") as src:
        layout = src.layout
        last = layout.moe_layers[-1]
        with ExpertCache(
            layout, src, budget_experts=8, backend=backend, log_level=0, policy=policy, host_budget_bytes=1 << 20
        ) as cache:
            end_early(path, src, last, 4)  # experts 4-7 of `last` end early
            with pytest.raises(SourceIOError, match="ended early"):
                cache.select(last, [2, 6, 3])
            pool = cache.pool_stats()
            assert (pool.failed, pool.inserts, pool.resident) == (1, 1, 1)  # 2 read and entered; 6 failed
            assert testing.read_expert(cache, last, 6) is None
            assert (testing.read_expert(cache, last, 2) == src.expert_bytes(last, 2)).all()
            path.write_bytes(whole)
            _select(cache, src, last, [2, 6, 3])  # 2 a device hit; 6 and 3 read from the file
            pool = cache.pool_stats()
            assert (pool.hits, pool.source_reads, pool.failed, pool.inserts, pool.resident) == (0, 4, 1, 3, 3)


def test_a_failed_read_is_not_entered_into_the_pool_device(tmp_path, backend, policy):
    """A fed select whose file ends early gives the failed expert slot -1 and leaves it out of the
    pool; once the file is whole the next select reads it from the file, and it is byte-exact."""
    pytest.importorskip("gguf", reason="a GGUF file source needs the gguf package")
    from support.gguf_files import end_early, shrinking_model

    path, whole = shrinking_model(tmp_path)
    with GGUFSource(path, reads="file") as src:
        layout = src.layout
        last = layout.moe_layers[-1]
        with ExpertCache(
            layout, src, budget_experts=2, backend=backend, lookup="device", policy=policy, host_budget_bytes=1 << 20
        ) as cache:
            cache.bank(last)
            end_early(path, src, last, 4)
            with pytest.warns(ExpcacheWarning, match=f"expert 6 of layer {last}.*slot -1"):
                got = to_numpy(cache.select_device(last, device_ids(cache, [6, 2])))
                cache.synchronize()
            assert got[0] == -1 and got[1] >= 0
            pool = cache.pool_stats()
            assert (pool.source_reads, pool.failed, pool.inserts, pool.resident) == (2, 1, 1, 1)
            path.write_bytes(whole)
            _select(cache, src, last, [6, 0])  # 6 read from the file; evicts 2 from the device
            _select(cache, src, last, [2])  # from the pool
            pool = cache.pool_stats()
            assert (pool.hits, pool.source_reads, pool.failed, pool.inserts) == (1, 4, 1, 3)


@pytest.mark.parametrize("lookup", LOOKUPS)
def test_a_pool_smaller_than_an_expert_reads_past_it(backend, lookup):
    """A budget below one expert: no slot, every read goes past the pool (bypassed), served
    exactly; with no pool the source reads are counted all the same."""
    layout = _layout()
    layer = layout.moe_layers[0]
    for budget in (64, 0):
        warns = pytest.warns(ExpcacheWarning, match="in the host pool, more than 64 B") if budget else _nothing()
        with (
            HostSource(layout, pinned=False) as source,
            warns,
            ExpertCache(
                layout, source, budget_experts=2, backend=backend, lookup=lookup, host_budget_bytes=budget
            ) as cache,
        ):
            for ids in ([0, 1], [2, 3], [0, 1]):
                _select(cache, source, layer, ids)
            pool = _check_sums(cache)
            assert (pool.budget_bytes, pool.slots, pool.hits, pool.source_reads) == (budget, 0, 0, 6)
            assert pool.bypassed == (6 if budget else 0)


def test_a_pinned_source_does_not_use_the_pool(backend):
    """The GPU reads a pinned source itself: nothing goes through the pool."""
    layout = _layout()
    with (
        HostSource(layout, pinned=True) as source,
        ExpertCache(layout, source, budget_experts=2, backend=backend, host_budget_bytes=1 << 20) as cache,
    ):
        layer = layout.moe_layers[0]
        for ids in ([0, 1], [2, 3], [0, 1]):
            _select(cache, source, layer, ids)
        pool = cache.pool_stats()
        assert (pool.hits, pool.source_reads, pool.slots) == (0, 0, 0)


@pytest.mark.parametrize(
    "value,error,match",
    [
        (-1, ArgumentRangeError, r"host_budget_bytes must be in \[0, 281474976710656\], got -1"),
        ((1 << 48) + 1, ArgumentRangeError, "host_budget_bytes must be in"),
        (1 << 64, ArgumentRangeError, "host_budget_bytes must be in"),
        (1.5, TypeError, "host_budget_bytes must be an integer"),
        (True, TypeError, "host_budget_bytes must be an integer, got a bool"),
    ],
)
def test_a_bad_host_budget_is_refused(value, error, match):
    layout = _layout()
    with HostSource(layout, pinned=False) as source:
        with pytest.raises(error, match=match):
            ExpertCache(layout, source, budget_experts=2, backend="host", host_budget_bytes=value)


def test_an_unregistered_layer_leaves_the_pool(backend, policy):
    """A layer unregistered and registered again (its source may have changed) is read from the
    source again, not from the pool."""
    layout = _layout()
    layer = layout.moe_layers[0]
    with (
        HostSource(layout, pinned=False) as source,
        ExpertCache(
            layout, source, budget_experts=2, backend=backend, policy=policy, host_budget_bytes=1 << 20
        ) as cache,
    ):
        _select(cache, source, layer, [0, 1])
        assert cache.pool_stats().resident == 2
        cache._call("expcache_layer_unregister", layer)
        assert cache.pool_stats().resident == 0


@pytest.mark.parametrize("lookup", LOOKUPS)
def test_a_file_read_with_o_direct_stays_out_of_the_page_cache_through_the_pool(tmp_path, backend, lookup):
    """file_reads="direct": the pool's fills are O_DIRECT reads too (the host path's through a
    bounce buffer, the feed's in place), so serving from a dropped file leaves none of it in the
    page cache, and every expert served is the file's."""
    from expcache_bench.disk import direct_allowed
    from expcache_bench.file_source import FileSource

    layout = _layout()
    with FileSource(layout, directory=str(tmp_path)) as src:
        if not direct_allowed(src.path):
            pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT")
        src.drop_page_cache()
        assert src.page_cache_fraction() == 0.0
        with ExpertCache(
            layout,
            src,
            budget_experts=12,
            backend=backend,
            lookup=lookup,
            file_reads="direct",
            host_budget_bytes=64 * max(_slot_bytes(layout[i]) for i in layout.moe_layers),
        ) as cache:
            for layer, ids in _trace(layout, 24):  # unchecked: a check reads the file (its mapping)
                if lookup == "device":
                    cache.select_device(layer, device_ids(cache, ids))
                else:
                    cache.select(layer, ids)
            cache.synchronize()
            pool = _check_sums(cache)
            assert pool.inserts > 0 and pool.hits > 0
            assert src.page_cache_fraction() == 0.0
            for layer, ids in _trace(layout, 6, seed=4):  # now the bytes, through the pool
                _select(cache, src, layer, ids)
            assert _check_sums(cache).hits > pool.hits


def _phased_tokens(tokens, layers, seed):
    """(token's steps) for ``tokens`` tokens: each visits some of ``layers`` in order (at least
    one), one expert of each, of eight; the popular experts change at the middle, so a count's
    decay and an entry's age decide what stays."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(tokens):
        hot = (0, 1, 2) if t < tokens // 2 else (5, 6, 7)
        visited = [layer for layer in layers if rng.random() < 0.7] or [layers[0]]
        out.append([(layer, int(rng.choice(hot) if rng.random() < 0.8 else rng.integers(8))) for layer in visited])
    return out


def _pool_outcomes(cache, source, steps):
    """Each step (layer, expert, how) served by a host-side select (how "host") or a device select
    ("device"): whether the pool served it ("hit"), it was read from the source ("read") or the
    device cache held it ("device")."""
    seen = []
    for layer, e, how in steps:
        before = cache.pool_stats()
        if how == "device":
            slots = to_numpy(cache.select_device(layer, device_ids(cache, [e])))
            cache.synchronize()
            assert_served(cache, source, layer, [e], bank_rows(cache.bank(layer), slots))
        else:
            assert_served(cache, source, layer, [e], cache.select(layer, [e]))
        after = cache.pool_stats()
        seen.append(
            "hit" if after.hits > before.hits else "read" if after.source_reads > before.source_reads else "device"
        )
    return seen


@pytest.mark.parametrize("policy", ["oppclass", "duel"])
@pytest.mark.parametrize("mix", ["device", "mixed"])
def test_device_selects_time_the_pool_as_host_side_calls_do(backend, policy, mix):
    """The pool's policy clock under device selects is the select's: a device cache of one slot
    over a pool of four, tokens over three layers whose popular experts change halfway, so
    OppClassLRU's counts must decay and its entries age. Served by device selects alone, or
    device selects and host-side ones mixed at random on the same cache, every step's outcome is
    the one host-side calls of a host-lookup cache get, whose clock the calls set."""
    layout = _layout()
    layers = layout.moe_layers[:3]
    rng = np.random.default_rng(11)
    steps = [
        (layer, e, "device" if mix == "device" or rng.random() < 0.5 else "host")
        for token in _phased_tokens(160, layers, seed=5)
        for layer, e in token
    ]
    options = dict(device_experts=1, pool_slots=4, backend=backend, policy=policy)
    with _pooled(layout, layers[0], lookup="host", **options) as (source, cache):
        want = _pool_outcomes(cache, source, [(layer, e, "host") for layer, e, _ in steps])
    assert want.count("hit") > 50 and want.count("read") > 50
    with _pooled(layout, layers[0], lookup="device", **options) as (source, cache):
        assert _pool_outcomes(cache, source, steps) == want
        pool = cache.pool_stats()
        assert (pool.hits, pool.source_reads) == (want.count("hit"), want.count("read"))
        assert (pool.resident, pool.evictions) == (4, pool.inserts - 4)
