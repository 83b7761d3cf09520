"""Unregistering a layer of a live cache (``unregister_layer``; C: expcache_layer_unregister): its
residents leave and their slots serve the class's other layers, every other resident keeps its
bytes, the layer may be registered again with other sizes or another source, and a call that would
pull something from under a batch is refused with nothing changed; on both lookups."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from pyexpcache import (
    ArgumentRangeError,
    CacheClosedError,
    InvalidArgumentError,
    InvalidStateError,
    _lib,
    testing,
)

from support.cache import assert_served

LOOKUPS = ["host", "device"]


def _make(make_cache, lookup, **kwargs):
    return make_cache(lookup=lookup, **({"pinned": True} if lookup == "device" else {}), **kwargs)


def _resident(cache, layer, experts=16):
    return {e for e in range(experts) if testing.read_expert(cache, layer, e) is not None}


def _desc(buf, num_experts, part_bytes):
    """A pageable layer of `num_experts` experts of three parts of `part_bytes` each, laid out
    expert after expert in `buf`."""
    d = _lib.LayerDesc()
    _lib.lib.expcache_layer_desc_init(ctypes.byref(d))
    d.num_experts, d.source_kind = num_experts, _lib.SOURCE_PAGEABLE
    base = buf.ctypes.data
    for p, part in enumerate(("gate", "up", "down")):
        setattr(d, f"{part}_bytes", part_bytes)
        setattr(d, f"{part}_stride", 3 * part_bytes)
        setattr(d, f"{part}_base", base + p * part_bytes)
    return d


def _register(cache, layer, desc):
    with cache.raw_handle() as handle:
        _lib.lib.expcache_layer_register(handle, layer, ctypes.byref(desc))


@pytest.mark.parametrize("lookup", LOOKUPS)
def test_unregister_frees_the_layers_slots_and_keeps_the_rest(make_cache, policy, lookup):
    """A full class of 9 (5 experts of layer a, 3 of b, 1 of c): after a leaves, b's and c's
    residents are the same, byte for byte; the class counts 4 residents and one layer less; and 5
    new experts of b take a's slots without evicting anything."""
    cache, source = _make(make_cache, lookup, budget_experts=9)
    a, b, c = cache.layout.moe_layers[:3]
    cache.select(a, [1, 2, 3, 4, 5])
    cache.select(b, [2, 7, 9])
    cache.select(c, [3])
    kept = {layer: _resident(cache, layer) for layer in (b, c)}
    assert kept == {b: {2, 7, 9}, c: {3}}
    info = cache.classes()[0]
    assert info.resident_experts == 9
    cache.unregister_layer(a)
    assert {layer: _resident(cache, layer) for layer in (b, c)} == kept
    for layer, experts in kept.items():
        for e in experts:
            assert (testing.read_expert(cache, layer, e) == source.expert_bytes(layer, e)).all()
    after = cache.classes()[0]
    assert after.resident_experts == 4
    assert after.num_layers == info.num_layers - 1
    assert after.cap_experts == 9
    with pytest.raises(InvalidStateError, match=f"layer {a} is not registered"):
        cache.select(a, [1])
    evictions = cache.stats().path("decode").evictions
    ptrs = cache.select(b, [10, 11, 12, 13, 14])
    assert_served(cache, source, b, [10, 11, 12, 13, 14], ptrs)
    assert cache.stats().path("decode").evictions == evictions
    assert _resident(cache, b) == {2, 7, 9, 10, 11, 12, 13, 14}
    assert _resident(cache, c) == {3}


@pytest.mark.parametrize("lookup", LOOKUPS)
def test_a_layer_registered_again_serves_its_new_source(make_cache, policy, lookup):
    """Registered again with another part size (a class of its own) or with the same sizes from
    another buffer, the layer serves the new bytes, never the old ones; on a device-lookup cache
    the device table allows no more experts than the layer had."""
    cache, source = _make(make_cache, lookup, budget_experts=8, max_classes=2)
    a, b = cache.layout.moe_layers[:2]
    cache.select(a, [1, 2, 3])
    cache.select(b, [4])
    rng = np.random.default_rng(0)
    # Other sizes: 8 experts of 3 x 512 bytes.
    other = rng.integers(0, 256, 8 * 3 * 512, dtype=np.uint8)
    cache.unregister_layer(a)
    _register(cache, a, _desc(other, 8, 512))
    ptrs = cache.select(a, [1, 2, 6])
    for e, row in zip([1, 2, 6], ptrs):
        got = np.concatenate([testing.read_device(cache, int(addr), 512) for addr in row])
        assert (got == other[e * 1536 : (e + 1) * 1536]).all()
    assert sorted(i.key for i in cache.classes()) == sorted([(512, 512, 512), cache.layout[b].class_key])
    assert (testing.read_expert(cache, b, 4) == source.expert_bytes(b, 4)).all()
    # The same sizes again, from another buffer.
    spec = cache.layout[b]
    again = rng.integers(0, 256, spec.num_experts * spec.expert_bytes, dtype=np.uint8)
    cache.unregister_layer(b)
    d = _desc(again, spec.num_experts, spec.gate_bytes)
    for part, nbytes in zip(("gate", "up", "down"), spec.class_key):
        setattr(d, f"{part}_bytes", nbytes)
        setattr(d, f"{part}_stride", spec.expert_bytes)
    d.up_base = d.gate_base + spec.gate_bytes
    d.down_base = d.up_base + spec.up_bytes
    _register(cache, b, d)
    row = cache.select(b, [4])[0]
    got = np.concatenate([testing.read_device(cache, int(addr), n) for addr, n in zip(row, spec.class_key)])
    assert (got == again[4 * spec.expert_bytes : 5 * spec.expert_bytes]).all()
    if lookup == "device":
        cache.unregister_layer(a)
        with pytest.raises(InvalidStateError, match="register it with at most 256"):
            _register(cache, a, _desc(np.zeros(300 * 3 * 512, np.uint8), 300, 512))


@pytest.mark.parametrize("lookup", LOOKUPS)
def test_unregister_waits_for_open_batches(make_cache, policy, lookup):
    """A layer with an unfinished prefill batch is refused, nothing changed (still registered, its
    residents in place); once the batch is finished it leaves."""
    cache, source = _make(make_cache, lookup, budget_experts=8)
    a, b = cache.layout.moe_layers[:2]
    cache.select(a, [1, 2])
    batch = cache.prepare_batch(a, [[2, 3]])
    cache.prepare_batch(b, [[5]]).finish()  # another layer's batch is no obstacle
    with pytest.raises(InvalidStateError, match=f"layer {a} has an unfinished prefill batch"):
        cache.unregister_layer(a)
    assert _resident(cache, a) == {1, 2, 3}
    assert_served(cache, source, a, [1], cache.select(a, [1]))
    batch.finish()
    cache.unregister_layer(a)
    assert cache.classes()[0].resident_experts == 1  # b's expert 5


def test_unregister_cancels_the_layers_queued_prefetches(make_cache, policy):
    """Prefetches of the layer still queued are cancelled (no wait, no refusal); the slots they
    took are free again and nothing else changes."""
    cache, source = make_cache(budget_experts=8)
    a, b = cache.layout.moe_layers[:2]
    cache.select(b, [1])
    testing.pause_prefetch(cache)
    assert cache.prefetch(a, [1, 2, 3]) == 3
    cache.unregister_layer(a)
    assert cache.prefetch_stats().cancelled == 3
    assert cache.classes()[0].resident_experts == 1
    assert (testing.read_expert(cache, b, 1) == source.expert_bytes(b, 1)).all()
    testing.pause_prefetch(cache, False)


def test_bad_unregisters_are_refused(make_cache):
    """A layer out of range, negative, or not registered (again) is refused with the reason,
    nothing changed; a closed cache raises CacheClosedError."""
    cache, _ = make_cache(budget_experts=8)
    a = cache.layout.moe_layers[0]
    cache.select(a, [1])
    with pytest.raises(InvalidArgumentError, match="layer 5000 out of range"):
        cache.unregister_layer(5000)
    with pytest.raises(ArgumentRangeError, match="layer"):
        cache.unregister_layer(-1)
    cache.unregister_layer(a)
    with pytest.raises(InvalidStateError, match=f"layer {a} is not registered"):
        cache.unregister_layer(a)
    cache.close()
    with pytest.raises(CacheClosedError):
        cache.unregister_layer(cache.layout.moe_layers[1])
