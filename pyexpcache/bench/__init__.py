"""The main job: replay real routing through the cache and report decode
tokens/s and hit rate next to the baselines it replaces and the optimum.

Every layer of every token does what an engine does: select the router's
experts, run a kernel that reads every byte of them (the memory-bound floor
of the expert GEMVs) and checksums them against the source, and wait for it
before the next layer (the next layer's ids depend on this layer's output).

Variants, side by side in one process on the same source and stream:

``oppclass``  this library as it comes: one cache per size class, OppClassLRU decode
              (docs/policy.md), batches that never evict.
``lru``       the same with the LRU policy.
``slab``      the old ds4 design: one slab keyed on the last-seen expert size (a cache
              with ``max_classes=1``, so every size change releases it), released again
              before every prefill batch; pageable memory copied with plain cudaMemcpyAsync.
``nocache``   every selected expert uploaded every time (compact loads, nothing kept; pageable
              memory copied with plain cudaMemcpyAsync).
``resident``  the ceiling: every expert resident before the replay starts (skipped when
              device memory cannot hold the model).

The link bound of a variant is its host-to-device bytes divided by the pinned
copy bandwidth measured in the same run: how fast decode could be if moving
misses were the only cost.
"""

from .curve import hit_rate_curve, plot_curve
from .progress import Progress
from .report import Report, VariantResult, format_report, git_commit, write_json
from .runner import HOST_SCALE, POLICY_VARIANTS, VARIANTS, Bench, belady_hit_rate, resolve_backend, run
from .workload import DEFAULT_TRACES, SCENARIOS, Workload, build_workload

__all__ = ["DEFAULT_TRACES", "HOST_SCALE", "POLICY_VARIANTS", "SCENARIOS", "VARIANTS", "Bench", "Progress", "Report", "VariantResult",
           "Workload", "belady_hit_rate", "build_workload", "format_report", "git_commit", "hit_rate_curve",
           "plot_curve", "resolve_backend", "run", "write_json"]
