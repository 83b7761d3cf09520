"""Every policy in the device lookup (``ExpertCache(lookup="device")``; libexpcache/src/kernels/
lookup_rules.hpp): the device selects' counters equal the offline simulator's twin of the cache's
policy (expcache_bench/sim/) count for count on the bundled traces, as the host select's do
(tests/test_policy.py); the host-side serving calls run on the device's state as the host-lookup
cache's policy runs them; the control calls keep working. On the host backend the device lookup
runs the rules the CUDA kernel runs (the same source); on a GPU these tests run the kernel
itself."""

from __future__ import annotations

import numpy as np
import pytest

import expcache_bench as bench
from expcache_bench.sim import DECODE, simulate_policy
from pyexpcache import ExpertCache, HostSource, ModelLayout, UnsupportedError, testing

from support.cache import SCALE, assert_served, bank_rows, device_ids

DEVICE_STATE_POLICIES = ["duel", "oppclass"]  # whose state only the device lookup keeps


def _registered(quant: str, first: int) -> ModelLayout:
    full = ModelLayout.preset(quant, scale=SCALE)
    return ModelLayout(tuple(s if i >= first else None for i, s in enumerate(full.layers)), name="registered")


def _replay_device(cache, workload) -> None:
    for call in workload.calls:
        assert call.kind == DECODE
        cache.select_device(call.layer, device_ids(cache, call.ids))


def _twin(cache, layout, workload, policy):
    layer_class = [cache.bind_class(i) if layout[i] else 0 for i in range(layout.num_layers)]
    caps = [c.cap_experts for c in sorted(cache.classes(), key=lambda c: c.index)]
    return simulate_policy(workload.calls, caps, layer_class, policy=policy, layers=layout.moe_layers)


@pytest.mark.parametrize("policy", ["duel", "oppclass", "lru"])
@pytest.mark.parametrize(
    "quant,budget_fraction,first", [("mixed", 0.05, 0), ("mixed", 0.15, 3), ("q2", 0.10, 0), ("q2", 0.25, 3)]
)
def test_device_lookup_equals_the_simulator_twin(make_cache, policy, quant, budget_fraction, first):
    """select_device's counters (path "device") equal the twin's per class, hit for hit, on two
    bundled traces, with the layers the traces never route registered or not (they shift every
    layer's position in the policy clock)."""
    layout = _registered(quant, first)
    cache, _ = make_cache(layout, budget_bytes=int(layout.total_bytes * budget_fraction), lookup="device", pinned=True)
    assert cache.policy == policy
    w = bench.build_workload("decode", ["podA_c_python_full", "podA_b_json_full"])
    _replay_device(cache, w)
    sim = _twin(cache, layout, w, policy)
    checked = 0
    for c in cache.stats().classes:
        d = c.paths["device"]
        i = c.info.index
        assert (d.hits, d.misses, d.evictions) == (sim.hits[i], sim.misses[i], sim.evictions[i]), c.info
        checked += d.calls
    assert checked == len(w.calls) and sim.evictions.sum() > 0


def test_the_default_policy_runs_in_the_device_lookup(backend):
    """A device-lookup cache made without a policy runs the library's default (duel) on the device."""
    layout = ModelLayout.preset("q2", scale=SCALE)
    with (
        HostSource(layout, pinned=True) as source,
        ExpertCache(layout, source, budget_bytes=layout.total_bytes // 10, backend=backend, lookup="device") as cache,
    ):
        assert cache.policy == "duel"
        w = bench.build_workload("decode", ["podA_b_json_full"])
        _replay_device(cache, w)
        sim = _twin(cache, layout, w, "duel")
        assert cache.stats().path("device").hits == sim.hits.sum()


@pytest.mark.parametrize("policy", ["duel", "oppclass", "lru"])
def test_host_serving_calls_run_on_the_device_state(make_cache, policy):
    """The host-side serving calls of a device-lookup cache (select, select_views, select_slots,
    compact loads, prefill batches) are the device select in their path's mode, on the one copy
    of the residency: mixed with device selects, they give the hits, misses and evictions, and
    leave the residents, that the same calls give on a host-lookup cache of the same policy
    (whose policy object runs them), and serve the source's bytes."""
    layout = ModelLayout.preset("q2", scale=SCALE)
    budget = layout.total_bytes // 10
    host, _ = make_cache(layout, budget_bytes=budget, pinned=True)
    dev, source = make_cache(layout, budget_bytes=budget, lookup="device", pinned=True)
    w = bench.build_workload("decode", ["podA_b_json_full"])
    rng = np.random.default_rng(3)
    open_batches = []
    for n, call in enumerate(w.calls[:1500]):
        layer, ids = call.layer, np.asarray(call.ids)
        kind = n % 7
        if kind == 0:
            dev.select_device(layer, device_ids(dev, ids))
            host.select(layer, ids)
        elif kind == 1:
            slots = dev.select_slots(layer, ids.astype(np.int32))
            host.select_slots(layer, ids.astype(np.int32))
            if n % 50 == 1:
                assert_served(dev, source, layer, ids, bank_rows(dev.bank(layer), slots))
        elif kind == 2 and n % 5 == 0:
            more = rng.integers(0, layout[layer].num_experts, size=6)
            buf = dev.load_compact(layer, np.concatenate([ids, more]))
            host.load_compact(layer, np.concatenate([ids, more]))
            assert_served(dev, source, layer, np.concatenate([ids, more]), buf.pointers())
        elif kind == 3 and n % 3 == 0:
            rows = np.stack([ids, rng.integers(0, layout[layer].num_experts, size=ids.size)])
            pair = (dev.prepare_batch(layer, rows), host.prepare_batch(layer, rows))
            assert list(pair[0].ids) == list(pair[1].ids)
            assert_served(dev, source, layer, pair[0].ids, pair[0].pointers)
            open_batches.append(pair)
            if len(open_batches) > 2:
                for b in open_batches.pop(0):
                    b.finish()
        else:
            ptrs = dev.select(layer, ids)
            host.select(layer, ids)
            if n % 50 == 3:
                assert_served(dev, source, layer, ids, ptrs)
    for pair in open_batches:
        for b in pair:
            b.finish()
    got = {c.info.index: c for c in dev.stats().classes}
    for c in host.stats().classes:
        d = got[c.info.index]
        for path in ("compact", "batch"):
            h, g = c.paths[path], d.paths[path]
            assert (g.hits, g.misses, g.evictions) == (h.hits, h.misses, h.evictions), path
        h, g = c.paths["decode"], d.paths["decode"]
        gd = d.paths["device"]
        assert (g.hits + gd.hits, g.misses + gd.misses, g.evictions + gd.evictions) == (h.hits, h.misses, h.evictions)
        assert d.info.resident_experts == c.info.resident_experts
    for layer in layout.moe_layers[:4]:
        for e in range(layout[layer].num_experts):
            assert (testing.read_expert(dev, layer, e) is None) == (testing.read_expert(host, layer, e) is None)


def test_a_split_select_is_refused_on_a_device_lookup_cache(make_cache):
    cache, _ = make_cache(ModelLayout.preset("q2", scale=SCALE), budget_experts=8, lookup="device", pinned=True)
    layer = cache.layout.moe_layers[0]
    with pytest.raises(UnsupportedError, match="select_split is not available on a device-lookup cache"):
        cache.select_split(layer, [1, 3])
    assert cache.stats().path("decode").calls == 0


@pytest.mark.parametrize("policy", DEVICE_STATE_POLICIES)
def test_control_calls_keep_working(make_cache, policy):
    """stats, class_info, reset_stats, bind, read_expert and release_all on a cache whose policy
    lives on the device: counters read back, a release empties the bank (the policy's counts and
    duel's shadows stay, as on the host) and the next selects miss again."""
    cache, source = make_cache(ModelLayout.preset("q2", scale=SCALE), budget_experts=4, lookup="device", pinned=True)
    layer = cache.layout.moe_layers[0]
    c = cache.bind_class(layer)
    cache.select_device(layer, device_ids(cache, [1, 2, 3]))
    cache.select_device(layer, device_ids(cache, [1, 4, 5]))  # 2 evictions
    info = next(x for x in cache.classes() if x.index == c)
    assert (info.resident_experts, info.cap_experts) == (4, 4)
    d = cache.stats().path("device")
    assert (d.calls, d.hits, d.misses, d.evictions) == (2, 1, 5, 1)
    assert testing.read_expert(cache, layer, 1) is not None
    cache.reset_stats()
    assert cache.stats().path("device").calls == 0
    cache.release_all()
    assert next(x for x in cache.classes() if x.index == c).resident_experts == 0
    cache.select_device(layer, device_ids(cache, [1, 4]))
    d = cache.stats().path("device")
    assert (d.calls, d.hits, d.misses, d.evictions) == (1, 0, 2, 0)


@pytest.mark.parametrize("policy", DEVICE_STATE_POLICIES + ["lru"])
def test_a_release_keeps_what_the_policy_learned_as_on_the_host(make_cache, policy):
    """The same selects, with a release_all in the middle, on a host-lookup cache (the host's policy
    object) and a device-lookup cache (the device's state): the same hits, misses and evictions. The
    release forgets the slots and keeps the counts, duel's shadows and its counter on both."""
    layout = ModelLayout.preset("q2", scale=SCALE)
    budget = layout.total_bytes // 12
    host, _ = make_cache(layout, budget_bytes=budget)
    dev, _ = make_cache(layout, budget_bytes=budget, lookup="device", pinned=True)
    w = bench.build_workload("decode", ["podA_b_json_full"])
    half = len(w.calls) // 2
    for n, call in enumerate(w.calls):
        if n == half:
            host.release_all()
            dev.release_all()
        host.select(call.layer, call.ids)
        dev.select_device(call.layer, device_ids(dev, call.ids))
    got = [(c.info.index, c.paths["device"]) for c in dev.stats().classes]
    want = {c.info.index: c.paths["decode"] for c in host.stats().classes}
    for i, d in got:
        h = want[i]
        assert (d.hits, d.misses, d.evictions) == (h.hits, h.misses, h.evictions)


@pytest.mark.parametrize("policy", ["duel", "oppclass", "lru"])
def test_device_selects_serve_the_source_bytes_under_every_policy(make_cache, policy):
    """16 layers of one class sharing a bank of a quarter of their experts, top-8, skewed routing
    with many evictions: after every select each slot it gave holds its expert's bytes (the bank
    checksum kernel, reading the slots where select_device wrote them), under every policy."""
    from pyexpcache import LayerSpec

    layers, experts, k = 16, 128, 8
    layout = ModelLayout(tuple(LayerSpec(experts, 256, 256, 512) for _ in range(layers)), name="one-class")
    cache, source = make_cache(layout, budget_experts=layers * experts // 4, lookup="device", pinned=True)
    rng = np.random.default_rng(0)
    want = {(layer, e): source.expected_checksum(layer, e) for layer in range(layers) for e in range(experts)}
    for step in range(48):
        for layer in range(layers):
            ids = np.unique((rng.zipf(1.1, size=4 * k) * 7 + rng.integers(0, 3, size=4 * k)) % experts)[:k]
            while ids.size < k:
                ids = np.unique(np.concatenate([ids, rng.integers(0, experts, k)]))[:k]
            slots = cache.select_device(layer, device_ids(cache, ids, dtype="int32"))
            testing.bank_checksum_async(cache, layer, slots, 0)
            cache.synchronize()
            got = testing.checksum_results(cache, 0, k).tolist()
            assert got == [want[layer, int(e)] for e in ids], f"step {step} layer {layer}: served bytes differ"
    assert cache.stats().path("device").evictions > 0


@pytest.mark.parametrize("policy", ["duel", "oppclass", "lru"])
def test_device_lookup_after_a_prefill_equals_the_host_lookup_and_the_twin(policy):
    """A prefill batch (appends counted in the real order alone: duel's OppClassLRU shadow counts
    requests only) then decode selects: the device lookup's counters equal the host lookup's and
    the simulator twin's, call for call."""
    from expcache_bench.sim import BATCH, Call
    from pyexpcache import LayerSpec

    rng = np.random.default_rng(1)
    layout = ModelLayout([LayerSpec(24, 256, 256, 256)])
    prompt = rng.integers(0, 24, size=(2, 4))
    decode = [rng.choice(24, size=4, replace=False) for _ in range(300)]
    per_call = {}
    for lookup in ("host", "device"):
        with (
            HostSource(layout) as src,
            ExpertCache(layout, src, budget_experts=8, backend="host", lookup=lookup, policy=policy, log_level=0) as c,
        ):
            c.prepare_batch(0, prompt, slots=True).finish()
            path, hits = ("device" if lookup == "device" else "decode"), []
            for ids in decode:
                if lookup == "device":
                    c.select_device(0, ids.astype(np.int64))
                else:
                    c.select(0, ids.astype(np.uint32))
                hits.append(c.stats().classes[0].paths[path].hits)
            per_call[lookup] = hits
    assert per_call["device"] == per_call["host"]
    stream = [Call(BATCH, 0, tuple(int(x) for x in prompt.ravel()))] + [
        Call(DECODE, 0, tuple(int(x) for x in ids)) for ids in decode
    ]
    sim = simulate_policy(stream, [8], [0], policy=policy, tokens=list(range(len(stream))))
    assert per_call["host"][-1] == sim.hits[0] and sim.evictions[0] > 0
