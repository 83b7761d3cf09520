"""Contract suite of the cache core, run against every backend and every eviction policy
(tests/conftest.py's make_cache). Tests whose assertions depend on one policy's victim order
pin it (``@pytest.mark.parametrize("policy", ["lru"])``) and say why."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from pyexpcache import (
    ExpcacheWarning,
    InvalidArgumentError,
    InvalidStateError,
    LayerSpec,
    ModelLayout,
    OutOfDeviceMemoryError,
    testing,
)

from support.cache import SCALE, assert_served


def small(num_layers=4, num_experts=16, quant="q2"):
    base = ModelLayout.preset(quant, scale=SCALE)
    return ModelLayout(tuple(LayerSpec(num_experts, *base[0].class_key) for _ in range(num_layers)), name="small")


def test_select_serves_source_bytes(make_cache):
    cache, source = make_cache(small(), budget_experts=8)
    for layer in range(4):
        ids = [layer, 7, 15, 3]
        ptrs = cache.select(layer, ids)
        assert ptrs.shape == (4, 3)
        assert_served(cache, source, layer, ids, ptrs)
        for e in ids:
            assert (testing.read_expert(cache, layer, e) == source.expert_bytes(layer, e)).all()


def test_select_counts_hits_and_misses(make_cache):
    cache, _ = make_cache(small(), budget_experts=8)
    cache.select(0, [1, 2, 3])
    cache.select(0, [2, 3, 4])
    st = cache.stats().path("decode")
    assert (st.calls, st.hits, st.misses, st.appends, st.evictions) == (2, 2, 4, 4, 0)
    assert st.hit_rate == pytest.approx(2 / 6)
    assert st.bytes_h2d == 4 * cache.layout[0].expert_bytes


def test_full_class_evicts_one_resident_expert_per_miss(make_cache):
    """Whatever the policy: a miss on a full class evicts exactly one expert of another call and
    the new one is resident, with its bytes."""
    cache, source = make_cache(small(), budget_experts=3)
    for e in (0, 1, 2):
        cache.select(0, [e])
    cache.select(0, [0])
    cache.select(0, [3])
    resident = [e for e in range(4) if testing.read_expert(cache, 0, e) is not None]
    assert len(resident) == 3 and 3 in resident
    for e in resident:
        assert (testing.read_expert(cache, 0, e) == source.expert_bytes(0, e)).all()
    st = cache.stats().path("decode")
    assert (st.hits, st.misses, st.evictions) == (1, 4, 1)


@pytest.mark.parametrize("policy", ["lru"])  # which expert goes is LRU's victim order
def test_lru_evicts_least_recently_used(make_cache):
    cache, _ = make_cache(small(), budget_experts=3)
    for e in (0, 1, 2):
        cache.select(0, [e])
    cache.select(0, [0])  # 1 is now least recently used
    cache.select(0, [3])  # evicts 1
    assert testing.read_expert(cache, 0, 1) is None
    assert all(testing.read_expert(cache, 0, e) is not None for e in (0, 2, 3))
    assert cache.stats().path("decode").evictions == 1


def test_duplicate_ids_served_once_with_same_pointers(make_cache):
    cache, source = make_cache(small(), budget_experts=8)
    ids = [5, 5, 9, 5, 9, 1]
    ptrs = cache.select(2, ids)
    assert (ptrs[0] == ptrs[1]).all() and (ptrs[0] == ptrs[3]).all() and (ptrs[2] == ptrs[4]).all()
    st = cache.stats().path("decode")
    assert st.misses == 3 and st.hits == 0
    assert_served(cache, source, 2, ids, ptrs)


def test_miss_never_evicts_expert_of_same_call(make_cache):
    cache, source = make_cache(small(), budget_experts=3)
    cache.select(0, [0, 1, 2])
    # 0 and 1 are hits of this call; the miss 3 must evict 2, the only one not in the call.
    ptrs = cache.select(0, [1, 3, 0])
    assert testing.read_expert(cache, 0, 2) is None
    assert_served(cache, source, 0, [1, 3, 0], ptrs)


def test_request_larger_than_class_capacity_served_through_staging(make_cache):
    cache, source = make_cache(small(), budget_experts=2)
    ids = [0, 1, 2, 3, 4, 5]
    ptrs = cache.select(1, ids)
    assert_served(cache, source, 1, ids, ptrs)
    st = cache.stats().path("decode")
    assert st.misses == 6 and st.direct_loads == 4
    assert cache.classes()[0].resident_experts == 2
    # Staging is reused by the next call and still serves the right bytes.
    ptrs = cache.select(1, [10, 11, 12, 13, 0])
    assert_served(cache, source, 1, [10, 11, 12, 13, 0], ptrs)


def test_mixed_q2_q4_alternation_is_all_hits_after_warmup(make_cache):
    layout = ModelLayout.preset("mixed", scale=SCALE)
    cache, source = make_cache(layout, budget_experts=6 * 40)
    rng = np.random.default_rng(0)
    pattern = [(layer, rng.choice(256, 6, replace=False)) for layer in range(3, 43)]
    for layer, ids in pattern:  # warm-up
        cache.select(layer, ids)
    cache.reset_stats()
    for _ in range(3):
        for layer, ids in pattern:
            cache.select(layer, ids)
    stats = cache.stats()
    assert len(stats.classes) == 2
    assert stats.path("decode").misses == 0 and stats.path("decode").hits == 3 * 40 * 6
    for c in stats.classes:
        assert c.total.releases == 0
    cache.reset_stats()
    # From a cold cache: exactly one cap notice per class, however often the sizes alternate.
    cache2, _ = make_cache(layout, budget_experts=6 * 40)
    for _ in range(4):
        for layer, ids in pattern:
            cache2.select(layer, ids)
    stats2 = cache2.stats()
    assert [c.total.cap_notices for c in stats2.classes] == [1, 1]
    assert sum(c.total.releases for c in stats2.classes) == 0
    assert stats2.path("decode").misses == 40 * 6


def test_prefill_batch_leaves_decode_working_set_resident(make_cache):
    layout = ModelLayout.preset("q2", scale=SCALE)
    cache, source = make_cache(layout, budget_experts=40 * 6 * 2)
    rng = np.random.default_rng(1)
    decode = [[(layer, rng.choice(256, 6, replace=False)) for layer in range(3, 43)] for _ in range(2)]
    for token in decode:
        for layer, ids in token:
            cache.select(layer, ids)
    # A 2,000-token prompt at every layer: far more experts than the cache holds.
    for layer in range(3, 43):
        prompt = np.stack([rng.choice(256, 6, replace=False) for _ in range(2000)])
        with cache.prepare_batch(layer, prompt) as batch:
            assert sorted(batch.ids.tolist()) == sorted(set(prompt.ravel().tolist()))
            assert_served(cache, source, layer, batch.ids[:8], batch.pointers[:8])
    assert cache.stats().path("batch").evictions == 0
    cache.reset_stats()
    for token in decode:
        for layer, ids in token:
            cache.select(layer, ids)
    assert cache.stats().path("decode").misses == 0


def test_batch_appends_into_free_capacity_only(make_cache):
    cache, source = make_cache(small(), budget_experts=4)
    cache.select(0, [0, 1])
    with cache.prepare_batch(0, [[0, 2], [3, 4], [5, 2]]) as batch:
        assert batch.ids.tolist() == [0, 2, 3, 4, 5]
        assert_served(cache, source, 0, batch.ids, batch.pointers)
    st = cache.stats().path("batch")
    assert (st.hits, st.misses, st.appends, st.direct_loads, st.evictions) == (1, 4, 2, 2, 0)
    assert testing.read_expert(cache, 0, 1) is not None  # the decode expert survived


def test_batch_appends_are_evicted_first(make_cache):
    cache, _ = make_cache(small(), budget_experts=3)
    cache.select(0, [0])
    cache.prepare_batch(0, [[1, 2]]).finish()
    cache.select(0, [3])  # evicts a cold append, not the decode expert 0
    assert testing.read_expert(cache, 0, 0) is not None


def test_batch_holds_slots_until_finished(make_cache):
    cache, source = make_cache(small(), budget_experts=2)
    batch = cache.prepare_batch(0, [[0, 1]])
    ptrs = cache.select(0, [2, 3])  # cannot evict 0 or 1: served through staging
    assert_served(cache, source, 0, [2, 3], ptrs)
    assert cache.stats().path("decode").direct_loads == 2
    assert_served(cache, source, 0, batch.ids, batch.pointers)
    batch.finish()
    batch.finish()  # idempotent
    cache.select(0, [2, 3])
    assert testing.read_expert(cache, 0, 2) is not None and testing.read_expert(cache, 0, 0) is None


def test_batch_finish_rejects_unknown_batch(make_cache):
    cache, _ = make_cache(small(), budget_experts=2)
    batch = cache.prepare_batch(0, [[0]])
    batch.finish()
    from pyexpcache._lib import lib

    with pytest.raises(InvalidArgumentError, match="unknown or already finished"):
        lib.expcache_batch_finish(cache._handle, batch.handle, 0)


def test_too_many_unfinished_batches(make_cache):
    cache, _ = make_cache(small(), budget_experts=2)
    batches = [cache.prepare_batch(0, [[i % 16]]) for i in range(64)]
    with pytest.raises(InvalidStateError, match="unfinished"):
        cache.prepare_batch(0, [[1]])
    for b in batches:
        b.finish()
    cache.prepare_batch(0, [[1]]).finish()


def three_class_layout():
    return ModelLayout(
        (
            LayerSpec(8, 512, 512, 640),
            LayerSpec(8, 1024, 1024, 1024),
            LayerSpec(8, 264, 264, 336),
            LayerSpec(8, 512, 512, 640),
        ),
        name="three",
    )


def test_more_classes_than_max_classes_reuses_least_recent_class(make_cache, caplog):
    with pytest.warns(ExpcacheWarning, match="3 expert size classes and max_classes is 2"):
        cache, source = make_cache(three_class_layout(), budget_experts=4, max_classes=2)
    with (
        caplog.at_level(logging.INFO, logger="pyexpcache"),
        pytest.warns(ExpcacheWarning, match="reused it .*raise max_classes"),
    ):  # the first reuse
        for _ in range(3):
            for layer in range(4):
                ptrs = cache.select(layer, [1, 2])
                assert_served(cache, source, layer, [1, 2], ptrs)
    stats = cache.stats()
    assert len(stats.classes) == 2
    assert sum(c.total.class_reuses for c in stats.classes) > 0
    assert any("more size classes than max_classes" in r.message for r in caplog.records)


def test_max_classes_sixteen(make_cache):
    layers = tuple(LayerSpec(4, 256 + 8 * i, 256, 256) for i in range(16))
    cache, source = make_cache(ModelLayout(layers), budget_experts=2, max_classes=16)
    for layer in range(16):
        cache.select(layer, [0, 1])
    assert len(cache.classes()) == 16
    assert sum(c.total.class_reuses for c in cache.stats().classes) == 0


def test_compact_buffer_layout_and_bytes(make_cache):
    cache, source = make_cache(small(), budget_experts=8)
    cache.select(0, [1, 2])
    ids = [2, 5, 1, 5]
    buf = cache.load_compact(0, ids)
    spec = cache.layout[0]
    assert buf.num_experts == 4 and buf.gate_bytes == spec.gate_bytes
    assert buf.up_offset >= 4 * spec.gate_bytes and buf.down_offset >= buf.up_offset + 4 * spec.up_bytes
    assert_served(cache, source, 0, ids, buf.pointers())
    whole = testing.read_device(cache, buf.base, buf.nbytes)
    gate = whole[: 4 * spec.gate_bytes].reshape(4, -1)
    for i, e in enumerate(ids):
        assert (gate[i] == source.part(0, e, 0)).all()
    st = cache.stats().path("compact")
    assert (st.hits, st.misses) == (2, 1)
    assert st.bytes_d2d == 2 * spec.expert_bytes and st.bytes_h2d == 2 * spec.expert_bytes  # 5 is copied twice
    assert testing.read_expert(cache, 0, 5) is None  # compact loads do not change residency


def test_compact_retries_once_after_releasing_the_cache(make_cache):
    cache, source = make_cache(small(), budget_experts=8)
    cache.select(0, [0, 1, 2])
    testing.fail_device_alloc_after(cache, 0, count=1)
    buf = cache.load_compact(0, [0, 3])
    assert_served(cache, source, 0, [0, 3], buf.pointers())
    st = cache.stats()
    assert st.path("compact").alloc_retries == 1
    assert st.path("compact").releases == 1
    assert testing.read_expert(cache, 0, 1) is None  # the cache was released for the retry
    assert st.path("compact").misses == 2  # ... so 0 was read from the host


def test_compact_fails_cleanly_after_second_failure(make_cache):
    cache, source = make_cache(small(), budget_experts=8)
    cache.select(0, [0, 1, 2])
    testing.fail_device_alloc_after(cache, 0, count=2)
    with pytest.raises(OutOfDeviceMemoryError, match="even after releasing"):
        cache.load_compact(0, [0, 3])
    assert testing.device_bytes_in_use(cache) == 0  # slots released, nothing leaked
    assert cache.stats().path("compact").alloc_retries == 1
    # The cache is consistent and usable.
    ptrs = cache.select(0, [0, 1, 4])
    assert_served(cache, source, 0, [0, 1, 4], ptrs)
    buf = cache.load_compact(0, [4, 0])
    assert_served(cache, source, 0, [4, 0], buf.pointers())


def test_slot_allocation_failure_caps_the_class(make_cache):
    # Slots of 3 MiB: a piece of 2 slots is a whole number of the CUDA backend's 2 MiB granules.
    layout = ModelLayout((LayerSpec(8, 1 << 20, 1 << 20, 1 << 20),), name="three-mib")
    cache, source = make_cache(layout, budget_experts=8, slab_bytes=2 * 3 << 20)
    cache.select(0, [0, 1])  # the first piece of the bank: 2 slots
    testing.fail_device_alloc_after(cache, 0, count=1)
    ptrs = cache.select(0, [2, 3])  # growth fails: the class is capped at 2 and evicts
    assert_served(cache, source, 0, [2, 3], ptrs)
    info = cache.classes()[0]
    assert info.cap_experts == 2 and info.allocated_experts == 2
    assert cache.stats().path("decode").cap_notices == 2


def test_budget_bytes_shared_in_proportion_to_class_bytes(make_cache):
    layout = ModelLayout.preset("mixed", scale=SCALE)
    cache, _ = make_cache(layout, budget_bytes=layout.total_bytes // 10)
    for layer in (0, 40):
        cache.bind_class(layer)
    infos = {c.key: c for c in cache.classes()}
    q2, q4 = layout[0].class_key, layout[40].class_key
    # Same fraction of each class's experts, within one slot of rounding.
    frac_q2 = infos[q2].target_experts / (37 * 256)
    frac_q4 = infos[q4].target_experts / (6 * 256)
    assert abs(frac_q2 - frac_q4) < 2 / (6 * 256)
    used = sum(c.target_experts * c.slot_bytes for c in infos.values())
    assert used <= layout.total_bytes // 10


def test_reserve_limits_the_cap(backend, make_cache):
    if backend != "host":
        pytest.skip("the emulated device capacity exists on the host backend only")
    slot = 2304
    cache, _ = make_cache(small(), budget_experts=64, device_capacity_bytes=20 * slot, reserve_bytes=10 * slot)
    cache.select(0, list(range(16)))
    info = cache.classes()[0]
    assert info.target_experts == 64 and info.cap_experts == 10
    assert cache.stats().path("decode").direct_loads == 6


def test_reserve_env_overrides_config(backend, make_cache, monkeypatch):
    if backend != "host":
        pytest.skip("the emulated device capacity exists on the host backend only")
    monkeypatch.setenv("EXPCACHE_RESERVE_GB", "0.5")
    cache, _ = make_cache(small(), budget_experts=64, device_capacity_bytes=(1 << 29) + 5 * 2304, reserve_bytes=0)
    cache.select(0, list(range(8)))
    assert cache.classes()[0].cap_experts == 5


def test_cap_notice_only_when_cap_changes(make_cache, caplog):
    cache, _ = make_cache(small(), budget_experts=4)
    with caplog.at_level(logging.INFO, logger="pyexpcache"):
        for _ in range(5):
            for layer in range(4):
                cache.select(layer, [1, 2, 3])
        cache.release_all()
        cache.select(0, [1])
    notices = [r for r in caplog.records if "cap 4 experts" in r.message]
    assert len(notices) == 1
    assert cache.stats().classes[0].total.cap_notices == 1


def test_release_all_frees_slots_and_keeps_layout(make_cache):
    cache, source = make_cache(small(), budget_experts=4)
    cache.select(0, [1, 2])
    assert testing.device_bytes_in_use(cache) > 0
    cache.release_all()
    assert testing.device_bytes_in_use(cache) == 0
    assert testing.read_expert(cache, 0, 1) is None
    assert cache.stats().path("control").releases == 1
    ptrs = cache.select(0, [1, 2])
    assert_served(cache, source, 0, [1, 2], ptrs)


def test_reset_stats_zeroes_counters(make_cache):
    cache, _ = make_cache(small(), budget_experts=4)
    cache.select(0, [1, 2])
    cache.reset_stats()
    assert cache.stats().total == type(cache.stats().total)()


def test_verbose_logs_one_line_per_call(make_cache, monkeypatch, caplog):
    monkeypatch.setenv("EXPCACHE_VERBOSE", "1")
    cache, _ = make_cache(small(), budget_experts=4)
    with caplog.at_level(logging.DEBUG, logger="pyexpcache"):
        cache.select(0, [1])
        cache.select(0, [1, 2])
    lines = [r.message for r in caplog.records if r.message.startswith("select")]
    assert len(lines) == 2 and "1 hits" in lines[1]


def test_expert_major_source_is_copied_whole(make_cache):
    layout = small()
    cache, source = make_cache(layout, budget_experts=4, arrangement="expert")
    ptrs = cache.select(0, [3, 1])
    assert_served(cache, source, 0, [3, 1], ptrs)


def test_checksum_kernel_matches_source(make_cache):
    layout = ModelLayout((LayerSpec(4, 520, 1000, 333),), name="odd")  # unaligned sizes, tails
    cache, source = make_cache(layout, budget_experts=2)
    ptrs = cache.select(0, [0, 1, 2])
    sums = testing.checksum(cache, 0, ptrs)
    assert sums.tolist() == [source.expected_checksum(0, e) for e in (0, 1, 2)]
    # A corrupted expectation is detected: the sums differ per expert.
    assert len(set(sums.tolist())) == 3


def test_closed_cache_raises(make_cache):
    cache, _ = make_cache(small(), budget_experts=4)
    cache.close()
    cache.close()
    with pytest.raises(ValueError, match="closed"):
        cache.select(0, [1])


def test_checksum_many_experts_and_multi_chunk_parts(make_cache):
    # > 24 ranges per call (the kernel's job table path) and parts spanning several 256 KiB chunks.
    layout = ModelLayout((LayerSpec(12, 600_000, 300_000, 700_001),), name="big")
    cache, source = make_cache(layout, budget_experts=12)
    ids = list(range(12))
    ptrs = cache.select(0, ids)
    assert testing.checksum(cache, 0, ptrs).tolist() == [source.expected_checksum(0, e) for e in ids]
    buf = cache.load_compact(0, ids[::-1])
    assert testing.checksum(cache, 0, buf.pointers()).tolist() == [source.expected_checksum(0, e) for e in ids[::-1]]


@pytest.mark.parametrize("copy_threads", [0, 1, 4])
def test_pageable_source_staged_through_the_pinned_ring(make_cache, copy_threads):
    # 1 MiB ring = eight 128 KiB chunks: experts of ~1.3 MiB cross many chunks and reuse every buffer.
    layout = ModelLayout((LayerSpec(16, 400_000, 400_000, 500_008),), name="pageable")
    cache, source = make_cache(
        layout,
        pinned=False,
        budget_experts=4,
        copy_threads=copy_threads,
        staging_bytes=1 << 20,
        staging_chunk_bytes=128 << 10,
    )
    for ids in ([0, 1, 2, 3], [4, 5, 0, 6], [7, 8, 9, 10, 11, 12]):
        ptrs = cache.select(0, ids)
        assert testing.checksum(cache, 0, ptrs).tolist() == [source.expected_checksum(0, e) for e in ids]
    buf = cache.load_compact(0, [13, 14, 15])
    assert_served(cache, source, 0, [13, 14, 15], buf.pointers())


def test_a_ring_of_two_chunks_serves_many_threads(make_cache):
    # Eight threads and two 512 KiB chunks: every piece waits for its chunk's previous one to be
    # sent, and each chunk is reused many times within one call.
    layout = ModelLayout((LayerSpec(12, 700_000, 700_000, 900_104),), name="two-chunks")
    cache, source = make_cache(
        layout, pinned=False, budget_experts=4, copy_threads=8, staging_bytes=1 << 20, staging_chunk_bytes=512 << 10
    )
    for ids in ([0, 1, 2, 3], [4, 5, 6, 7, 8, 9], [10, 11, 0]):
        ptrs = cache.select(0, ids)
        assert testing.checksum(cache, 0, ptrs).tolist() == [source.expected_checksum(0, e) for e in ids]
    assert_served(cache, source, 0, [8, 9, 1], cache.load_compact(0, [8, 9, 1]).pointers())
    assert cache.staging_stats().pieces >= 13 * -(-layout[0].expert_bytes // (512 << 10))


@pytest.mark.parametrize("copy_threads", [1, 4])
@pytest.mark.parametrize("skip", [0, 3, 9])
def test_failed_staged_piece_leaves_none_of_the_calls_experts_resident(make_cache, copy_threads, skip):
    from pyexpcache import CudaError

    layout = ModelLayout((LayerSpec(16, 400_000, 400_000, 500_008),), name="staged-fault")
    cache, source = make_cache(
        layout,
        pinned=False,
        budget_experts=6,
        copy_threads=copy_threads,
        staging_bytes=1 << 20,
        staging_chunk_bytes=128 << 10,
    )
    cache.select(0, [0, 1])
    testing.fail_staging_after(cache, skip)
    # Each expert is three uploads of several pieces: the failing piece is inside this call.
    with pytest.raises(CudaError, match="injected staging failure"):
        cache.select(0, [0, 2, 3, 4])
    assert testing.read_expert(cache, 0, 0) is not None  # the call's hit stays
    for e in (2, 3, 4):  # whatever was uploaded before the failing piece is not resident either
        assert testing.read_expert(cache, 0, e) is None
    _consistent(cache, source, layout)
    # The next calls are served, byte for byte; batches and compact loads fail the same way.
    ptrs = cache.select(0, [2, 3, 4])
    assert testing.checksum(cache, 0, ptrs).tolist() == [source.expected_checksum(0, e) for e in (2, 3, 4)]
    testing.fail_staging_after(cache, skip)
    with pytest.raises(CudaError, match="injected staging failure"):
        cache.load_compact(0, [5, 6, 7])
    testing.fail_staging_after(cache, skip)
    with pytest.raises(CudaError, match="injected staging failure"):
        cache.prepare_batch(0, [[8, 9], [10, 11]])
    for e in (8, 9, 10, 11):
        assert testing.read_expert(cache, 0, e) is None
    assert all(c.held_experts == 0 for c in cache.classes())  # the failed batch holds nothing
    _consistent(cache, source, layout)
    assert_served(cache, source, 0, [5, 6, 7], cache.load_compact(0, [5, 6, 7]).pointers())


_THREADS_CANNOT_START = """
import resource
from pyexpcache import ExpcacheError, ExpertCache, HostSource, LayerSpec, ModelLayout, testing

layout = ModelLayout((LayerSpec(16, 400_000, 400_000, 500_008),), name="threads-cannot-start")
with HostSource(layout, pinned=False) as source, \\
        ExpertCache(layout, source, budget_experts=6, backend="host", copy_threads=8, staging_bytes=1 << 20,
                    staging_chunk_bytes=128 << 10, log_level=0, policy=POLICY) as cache:
    cache.bind_class(0)  # reserves the class's bank: address space, counted by RLIMIT_AS
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmSize:"))
    # Room for the slots of 6 experts, the ring's eight 136 KiB chunks and its queue; none for
    # a thread's 8 MiB stack.
    resource.setrlimit(resource.RLIMIT_AS, (vm + 6 * 1_300_008 + (4 << 20), hard))
    try:
        cache.select(0, [0, 1, 2])
        print("no error")
    except ExpcacheError as e:
        print(type(e).__name__, e)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    print(*[testing.read_expert(cache, 0, e) is None for e in range(3)])
    cache.reset_stats()
    ids = [3, 4, 5, 6, 7, 8]
    ptrs = cache.select(0, ids)
    st = cache.stats().total
    print(st.misses, st.direct_loads,
          testing.checksum(cache, 0, ptrs).tolist() == [source.expected_checksum(0, e) for e in ids])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="limits the address space with RLIMIT_AS (Linux)")
def test_staging_threads_that_cannot_start_fail_the_call_and_free_its_slot(policy):
    """The staging ring starts its threads on the first staged upload; when the system refuses
    them (here: no address space for their stacks), that upload fails with a status and the slot
    it was filling is free again: the next call of the whole budget loads every expert into a slot,
    none directly, byte for byte (the ring goes on with the threads it has)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    code = _THREADS_CANNOT_START.replace("POLICY", repr(policy))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("InternalError") and "an upload could not be set up" in lines[0], lines
    assert lines[1:] == ["True True True", "6 0 True"], lines


@pytest.mark.parametrize("copy_threads", [1, 4])
def test_staging_stats_count_what_the_ring_moved(make_cache, copy_threads):
    from pyexpcache import StagingStats

    layout = ModelLayout((LayerSpec(16, 400_000, 400_000, 500_008),), name="pageable")
    cache, source = make_cache(
        layout,
        pinned=False,
        budget_experts=4,
        copy_threads=copy_threads,
        staging_bytes=1 << 20,
        staging_chunk_bytes=128 << 10,
    )
    assert cache.staging_stats() == StagingStats()
    cache.select(0, [0, 1, 2])
    st = cache.staging_stats()
    expert = layout[0].expert_bytes
    assert st.calls == 1
    assert st.bytes == 3 * expert == cache.stats().total.bytes_h2d
    assert st.pieces >= 3 * -(-expert // (128 << 10))  # no piece is larger than a chunk
    assert st.fill_ns > 0 and st.send_ns > 0
    assert 1 <= st.sends <= st.pieces
    assert 0 < st.first_fill_ns <= st.span_ns  # the first piece is filled before the last is sent
    if copy_threads == 1:  # no workers: the calling thread fills every piece, never waits, sends each alone
        assert st.caller_fills == st.pieces and st.wait_ns == 0 and st.sends == st.pieces
    cache.select(0, [0, 1, 2])  # all hits: nothing staged
    assert cache.staging_stats().calls == 1
    cache.reset_stats()
    assert cache.staging_stats() == StagingStats()


def test_staged_pieces_filled_together_are_sent_together(make_cache):
    """The pieces the workers have filled by the time the caller comes to send go to the link in
    one transfer (a cudaMemcpyBatchAsync on the CUDA backend), and arrive byte-exact."""
    layout = ModelLayout((LayerSpec(32, 300_000, 300_000, 300_008),), name="pageable")
    cache, source = make_cache(
        layout, pinned=False, budget_experts=32, copy_threads=4, staging_bytes=4 << 20, staging_chunk_bytes=64 << 10
    )
    for first in range(0, 32, 8):  # 8 misses of ~0.9 MiB a call: ~14 pieces each
        experts = list(range(first, first + 8))
        assert_served(cache, source, 0, experts, cache.select(0, experts))
    st = cache.staging_stats()
    assert st.bytes == 32 * layout[0].expert_bytes
    # Four workers fill while the caller sends: sooner or later it finds several pieces ready.
    assert 1 <= st.sends < st.pieces, st
    _consistent(cache, source, layout)


def test_pinned_uploads_of_a_call_go_together(backend, policy):
    """Pinned uploads wait until the end of their call and then go to the link together (one
    cudaMemcpyBatchAsync on the CUDA backend; the host backend copies them one by one, and takes
    that path for a source declared pinned). Every part lands, in a call of over a thousand
    uploads too, and a copy failing in the middle of a call leaves no resident expert with
    wrong bytes."""
    from pyexpcache import CudaError, ExpertCache, HostSource

    layout = ModelLayout((LayerSpec(400, 4096, 4096, 8200),), name="many-parts")  # 3 uploads an expert
    with HostSource(layout, pinned=backend == "cuda", arrangement="tensor") as source:
        source.pinned = True  # host backend: the library copies "pinned" memory directly, whatever it is
        with ExpertCache(layout, source, backend=backend, budget_experts=400, log_level=2, policy=policy) as cache:
            ids = np.arange(400)
            assert_served(cache, source, 0, ids[:6], cache.select(0, ids[:6]))
            with cache.prepare_batch(0, ids[6:].reshape(2, 197)) as batch:  # 1,182 uploads in one call
                assert sorted(batch.ids.tolist()) == list(range(6, 400))
                assert_served(cache, source, 0, batch.ids, batch.pointers)
            assert cache.stats().total.bytes_h2d == 400 * layout[0].expert_bytes
            cache.release_all()
            testing.fail_copy_after(cache, 700)
            with pytest.raises(CudaError, match="injected copy failure"):
                cache.prepare_batch(0, ids.reshape(4, 100))
            _consistent(cache, source, layout)
            assert all(c.held_experts == 0 for c in cache.classes())
            assert_served(cache, source, 0, ids[::7], cache.select(0, ids[::7]))


def _consistent(cache, source, layout):
    """Every resident expert holds exactly its source bytes."""
    for layer in layout.moe_layers:
        for e in range(layout[layer].num_experts):
            got = testing.read_expert(cache, layer, e)
            if got is not None:
                assert (got == source.expert_bytes(layer, e)).all(), f"({layer}, {e}) resident with wrong bytes"


@pytest.mark.parametrize("skip", range(8))
def test_failed_copy_never_leaves_a_wrong_resident_expert(make_cache, skip):
    from pyexpcache import CudaError

    layout = small(num_layers=2, num_experts=12)
    cache, source = make_cache(layout, budget_experts=3)
    cache.select(0, [0, 1, 2])
    # Every path, with the (skip+1)-th copy of the sequence failing.
    testing.fail_copy_after(cache, skip, count=1)
    failures = 0
    for step in (
        lambda: cache.select(0, [3, 4, 0]),
        lambda: cache.select(0, [5, 6, 7, 8, 9]),
        lambda: cache.load_compact(0, [1, 3, 10]),
        lambda: cache.prepare_batch(1, [[0, 1], [2, 3]]).finish(),
        lambda: cache.prepare_batch(0, [[10, 11], [4, 5]]).finish(),
    ):
        try:
            step()
        except CudaError as exc:
            assert "injected copy failure" in str(exc)
            failures += 1
        _consistent(cache, source, layout)
    assert failures == 1
    # Still fully usable afterwards.
    ptrs = cache.select(0, [11, 3, 0])
    assert_served(cache, source, 0, [11, 3, 0], ptrs)
    assert all(c.held_experts == 0 for c in cache.classes())


def test_checksum_async_layer_after_layer_without_waiting(make_cache):
    """Select and checksum every layer of a token back to back, one wait at the end: each
    kernel still reads the bytes its select served (stream order), even where a later layer
    evicts them, and the sync checksum in between does not disturb the async slots."""
    layout = small(num_layers=4, num_experts=16)
    cache, source = make_cache(layout, budget_experts=3)  # every layer evicts the previous layers' experts
    rng = np.random.default_rng(3)
    expected = []
    for _token in range(3):
        for layer in range(4):
            ids = rng.choice(16, 3, replace=False)
            ptrs = cache.select(layer, ids)
            testing.checksum_async(cache, layer, ptrs, first=len(expected))
            expected += [source.expected_checksum(layer, int(e)) for e in ids]
        mid = cache.select(0, [15])
        assert testing.checksum(cache, 0, mid).tolist() == [source.expected_checksum(0, 15)]
    cache.synchronize()
    assert testing.checksum_results(cache, 0, len(expected)).tolist() == expected


def test_layer_class_is_the_deprecated_spelling_of_bind_class(make_cache):
    """bind_class binds and returns the class index; layer_class, its old name, warns and agrees."""
    cache, _ = make_cache(budget_experts=8)
    layer = cache.layout.moe_layers[0]
    index = cache.bind_class(layer)
    assert cache.classes()[0].index == index
    with pytest.warns(DeprecationWarning, match="use bind_class"):
        assert cache.layer_class(layer) == index


def test_find_class_by_part_sizes(make_cache):
    """An engine that knows its experts' sizes finds their class (and its cap) once a layer of them
    is bound; before that, or for sizes no layer has, the error says which case it is."""
    cache, _ = make_cache(ModelLayout.preset("mixed", scale=SCALE), budget_experts=8)
    by_sizes = cache.layout.classes()  # (gate, up, down) -> layers
    (small, small_layers), (large, large_layers) = sorted(by_sizes.items())[:2]
    with pytest.raises(InvalidStateError, match=f"bind one of their layers first \\(layer {small_layers[0]} has them"):
        cache.find_class(*small)
    index = cache.bind_class(large_layers[0])
    assert cache.find_class(*large) == index
    info = next(c for c in cache.classes() if c.index == index)
    assert (info.gate_bytes, info.up_bytes, info.down_bytes) == large
    with pytest.raises(InvalidArgumentError, match="no registered layer has experts of gate 1, up 2, down 3"):
        cache.find_class(1, 2, 3)
    with pytest.raises(ValueError, match="gate_bytes"):
        cache.find_class(-1, 2, 3)
