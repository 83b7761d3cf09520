"""The banks' two arrangements (``ExpertCache(bank_arrangement=...)``, expcache_config_t's
``bank_arrangement``): under ``"parts"`` each part of a class's experts is its own region, so a part
of 256-multiple bytes is one C-contiguous ``[rows, ...]`` array; every path serves the source's
bytes, part for part, in both; the one address rule (``base + part_offset[p] + s * part_stride[p]``)
holds for both; a bad arrangement is refused before C and by C."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from pyexpcache import ExpertCache, HostSource, LayerSpec, ModelLayout, _lib, testing

from support.cache import SCALE, assert_served, bank_rows, device_ids, to_numpy

ARRANGEMENTS = ["slots", "parts"]


def _aligned_layout():
    """Three parts of 256-multiple bytes (gate and up 1,024, down 512), two layers of one class."""
    return ModelLayout([LayerSpec(16, 1024, 1024, 512), LayerSpec(16, 1024, 1024, 512)])


def _odd_layout():
    """Parts of no 256 multiple (the q2 preset scaled: 528, 528, 264 bytes... and the like)."""
    return ModelLayout.preset("q2", scale=SCALE)


def _bank_struct(cache, layer):
    return cache._bank_struct(layer)


def _rows_hold_their_experts(cache, source, layer, ids, slots):
    bank = cache.bank(layer)
    assert all(0 <= int(s) < bank.rows for s in slots)
    assert_served(cache, source, layer, ids, bank_rows(bank, slots))


@pytest.mark.parametrize("arrangement", ARRANGEMENTS)
@pytest.mark.parametrize("layout", [_aligned_layout, _odd_layout], ids=["aligned", "odd"])
def test_the_one_address_rule_holds_for_both(backend, arrangement, layout):
    """expcache_bank_t: part p of slot s at base + part_offset[p] + s * part_stride[p]; SLOTS: every
    part_stride is slot_stride and part_offset within a slot; PARTS: slot_stride 0, a region per
    part on 256 bytes at least, none overlapping another, part_stride the part's bytes rounded up
    to 256."""
    layout = layout()
    with (
        HostSource(layout, pinned=backend == "cuda") as source,
        ExpertCache(layout, source, budget_experts=5, backend=backend, bank_arrangement=arrangement) as cache,
    ):
        layer = layout.moe_layers[0]
        ids = [0, 3, 5, 7, 9, 11, 13]  # 5 in slots, 2 staged
        ptrs = cache.select(layer, ids)
        b = _bank_struct(cache, layer)
        assert b.arrangement == _lib.BANK_ARRANGEMENTS[arrangement]
        n = b.num_parts
        strides = list(b.part_stride[:n])
        if arrangement == "slots":
            assert strides == [b.slot_stride] * n and b.slot_stride > 0
            assert list(b.part_offset[:n]) == sorted(b.part_offset[:n]) and b.part_offset[0] == 0
        else:
            assert b.slot_stride == 0
            assert strides == [(nbytes + 255) // 256 * 256 for nbytes in b.part_bytes[:n]]
            ends = [b.part_offset[p] + b.rows * strides[p] for p in range(n)]
            assert all(b.part_offset[p] % 256 == 0 for p in range(n))
            assert all(ends[p] <= b.part_offset[p + 1] for p in range(n - 1))
        for row in ptrs:
            slot = int((int(row[0]) - b.base - b.part_offset[0]) // strides[0])
            assert [int(x) for x in row[:n]] == [b.base + b.part_offset[p] + slot * strides[p] for p in range(n)]
        assert_served(cache, source, layer, ids, ptrs)


@pytest.mark.parametrize("lookup", ["host", "device"])
def test_a_parts_bank_of_aligned_parts_is_contiguous_per_part(backend, lookup):
    """Each part of 256-multiple bytes is one C-contiguous [rows, bytes] array (numpy's flags, and
    torch's is_contiguous through DLPack where torch is installed), whose row s is slot s's part."""
    try:
        import torch
    except ImportError:  # numpy's flags still say it (host backend)
        torch = None
    layout = _aligned_layout()
    with (
        HostSource(layout, pinned=True) as source,
        ExpertCache(
            layout, source, budget_experts=6, backend=backend, lookup=lookup, bank_arrangement="parts"
        ) as cache,
    ):
        layer = layout.moe_layers[0]
        ids = [2, 4, 6, 8]
        if lookup == "device":
            slots = to_numpy(cache.select_device(layer, device_ids(cache, ids)))
        else:
            slots = cache.select_slots(layer, ids)
        bank = cache.bank(layer)
        assert bank.arrangement == "parts" and bank.slot_stride == 0
        spec = layout[layer]
        for p, name in enumerate(bank.names):
            view = bank.part(name, "uint8", (spec.class_key[p],))
            assert view.shape == (bank.rows, spec.class_key[p])
            assert bank.part_strides[p] == spec.class_key[p]
            if backend == "host":
                array = np.asarray(view)
                assert array.flags.c_contiguous
                for e, s in zip(ids, slots):
                    assert (array[int(s)] == source.part(layer, e, p)).all()
            if torch is not None:  # on CUDA the check that matters: a kernel asserting contiguity takes it
                tensor = torch.from_dlpack(view)
                assert tensor.is_contiguous() and tensor.shape == (bank.rows, spec.class_key[p])
                cache.synchronize()
                for e, s in zip(ids, slots):
                    assert (tensor[int(s)].cpu().numpy() == source.part(layer, e, p)).all()


def test_gate_up_needs_a_slots_bank(make_cache):
    """Under PARTS gate and up are separate regions: gate_up says so; under SLOTS it is one view."""
    layout = _aligned_layout()
    slots, _ = make_cache(layout, budget_experts=4, bank_arrangement="slots")
    parts, _ = make_cache(layout, budget_experts=4, bank_arrangement="parts")
    layer = layout.moe_layers[0]
    assert slots.bank(layer).gate_up().shape[0] == slots.bank(layer).rows
    with pytest.raises(ValueError, match="separate regions.*bank_arrangement='slots'"):
        parts.bank(layer).gate_up()


@pytest.mark.parametrize("layout", [_aligned_layout, _odd_layout], ids=["aligned", "odd"])
def test_every_path_serves_every_part_byte_exact_under_parts(make_cache, layout):
    """Decode selects (hits, evictions, staging rows), select_slots, compact loads and batches by
    slot id (batch rows) on a parts bank: every served expert's every part is the source's."""
    layout = layout()
    cache, source = make_cache(layout, budget_experts=4, bank_arrangement="parts")
    rng = np.random.default_rng(11)
    for step in range(16):
        layer = layout.moe_layers[step % len(layout.moe_layers)]
        ids = rng.choice(layout[layer].num_experts, 6, replace=False).tolist()
        if step % 4 == 0:
            assert_served(cache, source, layer, ids, cache.select(layer, ids))
        elif step % 4 == 1:
            _rows_hold_their_experts(cache, source, layer, ids, cache.select_slots(layer, ids))
        elif step % 4 == 2:
            assert_served(cache, source, layer, ids, cache.load_compact(layer, ids).pointers())
        else:
            with cache.prepare_batch(layer, np.array([ids]), slots=True) as batch:
                _rows_hold_their_experts(cache, source, layer, batch.ids, batch.slots)
                assert (batch.pointers == np.array(bank_rows(cache.bank(layer), batch.slots), dtype=np.uint64)).all()
    assert cache.stats().total.evictions > 0


def test_a_parts_bank_shrinks_and_grows_keeping_its_residents(make_cache):
    """budget_set down packs the residents below the new cap (a copy per region) and gives the rest
    back; up grows again: the residents kept and those served after are the source's bytes."""
    layout = _odd_layout()
    cache, source = make_cache(layout, budget_experts=12, bank_arrangement="parts")
    layer = layout.moe_layers[0]
    ids = list(range(12))
    cache.select(layer, ids)
    cache.select(layer, ids[6:])  # the later six the most recent
    cache.set_budget(budget_experts=4)
    kept = [e for e in ids if testing.read_expert(cache, layer, e) is not None]
    assert len(kept) == 4
    _rows_hold_their_experts(cache, source, layer, kept, cache.select_slots(layer, kept))
    for e in kept:
        assert (testing.read_expert(cache, layer, e) == source.expert_bytes(layer, e)).all()
    cache.set_budget(budget_experts=10)
    more = [20, 21, 22, 23, 24]
    _rows_hold_their_experts(cache, source, layer, kept + more, cache.select_slots(layer, kept + more))


@pytest.mark.parametrize("bad", ["rows", "SLOTS", "", 1, None])
def test_a_bad_arrangement_is_refused_before_c(bad):
    layout = _odd_layout()
    with HostSource(layout) as source, pytest.raises(ValueError, match="bank_arrangement must be one of"):
        ExpertCache(layout, source, budget_experts=2, backend="host", bank_arrangement=bad)


def test_the_config_defaults_to_slots_and_the_bank_reports_it():
    cfg = _lib.Config()
    _lib.lib.expcache_config_init(ctypes.byref(cfg))
    assert cfg.bank_arrangement == _lib.BANK_ARRANGEMENTS["slots"] == 0 and cfg.reserved2 == 0
    assert _lib.BANK_ARRANGEMENTS == {"slots": 0, "parts": 1}
