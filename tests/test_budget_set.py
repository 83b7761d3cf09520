"""The budgets and the reserve of a live cache (``set_budget``, ``set_reserve``; C: expcache_budget_set,
expcache_reserve_set): the caps recomputed as a new cache computes them, a shrink that evicts
exactly the policy's victims (those its simulator twin picks after the same calls), keeps every
other resident byte for byte and gives the bank's memory past the new cap back at the same base
address, a grow that lets more experts stay; on both lookups."""

from __future__ import annotations

import gc
import random

import pytest

from expcache_bench.sim.calls import DECODE, KEY_SHIFT, Call, check_classes
from expcache_bench.sim.driver import ClassSlots, prepare, replay
from expcache_bench.sim.registry import make_policy
from pyexpcache import (
    ArgumentRangeError,
    CacheClosedError,
    ExpcacheWarning,
    ExpertCache,
    HostSource,
    InvalidArgumentError,
    InvalidStateError,
    ModelLayout,
    testing,
)

from support.cache import SCALE, assert_served, bank_rows, device_ids, to_numpy

#: Every test here that makes its caches through make_cache runs against both bank arrangements.
pytestmark = pytest.mark.arrangements

LOOKUPS = ["host", "device"]
EXPERTS = 20  # the experts of each layer the calls below use


def _make(make_cache, lookup, **kwargs):
    # One slot per mapped piece (slab_bytes below a slot), so a shrink gives back exactly its slots.
    kwargs.setdefault("slab_bytes", 1)
    return make_cache(lookup=lookup, **({"pinned": True} if lookup == "device" else {}), **kwargs)


def _calls(layout, tokens=12, seed=5):
    """Decode calls of 3 experts over the first 4 MoE layers, token by token."""
    rng = random.Random(seed)
    return [
        Call(DECODE, layer, rng.sample(range(EXPERTS), 3)) for _ in range(tokens) for layer in layout.moe_layers[:4]
    ]


def _replay(cache, calls):
    for call in calls:
        cache.select(call.layer, list(call.ids))


def _resident(cache, layers, experts=EXPERTS):
    """The (layer, expert) of `layers` resident now, among their first `experts` experts."""
    return {(layer, e) for layer in layers for e in range(experts) if testing.read_expert(cache, layer, e) is not None}


def _twin_victims(layout, calls, cap, policy, n):
    """The first n victims of `policy`'s simulator twin (expcache_bench/sim, which counts as the
    library does: tests/test_policy.py) after the same calls at cap `cap`, as (layer, expert)."""
    prepared = prepare(calls, None, None, layout.moe_layers)
    caps, classes = check_classes(prepared.stream, [cap], [0] * layout.num_layers)
    twin = make_policy(policy)(caps[0])
    replay(prepared, ClassSlots(caps, classes, [twin]))
    out = []
    for _ in range(n):
        key = twin.victim(lambda k: True)
        twin.on_remove(key)
        out.append((key >> KEY_SHIFT, key & ((1 << KEY_SHIFT) - 1)))
    return out


def _gate_base(cache, layer):
    bank = cache.bank(layer)
    base = bank.gate.ptr
    del bank  # its views would keep the bank mapped
    gc.collect()
    return base


@pytest.mark.parametrize("lookup", LOOKUPS)
def test_shrink_evicts_the_policys_victims(make_cache, policy, lookup):
    """A full class of 40 set to 30: the 10 experts gone are the twin's first 10 victims after the
    same calls; the other 30 keep their bytes; the class has 30 slots, 10 evictions on the control
    path, 10 slots' memory less, and its bank at the same address."""
    cache, source = _make(make_cache, lookup, budget_experts=40)
    calls = _calls(cache.layout)
    _replay(cache, calls)
    layers = cache.layout.moe_layers[:4]
    before = _resident(cache, layers)
    assert len(before) == 40
    base, used = _gate_base(cache, layers[0]), testing.device_bytes_in_use(cache)
    slot_bytes = cache.classes()[0].slot_bytes
    cache.set_budget(budget_experts=30)
    after = _resident(cache, layers)
    assert after <= before
    assert sorted(before - after) == sorted(_twin_victims(cache.layout, calls, 40, policy, 10))
    for layer, e in after:
        assert (testing.read_expert(cache, layer, e) == source.expert_bytes(layer, e)).all()
    info = cache.classes()[0]
    assert (info.target_experts, info.cap_experts, info.allocated_experts, info.resident_experts) == (30, 30, 30, 30)
    assert cache.stats().path("control").evictions == 10
    assert _gate_base(cache, layers[0]) == base
    if cache.backend == "host":  # a piece per slot; a GPU's pieces are 2 MiB granules of several slots
        assert testing.device_bytes_in_use(cache) == used - 10 * slot_bytes
    assert testing.device_bytes_in_use(cache) <= used
    # It serves on, within the new cap: 3 new experts each take a victim's slot.
    layer = layers[1]
    ptrs = cache.select(layer, [EXPERTS, EXPERTS + 1, EXPERTS + 2])
    assert_served(cache, source, layer, [EXPERTS, EXPERTS + 1, EXPERTS + 2], ptrs)
    assert cache.classes()[0].resident_experts == 30


def test_device_selects_after_a_shrink_stay_below_the_cap(make_cache, policy):
    """On a device-lookup cache the device's residency shrinks with the bank: a device select
    afterwards finds every survivor where the shrink left it, and fills its misses only into slots
    below the new cap (the rows past it are pinned)."""
    cache, source = _make(make_cache, "device", budget_experts=16)
    layer = cache.layout.moe_layers[0]
    for step in ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15], [0, 5, 10, 15]):
        cache.select_device(layer, device_ids(cache, step))
    cache.set_budget(budget_experts=6)
    kept = sorted(e for e in range(16) if testing.read_expert(cache, layer, e) is not None)
    assert len(kept) == 6
    slots = to_numpy(cache.select_device(layer, device_ids(cache, kept[:3] + [30, 31, 32])))
    assert all(0 <= s < 6 for s in slots)
    assert_served(cache, source, layer, kept[:3] + [30, 31, 32], bank_rows(cache.bank(layer), slots))
    assert cache.stats().path("device").hits >= 3


@pytest.mark.parametrize("lookup", LOOKUPS)
def test_grow_lets_more_experts_stay(make_cache, policy, lookup):
    """A class of 8 grown to 16 keeps its 8 residents; the 12 experts that thrashed it before all
    stay resident now, with no eviction."""
    cache, source = _make(make_cache, lookup, budget_experts=8)
    layer = cache.layout.moe_layers[0]
    ids = list(range(12))
    cache.select(layer, ids)
    before = _resident(cache, [layer])
    assert len(before) == 8
    cache.set_budget(budget_experts=16)
    assert _resident(cache, [layer]) == before
    for _, e in before:
        assert (testing.read_expert(cache, layer, e) == source.expert_bytes(layer, e)).all()
    evictions = cache.stats().path("decode").evictions
    cache.select(layer, ids)
    assert cache.stats().path("decode").evictions == evictions
    assert _resident(cache, [layer]) == {(layer, e) for e in ids}
    info = cache.classes()[0]
    assert (info.target_experts, info.cap_experts) == (16, 16)


@pytest.mark.parametrize("lookup", LOOKUPS)
def test_budget_bytes_caps_equal_a_new_caches(make_cache, policy, lookup):
    """After set_budget(budget_bytes=...) each class of a mixed layout has the target and cap a
    cache made with that budget computes."""
    layout = ModelLayout.preset("mixed", scale=SCALE)
    cache, _ = _make(make_cache, lookup, layout=layout, budget_experts=4)
    fresh, _ = _make(make_cache, lookup, layout=layout, budget_bytes=layout.total_bytes // 10)
    for c in (cache, fresh):
        for layer in (0, 40):
            c.select(layer, [1, 2, 3])
    cache.set_budget(budget_bytes=layout.total_bytes // 10)
    got = [(i.key, i.target_experts, i.cap_experts) for i in cache.classes()]
    assert got == [(i.key, i.target_experts, i.cap_experts) for i in fresh.classes()]
    assert all(cap > 4 for _, _, cap in got)


@pytest.mark.parametrize("lookup", LOOKUPS)
def test_reserve_past_all_memory_empties_the_classes_and_back(make_cache, policy, lookup):
    """A reserve no device can leave takes every class to cap 0 (its slots and their memory gone,
    its experts served from the bank's staging rows, byte for byte); the default reserve again
    lets the class grow back to its budget."""
    cache, source = _make(make_cache, lookup, budget_experts=8)
    layer = cache.layout.moe_layers[0]
    cache.select(layer, list(range(8)))
    used = testing.device_bytes_in_use(cache)
    with pytest.warns(ExpcacheWarning, match="cap 0 experts, nothing of this class will be cached"):
        cache.set_reserve(1 << 62)
    info = cache.classes()[0]
    assert (info.target_experts, info.cap_experts, info.allocated_experts, info.resident_experts) == (8, 0, 0, 0)
    assert cache.stats().path("control").evictions == 8
    assert testing.device_bytes_in_use(cache) < used
    assert_served(cache, source, layer, [1, 2, 3], cache.select(layer, [1, 2, 3]))
    assert cache.stats().path("decode").direct_loads == 3
    cache.set_reserve(1 << 30)
    assert cache.classes()[0].cap_experts == 8
    assert_served(cache, source, layer, [1, 2, 3], cache.select(layer, [1, 2, 3]))
    assert _resident(cache, [layer]) == {(layer, 1), (layer, 2), (layer, 3)}


@pytest.mark.parametrize("lookup", LOOKUPS)
def test_reserve_gives_memory_back_by_its_step(make_cache, backend, policy, lookup):
    """A reserve that leaves the full class of 24 less than its memory shrinks it (by some slots:
    the emulated device's free memory is not read here); 5 slots more of reserve then shrink it by
    exactly 5, their memory given back, the rest kept byte for byte; lowered to 0, the class grows
    back to its budget. The host backend's emulated capacity is what the reserve is sized by."""
    if backend != "host":
        pytest.skip("sized by the host backend's emulated device capacity")
    capacity = 1 << 26
    cache, source = _make(make_cache, lookup, budget_experts=24, reserve_bytes=0, device_capacity_bytes=capacity)
    layer = cache.layout.moe_layers[0]
    cache.select(layer, list(range(24)))
    slot_bytes = cache.classes()[0].slot_bytes
    reserve = capacity - testing.device_bytes_in_use(cache) + 2 * slot_bytes
    cache.set_reserve(reserve)
    first = cache.classes()[0].cap_experts
    assert 5 < first < 24
    before, used = _resident(cache, [layer], 24), testing.device_bytes_in_use(cache)
    assert len(before) == first
    cache.set_reserve(reserve + 5 * slot_bytes)
    left = _resident(cache, [layer], 24)
    assert left <= before and len(left) == first - 5
    for _, e in left:
        assert (testing.read_expert(cache, layer, e) == source.expert_bytes(layer, e)).all()
    info = cache.classes()[0]
    assert (info.target_experts, info.cap_experts, info.allocated_experts) == (24, first - 5, first - 5)
    assert testing.device_bytes_in_use(cache) == used - 5 * slot_bytes
    cache.set_reserve(0)
    assert cache.classes()[0].cap_experts == 24
    cache.select(layer, list(range(24)))
    assert _resident(cache, [layer], 24) == {(layer, e) for e in range(24)}


@pytest.mark.parametrize("lookup", LOOKUPS)
def test_shrink_waits_for_open_batches(make_cache, policy, lookup):
    """A class that must shrink while a prefill batch holds its slots is refused, nothing changed;
    a grow is not; once the batch is finished the shrink goes through."""
    cache, _ = _make(make_cache, lookup, budget_experts=8)
    layer = cache.layout.moe_layers[0]
    cache.select(layer, list(range(8)))
    before = _resident(cache, [layer])
    batch = cache.prepare_batch(layer, [[1, 2, 3]])
    with pytest.raises(InvalidStateError, match="unfinished prefill batches hold"):
        cache.set_budget(budget_experts=4)
    assert _resident(cache, [layer]) == before
    assert cache.classes()[0].cap_experts == 8
    assert cache.stats().path("control").evictions == 0
    cache.set_budget(budget_experts=10)
    assert cache.classes()[0].cap_experts == 10
    batch.finish()
    cache.set_budget(budget_experts=4)
    assert len(_resident(cache, [layer])) == 4


def test_bad_budgets_are_refused(make_cache):
    """Neither budget, a value outside uint64 or not an integer: refused before anything changes
    (the library's message for the first, Python's range checks for the others); a closed cache
    raises CacheClosedError."""
    cache, _ = make_cache(budget_experts=8)
    with pytest.raises(InvalidArgumentError, match="set budget_experts or budget_bytes"):
        cache.set_budget()
    with pytest.raises(ArgumentRangeError, match="budget_bytes"):
        cache.set_budget(budget_bytes=-1)
    with pytest.raises(ArgumentRangeError, match="budget_experts"):
        cache.set_budget(budget_experts=1 << 64)
    with pytest.raises(ArgumentRangeError, match="reserve_bytes"):
        cache.set_reserve(-1)
    with pytest.raises(TypeError, match="reserve_bytes"):
        cache.set_reserve(1.5)
    layer = cache.layout.moe_layers[0]
    cache.select(layer, [1])
    assert cache.classes()[0].target_experts == 8
    cache.close()
    for call in (lambda: cache.set_budget(budget_experts=4), lambda: cache.set_reserve(0)):
        with pytest.raises(CacheClosedError):
            call()


def test_a_new_budget_is_the_one_in_force_for_later_layers(backend):
    """A class bound after set_budget takes its cap from the new budget, as at construction."""
    layout = ModelLayout.preset("mixed", scale=SCALE)
    with (
        HostSource(layout, pinned=backend == "cuda") as source,
        ExpertCache(layout, source, budget_experts=4, backend=backend, log_level=0) as cache,
    ):
        cache.select(0, [1])
        cache.set_budget(budget_experts=9)
        cache.select(40, [1])  # the q4 class is bound now
        assert sorted(i.cap_experts for i in cache.classes()) == [9, 9]
