"""asv: the main benchmark (``expcache_bench``; ``pyexpcache.bench`` at older commits) tracked over commits.

Replays real DeepSeek V4 Flash routing through the library with the LRU policy (the
``expcache`` variant at commits where LRU was the default, ``lru`` after) and, where the
commit has it, with OppClassLRU (``oppclass``), per layout
(uniform q2, mixed q2-q4) and scenario (``decode``: decode traces back to back;
``prefill``: each bundled prompt prefilled at every layer, then decode). Every
number comes from ``bench.run``'s :class:`VariantResult`, whose hits, misses and
bytes are the library's own counters; Belady is ``simulate_belady`` at the
library's per-class capacities. The replays run once per commit, in
``setup_cache``, and every ``track_`` reads its number from there.
"""

from __future__ import annotations

import inspect

from . import (
    BACKENDS,
    BUDGET_GIB,
    LAYOUTS,
    GiB,
    backend,
    replay_scale,
    replay_traces,
    skip_other_backends,
    suite_module,
)

BACKEND = backend()
SCENARIOS = ["decode", "prefill"]


def run_replays() -> dict:
    """{(layout, scenario): numbers} for every layout and scenario, run on BACKEND."""
    try:
        from pyexpcache import ModelLayout

        bench = suite_module()
    except ImportError:  # a commit from before the benchmark existed: the tracks are skipped
        return {}
    scale = replay_scale(BACKEND)
    traces = replay_traces(BACKEND)
    budget = int(BUDGET_GIB * GiB / scale)
    # Where bench.run can reuse a Bench, both scenarios share one source (on the GPU a
    # full-size pinned source takes long to fill); older commits build one per run.
    shared = "bench" in inspect.signature(bench.run).parameters
    out = {}
    for quant in LAYOUTS:
        layout = ModelLayout.preset(quant, scale=scale)
        kwargs = {}
        if shared:
            kwargs["bench"] = bench.Bench(layout, backend=BACKEND, budget_bytes=budget)
        try:
            for scenario in SCENARIOS:
                out[(quant, scenario)] = _replay(bench, layout, scenario, traces, budget, scale, kwargs)
        finally:
            if shared:
                kwargs["bench"].close()
    return out


def _replay(bench, layout, scenario, traces, budget, scale, kwargs) -> dict:
    # The LRU variant (Replay's graphs) was named "expcache" while LRU was the default, "lru" after;
    # the OppClassLRU variant rides along where the commit has it (its own graphs: ReplayPolicy).
    # The variants are bench.variants() (read from the library's policy table) since that exists,
    # the constant bench.VARIANTS before; the series keep their names either way.
    names = bench.variants() if callable(getattr(bench, "variants", None)) else getattr(bench, "VARIANTS", ())
    lru = "lru" if "lru" in names else "expcache"
    variants = (lru, "oppclass") if "oppclass" in names else (lru,)
    report = bench.run(
        layout,
        scenario,
        variants=variants,
        traces=traces,
        budget_bytes=budget,
        backend=BACKEND,
        host_scale=scale,
        **kwargs,
    )
    if report.backend != BACKEND:
        raise RuntimeError(f"asked for the {BACKEND} backend, ran on {report.backend}")
    for x in report.results:
        if x.checksum_errors:
            raise RuntimeError(
                f"{layout.name} {scenario} {x.variant}: {x.checksum_errors} experts served with wrong bytes"
            )
    by_variant = {x.variant: x for x in report.results}
    r = by_variant[lru]
    opp = by_variant.get("oppclass")
    return {
        "oppclass_hit_rate": opp.hit_rate if opp else None,
        "oppclass_tokens_per_s": opp.tokens_per_s if opp else None,
        "tokens_per_s": r.tokens_per_s,
        "hit_rate": r.hit_rate,
        "belady_hit_rate": r.belady_hit_rate,
        "gib_per_token": r.gib_per_token,
        "link_bound_tokens_per_s": r.link_bound_tokens_per_s,
        "hits": r.hits,
        "misses": r.misses,
    }


# Full-size replays on the GPU fill an ~80 GiB pinned source per layout: allow for it.
run_replays.timeout = 3600


def _numbers(results: dict, layout: str, scenario: str) -> dict:
    try:
        return results[(layout, scenario)]
    except KeyError:
        raise NotImplementedError("the benchmark suite is missing at this commit") from None


class _ScenarioGrid:
    """Parameters shared by the suites read per (backend, layout, scenario); no benchmarks."""

    params = (BACKENDS, LAYOUTS, SCENARIOS)
    param_names = ["backend", "layout", "scenario"]
    skip_params = skip_other_backends(LAYOUTS, SCENARIOS)
    setup_cache = staticmethod(run_replays)
    timeout = 3600


class Replay(_ScenarioGrid):
    """Decode throughput, hit rate and traffic of the library with the LRU policy."""

    def setup(self, results, backend, layout, scenario):
        _numbers(results, layout, scenario)

    def track_tokens_per_s(self, results, backend, layout, scenario):
        """Decode tokens per second (host backend: host-emulated; higher is better)."""
        return _numbers(results, layout, scenario)["tokens_per_s"]

    track_tokens_per_s.unit = "tokens/s"

    def track_hit_rate(self, results, backend, layout, scenario):
        """Hits / (hits + misses) over every path, from the library's counters (higher is better)."""
        return 100.0 * _numbers(results, layout, scenario)["hit_rate"]

    track_hit_rate.unit = "%"

    def track_gib_per_token(self, results, backend, layout, scenario):
        """Host-to-device GiB per decode token (at commits before the prefill fix, prefill bytes
        and tokens were included); full-size GiB on the GPU, sizes / scale on the host; lower
        is better."""
        return _numbers(results, layout, scenario)["gib_per_token"]

    track_gib_per_token.unit = "GiB/token"

    def track_link_bound_tokens_per_s(self, results, backend, layout, scenario):
        """Decode tokens per second if moving misses at the measured copy bandwidth were the
        only cost (host backend: memcpy bandwidth)."""
        return _numbers(results, layout, scenario)["link_bound_tokens_per_s"] or float("nan")

    track_link_bound_tokens_per_s.unit = "tokens/s"


class ReplayBelady:
    """The decode scenario's distance to the clairvoyant optimum (Belady's MIN) at the
    library's own per-class capacities. Prefill has no such reference: batches never
    evict, and clairvoyant replacement is not modelled for them."""

    params = (BACKENDS, LAYOUTS)
    param_names = ["backend", "layout"]
    skip_params = skip_other_backends(LAYOUTS)
    setup_cache = staticmethod(run_replays)
    timeout = 3600

    def setup(self, results, backend, layout):
        _numbers(results, layout, "decode")

    def track_belady_hit_rate(self, results, backend, layout):
        """Belady's hit rate on the decode scenario."""
        return 100.0 * _numbers(results, layout, "decode")["belady_hit_rate"]

    track_belady_hit_rate.unit = "%"

    def track_belady_gap(self, results, backend, layout):
        """Belady's hit rate minus the library's, in percentage points (lower is better)."""
        n = _numbers(results, layout, "decode")
        return 100.0 * (n["belady_hit_rate"] - n["hit_rate"])

    track_belady_gap.unit = "percentage points"


class ReplayPolicy(_ScenarioGrid):
    """The OppClassLRU policy (``policy="oppclass"``) next to LRU, same replay."""

    def setup(self, results, backend, layout, scenario):
        if _numbers(results, layout, scenario).get("oppclass_hit_rate") is None:
            raise NotImplementedError("no oppclass policy at this commit")

    def track_oppclass_hit_rate(self, results, backend, layout, scenario):
        """OppClassLRU's hit rate, from the library's counters (higher is better)."""
        return 100.0 * _numbers(results, layout, scenario)["oppclass_hit_rate"]

    track_oppclass_hit_rate.unit = "%"

    def track_oppclass_gain(self, results, backend, layout, scenario):
        """OppClassLRU's hit rate minus LRU's, in percentage points (higher is better)."""
        n = _numbers(results, layout, scenario)
        return 100.0 * (n["oppclass_hit_rate"] - n["hit_rate"])

    track_oppclass_gain.unit = "percentage points"

    def track_oppclass_tokens_per_s(self, results, backend, layout, scenario):
        """OppClassLRU's decode tokens per second (host backend: host-emulated)."""
        return _numbers(results, layout, scenario)["oppclass_tokens_per_s"]

    track_oppclass_tokens_per_s.unit = "tokens/s"
