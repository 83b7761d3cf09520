"""Experts of 1 to 8 named parts through pyexpcache, on every backend and policy: LayerSpec.of_parts
layers registered and served byte for byte (select_slots and the bank's part views, select,
select_views by name, load_compact's regions, batches), classes keyed by every part's size in a
model that mixes part counts, find_class over any number of sizes, and the calls that hand out
three-part addresses refused for other layers. (tests/test_parts_abi.py drives the C ABI itself.)"""

from __future__ import annotations

import numpy as np
import pytest

from pyexpcache import (
    ArgumentRangeError,
    ExpertView,
    InvalidArgumentError,
    InvalidStateError,
    LayerSpec,
    ModelLayout,
    testing,
)
from pyexpcache.source import pattern_seed

from support.cache import assert_served, bank_rows

#: Every test here that makes its caches through make_cache runs against both bank arrangements.
pytestmark = pytest.mark.arrangements

NUM_EXPERTS = 8


def _spec(nparts: int, experts: int = NUM_EXPERTS) -> LayerSpec:
    """Parts of distinct sizes, none a multiple of 16 (so the copies' tails and the bank's
    alignment count): 300, 533, 766, ..., named p0, p1, ..."""
    return LayerSpec.of_parts(experts, [(f"p{p}", 300 + 233 * p) for p in range(nparts)])


def _assert_bank_holds(cache, source, layer, ids, slots):
    bank = cache.bank(layer)
    spec = cache.layout[layer]
    assert bank.names == spec.part_names
    for e, slot in zip(ids, slots):
        for p, name in enumerate(spec.part_names):
            at = bank.part(name).ptr + int(slot) * bank.part_strides[p]
            got = testing.read_device(cache, at, spec.parts[p].nbytes)
            assert (got == source.part(layer, e, name)).all(), f"expert {e} part {name} differs from the source"


ROUNDS = ([1, 2], [3, 4], [1, 5], [6, 7, 0], [2, 3])  # 3 experts a class: later rounds evict


@pytest.mark.parametrize("nparts", [1, 2, 5, 8])
@pytest.mark.parametrize("arrangement", ["tensor", "expert"])
def test_every_part_is_served_byte_exact(make_cache, nparts, arrangement):
    layout = ModelLayout((_spec(nparts), None))
    cache, source = make_cache(layout, budget_experts=3, arrangement=arrangement)
    for ids in ROUNDS:
        slots = cache.select_slots(0, ids)
        cache.synchronize()
        _assert_bank_holds(cache, source, 0, ids, slots)
        ptrs = cache.select(0, ids)
        assert ptrs.shape == (len(ids), nparts) and ptrs.dtype == np.uint64
        assert ptrs.tolist() == bank_rows(cache.bank(0), cache.select_slots(0, ids))
        assert_served(cache, source, 0, ids, ptrs)
        views = cache.select_views(0, ids)
        for e, view in zip(ids, views):
            assert isinstance(view, ExpertView) and view.names == layout[0].part_names and len(view) == nparts
            for name in view.names:
                # Host backend: the array interface reads the bytes; CUDA: read them back.
                got = testing.read_device(cache, view[name].ptr, view[name].nbytes)
                assert (got == source.part(0, e, name)).all()
                assert view.part(name) is view[name]


@pytest.mark.parametrize("nparts", [2, 5])
def test_compact_loads_and_batches_give_every_part(make_cache, nparts):
    layout = ModelLayout((_spec(nparts),))
    cache, source = make_cache(layout, budget_experts=3)
    ids = [4, 1, 6]
    buf = cache.load_compact(0, ids)
    assert buf.names == layout[0].part_names and buf.part_bytes == layout[0].class_key
    for p, region in enumerate(buf.regions):
        assert region is not None and region == buf.region(region.name) == buf.region(p)
        for i, e in enumerate(ids):
            got = testing.read_device(cache, region.address + i * region.nbytes, region.nbytes)
            assert (got == source.part(0, e, p)).all()
    assert_served(cache, source, 0, ids, buf.pointers())
    with pytest.raises(KeyError, match="no part 'gate': this buffer's parts are p0, p1"):
        buf.region("gate")
    with cache.prepare_batch(0, [[1, 2], [2, 7]]) as batch:  # always by slot id: the layer is not three parts
        assert sorted(batch.ids.tolist()) == [1, 2, 7] and batch.slots is not None
        assert batch.pointers.shape == (3, nparts)
        assert_served(cache, source, 0, batch.ids, batch.pointers)
        _assert_bank_holds(cache, source, 0, batch.ids, batch.slots)


def test_layers_of_other_part_counts_are_classes_apart(make_cache):
    """A model mixing three-part and five-part layers: a class per part layout, even where the
    total bytes or the first sizes agree, each served from its own bank."""
    three = LayerSpec(NUM_EXPERTS, 300, 533, 766)
    five = _spec(5)
    same_total = LayerSpec.of_parts(NUM_EXPERTS, [("a", 300), ("b", 533), ("c", 383), ("d", 383)])
    layout = ModelLayout((three, five, three, same_total, five))
    cache, source = make_cache(layout, budget_experts=3)
    assert list(layout.classes()) == [three.class_key, five.class_key, same_total.class_key]
    for layer in layout.moe_layers:
        ids = [layer % NUM_EXPERTS, (layer + 3) % NUM_EXPERTS]
        assert_served(cache, source, layer, ids, cache.select(layer, ids))
    classes = {c.key: c for c in cache.classes()}
    assert set(classes) == set(layout.classes())
    assert classes[five.class_key].part_bytes == five.class_key and classes[five.class_key].num_layers == 2
    assert classes[three.class_key].gate_bytes == 300 and classes[five.class_key].gate_bytes == 0
    assert cache.find_class(*five.class_key) == cache.find_class(five.class_key) == classes[five.class_key].index
    assert cache.find_class(300, 533, 766) == classes[three.class_key].index
    assert cache.find_class(same_total.class_key) == classes[same_total.class_key].index
    assert cache.bank(1).names == five.part_names and cache.bank(0).names == ("gate", "up", "down")
    assert cache.bank(0).gate.nbytes // cache.bank(0).rows == 300


def test_find_class_checks_every_size_before_the_library(make_cache):
    cache, _ = make_cache(ModelLayout((_spec(5),)), budget_experts=3)
    with pytest.raises(InvalidStateError):
        cache.find_class(_spec(5).class_key)  # a layer has them, no class holds them yet
    with pytest.raises(InvalidArgumentError):
        cache.find_class(300, 533)  # no layer has these
    with pytest.raises(ArgumentRangeError, match=r"1\.\.8 part sizes"):
        cache.find_class()
    with pytest.raises(ArgumentRangeError, match=r"1\.\.8 part sizes .* got 9"):
        cache.find_class(*range(1, 10))
    with pytest.raises(ArgumentRangeError, match=r"part_bytes\[1\] must be in \[0, 18446744073709551615\], got -1"):
        cache.find_class(300, -1)
    with pytest.raises(ArgumentRangeError, match=r"part_bytes\[3\]"):
        cache.find_class(1, 2, 3, 1 << 64)
    with pytest.raises(TypeError, match=r"part_bytes\[0\] must be an integer, got a bool"):
        cache.find_class(True, 2)
    with pytest.raises(TypeError, match=r"part_bytes\[1\] must be an integer, got float"):
        cache.find_class([300, 533.0])


def test_the_calls_handing_out_three_part_addresses_refuse_other_layers(make_cache):
    cache, _ = make_cache(ModelLayout((_spec(5),)), budget_experts=3)
    with pytest.raises(
        InvalidStateError, match=r"select_split: layer 0's experts have 5 parts \(p0, .*use select_slots"
    ):
        cache.select_split(0, [1, 2])
    view = cache.select_views(0, [1])[0]
    with pytest.raises(
        AttributeError, match=r"this expert's parts are p0, p1, p2, p3, p4, not gate, .*view.part\('p0'\)"
    ):
        view.gate  # noqa: B018
    with pytest.raises(KeyError, match="no part 'gate'"):
        view["gate"]
    bank = cache.bank(0)
    with pytest.raises(AttributeError, match=r"use bank.part\('p0'\)"):
        bank.down  # noqa: B018
    with pytest.raises(KeyError, match="this bank's parts are p0, p1, p2, p3, p4"):
        bank.part("w")


def test_parts_are_shown_in_their_own_dtype_and_shape(make_cache):
    """A part with a dtype and shape is viewed in them by default (bank and select_views); any
    other format may be asked for, covering the same bytes."""
    spec = LayerSpec.of_parts(
        NUM_EXPERTS,
        [("w", 64 * 32, "float16", (64, 16)), ("scale", 4 * 2, "float32", (2,)), ("bias", 100)],
    )
    cache, source = make_cache(ModelLayout((spec,)), budget_experts=4)
    slots = cache.select_slots(0, [3, 5])
    cache.synchronize()
    bank = cache.bank(0)
    assert [(v.dtype.name, v.shape) for v in bank.parts] == [
        ("float16", (bank.rows, 64, 16)),
        ("float32", (bank.rows, 2)),
        ("uint8", (bank.rows, 100)),
    ]
    w = bank.part("w", shape=(32, 32))  # its own dtype, another shape
    assert w.dtype.name == "float16" and w.shape == (bank.rows, 32, 32) and w.strides[0] == bank.part_strides[0]
    raw = bank.part("scale", dtype="uint8", shape=(8,))
    assert raw.shape == (bank.rows, 8)
    with pytest.raises(ValueError, match=r"shape \(3,\) of float32 is 12 bytes, but the view has 8 bytes"):
        bank.part("scale", shape=(3,))
    view = cache.select_views(0, [3])[0]
    assert view["w"].shape == (64, 16) and view["scale"].dtype.name == "float32"
    if cache.backend == "host":
        assert (np.asarray(bank.part("w"))[slots[0]].view(np.uint8).ravel() == source.part(0, 3, "w")).all()
        assert (np.asarray(view["scale"]).view(np.uint8) == source.part(0, 3, "scale")).all()
    formatted = cache.select_views(0, [3], dtype="uint8", shapes={"w": (2048,)})[0]
    assert formatted["w"].shape == (2048,) and formatted["bias"].shape == (100,)
    with pytest.raises(ValueError, match=r"shapes: one shape per part \(w, scale, bias\), got 2"):
        cache.select_views(0, [3], shapes=[(1,), (2,)])
    with pytest.raises(KeyError, match="shapes names 'gate'"):
        cache.bank(0, shapes={"gate": (1,)})


def test_a_source_fills_each_part_with_its_own_pattern():
    """HostSource's pattern differs for every part of every expert: parts 4..7 never repeat
    parts 0..3 of another expert, and three-part experts keep the words they always had."""
    seeds = {pattern_seed(2, e, p) for e in range(64) for p in range(8)}
    assert len(seeds) == 64 * 8
    mask = (1 << 64) - 1

    def three_part_seed(layer, expert, part):  # the pattern before experts had more parts
        z = ((layer << 32) | (expert << 2) | part) + 0x9E3779B97F4A7C15 & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    assert all(pattern_seed(7, e, p) == three_part_seed(7, e, p) for e in range(64) for p in range(3))


def test_the_simulator_keys_classes_by_every_parts_size(make_cache, policy):
    """DeepSeek V4 Flash's mixed layout with layers 3-12 made five-part experts of the q2 experts'
    total bytes: those layers are a class of their own, in the layout (and so in the simulator,
    which takes its classes from it) as in the library, and the library's decode counters equal
    the simulator's, selects by slot id included."""
    import expcache_bench as bench
    from expcache_bench.sim import simulate_policy

    mixed = ModelLayout.preset("mixed", scale=4096)
    q2 = mixed[3]
    five = LayerSpec.of_parts(q2.num_experts, [("a", 528), ("b", 528), ("c", 336), ("d", 200), ("e", 136)])
    assert five.expert_bytes == q2.expert_bytes
    layout = ModelLayout(tuple(five if 3 <= i <= 12 else s for i, s in enumerate(mixed.layers)), name="parts")
    cache, _ = make_cache(layout, budget_bytes=layout.total_bytes // 10, policy=policy)
    workload = bench.build_workload("decode", ["podA_b_json_full"])
    for call in workload.calls:
        cache.select(call.layer, call.ids)
    layer_class = [cache.bind_class(i) if layout[i] else 0 for i in range(layout.num_layers)]
    by_class: dict[int, list[int]] = {}
    for i in layout.moe_layers:
        by_class.setdefault(layer_class[i], []).append(i)
    assert sorted(by_class.values()) == sorted(layout.classes().values()) and len(by_class) == 3
    caps = [c.cap_experts for c in sorted(cache.classes(), key=lambda c: c.index)]
    sim = simulate_policy(workload.calls, caps, layer_class, policy=policy, layers=layout.moe_layers)
    for c in cache.stats().classes:
        d = c.paths["decode"]
        i = c.info.index
        assert (d.hits, d.misses, d.evictions) == (sim.hits[i], sim.misses[i], sim.evictions[i])


class _Placed:
    """A source of one layer whose placement is given (bases and strides unchecked here)."""

    pinned = False
    file_path = None

    def __init__(self, layout, place):
        self.layout, self._place = layout, place

    def placement(self, layer):
        return self._place


@pytest.mark.parametrize(
    "bases, strides, error, message",
    [
        (
            (4096, 8192),
            (300, 533),
            ValueError,
            r"the source places 2 parts \(2 strides\) of a layer whose experts have 5",
        ),
        (
            (4096,) * 5,
            (300, 533, -1, 999, 1232),
            ArgumentRangeError,
            r"part 'p2' stride must be in \[0, 18446744073709551615\], got -1",
        ),
        ((4096,) * 4 + (1 << 64,), (300, 533, 766, 999, 1232), ArgumentRangeError, r"part 'p4' base must be in"),
        ((4096,) * 5, (300, 533, 766, 999.0, 1232), TypeError, r"part 'p3' stride must be an integer, got float"),
    ],
)
def test_a_placement_is_range_checked_before_ctypes(backend, bases, strides, error, message):
    from pyexpcache import ExpertCache
    from pyexpcache.source import LayerPlacement

    layout = ModelLayout((_spec(5),))
    place = LayerPlacement(bases, strides, layout[0].class_key)
    with pytest.raises(error, match=message):
        ExpertCache(layout, _Placed(layout, place), budget_experts=2, backend=backend, log_level=0)
