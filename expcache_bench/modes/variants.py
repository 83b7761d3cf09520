"""The variants table (``expcache bench variants``; ``expcache bench`` runs it unless its options
name another mode): real routing replayed through the cache and the baselines it replaces, side
by side, with the clairvoyant optimum.

Every layer of every token does what an engine does: select the router's experts, run a kernel
that reads every byte of them (the memory-bound floor of the expert GEMVs) and checksums them
against the source, and wait for it before the next layer (the next layer's ids depend on this
layer's output). Experts of other than three parts (a quantized checkpoint's weights and scales)
are served by slot id: the select and prefill batches by slot, the kernel reading every part of
each expert's row in the bank (the C loop's BY_SLOT mode).

Variants, side by side in one process on the same source and stream (:func:`variants`):

each policy   this library: one cache per size class, batches that never evict, decode evicting
              by one of the library's policies, the variant named after it (``oppclass``, ``lru``:
              docs/policy.md), the library's default first (:func:`~expcache_bench.policies.policy_variants`);
              ``default`` in ``--variants`` names it. With ``--partition global,layer`` each
              policy also runs with ``partition="layer"`` (each layer its share of its class),
              the variant ``<policy> (layer)``, its Belady column run within each layer's share.
``slab``      the old ds4 design: one slab keyed on the last-seen expert size (a cache
              with ``max_classes=1``, so every size change releases it), released again
              before every prefill batch; pageable memory copied with plain cudaMemcpyAsync.
``nocache``   every selected expert uploaded every time (compact loads, nothing kept; pageable
              memory copied with plain cudaMemcpyAsync). Skipped, saying why, for experts of
              other than three parts (a quantized checkpoint's weights and scales): compact
              loads hand out three pointers per expert.
``resident``  the ceiling: every expert resident before the replay starts (skipped when
              device memory cannot hold the model).

The link bound of a variant is its host-to-device bytes divided by the link measured in the same
run (:mod:`~expcache_bench.link`): how fast decode could be if moving misses were the only
cost. From a file (``--source mmap|file``, ``--gguf``) the disk's read rate is measured too
(:mod:`~expcache_bench.disk`) and the table's bound is the lower of the two, named in its
columns; the bench drops a file it wrote from the page cache before each variant. Each policy
variant's hit rate is checked against the offline simulator of the same policy (its twin of the
same name) at the same per-class capacities.

The policies are the library's (``pyexpcache._lib.POLICIES``), so :func:`variants` loads it; nothing
here does at import, and ``--variants`` is checked against them only when it is parsed, so every
--help works before the library is built.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar, Optional

import numpy as np
from tabulate import tabulate

from pyexpcache import _lib
from pyexpcache.budget import class_info, resolve_budget
from pyexpcache.cache import ExpertCache, StagingStats
from pyexpcache.layout import GiB, ModelLayout
from pyexpcache.progress import Progress
from pyexpcache.stats import PoolStats

from ..bench import Bench, serve_refused
from ..budget import keeps_slot_counts
from ..options import BENCH, OUTPUT, PLOT, Option, csv, synthetic_traces
from ..policies import policy_variants
from ..report import DecodeRate, HitRate, Report, share, timed
from ..sim import BATCH, simulate_policy
from ..sim.registry import PARTITIONS, simulate_belady_partitioned
from ..traces import check_layout
from ..workload import DEFAULT_TRACES, SCENARIOS, TraceSpec, Workload, build_workload, decode_trace, trace_label
from . import curve

# The designs the library replaces, after its policies (variants()).
BASELINES = ("slab", "nocache", "resident")


def variants() -> tuple[str, ...]:
    """Every variant: :func:`policy_variants`, then :data:`BASELINES`. Loads the library."""
    return policy_variants() + BASELINES


_all_variants = variants  # for run_scenario, whose argument of that name hides it


def resolve_variants(names: Sequence[str]) -> list[str]:
    """``names`` with ``default`` replaced by the library's default policy (each name once, in
    order). Loads the library when ``default`` is among them."""
    out = []
    for n in names:
        n = _lib.DEFAULT_POLICY if n == "default" else n
        if n not in out:
            out.append(n)
    return out


NAME = "variants"
TITLE = "variants table"
HELP = "the library's policies next to the designs they replace and Belady, per scenario"
DESCRIPTION = (
    "Replay bundled DeepSeek V4 Flash routing through the cache on the GPU (or on the host backend when "
    "there is none) and compare with the baselines: each scenario a table of the variants side by side."
)
RUNS = "replays each --scenario through every --variants"
USES_BENCH = True

SCENARIO = Option(
    "--scenario",
    type=csv(SCENARIOS + ("all",)),
    default=["decode"],
    help=f"comma list of {', '.join(SCENARIOS)}, or all (default: decode)",
)
VARIANTS_OPTION = Option(
    "--variants",
    type=csv(lambda: ("default",) + variants()),
    default=None,
    help="comma list of variants: the library's eviction policies by name (default: the "
    f"library's default policy), {', '.join(BASELINES)} (default: all, the library's "
    "default policy first)",
)
PARTITION = Option(
    "--partition",
    type=csv(PARTITIONS),
    default=["global"],
    help="comma list of global, layer: how each policy variant's classes are shared among their "
    "layers (layer: each layer its own share; a variant '<policy> (layer)'); default global",
)
NO_LAYER_SYNC = Option(
    "--no-layer-sync",
    action="store_true",
    help="enqueue a token's layers back to back and wait once per token, instead of after every "
    "layer (an engine waits per layer: the next layer's ids come from this one's output)",
)
OPTIONS = BENCH + (SCENARIO, VARIANTS_OPTION, PARTITION, NO_LAYER_SYNC, PLOT) + OUTPUT
SELECTED_BY = ()  # the default of the flag spelling


@dataclass
class VariantResult(DecodeRate, HitRate):
    variant: str
    decode_seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_calls: int = 0
    # Of decode_seconds, the time in the serving calls (select); the rest is each layer's
    # checksum kernel and the wait for the transfers still crossing when select returned.
    decode_serve_seconds: float = 0.0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    hits: int = 0
    misses: int = 0
    bytes_h2d: int = 0
    decode_bytes_h2d: int = 0
    bytes_d2d: int = 0
    releases: int = 0
    checksum_errors: int = 0
    experts_checked: int = 0
    link_bound_tokens_per_s: Optional[float] = None
    disk_bound_tokens_per_s: Optional[float] = None  # a file source: the same at the disk's measured read rate
    belady_hit_rate: Optional[float] = None
    skipped: Optional[str] = None
    staging: Optional[StagingStats] = None  # pageable or file sources: the staging ring's counters
    pool: Optional[PoolStats] = None  # --host-budget-gib: the host pool's counters
    page_cache_after: Optional[float] = None  # a file source: the share of its file in the page cache after the run

    DERIVED: ClassVar[tuple[str, ...]] = (
        "tokens_per_s",
        "hit_rate",
        "gib_per_token",
        "serve_us_per_call",
        "after_serve_us_per_call",
        "bound_tokens_per_s",
        "pool_hit_rate",
    )  # in the JSON beside the fields

    @property
    def pool_hit_rate(self) -> Optional[float]:
        """The share of the device's misses the host pool served (None without a pool)."""
        return self.pool.hit_rate if self.pool else None

    @property
    def bound_tokens_per_s(self) -> Optional[float]:
        """The lower of the link and disk bounds (the link's for a source in memory)."""
        bounds = [b for b in (self.link_bound_tokens_per_s, self.disk_bound_tokens_per_s) if b]
        return min(bounds) if bounds else None

    @property
    def serve_us_per_call(self) -> float:
        """Mean µs a decode call spends in select (or the compact load)."""
        return 1e6 * self.decode_serve_seconds / self.decode_calls if self.decode_calls else 0.0

    @property
    def after_serve_us_per_call(self) -> float:
        """Mean µs of a decode call after select returned: the checksum kernel, the wait for
        transfers still crossing, the readback (per token without the per-layer wait)."""
        return 1e6 * (self.decode_seconds - self.decode_serve_seconds) / self.decode_calls if self.decode_calls else 0.0

    @property
    def gib_per_token(self) -> float:
        """Host-to-device GiB per decode token, counting decode calls only."""
        return self.decode_bytes_h2d / GiB / self.decode_tokens if self.decode_tokens else 0.0


def class_capacities(layout: ModelLayout, cache: ExpertCache) -> tuple[list[int], list[int]]:
    """(runtime cap per class index, class index per layer) of a cache, for the simulators."""
    layer_class = [0] * layout.num_layers
    for layer in layout.moe_layers:
        layer_class[layer] = cache.bind_class(layer)
    caps = {c.index: c.cap_experts for c in cache.classes()}
    return [caps.get(i, 0) for i in range(max(caps) + 1)], layer_class


def _preload(bench: Bench, cache: ExpertCache) -> None:
    layers = bench.layout.moe_layers
    select = cache.select_slots if bench.by_slot else cache.select  # experts of other than three parts: by slot id
    for n, layer in enumerate(layers):
        experts = bench.layout[layer].num_experts
        for start in range(0, experts, 256):
            select(layer, np.arange(start, min(start + 256, experts)), bench.stream)
        bench.progress("preloading all experts", n + 1, len(layers))
    cache.synchronize(bench.stream)


def variant_label(variant: str, partition: str = "global") -> str:
    """A policy variant's name in the table: the policy, with `` (layer)`` under that partition."""
    return variant if partition == "global" else f"{variant} ({partition})"


def _run_variant(bench: Bench, variant: str, workload: Workload, partition: str = "global"):
    """:func:`run_variant`, and the cache's class capacities for the simulators (policy variants)."""
    layout = bench.layout
    result = VariantResult(
        variant_label(variant, partition), decode_tokens=workload.decode_tokens, prefill_tokens=workload.prefill_tokens
    )
    capacities = None
    refused = serve_refused(bench.parts, "nocache" if variant == "nocache" else "cache")
    if refused:
        result.skipped = refused
        return result, capacities
    # A file source is read the same way by every variant (the baselines' other settings are the old design's).
    reads = {k: v for k, v in bench.cache_options.items() if k == "file_reads"}
    if variant in _lib.POLICIES:
        # Cap notices once, from the default policy's run; the same caps follow for the others.
        notices = variant == _lib.DEFAULT_POLICY and partition == "global"
        cache = bench.make_cache(
            budget_bytes=bench.budget_bytes,
            policy=variant,
            partition=partition,
            log_level=_lib.LOG_NOTICE if notices else _lib.LOG_WARNING,
            **bench.cache_options,
        )
    # The baselines are LRU, as the old designs were.
    elif variant == "slab":
        # The old design also copied pageable memory with plain cudaMemcpyAsync (copy_threads=0). Its
        # slots: the full-size budget over the full-size run's largest slot (the same count at any scale).
        biggest = max(bench.full_slot_bytes())
        # Silent: its class reuses (the thrash it stands for) would warn; they are counted in its stats.
        cache = bench.make_cache(
            budget_experts=max(1, bench.full_budget_bytes // biggest),
            max_classes=1,
            policy="lru",
            log_level=_lib.LOG_SILENT,
            copy_threads=0,
            **reads,
        )
    elif variant == "nocache":
        cache = bench.make_cache(budget_experts=1, policy="lru", log_level=_lib.LOG_WARNING, copy_threads=0, **reads)
    elif variant == "resident":
        need = sum(
            sum(layout[i].num_experts for i in layers) * c.slot_bytes
            for layers, c in zip(layout.classes().values(), class_info(layout, 1))
        )
        cache = None
        try:
            cache = bench.make_cache(
                budget_bytes=need + (1 << 20), reserve_bytes=0, policy="lru", log_level=_lib.LOG_WARNING, **reads
            )
            _preload(bench, cache)
        except MemoryError as exc:
            if cache is not None:
                cache.close()
            result.skipped = f"the model does not fit in device memory ({exc})"
            return result, capacities
        if any(
            c.resident_experts < sum(layout[i].num_experts for i in layout.moe_layers if layout[i].class_key == c.key)
            for c in cache.classes()
        ):
            cache.close()
            result.skipped = "the model does not fit in device memory minus the reserve"
            return result, capacities
        cache.reset_stats()
    else:
        raise ValueError(f"unknown variant {variant!r}: expected one of {', '.join(variants())}")
    with cache:
        out = bench.replay(cache, workload, label=variant, serve=variant if variant in ("slab", "nocache") else "cache")
        result.decode_seconds, result.prefill_seconds = out.decode_seconds, out.prefill_seconds
        result.decode_calls, result.decode_serve_seconds = out.decode_calls, out.decode_serve_seconds
        result.checksum_errors, result.experts_checked = out.checksum_errors, out.experts_checked
        result.decode_bytes_h2d = out.decode_bytes_h2d
        if variant in _lib.POLICIES:
            capacities = class_capacities(layout, cache)
        total = cache.stats().total
        result.hits, result.misses = total.hits, total.misses
        result.bytes_h2d, result.bytes_d2d, result.releases = total.bytes_h2d, total.bytes_d2d, total.releases
        staging = cache.staging_stats()
        result.staging = staging if staging.calls else None
        pool = cache.pool_stats()
        result.pool = pool if pool.budget_bytes else None
    result.page_cache_after = bench.page_cache_fraction()
    return result, capacities


def run_variant(bench: Bench, variant: str, workload: Workload, partition: str = "global") -> VariantResult:
    """One variant's replay of ``workload`` on ``bench``, with a new cache of its own."""
    return _run_variant(bench, variant, workload, partition)[0]


def _layer_experts(layout: ModelLayout) -> list[int]:
    return [layout[i].num_experts if layout[i] else 0 for i in range(layout.num_layers)]


def belady_hit_rate(
    workload: Workload,
    capacities: list[int],
    layer_class: list[int],
    partition: str = "global",
    layer_experts: Optional[Sequence[int]] = None,
) -> Optional[float]:
    """The clairvoyant optimum at the library's per-class capacities (decode-only workloads);
    under ``partition="layer"`` within each layer's share (``layer_experts``: each layer's experts)."""
    if workload.has_batches:
        return None
    return simulate_belady_partitioned(
        workload.calls, capacities, layer_class, partition=partition, layer_experts=layer_experts
    ).hit_rate


def run_scenario(
    layout: ModelLayout,
    scenario: str = "decode",
    *,
    variants: Optional[Sequence[str]] = None,
    traces: Sequence[TraceSpec] = DEFAULT_TRACES,
    budget_bytes: Optional[int] = None,
    budget_fraction: Optional[float] = None,
    backend: str = "auto",
    pinned: Optional[bool] = None,
    reserve_bytes: Optional[int] = None,
    host_scale: Optional[int] = None,
    progress: Optional[Progress] = None,
    device: int = 0,
    source=None,
    bench: Optional[Bench] = None,
    layers: Optional[Sequence[int]] = None,
    partitions: Sequence[str] = ("global",),
) -> Report:
    """Run ``variants`` (default: all, :func:`variants`) on one scenario and return a :class:`Report`
    (see the module docstring). ``traces``: loaded :class:`~pyexpcache.routing.Trace` objects,
    generic routing-trace files, bundled names or ``synthetic:TOKENS[:SEED]``
    (:func:`~expcache_bench.workload.decode_trace`); each is checked against ``layout``
    (:func:`~expcache_bench.traces.check_layout`: its layers must be MoE layers of the layout, its ids
    below their expert counts), and a (token, layer) a trace has no record of makes no call.
    ``layers``: the model layers replayed (default: all the traces have). The budget:
    ``budget_bytes`` or ``budget_fraction`` of every expert's bytes (not both; default 12 GiB,
    :func:`~expcache_bench.bench.resolve_budget`); with ``bench``, the bench's.
    ``source`` (e.g. a :class:`~pyexpcache.gguf.GGUFSource`) replaces
    the generated host source; an existing ``bench`` (whose source is then reused, and left open)
    replaces both.
    ``host_scale``: what the layout's sizes and the budget were divided by (default: the bench's
    ``scale``), for the header. ``partitions``: each policy variant runs once per partition
    (``"layer"``: the variant ``<policy> (layer)``); the baselines once."""
    budget_bytes = resolve_budget(layout, budget_bytes, budget_fraction)
    loaded = [decode_trace(t, layout) for t in traces]
    keep = layout.moe_layers if layers is None else [i for i in layers if i in set(layout.moe_layers)]
    workload = build_workload(scenario, loaded, keep)
    if not workload.calls:
        raise ValueError(f"the traces route none of layout {layout.name}'s layers")
    for trace in loaded:
        check_layout(trace, layout, layers)
    for call in workload.calls:
        if call.kind == BATCH and max(call.ids) >= layout[call.layer].num_experts:
            raise ValueError(
                f"the {scenario} scenario replays the bundled DeepSeek V4 Flash prompts, which route to "
                f"layer {call.layer}, expert {max(call.ids)}; layout {layout.name} gives that layer "
                f"{layout[call.layer].num_experts} experts"
            )
    if variants is None:
        variants = _all_variants()
    variants = resolve_variants(variants)
    bad = [p for p in partitions if p not in PARTITIONS]
    if bad or not partitions:
        raise ValueError(f"partitions must be a non-empty list of {', '.join(PARTITIONS)}, got {list(partitions)}")
    own = bench is None
    if own:
        bench = Bench(
            layout,
            backend=backend,
            pinned=pinned,
            budget_bytes=budget_bytes,
            reserve_bytes=reserve_bytes,
            progress=progress,
            device=device,
            source=source,
            scale=host_scale or 1,
        )
    try:
        bounds = bench.measure_bounds()
        header = bench.report_header()
        if host_scale is not None and host_scale != bench.scale:
            # The bench's layout and budget were divided by host_scale outside it: whether that kept
            # the full size's slot counts is checked here, for the header.
            full = bench.budget_bytes * host_scale
            header.update(
                host_scale=host_scale,
                full_budget_bytes=full if keeps_slot_counts(layout, bench.budget_bytes, full, host_scale) else None,
            )
        report = Report(
            "variants",
            scenario,
            **header,
            traces=[trace_label(t) for t in traces],
            **bounds,
            settings=dict(
                scenario=scenario,
                decode_tokens=workload.decode_tokens,
                prefill_tokens=workload.prefill_tokens,
                layer_sync=bench.layer_sync,
            ),
        )
        runs = [(v, p) for v in variants for p in (partitions if v in _lib.POLICIES else ("global",))]
        experts = _layer_experts(layout)
        for variant, partition in runs:
            r, capacities = _run_variant(bench, variant, workload, partition)
            if r.skipped is None and r.decode_bytes_h2d:
                # Decode tokens/s is timed over decode calls only, so its bound counts their bytes only.
                r.link_bound_tokens_per_s = workload.decode_tokens / (r.decode_bytes_h2d / report.link_bytes_per_s)
                if report.disk_bytes_per_s:
                    r.disk_bound_tokens_per_s = workload.decode_tokens / (r.decode_bytes_h2d / report.disk_bytes_per_s)
            if capacities is not None:
                caps, layer_class = capacities
                r.belady_hit_rate = belady_hit_rate(workload, caps, layer_class, partition, experts)
                # The offline simulator of the same policy must agree with the library's counters.
                sim = simulate_policy(
                    workload.calls,
                    caps,
                    layer_class,
                    policy=variant,
                    layers=layout.moe_layers,
                    partition=partition,
                    layer_experts=experts,
                )
                if sim.hit_rate != r.hit_rate:
                    raise RuntimeError(
                        f"{r.variant}: library hit rate {r.hit_rate} differs from the simulator's "
                        f"{sim.hit_rate} at the same capacities: a bug"
                    )
            report.results.append(r)
        return report
    finally:
        if own:
            bench.close()


# -- the mode ---------------------------------------------------------------------------------


def check(args) -> None:
    """What the variants table cannot run, before anything is allocated: --plot's file type. Without
    --variants, all of them (:func:`variants`: the library's policies are read here)."""
    curve.check_plot(args)
    synthetic_traces(args)
    args.variants = list(variants()) if args.variants is None else resolve_variants(args.variants)


def device_bytes(args, budget: int, model_bytes: int) -> int:
    """Emulated device memory its caches hold at once: the budget, or the model for ``resident``."""
    return model_bytes if args.variants is None or "resident" in args.variants else budget


def run(bench: Bench, args) -> Iterator[Report]:
    """A report per --scenario, each as it is finished; then --plot's curve, when asked for."""
    for scenario in SCENARIOS if "all" in args.scenario else tuple(args.scenario):
        yield run_scenario(
            bench.layout,
            scenario,
            variants=args.variants,
            traces=args.traces,
            budget_bytes=bench.budget_bytes,
            bench=bench,
            layers=args.layers,
            partitions=getattr(args, "partition", None) or ("global",),
        )
    if args.outputs.get("plot"):
        curve.write_plot(bench.layout, args.traces, args.outputs["plot"])


def describe(report: Report) -> list[str]:
    """The variants table's lines under the header: the tokens, and how often the loop waits."""
    st = report.settings
    lines = [
        f"{st['decode_tokens']} decode tokens, {st['prefill_tokens']} prefill tokens; "
        + ("a wait after every layer" if st["layer_sync"] else "one wait per token (--no-layer-sync)")
    ]
    cached = [r for r in report.results if r.page_cache_after is not None]
    if cached:
        lines.append(
            "the file in the page cache after each variant (dropped before it): "
            + "; ".join(f"{r.variant}: {100 * r.page_cache_after:.1f} %" for r in cached)
        )
    return lines


def table(report: Report) -> str:
    """The variants side by side, with each one's ratio to ``slab`` (tabulate)."""
    base = {r.variant: r for r in report.results if r.skipped is None}
    ref = base.get("slab")
    rows = []
    pooled = any(r.pool for r in report.results)  # --host-budget-gib: the pool's hit rate beside the device's
    for r in report.results:
        if r.skipped:
            rows.append([r.variant] + ["—"] * (8 if pooled else 7) + [f"skipped: {r.skipped}"])
            continue
        ratio = r.tokens_per_s / r.bound_tokens_per_s if r.bound_tokens_per_s else None
        rows.append(
            [
                r.variant,
                f"{r.tokens_per_s:.2f}",
                f"{100 * r.hit_rate:.1f} %",
                *([f"{100 * r.pool_hit_rate:.1f} %" if r.pool else "—"] if pooled else []),
                f"{100 * r.belady_hit_rate:.1f} %" if r.belady_hit_rate is not None else "—",
                f"{r.gib_per_token:.3f}",
                f"{r.bound_tokens_per_s:.2f}" if r.bound_tokens_per_s else "∞",
                share(ratio) if ratio else "—",
                f"{r.tokens_per_s / ref.tokens_per_s:.2f}×" if ref and ref.tokens_per_s else "—",
                f"{r.checksum_errors} bad / {r.experts_checked}",
            ]
        )
    return tabulate(
        rows,
        headers=[
            "variant",
            timed(report, "decode tok/s"),
            "hit rate",
            *(["host pool hit rate"] if pooled else []),
            "Belady",
            "GiB/decode token",
            timed(report, f"{report.bound_by}-bound tok/s"),
            timed(report, f"of {report.bound_by} bound"),
            timed(report, "vs slab"),
            "checksums",
        ],
        disable_numparse=True,
    )
