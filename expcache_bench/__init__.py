"""The benchmark (``expcache bench``): real routing replayed through the cache, in modes.

What every mode shares lives here: :class:`Bench` (the layout, source, stream and expected
checksums; its caches, replays through the C loop and the link), the workloads, the link
measurement, the report, the command-line options and the progress bar. The modes, one module
each behind one interface, are in :mod:`pyexpcache.bench.modes`; the names below re-export the
variants table's (:func:`run` is its ``run_scenario``: the main benchmark, which asv tracks)
and the hit-rate curve's.
"""

from .bench import HOST_SCALE, Bench, resolve_backend
from .modes.curve import hit_rate_curve, plot_curve
from .modes.variants import BASELINES, VariantResult, belady_hit_rate, policy_variants, variants
from .modes.variants import run_scenario as run
from .progress import Progress
from .report import Report, format_report, git_commit, write_json
from .workload import DEFAULT_TRACES, SCENARIOS, Workload, build_workload

__all__ = [
    "BASELINES",
    "DEFAULT_TRACES",
    "HOST_SCALE",
    "SCENARIOS",
    "Bench",
    "Progress",
    "Report",
    "VariantResult",
    "Workload",
    "belady_hit_rate",
    "build_workload",
    "format_report",
    "git_commit",
    "hit_rate_curve",
    "plot_curve",
    "policy_variants",
    "resolve_backend",
    "run",
    "variants",
    "write_json",
]
