"""Object lifetimes: a source outlives the caches reading it, whatever the order of the
``with`` blocks, and a cache closed while other threads call it never crashes. The crashes
these guard against are reproduced in child processes, so the suite survives a regression."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from pyexpcache import CacheClosedError, ExpertCache, HostSource, ModelLayout, testing

from support.cache import CUDA_OK, CUDA_REASON, SCALE
from support.child import close_while_threads_call, run_child


def layout():
    return ModelLayout.preset("q2", scale=SCALE)


@pytest.mark.parametrize("arrangement", ["tensor", "expert"])
def test_cache_serves_right_bytes_after_its_source_with_block_ends(backend, policy, arrangement):
    lay = layout()
    pinned = backend == "cuda"
    with HostSource(lay, pinned=pinned, arrangement=arrangement) as src:
        cache = ExpertCache(lay, src, budget_experts=4, backend=backend, log_level=0, policy=policy)
        want = {e: src.expert_bytes(7, e) for e in range(12)}
    # The source is closed, but the cache still uses it: its memory stays until the cache closes.
    assert src.closed and src.users == 1 and src.nbytes > 0
    try:
        for e in range(12):  # 12 misses through 4 slots: every one copies from the source
            cache.select(7, [e])
            assert (testing.read_expert(cache, 7, e) == want[e]).all()
    finally:
        cache.close()
    assert src.users == 0 and src.nbytes == 0  # released with its last cache


def test_closed_source_refuses_new_caches():
    lay = layout()
    src = HostSource(lay)
    src.close()
    with pytest.raises(ValueError, match="closed"):
        ExpertCache(lay, src, budget_experts=4, backend="host")


def test_source_shared_by_two_caches_is_released_by_the_last(backend, policy):
    lay = layout()
    src = HostSource(lay, pinned=backend == "cuda")
    want = [src.expert_bytes(3, e) for e in range(3)]
    a = ExpertCache(lay, src, budget_experts=2, backend=backend, log_level=0, policy=policy)
    b = ExpertCache(lay, src, budget_experts=2, backend=backend, log_level=0, policy=policy)
    src.close()
    a.close()
    assert src.nbytes > 0 and src.users == 1
    for e in range(3):
        b.select(3, [e])
        assert (testing.read_expert(b, 3, e) == want[e]).all()
    b.close()
    assert src.nbytes == 0 and src.users == 0


def test_failed_cache_creation_does_not_hold_the_source():
    lay = layout()
    src = HostSource(lay)
    with pytest.raises(ValueError):
        ExpertCache(lay, src, backend="host")  # no budget: the library refuses the config
    assert src.users == 0
    src.close()
    assert src.nbytes == 0


@pytest.mark.parametrize(
    "kind", ["pageable", pytest.param("pinned", marks=pytest.mark.skipif(not CUDA_OK, reason=CUDA_REASON))]
)
def test_explicit_source_close_then_misses_in_a_child(kind, policy):
    # Before the lifetime rule: a pinned source's close() freed its memory under the live cache,
    # and the next miss copied freed memory (wrong bytes; with a GGUF mapping, SIGSEGV).
    pinned = kind == "pinned"
    out = run_child(f"""
        from pyexpcache import ExpertCache, HostSource, ModelLayout, testing
        lay = ModelLayout.preset("q2", scale=4096)
        src = HostSource(lay, pinned={pinned})
        want = {{e: src.expert_bytes(9, e) for e in range(40)}}
        cache = ExpertCache(lay, src, budget_experts=4, backend="{"cuda" if pinned else "host"}", log_level=0,
                            policy={policy!r})
        src.close()
        bad = 0
        for e in range(40):
            cache.select(9, [e])
            bad += not (testing.read_expert(cache, 9, e) == want[e]).all()
        cache.close()
        print("bad", bad)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["bad", "0"]


def test_gguf_source_closed_under_a_live_cache_in_a_child(tmp_path, policy):
    pytest.importorskip("gguf")
    from support.gguf_files import Q4, write_model

    path = write_model(tmp_path / "m.gguf", [Q4] * 3)
    out = run_child(f"""
        from pyexpcache import ExpertCache, testing
        from pyexpcache.gguf import GGUFSource
        with GGUFSource({str(path)!r}) as src:
            want = {{(l, e): src.expert_bytes(l, e) for l in src.layout.moe_layers for e in range(8)}}
            cache = ExpertCache(src.layout, src, budget_experts=2, backend="host", log_level=0, policy={policy!r})
        bad = 0
        for (l, e), b in want.items():   # past the with block: every miss reads the mapping
            cache.select(l, [e])
            bad += not (testing.read_expert(cache, l, e) == b).all()
        src.close()                      # idempotent; the mapping still belongs to the cache
        cache.select(0, [7]); cache.select(0, [6])
        bad += not (testing.read_expert(cache, 0, 6) == want[(0, 6)]).all()
        cache.close()
        print("bad", bad, "closed", src.closed, "bytes", src.nbytes)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["bad", "0", "closed", "True", "bytes", "0"]


def test_close_while_threads_select_in_a_child(policy):
    # Before the call gate: SIGSEGV 3 times of 3 (close destroyed the handle under running selects).
    out = close_while_threads_call(
        f'ExpertCache(lay, src, budget_experts=16, backend="host", log_level=0, policy={policy!r})',
        """
        cache.select(int(rng.integers(3, 43)), rng.choice(256, 6, replace=False).astype(np.uint32))
        cache.stats()
        """,
        attempts=3,
    )
    assert out.returncode == 0, f"rc {out.returncode}: {out.stderr[-2000:]}"
    assert out.stdout.strip() == "ok"


def test_calls_after_close_raise_the_closed_error(make_cache):
    cache, _ = make_cache(budget_experts=4)
    cache.select(3, [1])
    cache.close()
    cache.close()  # idempotent
    assert cache.closed
    for call in (
        lambda: cache.select(3, [1]),
        cache.stats,
        cache.release_all,
        lambda: testing.read_expert(cache, 3, 1),
        lambda: cache.prepare_batch(3, [[1]]),
        lambda: cache.load_compact(3, [1]),
        cache.synchronize,
    ):
        with pytest.raises(CacheClosedError, match="closed"):
            call()


def test_close_waits_for_a_call_in_flight(make_cache):
    cache, _ = make_cache(budget_experts=4)
    with cache.raw_handle():  # a call in flight, as the benchmark's C replay loop holds it
        closer = threading.Thread(target=cache.close)
        closer.start()
        closer.join(0.2)
        assert closer.is_alive(), "close() returned while a call was in flight"
    closer.join(10)
    assert not closer.is_alive() and cache.closed


def test_batch_finish_after_close_raises(make_cache):
    cache, _ = make_cache(budget_experts=8)
    batch = cache.prepare_batch(3, np.array([[1, 2]], dtype=np.uint32))
    cache.close()
    with pytest.raises(CacheClosedError):
        batch.finish()


DROPPED_CHILD = """
    import gc, resource, weakref
    from pyexpcache import ExpertCache, HostSource, ModelLayout
    gc.disable()  # what is freed here is freed by reference counts alone
    lay = ModelLayout.preset("mixed", scale=4096)
    src = HostSource(lay)

    def make_and_drop(n):
        for i in range(n):
            cache = ExpertCache(lay, src, budget_bytes=lay.total_bytes // 8, backend="host", policy="lru")
            cache.select(5, [1, 2, 3])
            views = cache.select_views(40, [4])  # a view pins the cache's memory
            del views
            cache = None  # rebinding, no close()

    def rss_kib():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

    make_and_drop(300)
    before = rss_kib()
    make_and_drop(3000)
    grown = rss_kib() - before
    probe = ExpertCache(lay, src, budget_bytes=lay.total_bytes // 8, backend="host", policy="lru")
    ref = weakref.ref(probe)
    del probe
    print("grown_kib", grown, "collected", ref() is None, "users", src._users)
"""


def test_caches_dropped_without_close_free_their_memory_in_a_child():
    # Each cache's callbacks used to hold it in reference cycles: its emulated device memory,
    # staging and source stayed until the cyclic collector ran (3,000 caches: +250 MiB).
    out = run_child(DROPPED_CHILD, timeout=300)
    assert out.returncode == 0, out.stderr
    words = out.stdout.split()
    assert words[0] == "grown_kib" and words[2] == "collected", out.stdout
    assert words[3] == "True", out.stdout  # closed by its last reference
    assert int(words[1]) < 16 * 1024, out.stdout  # flat: 3,000 caches later, under 16 MiB more
    assert words[5] == "0", out.stdout  # every dropped cache let go of the source
