"""asv: the graph loop (``expcache bench graph``) tracked over commits.

The decode traces served from the device: each token's step captured in a CUDA graph with
``select_device`` (eager on the host backend), next to the C loop's host select in the same run,
per layout. Tracked: the graph loop's decode tokens/s, its ratio to the C loop's, its share of
the link bound, and the all-hit ``select_device`` time per layer under graph replay; and the
same from a file read with O_DIRECT (``GraphLoopFile``). The runs happen once per commit, in
``setup_cache``; commits without the graph loop (or without file sources) are skipped.
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


#: The file-source series: the layers of ``gpu_report.sh graph_loop_file`` (27 GiB at full size,
#: within the H200 machine's 64 GiB disk), a budget of this share of their experts' bytes, misses
#: read with O_DIRECT from a file the run writes in a temporary folder.
FILE_LAYERS = range(33, 43)
FILE_BUDGET_FRACTION = 0.15


def run_graph_loops(kind: str = "pinned") -> dict:
    """{layout: numbers} for every layout, run on BACKEND, the experts in ``kind``: "pinned"
    memory (the whole model at the 12 GiB budget), or a "file" (:data:`FILE_LAYERS`)."""
    try:
        from pyexpcache import ModelLayout

        Bench = suite_module().Bench
        graph_loop = suite_module("modes.graph_loop")
        run_graph_loop = graph_loop.run_graph_loop
        if kind == "file":
            suite_module("file_source").FileSource  # noqa: B018 (a commit from before file sources: skipped)
    except (ImportError, AttributeError):  # a commit from before the graph loop
        return {}
    scale = replay_scale(BACKEND)
    traces = replay_traces(BACKEND)
    out = {}
    for quant in LAYOUTS:
        layout = ModelLayout.preset(quant, scale=scale)
        budget = int(BUDGET_GIB * GiB / scale)
        options = {}
        if kind == "file":
            layout = ModelLayout(
                tuple(spec if i in FILE_LAYERS else None for i, spec in enumerate(layout.layers)), name=layout.name
            )
            experts = sum(spec.expert_bytes * spec.num_experts for spec in layout.layers if spec is not None)
            budget = int(FILE_BUDGET_FRACTION * experts)
            options = dict(kind="file", cache_options={"file_reads": "direct"})
        else:  # the source the mode asks for (pinned on both backends), where the commit's mode says so
            options = dict(pinned=getattr(graph_loop, "PINNED_SOURCE", None))
        bench = Bench(layout, backend=BACKEND, budget_bytes=budget, scale=scale, **options)
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
            # From a file, of the bound the link or the disk sets, whichever binds.
            "of_link_bound": getattr(graph, "of_bound", None) if kind == "file" else graph.of_link_bound,
            "all_hit_select_us": report.settings["all_hit_select_us"],
        }
    return out


run_graph_loops.timeout = 3600  # a full-size pinned source per layout on the GPU


def run_file_graph_loops() -> dict:
    return run_graph_loops("file")


run_file_graph_loops.timeout = 3600  # a 27 GiB file written per layout on the GPU


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


class GraphLoopFile(GraphLoop):
    """Decode served from the device, its misses read from a file with O_DIRECT by the library's
    feed threads (layers 33-42, a budget of 15 % of their experts): tokens/s, the ratio to the
    C loop from the same file, the share of the bound (the link's or the disk's, whichever binds)."""

    setup_cache = staticmethod(run_file_graph_loops)
