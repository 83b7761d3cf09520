"""pyexpcache.testing: the test hooks live there, not among ExpertCache's methods. Each hook takes
the cache first and goes through its call gate. The hooks' behaviour is tested where it is used
(test_cache, test_prefetch, test_threads, test_multi, ...), against every backend and policy;
here, the wall and one pass over every hook on each backend."""

from __future__ import annotations

import numpy as np
import pytest

from pyexpcache import CacheClosedError, CudaError, ExpertCache, HostSource, ModelLayout, MultiDeviceCache, testing

from support.cache import SCALE

HOOKS = sorted(name for name in testing.__all__ if name != "CHECKSUM_RESULTS")


def test_the_hooks_are_the_modules_functions():
    assert HOOKS == [
        "bank_checksum_async",
        "checksum",
        "checksum_async",
        "checksum_results",
        "device_bytes_in_use",
        "device_reads",
        "fail_copy_after",
        "fail_device_alloc_after",
        "fail_staging_after",
        "pause_prefetch",
        "read_device",
        "read_expert",
        "table_reads",
    ]
    assert all(callable(getattr(testing, name)) for name in HOOKS)
    assert testing.CHECKSUM_RESULTS == 65536


@pytest.mark.parametrize("cls", [ExpertCache, MultiDeviceCache])
def test_caches_have_no_hook_among_their_methods(cls):
    assert not [name for name in dir(cls) if name in HOOKS]


def test_an_open_cache_has_no_hook_either(make_cache):
    cache, _ = make_cache(budget_experts=4)
    assert not [name for name in dir(cache) if name in HOOKS]


def test_every_hook_on_the_backend(make_cache):
    cache, source = make_cache(budget_experts=8)
    assert testing.device_bytes_in_use(cache) == 0
    ids = [1, 2, 3]
    ptrs = cache.select(3, ids)
    assert testing.device_bytes_in_use(cache) > 0
    for e in ids:
        assert (testing.read_expert(cache, 3, e) == source.expert_bytes(3, e)).all()
    assert testing.read_expert(cache, 3, 4) is None
    assert (testing.read_device(cache, int(ptrs[0][0]), cache.layout[3].class_key[0]) == source.part(3, 1, 0)).all()
    want = [source.expected_checksum(3, e) for e in ids]
    assert testing.checksum(cache, 3, ptrs).tolist() == want
    testing.checksum_async(cache, 3, ptrs, 5)
    cache.synchronize()
    assert testing.checksum_results(cache, 5, 3).tolist() == want
    with pytest.raises(ValueError, match="n must be at most"):
        testing.checksum_results(cache, 0, testing.CHECKSUM_RESULTS + 1)
    testing.fail_copy_after(cache, 0)
    with pytest.raises(CudaError):
        cache.select(3, [5])
    assert testing.read_expert(cache, 3, 5) is None
    testing.fail_device_alloc_after(cache, 0, 0)
    testing.fail_staging_after(cache, 0, 0)
    testing.pause_prefetch(cache)
    testing.pause_prefetch(cache, False)


def test_hooks_go_through_the_call_gate(make_cache):
    cache, _ = make_cache(budget_experts=4)
    ptrs = cache.select(3, [1])
    cache.close()
    calls = {
        "bank_checksum_async": lambda: testing.bank_checksum_async(cache, 3, np.zeros(1, np.int32), 0),
        "checksum": lambda: testing.checksum(cache, 3, ptrs),
        "checksum_async": lambda: testing.checksum_async(cache, 3, ptrs, 0),
        "checksum_results": lambda: testing.checksum_results(cache, 0, 1),
        "device_bytes_in_use": lambda: testing.device_bytes_in_use(cache),
        "device_reads": lambda: testing.device_reads(cache),
        "fail_copy_after": lambda: testing.fail_copy_after(cache, 0),
        "fail_device_alloc_after": lambda: testing.fail_device_alloc_after(cache, 0),
        "fail_staging_after": lambda: testing.fail_staging_after(cache, 0),
        "pause_prefetch": lambda: testing.pause_prefetch(cache),
        "read_device": lambda: testing.read_device(cache, int(ptrs[0][0]), 8),
        "read_expert": lambda: testing.read_expert(cache, 3, 1),
        "table_reads": lambda: testing.table_reads(cache, 3),
    }
    assert sorted(calls) == HOOKS
    for call in calls.values():
        with pytest.raises(CacheClosedError, match="closed"):
            call()


def test_a_multi_device_cache_is_refused_with_its_caches_named():
    layout = ModelLayout.preset("q2", scale=SCALE)
    with (
        HostSource(layout) as source,
        MultiDeviceCache(layout, source, devices=[0, 1], budget_experts=4, backend="host", log_level=0) as multi,
    ):
        with pytest.raises(TypeError, match=r"takes an ExpertCache \(a MultiDeviceCache's are its .caches\)"):
            testing.read_expert(multi, 3, 1)
        assert testing.read_expert(multi.caches[1], 3, 1) is None
