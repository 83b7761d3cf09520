"""Prefill batches by slot id (``prepare_batch(..., slots=True)``, C
``expcache_batch_prepare_slots_async``): every expert of a batch is a row of its class's bank,
the staged ones (no free capacity) in the bank's batch rows, so a kernel reads the whole batch by
``base + slot * stride``. On every cache: host lookup and device lookup, each backend, each policy.
The stateful fuzzing (tests/test_stateful.py) holds them to the reference model."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from pyexpcache import InvalidArgumentError, InvalidStateError, ModelLayout, _lib, testing

from support.cache import SCALE, assert_served, bank_rows, device_ids

#: Every test here that makes its caches through make_cache runs against both bank arrangements.
pytestmark = pytest.mark.arrangements

LOOKUPS = ["host", "device"]


def _cache(make_cache, lookup, experts=4):
    return make_cache(ModelLayout.preset("q2", scale=SCALE), budget_experts=experts, lookup=lookup, pinned=True)


@pytest.mark.parametrize("lookup", LOOKUPS)
def test_every_expert_of_a_batch_is_a_row_of_the_bank(make_cache, lookup):
    """Hits and appended misses are slots below the cap, the experts staged for want of a free slot
    batch rows past it; every row holds its expert's bytes, read at base + row * stride."""
    cache, source = _cache(make_cache, lookup)
    layer = cache.layout.moe_layers[0]
    cache.select(layer, [1, 2])  # two of the four slots
    with cache.prepare_batch(layer, np.array([[1, 3, 5, 7], [9, 11, 2, 13]]), slots=True) as batch:
        bank = cache.bank(layer)
        assert batch.ids.tolist() == [1, 3, 5, 7, 9, 11, 2, 13]
        assert batch.slots.dtype == np.int32
        rows = dict(zip(batch.ids.tolist(), batch.slots.tolist()))
        assert all(rows[e] < bank.cap for e in (1, 2, 3, 5))  # hits, and misses into the two free slots
        staged = [rows[e] for e in (7, 9, 11, 13)]
        assert all(bank.cap <= r < bank.rows for r in staged) and len(set(staged)) == 4
        assert_served(cache, source, layer, batch.ids, bank_rows(bank, batch.slots))
        assert (batch.pointers == np.array(bank_rows(bank, batch.slots), dtype=np.uint64)).all()
        assert cache.classes()[0].held_experts == 4
        assert cache.classes()[0].staging_bytes >= 4 * cache.classes()[0].slot_bytes
        st = cache.stats().path("batch")
        assert (st.hits, st.misses, st.appends, st.direct_loads) == (2, 6, 2, 4)
    assert cache.classes()[0].held_experts == 0


@pytest.mark.parametrize("lookup", LOOKUPS)
def test_batch_rows_are_taken_again_once_no_batch_holds_any(make_cache, lookup):
    """Two open batches stage in rows of their own; once both finish, the next batch's staged
    experts take the rows again from the first one."""
    cache, source = _cache(make_cache, lookup, experts=2)
    layer = cache.layout.moe_layers[0]
    cache.select(layer, [1, 2])  # the bank is full: a batch's misses are all staged
    a = cache.prepare_batch(layer, np.array([[10, 11, 12]]), slots=True)
    b = cache.prepare_batch(layer, np.array([[20, 21]]), slots=True)
    assert set(a.slots.tolist()).isdisjoint(b.slots.tolist())
    assert_served(cache, source, layer, a.ids, a.pointers)
    assert_served(cache, source, layer, b.ids, b.pointers)
    first = int(a.slots.min())
    a.finish()
    c = cache.prepare_batch(layer, np.array([[30]]), slots=True)
    assert int(c.slots[0]) == int(b.slots.max()) + 1  # b still holds its rows: after them
    b.finish()
    c.finish()
    d = cache.prepare_batch(layer, np.array([[40, 41]]), slots=True)
    assert d.slots.tolist() == [first, first + 1]
    assert_served(cache, source, layer, d.ids, d.pointers)
    d.finish()


@pytest.mark.parametrize("lookup", LOOKUPS)
def test_a_release_keeps_a_class_whose_batch_rows_are_in_use(make_cache, lookup):
    """A batch whose experts are all staged holds no slot, yet its rows must outlive a release:
    release_all keeps the class (as it keeps one with held slots) until the batch finishes."""
    cache, source = _cache(make_cache, lookup, experts=2)
    layer = cache.layout.moe_layers[0]
    cache.select(layer, [1, 2])
    with cache.prepare_batch(layer, np.array([[10, 11, 12]]), slots=True) as batch:
        assert cache.classes()[0].held_experts == 0
        cache.release_all()
        assert testing.read_expert(cache, layer, 1) is not None  # kept
        assert_served(cache, source, layer, batch.ids, batch.pointers)
    cache.release_all()
    assert testing.read_expert(cache, layer, 1) is None


@pytest.mark.parametrize("policy", ["lru"])  # which slots the batches get does not matter here
@pytest.mark.parametrize("lookup", LOOKUPS)
def test_open_batches_that_take_every_batch_row_are_told_to_finish(make_cache, lookup):
    """A class's batch rows (EXPCACHE_MAX_BATCH_ROWS) hold what its open batches by slot id stage;
    one more is refused with the reason and changes nothing, and once they finish it fits."""
    cache, source = _cache(make_cache, lookup, experts=2)
    layer = cache.layout.moe_layers[0]
    n = cache.layout[layer].num_experts
    cache.select(layer, [0, 1])
    ids = np.arange(2, n)  # every other expert: all staged
    batches = []
    while (len(batches) + 1) * ids.size <= _lib.MAX_BATCH_ROWS:
        batches.append(cache.prepare_batch(layer, ids[None, :], slots=True))
    before = cache.classes()
    with pytest.raises(InvalidStateError, match="batch rows.*finish batches first"):
        cache.prepare_batch(layer, ids[None, :], slots=True)
    assert cache.classes() == before
    assert_served(cache, source, layer, batches[-1].ids, batches[-1].pointers)
    for b in batches:
        b.finish()
    with cache.prepare_batch(layer, ids[None, :], slots=True) as batch:
        assert_served(cache, source, layer, batch.ids[:8], batch.pointers[:8])


def test_a_device_select_never_evicts_a_batch_by_slot_id(make_cache):
    """On a device-lookup cache the batch's hits and appends are pinned on the device: device selects
    evict around them until the batch finishes."""
    cache, source = _cache(make_cache, "device", experts=4)
    layer = cache.layout.moe_layers[0]
    with cache.prepare_batch(layer, np.array([[1, 2], [2, 3]]), slots=True) as batch:
        for e in (6, 7, 8):
            cache.select_device(layer, device_ids(cache, [e]))
        for e in (1, 2, 3):
            assert testing.read_expert(cache, layer, e) is not None
        assert_served(cache, source, layer, batch.ids, batch.pointers)
    cache.select_device(layer, device_ids(cache, [9, 10]))
    assert sum(testing.read_expert(cache, layer, e) is not None for e in (1, 2, 3)) < 3


def test_the_c_call_checks_its_ids(make_cache):
    cache, _ = _cache(make_cache, "host")
    layer = cache.layout.moe_layers[0]
    out_ids = np.zeros(4, dtype=np.uint32)
    out_slots = np.zeros(4, dtype=np.int32)
    count, handle = ctypes.c_uint32(), ctypes.c_uint64()

    def call(ids, id_bits, n=None):
        with cache.raw_handle() as h:
            return _lib.lib.expcache_batch_prepare_slots_async(
                h,
                layer,
                ids.ctypes.data,
                id_bits,
                ids.size if n is None else n,
                None,
                out_ids.ctypes.data,
                out_slots.ctypes.data,
                ctypes.byref(count),
                ctypes.byref(handle),
            )

    with pytest.raises(InvalidArgumentError, match="id_bits must be 32 or 64, got 16"):
        call(np.array([1, 2], dtype=np.int32), 16)
    with pytest.raises(InvalidArgumentError, match="expert id -3 \\(index 1\\) out of range"):
        call(np.array([1, -3], dtype=np.int32), 32)
    with pytest.raises(InvalidArgumentError, match="expert id 4294967296 \\(index 0\\) out of range"):
        call(np.array([1 << 32], dtype=np.int64), 64)
    with pytest.raises(InvalidArgumentError, match="n must be 1"):
        call(np.array([1], dtype=np.int32), 32, n=0)
    assert cache.stats().path("batch").calls == 0
    call(np.array([3, 1, 3], dtype=np.int64), 64)
    assert (count.value, out_ids[:2].tolist()) == (2, [3, 1])
    with cache.raw_handle() as h:
        _lib.lib.expcache_batch_finish(h, handle.value, None)
