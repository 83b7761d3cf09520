"""asv: the library's hot paths, one call at a time, through the Python API.

Each benchmark holds a cache in a steady state (see :class:`benchmarks.Rig`) and
times one call, alternating layer 5 and layer 40 (two size classes in ``mixed``):

``time_select_hits``      select of 6 resident experts (bookkeeping only: Python, ctypes, C).
``time_select_misses``    select of 6 experts none of which is resident (6 evictions, 6 copies
                          from the host), then a synchronize so the copies are counted.
``time_load_compact``     load_compact of 6 experts from the host into one buffer, synchronized.
``time_prepare_batch``    prepare_batch of a real prompt's layer (54 tokens x 6 ids) on a cache
                          full of decode experts, finished and synchronized.
``track_select_overhead`` ns per all-hit select in a tight loop: what the engine pays per layer
                          per token before any GPU work.
``track_select_views_ratio`` an all-hit select_views (zero-copy tensor views) over an all-hit
                          select, in the same loop and process (target: at most 2).

No ``setup`` method, on purpose: asv (asv_runner >= 0.3) re-runs setup before every
timed call of a class that has one and times each call alone. The rig is built
lazily, once per benchmark process, in the first (warm-up) call instead, and each
sample times ``number`` calls back to back.
"""

from __future__ import annotations

import time

from . import BACKENDS, LAYOUTS, Rig, backend, skip_other_backends

BACKEND = backend()
_RIGS: dict = {}

# Calls per timed sample (about 10 ms each): tiny experts on the host, real ones
# (7-14 MiB, tens of them per batch) on the GPU.
_NUMBER = {
    "host": {"hits": 1000, "misses": 1000, "compact": 1000, "batch": 500},
    "cuda": {"hits": 1000, "misses": 10, "compact": 10, "batch": 2},
}[BACKEND]


class _State:
    def __init__(self, layout: str, which: str):
        self.rig = Rig(layout, which)
        self.hits = self.rig.hits_cache()
        self.misses = self.rig.misses_cache()
        self.compact = self.rig.compact_cache()
        self.batch = self.rig.batch_cache()
        self.prompts = {layer: self.rig.prompt_ids(layer) for layer in self.rig.LAYERS}


def _state(which: str, layout: str) -> _State:
    key = (which, layout)
    if key not in _RIGS:
        for old in _RIGS.values():  # one rig at a time: the GPU's pinned sources are GiBs
            old.rig.close()
        _RIGS.clear()
        _RIGS[key] = _State(layout, which)
    return _RIGS[key]


class HotPaths:
    params = (BACKENDS, LAYOUTS)
    param_names = ["backend", "layout"]
    skip_params = skip_other_backends(LAYOUTS)
    timeout = 600

    def time_select_hits(self, backend, layout):
        s = _state(backend, layout)
        s.rig.select_hit(s.hits)

    time_select_hits.number = _NUMBER["hits"]

    def time_select_misses(self, backend, layout):
        s = _state(backend, layout)
        s.rig.select_miss(s.misses)

    time_select_misses.number = _NUMBER["misses"]

    def time_load_compact(self, backend, layout):
        s = _state(backend, layout)
        s.rig.load_compact(s.compact)

    time_load_compact.number = _NUMBER["compact"]

    def time_prepare_batch(self, backend, layout):
        s = _state(backend, layout)
        s.rig.prepare_batch(s.batch, s.prompts)

    time_prepare_batch.number = _NUMBER["batch"]

    def track_select_overhead(self, backend, layout):
        """Best of 5 rounds of 5,000 all-hit selects of 6 experts: ns per select (lower is better)."""
        s = _state(backend, layout)
        rig, cache = s.rig, s.hits
        before = cache.stats().path("decode")
        calls = 5000
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter_ns()
            for _ in range(calls):
                rig.select_hit(cache)
            best = min(best, (time.perf_counter_ns() - t0) / calls)
        after = cache.stats().path("decode")
        if after.misses != before.misses or after.hits - before.hits != 5 * calls * Rig.K:
            raise RuntimeError("an all-hit select missed: the benchmark's set-up is wrong")
        return best

    track_select_overhead.unit = "ns"

    def track_select_views_ratio(self, backend, layout):
        """Best-of-5 ns of an all-hit select_views over that of an all-hit select, side by side."""
        s = _state(backend, layout)
        rig, cache = s.rig, s.hits
        if not hasattr(cache, "select_views"):
            raise NotImplementedError("no select_views at this commit")
        before = cache.stats().path("decode")
        calls = 5000

        def best(fn) -> float:
            out = float("inf")
            for _ in range(5):
                t0 = time.perf_counter_ns()
                for i in range(calls):
                    fn(rig.LAYERS[i % 2], rig.hot_ids)
                out = min(out, (time.perf_counter_ns() - t0) / calls)
            return out

        plain, views = best(cache.select), best(cache.select_views)
        after = cache.stats().path("decode")
        if after.misses != before.misses:
            raise RuntimeError("an all-hit select missed: the benchmark's set-up is wrong")
        return views / plain

    track_select_views_ratio.unit = "ratio"
