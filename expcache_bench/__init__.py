"""expcache's benchmark suite (the ``expcache`` command): real routing replayed through the cache
of :mod:`pyexpcache`, in modes, and the tools it stands on.

Modules: :mod:`~expcache_bench.cli` (the command line), :mod:`~expcache_bench.modes` (the modes,
one module each behind one interface), :mod:`~expcache_bench.bench` (:class:`Bench`: what every
mode shares: the layout, source, stream and expected checksums; its caches, the replays through
the C loop and the link), :mod:`~expcache_bench.options`, :mod:`~expcache_bench.report`,
:mod:`~expcache_bench.workload`, :mod:`~expcache_bench.link`, :mod:`~expcache_bench.budget` (the
budget at divided sizes), :mod:`~expcache_bench.replay` (the C replay loop, ``replay.c``, built as
``libexpcache_replay.so``), :mod:`~expcache_bench.predict` (the prefetch predictors),
:mod:`~expcache_bench.policies`, the offline simulator :mod:`~expcache_bench.sim` and the bundled
and synthetic traces :mod:`~expcache_bench.traces`.

The library never imports this package. The names below re-export the variants table's
(:func:`run` is its ``run_scenario``: the main benchmark, which asv tracks) and the hit-rate
curve's.
"""

from pyexpcache.progress import Progress

from .bench import HOST_SCALE, Bench, resolve_backend
from .modes import format_report
from .modes.curve import hit_rate_curve, plot_curve
from .modes.variants import BASELINES, VariantResult, belady_hit_rate, policy_variants, run_scenario as run, variants
from .report import Report, git_commit, write_json
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
