"""Who moves a device select's misses from pinned memory (``ExpertCache(miss_copy=...)``): the
select's grid (``"sm"``) or a copy engine driven by the library's poller thread from the miss list
the select writes (``"engine"``; ``"auto"`` picks it for experts of 6 MiB and more). Either way
the same slots hold the same bytes, the counters agree, a captured select replays, and a copy
that fails leaves no slot claiming bytes it never got. Both backends run the protocol (the host
backend's copier is a memcpy on the poller thread)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from pyexpcache import ExpertCache, HostSource, LayerSpec, ModelLayout, _lib, testing

from support.cache import SCALE, assert_served, bank_rows, device_ids, to_numpy

pytestmark = pytest.mark.arrangements


@pytest.fixture
def policy() -> str:
    return "duel"  # the default, whose bookkeeping runs in the select beside the copy


def _cache(make_cache, miss_copy, experts=6, layout=None, **kw):
    return make_cache(
        layout or ModelLayout.preset("mixed", scale=SCALE),
        lookup="device",
        pinned=True,
        budget_experts=experts,
        miss_copy=miss_copy,
        **kw,
    )


def _steps(layout, n=40, seed=3):
    """n decode steps over the mixed layout's first q2 and first q4 layers: (layer, ids) with repeats."""
    rng = np.random.default_rng(seed)
    layers = [layout.moe_layers[0], layout.moe_layers[-1]]
    return [(layers[i % 2], rng.choice(24, size=6, replace=False).tolist()) for i in range(n)]


def test_the_engine_serves_the_grids_slots_with_the_source_bytes(make_cache):
    """The same steps through both: every step's slots equal, every expert's bytes the source's,
    the device counters equal."""
    engine, source = _cache(make_cache, "engine")
    sm, _ = _cache(make_cache, "sm")
    for layer, ids in _steps(engine.layout):
        got = to_numpy(engine.select_device(layer, device_ids(engine, ids)))
        want = to_numpy(sm.select_device(layer, device_ids(sm, ids)))
        assert got.tolist() == want.tolist()
        assert_served(engine, source, layer, ids, bank_rows(engine.bank(layer), got))
    for a, b in zip(engine.stats().classes, sm.stats().classes):
        da, db = a.paths["device"], b.paths["device"]
        assert (da.calls, da.hits, da.misses, da.evictions, da.bytes_h2d) == (
            db.calls,
            db.hits,
            db.misses,
            db.evictions,
            db.bytes_h2d,
        )
        assert da.misses > 0 and da.evictions > 0


def test_host_side_calls_beside_engine_selects(make_cache):
    """A host-side select and a prefill batch on a class the engine copies for: one residency."""
    cache, source = _cache(make_cache, "engine", experts=8)
    layer = cache.layout.moe_layers[0]
    slots = to_numpy(cache.select_device(layer, device_ids(cache, [1, 2, 3])))
    ptrs = cache.select(layer, [3, 4])
    assert_served(cache, source, layer, [3, 4], ptrs)
    again = to_numpy(cache.select_device(layer, device_ids(cache, [4, 1])))
    assert again[1] == slots[0]
    assert_served(cache, source, layer, [4, 1], bank_rows(cache.bank(layer), again))
    with cache.prepare_batch(layer, np.array([[5, 1, 6]])) as batch:
        assert_served(cache, source, layer, batch.ids, batch.pointers)
    assert cache.stats().classes[0].paths["device"].hits == 2  # 4 (the host select's) and 1


def test_a_failed_engine_copy_gives_slot_minus_one_and_is_copied_again(make_cache):
    cache, source = _cache(make_cache, "engine", experts=8)
    layer = cache.layout.moe_layers[0]
    cache.bank(layer)  # binds the class (and starts its copier) before the fault is armed
    testing.fail_copy_after(cache, 0)
    with pytest.warns(Warning, match="could not be copied: injected copy failure"):
        slots = to_numpy(cache.select_device(layer, device_ids(cache, [1, 2])))
        cache.synchronize()
    assert slots.tolist() == [-1, -1]
    assert cache.classes()[0].resident_experts == 0  # no slot claims the bytes it never got
    slots = to_numpy(cache.select_device(layer, device_ids(cache, [2, 1])))
    assert (slots >= 0).all()
    assert_served(cache, source, layer, [2, 1], bank_rows(cache.bank(layer), slots))


def test_a_captured_engine_select_replays_its_copies(make_cache, backend):
    if backend != "cuda":
        pytest.skip("CUDA graphs are the CUDA backend's")
    torch = pytest.importorskip("torch", reason="torch is not installed")
    cache, source = _cache(make_cache, "engine", experts=8)
    layer = cache.layout.moe_layers[0]
    cache.bank(layer)  # binds the class: a capture cannot allocate its bank
    ids = torch.tensor([1, 2, 3], device="cuda")
    slots = torch.empty(3, dtype=torch.int32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cache.select_device(layer, ids, out=slots)
    for step in ([1, 2, 3], [4, 5, 1], [9, 10, 11], [1, 2, 3]):
        ids.copy_(torch.tensor(step))
        graph.replay()
        torch.cuda.synchronize()
        assert_served(cache, source, layer, step, bank_rows(cache.bank(layer), slots.cpu().tolist()))


def _big_layout(expert_mib):
    part = int(expert_mib * (1 << 20)) // 3
    return ModelLayout([LayerSpec(num_experts=4, gate_bytes=part, up_bytes=part, down_bytes=part)])


@pytest.mark.parametrize("expert_mib, engine", [(6.0, True), (5.5, False)])
def test_auto_takes_the_engine_from_6_mib(backend, caplog, expert_mib, engine):
    layout = _big_layout(expert_mib)
    with HostSource(layout, pinned=True) as src, caplog.at_level(logging.INFO, logger="pyexpcache"):
        with ExpertCache(layout, src, backend=backend, lookup="device", budget_experts=2, log_level=2) as cache:
            assert cache.miss_copy == "auto"
            slots = to_numpy(cache.select_device(0, device_ids(cache, [3, 1])))
            assert_served(cache, src, 0, [3, 1], bank_rows(cache.bank(0), slots))
    said = "moved by a copy engine (miss_copy auto)" in caplog.text
    assert said == engine, caplog.text


def test_miss_copy_is_checked(backend):
    layout = ModelLayout.preset("q2", scale=SCALE)
    with HostSource(layout) as src:
        for bad in ("copy", 2, None):
            with pytest.raises(ValueError, match="miss_copy must be one of"):
                ExpertCache(layout, src, backend=backend, budget_experts=4, miss_copy=bad)
    assert _lib.MISS_COPIES == {"auto": 0, "sm": 1, "engine": 2}
