"""The benchmark as an engine sees it: every decode call is one layer of a decode step, with
``compute_us`` of non-expert work (attention, the shared expert, the router: a kernel that only
takes time) on the compute stream before the layer's select, and the advice for the layer (a
prefetch, or a hint, of the experts a predictor expects there, made once the previous layer was
routed) issued just before that work, while the link would otherwise sit idle.

:func:`run_engine` replays the decode traces once per setting, side by side in one process with
the same cache settings, and reports tok/s, demand misses and bytes moved per token (demand
misses and prefetch pieces), prefetch used/wasted/cancelled and how busy the link was: bytes
moved over the measured link bandwidth times the decode time. Settings: ``none`` first (the
reference every ratio is taken against), then each ``prefetch`` spec of
:mod:`~pyexpcache.bench.predict` (``cooc``, ``oracle:R``: simulated, and labelled so), and with
hints the same predictions given as :meth:`~pyexpcache.ExpertCache.hint` only. ``split``
serves every setting with the split select (the hits' kernel runs while the misses cross).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import ClassVar, Sequence

import numpy as np

from ...stats import PrefetchStats
from .. import predict
from ..report import Report
from ..workload import DEFAULT_TRACES, decode_trace, decode_workload


@dataclass
class Setting:
    """One way of running the engine: what its advice is and where it comes from."""

    advice: str     # "none", "prefetch" or "hint"
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
class EngineResult:
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
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

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
    return (np.asarray(offsets, np.uint64), np.asarray(counts, np.uint32),
            np.asarray(ids if ids else [0], np.uint32))


def run_engine(bench, *, traces: Sequence[str] = DEFAULT_TRACES, prefetch: Sequence[str] = ("cooc",),
               hints: bool = False, compute_us: float = 0.0, top: int = 6, split: bool = False,
               policy: str = "oppclass", seed: int = 0) -> Report:
    """Replay the decode traces once per :func:`settings` entry on ``bench`` (a
    :class:`~pyexpcache.bench.bench.Bench`: its source, stream and budget), each with a new cache
    of ``policy``; see the module docstring."""
    from .. import replay as _replay

    if not 0 <= compute_us <= 1e6:
        raise ValueError(f"compute_us must be in [0, 1e6], got {compute_us}")
    plan = settings(prefetch, hints)
    loaded = [decode_trace(name) for name in traces]  # parsed once, for the calls and the predictions
    workload = decode_workload(loaded, bench.layout.moe_layers)
    link = bench.measure_link()
    report = Report("engine", "engine model", **bench.report_header(), traces=list(traces),
                    link_bytes_per_s=link.bytes_per_s, link_label=link.label,
                    settings=dict(compute_us=compute_us, top=top, split=split))
    advice = {}  # predictor -> its arrays: a prefetch and a hint setting of one predictor share them
    for setting in plan:
        options = _replay.ReplayOptions()
        options.struct_size = ctypes.sizeof(options)
        options.compute_ns = int(round(compute_us * 1e3))
        options.split = int(split)
        if setting.advice != "none":
            arrays = advice.get(setting.predictor)
            if arrays is None:
                arrays = advice[setting.predictor] = advice_arrays(loaded, bench.layout.moe_layers,
                                                                   setting.predictor, top, seed)
            options.advice = _replay.ADVICE_PREFETCH if setting.advice == "prefetch" else _replay.ADVICE_HINT
            options.advice_offset, options.advice_count, options.advice_ids = (a.ctypes.data for a in arrays)
        with bench.make_cache(budget_bytes=bench.budget_bytes, policy=policy, log_level=1,
                              **bench.cache_options) as cache:
            out = bench.replay(cache, workload, label=setting.name, options=options)
            decode = cache.stats().path("decode")
            report.results.append(EngineResult(
                setting.name, setting.simulated, decode_tokens=workload.decode_tokens,
                decode_seconds=out.decode_seconds, hits=decode.hits, misses=decode.misses,
                demand_bytes=out.decode_bytes_h2d, prefetch=cache.prefetch_stats(), link_bytes_per_s=link.bytes_per_s,
                checksum_errors=out.checksum_errors, experts_checked=out.experts_checked))
    return report


def describe(report: Report) -> list[str]:
    """The engine model's lines under the header: the non-expert work, the select, the predictions."""
    st = report.settings
    return [f"{st['compute_us']:g} µs of non-expert work per layer before its select; "
            f"{'split select (hits before misses)' if st['split'] else 'plain select'}; predictions: top {st['top']}",
            "oracle:R is simulated: an engine that knows each next-layer expert with probability R."]


def table(report: Report) -> str:
    """The settings side by side, with each one's ratio to ``none``."""
    from tabulate import tabulate

    ref = report.results[0] if report.results else None
    rows = []
    for r in report.results:
        p = r.prefetch
        rows.append([
            r.setting + (" (simulated)" if r.simulated else ""),
            f"{r.tokens_per_s:.2f}",
            f"{r.tokens_per_s / ref.tokens_per_s:.3f}×" if ref and ref.tokens_per_s else "—",
            f"{r.misses_per_token:.2f}",
            f"{r.bytes_per_token / (1 << 20):.1f}",
            f"{p.used} / {p.wasted} / {p.cancelled}" if p.issued else "—",
            f"{p.hint_refreshes}" if p.hints else "—",
            f"{100 * r.link_busy:.0f} %",
            f"{r.checksum_errors} bad / {r.experts_checked}",
        ])
    return tabulate(rows, headers=["setting", "decode tok/s", "vs none", "demand misses/token", "MiB moved/token",
                                   "prefetch used / wasted / cancelled", "hint refreshes", "link busy",
                                   "checksums"], disable_numparse=True)
