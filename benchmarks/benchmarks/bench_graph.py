"""asv: the graph loop (``expcache bench graph``) tracked over commits.

The decode traces served from the device: each token's step captured in a CUDA graph with
``select_device`` (eager on the host backend), next to the C loop's host select in the same run,
per layout. Tracked: the graph loop's decode tokens/s, its ratio to the C loop's, its share of
the link bound, and the all-hit ``select_device`` time per layer under graph replay. The runs
happen once per commit, in ``setup_cache``; commits without the graph loop are skipped.
"""

from __future__ import annotations

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


def run_graph_loops() -> dict:
    """{layout: numbers} for every layout, run on BACKEND."""
    try:
        from pyexpcache import ModelLayout

        Bench = suite_module().Bench
        graph_loop = suite_module("modes.graph_loop")
        run_graph_loop = graph_loop.run_graph_loop
    except (ImportError, AttributeError):  # a commit from before the graph loop
        return {}
    scale = replay_scale(BACKEND)
    traces = replay_traces(BACKEND)
    budget = int(BUDGET_GIB * GiB / scale)
    out = {}
    for quant in LAYOUTS:
        layout = ModelLayout.preset(quant, scale=scale)
        # The source the mode asks for (pinned on both backends), where the commit's mode says so.
        bench = Bench(
            layout, backend=BACKEND, budget_bytes=budget, scale=scale, pinned=getattr(graph_loop, "PINNED_SOURCE", None)
        )
        try:
            report = run_graph_loop(bench, traces=traces)
        finally:
            bench.close()
        if report.backend != BACKEND:
            raise RuntimeError(f"asked for the {BACKEND} backend, ran on {report.backend}")
        c_loop, graph = report.results
        for r in report.results:
            if r.checksum_errors:
                raise RuntimeError(f"{layout.name} {r.loop}: {r.checksum_errors} experts served with wrong bytes")
        out[quant] = {
            "tokens_per_s": graph.tokens_per_s,
            "vs_c_loop": graph.tokens_per_s / c_loop.tokens_per_s if c_loop.tokens_per_s else float("nan"),
            "of_link_bound": graph.of_link_bound,
            "all_hit_select_us": report.settings["all_hit_select_us"],
        }
    return out


run_graph_loops.timeout = 3600  # a full-size pinned source per layout on the GPU


def _numbers(results: dict, layout: str) -> dict:
    try:
        return results[layout]
    except KeyError:
        raise NotImplementedError("the graph loop is missing at this commit") from None


class GraphLoop:
    """Decode served from the device, each token's step one CUDA graph replay."""

    params = (BACKENDS, LAYOUTS)
    param_names = ["backend", "layout"]
    skip_params = skip_other_backends(LAYOUTS)
    setup_cache = staticmethod(run_graph_loops)
    timeout = 3600

    def setup(self, results, backend, layout):
        _numbers(results, layout)

    def track_tokens_per_s(self, results, backend, layout):
        """The graph loop's decode tokens per second (host backend: eager, host-emulated)."""
        return _numbers(results, layout)["tokens_per_s"]

    track_tokens_per_s.unit = "tokens/s"

    def track_vs_c_loop(self, results, backend, layout):
        """The graph loop's tokens/s over the C loop's (host select), same run (higher is better)."""
        return _numbers(results, layout)["vs_c_loop"]

    track_vs_c_loop.unit = "ratio"

    def track_of_link_bound(self, results, backend, layout):
        """The graph loop's tokens/s as a share of the link bound (misses' bytes at the measured rate)."""
        return 100.0 * _numbers(results, layout)["of_link_bound"]

    track_of_link_bound.unit = "%"

    def track_all_hit_select_us(self, results, backend, layout):
        """An all-hit select_device of one token's ids, per layer, under graph replay (lower is better;
        host backend: eager, meaningless as a time)."""
        return _numbers(results, layout)["all_hit_select_us"]

    track_all_hit_select_us.unit = "µs"
