"""Slot ids from host selects (``expcache_select_slots_async``, ``ExpertCache.select_slots``) and
the banks every cache has: the rows a select gives hold the experts' bytes, the counters are the
plain select's, what gets no slot is staged in the bank's staging rows, and the bank's address never
moves while its class lives (releases give its memory back unless a view keeps it)."""

from __future__ import annotations

import numpy as np
import pytest

from pyexpcache import ExpertCache, HostSource, InvalidArgumentError, LayerSpec, ModelLayout, _lib, testing

from support.cache import SCALE, assert_served, bank_rows, device_ids

#: Every test here that makes its caches through make_cache runs against both bank arrangements.
pytestmark = pytest.mark.arrangements


def _layout():
    return ModelLayout.preset("q2", scale=SCALE)


def _served(cache, source, layer, ids, slots):
    bank = cache.bank(layer)
    assert all(0 <= s < bank.rows for s in slots)
    assert_served(cache, source, layer, ids, bank_rows(bank, slots))


def test_select_slots_serves_bank_rows_with_the_selects_counters(make_cache):
    """The same ids through select_slots on one cache and select on another: equal counters and
    residency, and every slot's row holds its expert's bytes; duplicates share a row."""
    layout = _layout()
    by_slot, source = make_cache(layout, budget_experts=6)
    by_ptr, _ = make_cache(layout, budget_experts=6)
    layer = layout.moe_layers[0]
    rng = np.random.default_rng(7)
    for _ in range(12):
        ids = rng.integers(0, layout[layer].num_experts, 4)
        slots = by_slot.select_slots(layer, ids)
        by_ptr.select(layer, ids)
        assert slots.dtype == np.int32 and slots.shape == (4,)
        assert len({int(s) for s in slots}) == len(set(ids.tolist()))
        _served(by_slot, source, layer, ids, slots)
    assert by_slot.stats().total == by_ptr.stats().total
    assert by_slot.classes()[0].resident_experts == by_ptr.classes()[0].resident_experts


def test_slots_index_the_bank_below_the_cap_when_the_class_holds_them(make_cache):
    cache, source = make_cache(_layout(), budget_experts=8)
    layer = cache.layout.moe_layers[0]
    slots = cache.select_slots(layer, [3, 1, 4, 1, 5])
    info = cache.classes()[0]
    assert all(0 <= s < info.cap_experts for s in slots)
    assert cache.bank(layer).cap == info.allocated_experts
    _served(cache, source, layer, [3, 1, 4, 1, 5], slots)


def test_what_gets_no_slot_is_staged_in_the_banks_last_rows(make_cache):
    """A class of 2 slots asked for 5 experts: 2 in slots, 3 staged in rows past the slots, read
    through the same base and stride, byte for byte; counted as direct loads, as select's are."""
    cache, source = make_cache(_layout(), budget_experts=2)
    layer = cache.layout.moe_layers[0]
    ids = [0, 1, 2, 3, 4]
    slots = cache.select_slots(layer, ids)
    bank = cache.bank(layer)
    cached = [s for s in slots if s < 2]
    staged = [s for s in slots if s >= 2]
    assert len(cached) == 2 and len(staged) == 3 and len(set(staged)) == 3
    # The staging rows: past the slots, before the batch rows (the bank's last MAX_BATCH_ROWS).
    assert all(bank.cap <= s < bank.rows - _lib.MAX_BATCH_ROWS for s in staged)
    _served(cache, source, layer, ids, slots)
    assert cache.stats().total.direct_loads == 3


def test_int64_ids_through_the_c_abi(make_cache):
    cache, source = make_cache(_layout(), budget_experts=4)
    layer = cache.layout.moe_layers[0]
    ids = np.array([5, 2, 5], dtype=np.int64)
    out = np.full(3, -7, dtype=np.int32)
    with cache._gate:
        _lib.lib.expcache_select_slots_async(cache._handle, layer, ids.ctypes.data, 64, 3, out.ctypes.data, None)
    assert out[0] == out[2] and out[0] != out[1] and (out >= 0).all()
    _served(cache, source, layer, ids.tolist(), out.tolist())


@pytest.mark.parametrize("dtype,bits", [(np.int32, 32), (np.int64, 64)])
def test_the_address_select_takes_a_routers_ids_as_they_are(make_cache, dtype, bits):
    """expcache_select_ids_async: expcache_select_async with int32 or int64 ids, the same addresses
    and counters as the uint32 call's."""
    cache, source = make_cache(_layout(), budget_experts=4)
    layer = cache.layout.moe_layers[0]
    ids = np.array([5, 2, 5, 7], dtype=dtype)
    ptrs = np.zeros((4, 3), dtype=np.uint64)
    with cache._gate:
        _lib.lib.expcache_select_ids_async(cache._handle, layer, ids.ctypes.data, bits, 4, None, ptrs.ctypes.data)
    assert (ptrs[0] == ptrs[2]).all() and not (ptrs[0] == ptrs[1]).all()
    assert_served(cache, source, layer, ids.tolist(), ptrs)
    again = cache.select(layer, ids.astype(np.uint32))
    assert (again == ptrs).all()
    st = cache.stats().path("decode")
    assert (st.calls, st.hits, st.misses) == (2, 3, 3)


def test_out_is_filled_and_checked(make_cache):
    cache, _ = make_cache(_layout(), budget_experts=4)
    layer = cache.layout.moe_layers[0]
    out = np.empty(2, dtype=np.int32)
    assert cache.select_slots(layer, [1, 2], out=out) is out
    with pytest.raises(ValueError, match="out must be a writable contiguous int32"):
        cache.select_slots(layer, [1, 2], out=np.empty(2, dtype=np.int64))
    with pytest.raises(ValueError, match="out must be"):
        cache.select_slots(layer, [1, 2], out=np.empty(3, dtype=np.int32))
    with pytest.raises(ValueError, match="must be in"):
        cache.select_slots(layer, [-1])
    with pytest.raises(InvalidArgumentError, match="out of range"):
        cache.select_slots(layer, [cache.layout[layer].num_experts])


def test_the_bank_keeps_its_address_across_releases_and_gives_memory_back(make_cache):
    """release_all unmaps a host-lookup bank nobody views (its memory is given back) and keeps
    its address: the next selects map it again at the same place."""
    cache, source = make_cache(_layout(), budget_experts=6)
    layer = cache.layout.moe_layers[0]
    base = cache.bank(layer).gate.ptr  # the view is dropped at once
    cache.select_slots(layer, [0, 1, 2])
    assert testing.device_bytes_in_use(cache) > 0
    cache.release_all()
    assert testing.device_bytes_in_use(cache) == 0
    assert cache.classes()[0].allocated_experts == 0
    slots = cache.select_slots(layer, [3, 4])
    assert cache.bank(layer).gate.ptr == base
    _served(cache, source, layer, [3, 4], slots)


def test_a_viewed_bank_stays_mapped_through_a_release(make_cache):
    """A bank someone holds a view of is emptied by a release, not unmapped (the view may be read
    by work in flight or captured in a graph): same address, its memory still in use."""
    cache, source = make_cache(_layout(), budget_experts=6)
    layer = cache.layout.moe_layers[0]
    bank = cache.bank(layer)
    cache.select_slots(layer, [0, 1, 2])
    used, allocated = testing.device_bytes_in_use(cache), cache.classes()[0].allocated_experts
    cache.release_all()
    info = cache.classes()[0]
    assert info.resident_experts == 0 and info.allocated_experts == allocated > 0
    assert testing.device_bytes_in_use(cache) == used
    slots = cache.select_slots(layer, [5, 6])
    assert cache.bank(layer).gate.ptr == bank.gate.ptr
    _served(cache, source, layer, [5, 6], slots)


def test_a_class_reused_for_other_sizes_gets_a_bank_of_its_stride(backend):
    """max_classes 1 and two sizes: the class is released and reused, with a bank of the new
    stride; each bank serves its own layers' experts."""
    layout = ModelLayout((LayerSpec(8, 1024, 1024, 2048), LayerSpec(8, 512, 512, 1024)), name="two-sizes")
    with (
        HostSource(layout, pinned=backend == "cuda") as source,
        ExpertCache(layout, source, budget_experts=4, backend=backend, max_classes=1, log_level=0) as cache,
    ):
        first = cache.select_slots(0, [1, 2])
        _served(cache, source, 0, [1, 2], first)
        stride = cache.bank(0).slot_stride
        slots = cache.select_slots(1, [3, 4])
        _served(cache, source, 1, [3, 4], slots)
        assert cache.bank(1).slot_stride != stride


def test_select_slots_on_a_device_lookup_cache(make_cache):
    """A device-lookup bank is all mapped when bound; what its 4 slots cannot hold is staged in its
    staging rows, as on a host-lookup cache."""
    cache, source = make_cache(_layout(), budget_experts=4, lookup="device", policy="lru")
    layer = cache.layout.moe_layers[0]
    bank = cache.bank(layer)
    assert bank.cap == 4 and bank.rows > bank.cap + _lib.MAX_SELECT + _lib.MAX_BATCH_ROWS - 1
    slots = cache.select_slots(layer, [1, 2, 1])
    _served(cache, source, layer, [1, 2, 1], slots)
    ids = [0, 1, 2, 3, 4, 5]
    slots = cache.select_slots(layer, ids)
    assert sum(s >= bank.cap for s in slots) == 2
    _served(cache, source, layer, ids, slots)


def test_bank_checksum_reads_staged_rows(make_cache):
    """The bank checksum (the reading kernel of the benchmarks) reads slots and staged rows
    alike, and equals the source's sums (the slots where the kernel reads them: on the device on
    CUDA)."""
    cache, source = make_cache(_layout(), budget_experts=2)
    layer = cache.layout.moe_layers[0]
    ids = [0, 1, 2, 3]
    slots = cache.select_slots(layer, ids)
    testing.bank_checksum_async(cache, layer, device_ids(cache, slots, dtype="int32"), 0)  # read by the kernel
    cache.synchronize()
    sums = testing.checksum_results(cache, 0, len(ids))
    assert sums.tolist() == [source.expected_checksum(layer, e) for e in ids]
