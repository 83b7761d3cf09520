"""pytest-benchmark micro benchmarks of the hot paths and the offline simulators.

Run (from the repository root, after `make lib`):

    python -m pytest benchmarks/test_micro.py                      # measure
    python -m pytest benchmarks/test_micro.py --benchmark-disable  # quick: each once, as tests

Each benchmark checks the library's counters afterwards (so it is also a test of
the set-up: an all-hit select really hit, a batch never evicted) and records hit
rate and bytes moved per call in ``extra_info`` (in the saved JSON and in
``--benchmark-columns``-independent reports). The regression gate is described in
benchmarks/README.md.
"""

from __future__ import annotations

import functools

import pytest

from benchmarks import LAYOUTS, Rig  # the asv package, benchmarks/benchmarks/ (no pytest in there)
from expcache_bench.sim import simulate_belady, simulate_lru
from expcache_bench.traces import load_decode_trace


@functools.cache
def _no_cuda() -> str:
    """Why the CUDA backend cannot run here ("" when it can). Asked only when a CUDA test
    runs, never at import: asv imports this module in the process it forks benchmarks from."""
    from pyexpcache import _cuda
    from pyexpcache._lib import library_path

    if library_path.name == "libexpcache_host.so":
        return f"{library_path.name} is the host-only build"
    if _cuda.device_count() == 0:
        return "no CUDA device (or cuda-python missing)"
    return ""


@pytest.fixture(scope="module", params=[(b, q) for b in ("host", "cuda") for q in LAYOUTS], ids=lambda p: "-".join(p))
def rig(request):
    """One rig per backend and layout, shared by the module's tests."""
    backend, layout = request.param
    if backend == "cuda" and _no_cuda():
        pytest.skip(_no_cuda())
    r = Rig(layout, backend)
    yield r
    r.close()


def _record(benchmark, before, after, path: str) -> dict:
    """Counters of ``path`` between two stats(), per call, into extra_info."""
    a, b = before.path(path), after.path(path)
    calls = b.calls - a.calls
    hits, misses = b.hits - a.hits, b.misses - a.misses
    delta = {
        "calls": calls,
        "hits": hits,
        "misses": misses,
        "evictions": b.evictions - a.evictions,
        "appends": b.appends - a.appends,
        "direct_loads": b.direct_loads - a.direct_loads,
        "bytes_h2d": b.bytes_h2d - a.bytes_h2d,
        "bytes_d2d": b.bytes_d2d - a.bytes_d2d,
    }
    benchmark.extra_info.update(
        path=path,
        hit_rate=hits / (hits + misses) if hits + misses else 0.0,
        bytes_moved_per_call=(delta["bytes_h2d"] + delta["bytes_d2d"]) / max(calls, 1),
        experts_per_call=(hits + misses) / max(calls, 1),
    )
    return delta


def test_select_all_hits(benchmark, rig):
    cache = rig.hits_cache()
    before = cache.stats()
    benchmark(rig.select_hit, cache)
    d = _record(benchmark, before, cache.stats(), "decode")
    assert d["calls"] >= 1
    assert d["hits"] == Rig.K * d["calls"] and d["misses"] == 0 and d["bytes_h2d"] == 0


def test_select_all_misses(benchmark, rig):
    cache = rig.misses_cache()
    before = cache.stats()
    benchmark(rig.select_miss, cache)
    d = _record(benchmark, before, cache.stats(), "decode")
    assert d["calls"] >= 1
    assert d["misses"] == Rig.K * d["calls"] and d["hits"] == 0
    assert d["bytes_h2d"] >= Rig.K * d["calls"] * min(rig.layout[i].expert_bytes for i in Rig.LAYERS)


def test_load_compact(benchmark, rig):
    cache = rig.compact_cache()
    before = cache.stats()
    benchmark(rig.load_compact, cache)
    d = _record(benchmark, before, cache.stats(), "compact")
    assert d["calls"] >= 1
    assert d["hits"] + d["misses"] == Rig.K * d["calls"] and d["bytes_h2d"] > 0


def test_prepare_batch(benchmark, rig):
    cache = rig.batch_cache()
    prompts = {layer: rig.prompt_ids(layer) for layer in Rig.LAYERS}
    before = cache.stats()
    benchmark(rig.prepare_batch, cache, prompts)
    d = _record(benchmark, before, cache.stats(), "batch")
    assert d["calls"] >= 1
    assert d["evictions"] == 0, "a prefill batch evicted the decode working set"
    assert d["appends"] == 0, "the cache was full: nothing may be appended"
    assert d["hits"] > 0 and d["direct_loads"] == d["misses"] > 0


# ---------------------------------------------------------------------------
# The offline simulators on a bundled trace (no library involved)

TRACE = "podA_c_python_full"
CAPACITY_FRACTION = 0.10  # of every layer's 256 experts, as one shared class


@pytest.fixture(scope="module")
def trace():
    return load_decode_trace(TRACE)


def _sim_info(benchmark, result, trace) -> None:
    benchmark.extra_info.update(
        trace=TRACE,
        tokens=trace.num_tokens,
        capacity=list(result.capacity),
        requests=result.requests,
        hit_rate=result.hit_rate,
        evictions=int(result.evictions.sum()),
    )


def test_simulate_lru(benchmark, trace):
    capacity = int(CAPACITY_FRACTION * trace.num_layers * trace.num_experts)
    result = benchmark(simulate_lru, trace, capacity)
    _sim_info(benchmark, result, trace)
    assert result.requests == trace.num_requests - _duplicates(trace)
    assert 0.0 < result.hit_rate < 1.0


def test_simulate_belady(benchmark, trace):
    capacity = int(CAPACITY_FRACTION * trace.num_layers * trace.num_experts)
    result = benchmark(simulate_belady, trace, capacity)
    _sim_info(benchmark, result, trace)
    lru = simulate_lru(trace, capacity)
    benchmark.extra_info["lru_hit_rate"] = lru.hit_rate
    assert result.requests == lru.requests
    assert result.hit_rate >= lru.hit_rate  # the clairvoyant reference is never worse here


def _duplicates(trace) -> int:
    """Requests a call repeats (served once): ids repeated within one (token, layer)."""
    ids = trace.ids.reshape(-1, trace.k)
    return int(sum(trace.k - len(set(row)) for row in ids.tolist()))
