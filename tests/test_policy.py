"""The library's eviction policies (libexpcache/src/policy/) against their twins in the offline
simulator (expcache_bench/sim/): replaying the same workload, the library's counters equal the
simulator's count for count, per class and path, for every policy and backend. This is what keeps
a policy and its simulator honest (docs/architecture.md, "Where to add")."""

from __future__ import annotations

import pytest

import expcache_bench as bench
from expcache_bench import sim
from expcache_bench.sim import DECODE, simulate_lru, simulate_policy
from pyexpcache import ExpertCache, HostSource, ModelLayout, _lib

from support.cache import SCALE


def test_every_library_policy_has_a_simulator_twin():
    """Each policy of the library's table (libexpcache/src/policy/registry.cpp, read through
    expcache_policy_name into pyexpcache._lib.POLICIES) has its twin under the same name in the
    simulator's registry (expcache_bench/sim/registry.py), which the tests below replay."""
    missing = sorted(set(_lib.POLICIES) - set(sim.POLICIES))
    assert not missing, f"library policies without a simulator twin in expcache_bench/sim/registry.py: {missing}"


def test_a_cache_without_a_policy_runs_the_librarys_default(backend):
    """ExpertCache(policy=None) leaves the policy expcache_config_init fills in: its name is
    _lib.DEFAULT_POLICY (a name of the table), and the cache counts as that policy's twin does."""
    assert _lib.DEFAULT_POLICY in _lib.POLICIES
    layout = ModelLayout.preset("mixed", scale=SCALE)
    with (
        HostSource(layout, pinned=backend == "cuda") as source,
        ExpertCache(layout, source, budget_bytes=layout.total_bytes // 20, backend=backend, log_level=0) as cache,
    ):
        assert cache.policy == _lib.DEFAULT_POLICY
        w = bench.build_workload("decode", ["podA_b_json_full"])
        sim, _, _ = _replay_and_simulate(cache, layout, w, _lib.DEFAULT_POLICY)
        assert cache.stats().total.hits == sim.hits.sum() and cache.stats().total.misses == sim.misses.sum()


def _replay_and_simulate(cache, layout, workload, policy, partition="global"):
    """Replay a workload through the cache, then the same calls through the offline simulator of
    `policy` (its twin of the same name) at the cache's runtime caps, under `partition`."""
    for call in workload.calls:
        if call.kind == DECODE:
            cache.select(call.layer, call.ids)
        else:
            cache.prepare_batch(call.layer, call.ids).finish()
    layer_class = [cache.bind_class(i) if layout[i] else 0 for i in range(layout.num_layers)]
    caps = [c.cap_experts for c in sorted(cache.classes(), key=lambda c: c.index)]
    experts = [layout[i].num_experts if layout[i] else 0 for i in range(layout.num_layers)]
    return (
        simulate_policy(
            workload.calls,
            caps,
            layer_class,
            policy=policy,
            layers=layout.moe_layers,
            partition=partition,
            layer_experts=experts,
        ),
        caps,
        layer_class,
    )


@pytest.mark.parametrize(
    "quant,budget_fraction,first", [("mixed", 0.05, 0), ("mixed", 0.15, 3), ("q2", 0.10, 0), ("q2", 0.05, 3)]
)
def test_simulator_equals_library_counters(backend, make_cache, policy, quant, budget_fraction, first):
    """The library and the offline simulator of the same policy agree count for count, with the
    layers 0-2 that the decode traces never route registered or not."""
    full = ModelLayout.preset(quant, scale=SCALE)
    layout = ModelLayout(tuple(s if i >= first else None for i, s in enumerate(full.layers)), name="registered")
    cache, _ = make_cache(layout, budget_bytes=int(layout.total_bytes * budget_fraction), policy=policy)
    w = bench.build_workload("decode", ["podA_c_python_full", "podA_b_json_full"])
    sim, caps, layer_class = _replay_and_simulate(cache, layout, w, policy)
    for c in cache.stats().classes:
        d = c.paths["decode"]
        i = c.info.index
        assert (d.hits, d.misses, d.evictions, d.direct_loads) == (
            sim.hits[i],
            sim.misses[i],
            sim.evictions[i],
            sim.direct[i],
        )
    assert cache.stats().hit_rate == sim.hit_rate
    if policy == "oppclass":  # and it earns its keep on these traces
        assert sim.hit_rate > simulate_lru(w.calls, caps, layer_class).hit_rate


def test_simulator_equals_library_with_prefill_batches(make_cache, policy):
    layout = ModelLayout.preset("mixed", scale=SCALE)
    cache, _ = make_cache(layout, budget_bytes=layout.total_bytes // 8, policy=policy)
    w = bench.build_workload("prefill", ["podA_b_json_full"])
    sim, _, _ = _replay_and_simulate(cache, layout, w, policy)
    st = cache.stats()
    assert st.total.hits == sim.hits.sum() and st.total.misses == sim.misses.sum()
    assert st.path("batch").appends == sim.appends.sum()
    assert st.path("decode").evictions == sim.evictions.sum()


@pytest.mark.parametrize("partition", ["global", "layer"])
@pytest.mark.parametrize("quant,budget_fraction,first", [("mixed", 0.10, 3), ("q2", 0.25, 0), ("q2", 0.05, 3)])
def test_simulator_equals_library_under_each_partition(make_cache, policy, partition, quant, budget_fraction, first):
    """partition="layer" in the library (each layer its share of its class's cap; a miss of a layer
    holding its share evicts among that layer's slots) and in the simulator (LayerSlots, the same
    shares) agree count for count, per class, for every policy; layers 0-2 registered or not
    (registered, they take shares the traces never use)."""
    full = ModelLayout.preset(quant, scale=SCALE)
    layout = ModelLayout(tuple(s if i >= first else None for i, s in enumerate(full.layers)), name="registered")
    cache, _ = make_cache(layout, budget_bytes=int(layout.total_bytes * budget_fraction), partition=partition)
    assert cache.partition == partition
    w = bench.build_workload("decode", ["podA_c_python_full", "podA_b_json_full"])
    sim, caps, layer_class = _replay_and_simulate(cache, layout, w, policy, partition)
    for c in cache.stats().classes:
        d = c.paths["decode"]
        i = c.info.index
        assert (d.hits, d.misses, d.evictions, d.direct_loads) == (
            sim.hits[i],
            sim.misses[i],
            sim.evictions[i],
            sim.direct[i],
        )
    other = simulate_policy(w.calls, caps, layer_class, policy=policy, layers=layout.moe_layers)
    if partition == "layer":  # the partition is not the global cache under another name
        assert (sim.hits != other.hits).any()


@pytest.mark.parametrize("partition", ["global", "layer"])
def test_prefill_batches_under_each_partition(make_cache, policy, partition):
    """Batches append below a layer's share only, in the library as in the simulator."""
    layout = ModelLayout.preset("mixed", scale=SCALE)
    cache, _ = make_cache(layout, budget_bytes=layout.total_bytes // 8, partition=partition)
    w = bench.build_workload("prefill", ["podA_b_json_full"])
    sim, _, _ = _replay_and_simulate(cache, layout, w, policy, partition)
    st = cache.stats()
    assert st.total.hits == sim.hits.sum() and st.total.misses == sim.misses.sum()
    assert st.path("batch").appends == sim.appends.sum()
    assert st.path("decode").evictions == sim.evictions.sum()


def test_partition_is_checked_before_the_library_sees_it(backend):
    layout = ModelLayout.preset("q2", scale=SCALE)
    with HostSource(layout) as source:
        for bad in ("layers", "", None, 1):
            with pytest.raises(ValueError, match="partition must be one of"):
                ExpertCache(layout, source, budget_experts=4, backend=backend, partition=bad)
