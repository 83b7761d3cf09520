"""Stream safety of slot reuse (CUDA only): a slot is never overwritten while
work enqueued earlier on another stream may still read it."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pyexpcache import ExpertCache, HostSource, LayerSpec, ModelLayout, _cuda, testing

from support.cache import CUDA_OK, CUDA_REASON

pytestmark = pytest.mark.skipif(not CUDA_OK, reason=CUDA_REASON)

PART = 4 << 20  # 4 MiB per part, 12 MiB per expert
REPEATS = 8192  # one checksum kernel reading an expert this many times: ~100 GiB, milliseconds of work


@pytest.fixture
def cuda():
    """(runtime, stream A, stream B), destroyed afterwards."""
    rt = _cuda.runtime()
    a, b = (
        int(_cuda.check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreate")) for _ in range(2)
    )
    yield rt, a, b
    rt.cudaDeviceSynchronize()
    rt.cudaStreamDestroy(a)
    rt.cudaStreamDestroy(b)


def _long_read(cache: ExpertCache, ptrs, stream: int) -> None:
    """One kernel launch on `stream` that reads the expert at `ptrs` REPEATS times (the library's
    checksum kernel, result slots [0, REPEATS)). Enqueued at once, it runs for milliseconds
    whatever the host does meanwhile, so a later write that is not ordered after it lands
    while it still reads."""
    testing.checksum_async(cache, 0, np.tile(np.asarray(ptrs, dtype=np.uint64).reshape(1, 3), (REPEATS, 1)), 0, stream)


def _all_reads_saw(cache: ExpertCache, want: int) -> bool:
    return bool((testing.checksum_results(cache, 0, REPEATS) == want).all())


def _bytes_at(addr: int, n: int) -> np.ndarray:
    rt = _cuda.runtime()
    out = np.empty(n, np.uint8)
    _cuda.check(rt.cudaMemcpy(out.ctypes.data, addr, n, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost), "cudaMemcpy")
    return out


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
def test_eviction_on_another_stream_waits_for_earlier_reads(cuda, policy, pinned):
    rt, a, b = cuda
    layout = ModelLayout((LayerSpec(4, PART, PART, PART),), name="fence")
    with (
        HostSource(layout, pinned=pinned) as source,
        ExpertCache(layout, source, budget_experts=1, backend="cuda", log_level=0, policy=policy) as cache,
    ):
        old = cache.select(0, [0], stream=a)[0]
        cache.synchronize(a)
        _long_read(cache, old, a)  # a long read of expert 0's slot on stream A
        new = cache.select(0, [1], stream=b)[0]  # evicts expert 0: the same slot, on stream B
        assert int(new[0]) == int(old[0]), "the test needs the eviction to reuse the slot being read"
        _cuda.check(rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
        # Every read on A happened before B's upload overwrote the slot.
        assert _all_reads_saw(cache, source.expected_checksum(0, 0))
        assert (_bytes_at(int(new[0]), PART) == source.part(0, 1, 0)).all()


def test_race_is_observable_without_the_fence(cuda, policy):
    """Control: the same overwrite done by hand on stream B, with no fence, corrupts what A reads.
    Shows the tests around it would fail if the cache did not order the streams."""
    rt, a, b = cuda
    layout = ModelLayout((LayerSpec(2, PART, PART, PART),), name="race")
    with (
        HostSource(layout, pinned=True) as source,
        ExpertCache(layout, source, budget_experts=2, backend="cuda", log_level=0, policy=policy) as cache,
    ):
        old = cache.select(0, [0], stream=a)[0]
        cache.synchronize(a)
        _long_read(cache, old, a)
        h2d = rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        _cuda.check(rt.cudaMemcpyAsync(int(old[0]), source.part(0, 1, 0).ctypes.data, PART, h2d, b), "cudaMemcpyAsync")
        _cuda.check(rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
        raced = not _all_reads_saw(cache, source.expected_checksum(0, 0))
    if not raced:
        pytest.skip("could not provoke the race on this device; the fence tests prove less here")
    assert raced


def test_staging_reuse_on_another_stream_waits_for_earlier_reads(cuda, policy):
    """Select's overflow staging (capacity smaller than the request) is fenced the same way."""
    rt, a, b = cuda
    layout = ModelLayout((LayerSpec(8, PART, PART, PART),), name="fence-staging")
    with (
        HostSource(layout, pinned=True) as source,
        ExpertCache(layout, source, budget_experts=1, backend="cuda", log_level=0, policy=policy) as cache,
    ):
        first = cache.select(0, [0, 1], stream=a)  # expert 1 is served from staging
        cache.synchronize(a)
        _long_read(cache, first[1], a)
        second = cache.select(0, [2, 3], stream=b)  # reuses the staging for expert 3
        assert int(second[1][0]) == int(first[1][0])
        _cuda.check(rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
        assert _all_reads_saw(cache, source.expected_checksum(0, 1))


def test_split_select_misses_wait_for_earlier_reads_on_the_stream(cuda, policy):
    """The split select copies its misses on the cache's own stream: that stream waits for the
    work enqueued on the caller's before overwriting a slot."""
    rt, a, _ = cuda
    layout = ModelLayout((LayerSpec(4, PART, PART, PART),), name="fence-split")
    with (
        HostSource(layout, pinned=True) as source,
        ExpertCache(layout, source, budget_experts=1, backend="cuda", log_level=0, policy=policy) as cache,
    ):
        old = cache.select(0, [0], stream=a)[0]
        cache.synchronize(a)
        _long_read(cache, old, a)
        sel = cache.select_split(0, [1], stream=a)  # evicts expert 0: the same slot, on the copy stream
        assert not sel.resident[0] and sel.ready != 0
        assert int(sel.pointers[0][0]) == int(old[0])
        sel.wait(a)
        _cuda.check(rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
        assert _all_reads_saw(cache, source.expected_checksum(0, 0))
        assert (_bytes_at(int(sel.pointers[0][0]), PART) == source.part(0, 1, 0)).all()


def test_split_select_misses_are_whole_after_wait(cuda, policy):
    """Work enqueued after Selection.wait() reads the misses' bytes whole."""
    rt, a, _ = cuda
    layout = ModelLayout((LayerSpec(6, PART, PART, PART),), name="split-ready")
    with (
        HostSource(layout, pinned=True) as source,
        ExpertCache(layout, source, budget_experts=6, backend="cuda", log_level=0, policy=policy) as cache,
    ):
        for e in range(6):
            sel = cache.select_split(0, [e], stream=a)
            sel.wait(a)
            _long_read(cache, sel.pointers[0], a)
            cache.synchronize(a)
            assert _all_reads_saw(cache, source.expected_checksum(0, e)), f"expert {e} read before it landed"


@pytest.mark.parametrize("policy", ["lru"])  # the victim must be expert 0
def test_prefetch_waits_for_reads_of_older_calls(cuda, policy):
    """A prefetch may evict an expert used two serving calls ago; its pieces wait for the work
    enqueued on the stream before the previous call, so a kernel still reading it is safe."""
    rt, a, _ = cuda
    layout = ModelLayout((LayerSpec(5, PART, PART, PART),), name="fence-prefetch")
    with (
        HostSource(layout, pinned=True) as source,
        ExpertCache(
            layout, source, budget_experts=3, backend="cuda", log_level=0, policy=policy, prefetch_piece_bytes=1 << 20
        ) as cache,
    ):
        old = cache.select(0, [0], stream=a)[0]
        cache.synchronize(a)
        _long_read(cache, old, a)
        cache.select(0, [1], stream=a)
        cache.select(0, [2], stream=a)
        assert cache.prefetch(0, [3], stream=a) == 1  # evicts 0 (used two calls ago)
        cache.wait_prefetch()
        _cuda.check(rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
        assert _all_reads_saw(cache, source.expected_checksum(0, 0))
        got = cache.select(0, [3], stream=a)[0]
        assert int(got[0]) == int(old[0]), "the test needs the prefetch to reuse the slot being read"
        cache.synchronize(a)
        assert (_bytes_at(int(got[0]), PART) == source.part(0, 3, 0)).all()
        assert cache.prefetch_stats().used == 1


def test_a_select_right_after_a_prefetch_reads_whole_bytes(cuda, policy):
    """Whether the prefetch was cancelled, half sent or landed when the select came, the expert
    read on the select's stream is whole."""
    rt, a, _ = cuda
    layout = ModelLayout((LayerSpec(8, PART, PART, PART),), name="prefetch-then-select")
    with (
        HostSource(layout, pinned=True) as source,
        ExpertCache(
            layout, source, budget_experts=8, backend="cuda", log_level=0, policy=policy, prefetch_piece_bytes=256 << 10
        ) as cache,
    ):
        for e in range(8):
            cache.prefetch(0, [e], stream=a)
            time.sleep(0.0002 * e)  # from at once to after it landed
            ptrs = cache.select(0, [e], stream=a)[0]
            _long_read(cache, ptrs, a)
            cache.synchronize(a)
            assert _all_reads_saw(cache, source.expected_checksum(0, e)), f"expert {e}"
        p = cache.prefetch_stats()
        assert p.issued == 8 and p.used + p.late + p.cancelled == 8


@pytest.mark.parametrize("policy", ["lru"])
def test_a_miss_into_a_cancelled_prefetchs_slot_waits_for_its_pieces(cuda, policy):
    """A serving call waits for the copy stream only where it touches a prefetch's slot: a miss
    that takes the slot of a prefetch it cancelled lands after that prefetch's pieces in flight,
    never under them."""
    rt, a, _ = cuda
    layout = ModelLayout((LayerSpec(3, PART, PART, PART),), name="fence-cancelled")
    with (
        HostSource(layout, pinned=True) as source,
        ExpertCache(
            layout, source, budget_experts=2, backend="cuda", log_level=0, policy=policy, prefetch_piece_bytes=64 << 10
        ) as cache,
    ):
        ptrs = cache.select(0, [0], stream=a)[0]
        cache.synchronize(a)
        _long_read(cache, ptrs, a)
        cache.select(0, [0], stream=a)  # marked after the long read: the prefetch's pieces wait for it
        cache.select(0, [0], stream=a)
        assert cache.prefetch(0, [1], stream=a) == 1  # the second slot; its pieces wait
        got = cache.select(0, [2], stream=a)[0]  # cancels it and takes its slot
        cache.synchronize(a)
        p = cache.prefetch_stats()
        assert p.cancelled == 1 and p.pieces >= 1, p
        assert int(got[0]) != int(ptrs[0])
        for part in range(3):
            assert (_bytes_at(int(got[part]), PART) == source.part(0, 2, part)).all(), f"part {part}"
