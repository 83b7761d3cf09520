"""The engine model (``expcache bench engine``; ``expcache bench`` with ``--layer-compute-us``,
``--prefetch``, ``--hints`` or ``--split``): the benchmark as an engine sees it. Every decode call
is one layer of a decode step, with ``compute_us`` of non-expert work (attention, the shared
expert, the router: a kernel that only takes time) on the compute stream before the layer's
select, and the advice for the layer (a prefetch, or a hint, of the experts a predictor expects
there, made once the previous layer was routed) issued just before that work, while the link
would otherwise sit idle.

:func:`run_engine` replays the decode traces once per setting, side by side in one process with
the same cache settings, and reports tok/s, demand misses and bytes moved per token (demand
misses and prefetch pieces), prefetch used/wasted/cancelled and how busy the link was: bytes
moved over the measured link bandwidth times the decode time. Settings: ``none`` first (the
reference every ratio is taken against), then each ``prefetch`` spec of
:mod:`~expcache_bench.predict` (``cooc``, ``oracle:R``: simulated, and labelled so), and with
hints the same predictions given as :meth:`~pyexpcache.ExpertCache.hint` only. ``split``
serves every setting with the split select (the hits' kernel runs while the misses cross).
Experts of other than three parts (a quantized checkpoint's) are served by slot id, the bank's
checksum reading every part; not with ``split``, whose select hands out three pointers per
expert (refused).
"""

from __future__ import annotations

import argparse
import ctypes
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Optional

import numpy as np
from tabulate import tabulate

from pyexpcache.stats import PrefetchStats

from .. import predict, replay as _replay
from ..options import BENCH, LAYER_COMPUTE_US, OUTPUT, Option, UsageError, synthetic_traces
from ..report import DecodeRate, Report, share, timed
from ..workload import DEFAULT_TRACES, decode_trace, decode_workload, trace_label

NAME = "engine"
TITLE = "engine model"
HELP = "each layer as an engine runs it: non-expert work, prefetch or hints of predicted experts, the split select"
DESCRIPTION = (
    "The decode traces as an engine runs them, through the C loop: before each layer's select, N µs of "
    "non-expert work, and the advice for the layer (a prefetch, or hints, of the experts a predictor "
    "expects) while the link would sit idle; each setting side by side with none in one run (decode "
    "scenario, the library's default policy)."
)
RUNS = "replays the decode scenario, waiting after every layer, with the library's default policy"
USES_BENCH = True


def _prefetch_specs(text: str) -> list[str]:
    specs = [s.strip() for s in text.split(",") if s.strip()]
    if not specs:
        raise argparse.ArgumentTypeError("expected a comma list of none, cooc, oracle:R")
    for spec in specs:
        try:
            predict.parse_prefetch(spec)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return specs


PREFETCH = Option(
    "--prefetch",
    type=_prefetch_specs,
    default=None,
    metavar="SPECS",
    help="comma list of none, cooc (an online next-layer predictor learning only from earlier tokens) "
    "and oracle:R (simulated: knows each next-layer expert with probability R); each prefetches "
    "its predictions of the next layer while this one computes",
)
PREFETCH_TOP = Option(
    "--prefetch-top",
    type=int,
    default=6,
    metavar="K",
    help="experts each prediction names, most likely first (default 6; a layer takes at most 8)",
)
HINTS = Option(
    "--hints",
    action="store_true",
    help="also run each --prefetch predictor as hints only (refresh resident experts, no copy)",
)
SPLIT = Option(
    "--split", action="store_true", help="serve with the split select: the hits' work runs while the misses cross"
)
OPTIONS = BENCH + (LAYER_COMPUTE_US, PREFETCH, PREFETCH_TOP, HINTS, SPLIT) + OUTPUT
SELECTED_BY = (LAYER_COMPUTE_US, PREFETCH, HINTS, SPLIT)  # any of them, in the flag spelling


@dataclass
class Setting:
    """One way of running the engine: what its advice is and where it comes from."""

    advice: str  # "none", "prefetch" or "hint"
    predictor: str  # a predict spec: "none", "cooc", "oracle:R"

    @property
    def name(self) -> str:
        return "none" if self.advice == "none" else f"{self.advice} {self.predictor}"

    @property
    def simulated(self) -> bool:
        return self.predictor.startswith("oracle")


def settings(prefetch: Sequence[str], hints: bool) -> list[Setting]:
    """``none``, then a prefetch setting per spec (``none`` specs dropped, duplicates once), then
    with ``hints`` the same predictors as hints. Specs are checked (ValueError naming them)."""
    specs = []
    for spec in prefetch:
        kind, _ = predict.parse_prefetch(spec)
        if kind != "none" and spec not in specs:
            specs.append(spec)
    out = [Setting("none", "none")] + [Setting("prefetch", s) for s in specs]
    if hints:
        out += [Setting("hint", s) for s in specs]
    return out


@dataclass
class EngineResult(DecodeRate):
    setting: str
    simulated: bool
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    hits: int = 0
    misses: int = 0
    demand_bytes: int = 0
    prefetch: PrefetchStats = field(default_factory=PrefetchStats)
    link_bytes_per_s: float = 0.0
    checksum_errors: int = 0
    experts_checked: int = 0

    DERIVED: ClassVar[tuple[str, ...]] = ("tokens_per_s", "misses_per_token", "bytes_per_token", "link_busy")

    @property
    def misses_per_token(self) -> float:
        return self.misses / self.decode_tokens if self.decode_tokens else 0.0

    @property
    def bytes_per_token(self) -> float:
        """Bytes over the link per token: demand misses and prefetch pieces."""
        return (self.demand_bytes + self.prefetch.bytes_sent) / self.decode_tokens if self.decode_tokens else 0.0

    @property
    def link_busy(self) -> float:
        """Share of the decode time the link would need to move those bytes at its measured speed."""
        if not self.decode_seconds or not self.link_bytes_per_s:
            return 0.0
        return (self.demand_bytes + self.prefetch.bytes_sent) / self.link_bytes_per_s / self.decode_seconds


def advice_arrays(traces, layers: Sequence[int], spec: str, top: int, seed: int = 0):
    """Per decode call of ``build_workload("decode", traces, layers)``: the ids the predictor
    ``spec`` expects at that call's layer, made when the token's previous layer was routed
    (none at a token's first layer). Returns (offsets uint64, counts uint32, ids uint32)."""
    offsets, counts, ids = [], [], []
    keep = set(layers)
    total = 0
    for trace in traces:
        preds = predict.predictions(trace, spec, top=top, seed=seed)
        for t in range(trace.num_tokens):
            for i, layer in enumerate(trace.layers):
                if layer not in keep:
                    continue
                row = preds[t, i - 1] if i > 0 else np.empty(0, np.int32)
                row = row[row >= 0]
                offsets.append(total)
                counts.append(len(row))
                ids.extend(row.tolist())
                total += len(row)
    return (np.asarray(offsets, np.uint64), np.asarray(counts, np.uint32), np.asarray(ids if ids else [0], np.uint32))


def run_engine(
    bench,
    *,
    traces: Sequence[str] = DEFAULT_TRACES,
    prefetch: Sequence[str] = ("cooc",),
    hints: bool = False,
    compute_us: float = 0.0,
    top: int = 6,
    split: bool = False,
    policy: Optional[str] = None,
    seed: int = 0,
) -> Report:
    """Replay the decode traces once per :func:`settings` entry on ``bench`` (a
    :class:`~expcache_bench.bench.Bench`: its source, stream and budget), each with a new cache
    of ``policy`` (None: the library's default); see the module docstring."""

    if not 0 <= compute_us <= 1e6:
        raise ValueError(f"compute_us must be in [0, 1e6], got {compute_us}")
    plan = settings(prefetch, hints)
    loaded = [decode_trace(name, bench.layout) for name in traces]  # parsed once, for the calls and the predictions
    for trace in loaded:
        if not trace.complete:
            raise ValueError(
                f"trace {trace.name} misses {trace.missing_records} (token, layer) records: the engine "
                "model predicts each layer from the token's previous one and needs complete traces "
                "(the variants table replays incomplete ones)"
            )
    workload = decode_workload(loaded, bench.layout.moe_layers)
    link = bench.measure_link()
    report = Report(
        "engine",
        "engine model",
        **bench.report_header(),
        traces=[trace_label(t) for t in traces],
        link_bytes_per_s=link.bytes_per_s,
        link_label=link.label,
        settings=dict(compute_us=compute_us, top=top, split=split),
    )
    advice = {}  # predictor -> its arrays: a prefetch and a hint setting of one predictor share them
    for setting in plan:
        options = _replay.ReplayOptions()
        options.struct_size = ctypes.sizeof(options)
        options.compute_ns = int(round(compute_us * 1e3))
        options.split = int(split)
        if setting.advice != "none":
            arrays = advice.get(setting.predictor)
            if arrays is None:
                arrays = advice[setting.predictor] = advice_arrays(
                    loaded, bench.layout.moe_layers, setting.predictor, top, seed
                )
            options.advice = _replay.ADVICE_PREFETCH if setting.advice == "prefetch" else _replay.ADVICE_HINT
            options.advice_offset, options.advice_count, options.advice_ids = (a.ctypes.data for a in arrays)
        with bench.make_cache(
            budget_bytes=bench.budget_bytes, policy=policy, log_level=1, **bench.cache_options
        ) as cache:
            out = bench.replay(cache, workload, label=setting.name, options=options)
            decode = cache.stats().path("decode")
            report.results.append(
                EngineResult(
                    setting.name,
                    setting.simulated,
                    decode_tokens=workload.decode_tokens,
                    decode_seconds=out.decode_seconds,
                    hits=decode.hits,
                    misses=decode.misses,
                    demand_bytes=out.decode_bytes_h2d,
                    prefetch=cache.prefetch_stats(),
                    link_bytes_per_s=link.bytes_per_s,
                    checksum_errors=out.checksum_errors,
                    experts_checked=out.experts_checked,
                )
            )
    return report


# -- the mode ---------------------------------------------------------------------------------


def check(args) -> None:
    if not 1 <= args.prefetch_top <= 256:
        raise UsageError(f"--prefetch-top must be 1..256, got {args.prefetch_top}")
    if args.hints and not args.prefetch:
        raise UsageError("--hints gives the --prefetch predictors as hints: name them, e.g. --prefetch cooc")
    synthetic_traces(args)


def device_bytes(args, budget: int, model_bytes: int) -> int:
    return budget  # one cache at a time


def run(bench, args) -> Iterator[Report]:
    yield run_engine(
        bench,
        traces=args.traces,
        prefetch=args.prefetch or ["none"],
        hints=args.hints,
        compute_us=args.layer_compute_us or 0.0,
        split=args.split,
        top=args.prefetch_top,
    )


def describe(report: Report) -> list[str]:
    """The engine model's lines under the header: the non-expert work, the select, the predictions."""
    st = report.settings
    return [
        f"{st['compute_us']:g} µs of non-expert work per layer before its select; "
        f"{'split select (hits before misses)' if st['split'] else 'plain select'}; predictions: top {st['top']}",
        "oracle:R is simulated: an engine that knows each next-layer expert with probability R.",
    ]


def table(report: Report) -> str:
    """The settings side by side, with each one's ratio to ``none``."""

    ref = report.results[0] if report.results else None
    rows = []
    for r in report.results:
        p = r.prefetch
        rows.append(
            [
                r.setting + (" (simulated)" if r.simulated else ""),
                f"{r.tokens_per_s:.2f}",
                f"{r.tokens_per_s / ref.tokens_per_s:.3f}×" if ref and ref.tokens_per_s else "—",
                f"{r.misses_per_token:.2f}",
                f"{r.bytes_per_token / (1 << 20):.1f}",
                f"{p.used} / {p.late} / {p.wasted} / {p.cancelled}" if p.issued else "—",
                f"{p.hint_refreshes}" if p.hints else "—",
                share(r.link_busy),
                f"{r.checksum_errors} bad / {r.experts_checked}",
            ]
        )
    return tabulate(
        rows,
        headers=[
            "setting",
            timed(report, "decode tok/s"),
            timed(report, "vs none"),
            "demand misses/token",
            "MiB moved/token",
            "prefetch used / late / wasted / cancelled",
            "hint refreshes",
            timed(report, "link busy"),
            "checksums",
        ],
        disable_numparse=True,
    )
