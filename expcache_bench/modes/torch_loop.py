"""The torch loop (``expcache bench torch``; ``expcache bench --loop torch``, deprecated): the decode traces
replayed in a Python/torch decode loop, as engines such as the public
mixtral-offloading project run one: per token, per layer, optionally ``compute_us`` of non-expert
work on the stream (the library's ``expcache_testing_spin_async``) and a synchronize (the
router's result must reach the host), then the layer's experts served as zero-copy views, then
**one torch kernel per expert over its view**, then a synchronize before the next layer.

The kernel is a reduction that reads every byte of the expert: ``torch.sum(t.view(torch.int32),
dtype=torch.int64)`` (``torch.uint8`` words when a part's size is not a multiple of 4), the
memory-bound floor of the expert's GEMVs. ``t`` spans the expert's gate, up and down parts at once
when they lie back to back in the slot (the library places each part at a 256-byte aligned
offset, so they do whenever the part sizes are multiples of 256 bytes: every preset at the real
sizes and down to ``--scale 256``); it is then a zero-copy :class:`~pyexpcache.views.TensorView`
from the gate's address over the three parts' bytes, made once per slot. Whether the parts touch
is checked per expert from the views' addresses; where they do not (padding between them, e.g.
``--scale 4096``) the loop launches one kernel per part instead (three per expert; reported as
"kernels / expert").

Modes, side by side in one run, each with a new cache of the same budget and policy:

``plain``  ``cache.select_views(layer, ids, stream)``; every expert's kernel; synchronize.
``split``  hits before misses: ``cache.select_split(layer, ids, stream, views=True)``; the hits'
           kernels at once; ``sel.wait(stream)``; the misses' kernels; synchronize.
``slots``  by slot id: ``cache.select_slots(layer, ids, stream)`` (the ids on the host, int32 slots
           back), the slots to the device, then the layer's experts read from the class's bank
           (:meth:`~pyexpcache.ExpertCache.bank`) by ``index_select`` and reduced per row: two
           kernels per layer whatever its k, as an engine whose kernels read ``base + slot *
           stride`` runs; synchronize.

Every kernel's result is checked against the same reduction computed with numpy from the source's
bytes (:func:`expected_sums`), after each layer's synchronize and outside the timed part (a stack
of the layer's results and one read back). The decode time of a layer runs from before its
non-expert work to after its synchronize, as in the C loop's engine model
(:mod:`~expcache_bench.modes.engine`).

CUDA: the loop runs with ``torch.cuda.ExternalStream(bench.stream)`` as torch's current stream,
so the cache's copies and torch's kernels share the stream the C loop uses (no event between
them). Host backend: the views are host memory, the kernels CPU reductions, the stream 0.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, ClassVar, Optional

import numpy as np
from tabulate import tabulate

from pyexpcache import _lib, bank as _bank
from pyexpcache.views import TensorView

from .. import options
from ..options import BENCH, LAYER_COMPUTE_US, OUTPUT, Option
from ..report import DecodeRate, HitRate, Report, timed
from ..workload import DEFAULT_TRACES, build_workload, trace_label

MODES = ("plain", "split", "slots")  # of the loop: how each layer is served
PROGRESS_EVERY = 256  # decode calls between two progress reports
KERNEL_NOTE = "torch loop: one torch kernel per expert over its view, a synchronize per layer"

NAME = "torch"
TITLE = "torch loop"
HELP = "a torch decode loop: one torch kernel per expert over its view (plain, split) or the bank by slot id"
DESCRIPTION = (
    "The decode traces in a torch decode loop (one torch kernel per expert over its zero-copy view, a "
    "synchronize per layer), the plain select against hits before misses and against select_slots with "
    "the bank read by index_select, side by side (decode "
    "scenario, the library's default policy); needs torch (the [torch] extra)."
)
RUNS = "replays the decode scenario in torch, plain and split selects side by side"
USES_BENCH = True

LOOP = Option(
    "--loop",
    choices=("c", "torch", "graph"),
    default="c",
    selects={"torch": "torch", "graph": "graph"},
    help="deprecated: name the mode instead, expcache bench torch (the torch loop) or expcache bench graph (each "
    "token's step captured in a CUDA graph with the device-side select); c: the C replay loop (default)",
)
OPTIONS = BENCH + (LAYER_COMPUTE_US,) + OUTPUT
SELECTED_BY = (LOOP,)  # --loop torch, in the flag spelling


@dataclass
class TorchLoopResult(DecodeRate, HitRate):
    mode: str
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    hits: int = 0
    misses: int = 0
    checksum_errors: int = 0
    experts_checked: int = 0
    decode_calls: int = 0
    serve_seconds: float = 0.0  # inside select_views / select_split (and making the views)
    kernels: int = 0  # torch reductions launched

    DERIVED: ClassVar[tuple[str, ...]] = (
        "tokens_per_s",
        "hit_rate",
        "misses_per_token",
        "kernels_per_expert",
        "serve_us_per_call",
    )

    @property
    def misses_per_token(self) -> float:
        return self.misses / self.decode_tokens if self.decode_tokens else 0.0

    @property
    def kernels_per_expert(self) -> float:
        return self.kernels / self.experts_checked if self.experts_checked else 0.0

    @property
    def serve_us_per_call(self) -> float:
        return 1e6 * self.serve_seconds / self.decode_calls if self.decode_calls else 0.0


def _word_bytes(spec) -> int:
    """The word the reduction of a layer's experts sums: int32 (4) when every part's size is a
    multiple of 4 bytes, else uint8 (1)."""
    return 4 if all(b % 4 == 0 for b in spec.class_key) else 1


def _reduce_np(data: np.ndarray, word: int) -> int:
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    return int(np.sum(raw.view("<i4") if word == 4 else raw, dtype=np.int64))


def expected_sums(
    bench,
    traces: Sequence[str] = DEFAULT_TRACES,
    *,
    workload=None,
    progress: Optional[Callable[[str, int, int], None]] = None,
) -> np.ndarray:
    """What each part's kernel must give: ``[num_layers, max_experts, 3]`` int64, entry ``[l, e, p]``
    the sum of part ``p`` of expert ``(l, e)`` of ``bench.source`` as int32 words (uint8 where a
    part's size is not a multiple of 4), computed with numpy from the source's bytes; an expert's
    is the sum over its parts. Only the experts the decode traces route to are computed (the
    others stay 0), layers in parallel (numpy's reductions release the GIL). ``progress``
    (default ``bench.progress``) is called once per layer done."""
    layout = bench.layout
    progress = progress or bench.progress
    if workload is None:
        workload = build_workload("decode", traces, layout.moe_layers, layout)
    _check_fits(layout, workload)
    wanted: dict[int, set] = {}
    for call in workload.calls:
        wanted.setdefault(call.layer, set()).update(call.ids)
    width = max(s.num_experts for s in layout.layers if s)
    out = np.zeros((layout.num_layers, width, 3), np.int64)
    source = bench.source

    def one_layer(layer: int) -> None:
        word = _word_bytes(layout[layer])
        for e in sorted(wanted[layer]):
            for p in range(3):
                out[layer, e, p] = _reduce_np(source.part(layer, e, p), word)

    layers = sorted(wanted)
    workers = max(1, min(8, os.cpu_count() or 1, len(layers)))
    with ThreadPoolExecutor(workers) as pool:
        for n, _ in enumerate(pool.map(one_layer, layers)):
            progress("torch loop: expected sums", n + 1, len(layers))
    return out


def _check_fits(layout, workload) -> None:
    for call in workload.calls:
        spec = layout[call.layer] if call.layer < layout.num_layers else None
        if spec is None or max(call.ids) >= spec.num_experts:
            raise ValueError(
                f"the traces route to layer {call.layer}, expert {max(call.ids)}, which layout "
                f"{layout.name} does not have: they are DeepSeek V4 Flash traces (43 layers, 256 "
                "experts)"
            )


def _import_torch():
    try:  # torch is optional (the [torch] extra) and slow to import: only when a loop runs
        import torch
    except ImportError as exc:
        raise ImportError("the torch decode loop (expcache bench torch) needs PyTorch: pip install torch") from exc
    return torch


class _Loop:
    """What both modes share: torch, the stream, the per-layer word type, the span views."""

    def __init__(self, torch, bench):

        self.torch = torch
        self.bench = bench
        self.cuda = bench.is_cuda
        self.stream = bench.stream if self.cuda else 0
        self.TensorView = TensorView
        self.words = {
            layer: (torch.int32 if _word_bytes(bench.layout[layer]) == 4 else None) for layer in bench.layout.moe_layers
        }
        self.spans: dict[tuple[int, int], object] = {}
        if self.cuda:
            if not torch.cuda.is_available():
                raise RuntimeError(
                    f"the cuda backend is in use but torch {torch.__version__} sees no CUDA device "
                    "(a CPU-only build?): install a CUDA build of torch, or use --backend host"
                )
            self.device = torch.device("cuda", bench.device)
            self.torch_stream = torch.cuda.ExternalStream(bench.stream, device=self.device)
        else:
            self.device = torch.device("cpu")
            self.torch_stream = None

    @contextlib.contextmanager
    def active(self):
        """torch's current device and stream are the bench's for the block."""
        if not self.cuda:
            yield
            return
        with self.torch.cuda.device(self.device), self.torch.cuda.stream(self.torch_stream):
            yield

    def synchronize(self) -> None:
        if self.cuda:
            self.torch_stream.synchronize()

    def warm_up(self) -> None:
        """torch's lazy initialization and first launches of each kernel, before any timing."""
        torch = self.torch
        with self.active():
            x = torch.zeros(1 << 16, dtype=torch.uint8, device=self.device)
            parts = [torch.sum(x.view(torch.int32), dtype=torch.int64), torch.sum(x, dtype=torch.int64)]
            torch.stack(parts).tolist()
            self.synchronize()

    def bank_rows(self, cache, layer: int):
        """The layer's bank as torch tensors of rows: one ``[rows, slot bytes]`` span over the three
        parts when they lie back to back in the slot, else one per part; made once per cache."""
        key = ("bank", id(cache), layer)
        made = self.spans.get(key)
        if made is None:
            bank = cache.bank(layer)
            g, u, d = bank.parts
            width = [p.nbytes // bank.rows for p in (g, u, d)]
            if u.ptr == g.ptr + width[0] and d.ptr == u.ptr + width[1]:
                spans = [(g, sum(width), bank.slot_stride)]
            else:  # apart in a slot, or each its own region (a bank_arrangement="parts" bank)
                spans = list(zip((g, u, d), width, bank.part_strides))
            made = self.spans[key] = [
                self.torch.from_dlpack(
                    _bank.slot_view(
                        p.ptr,
                        w,
                        bank.rows,
                        stride,
                        cuda=p.cuda,
                        device_id=p.device_id,
                        dtype=None,
                        shape=None,
                        owner=p.owner,
                    )
                )
                for p, w, stride in spans
            ]
        return made

    def slot_kernels(self, cache, layer: int, slots: np.ndarray, out: list) -> int:
        """The layer's experts read from its bank by slot id: per span, one ``index_select`` of the
        rows and one reduction per row, appended to ``out`` as one tensor of k sums; returns the
        spans (1, or 3 when the parts do not touch)."""
        torch = self.torch
        word = self.words[layer]
        index = torch.from_numpy(slots).to(self.device, non_blocking=True)
        spans = self.bank_rows(cache, layer)
        for rows in spans:
            picked = torch.index_select(rows, 0, index)
            words = picked.view(word) if word is not None else picked
            # A row reduction with dtype= has no vectorized CPU path (17 ms for 6 rows of 108 KiB on
            # the 2-core machine, 40 µs with the cast first); on the GPU it is one kernel.
            out.append(torch.sum(words, dim=1, dtype=torch.int64) if self.cuda else words.to(torch.int64).sum(dim=1))
        return len(spans)

    def expert_kernels(self, layer: int, view, out: list) -> int:
        """Launch the reduction(s) of one expert's view on torch's current stream, appending the
        result tensors to ``out``; returns how many (1: the parts are back to back, one span over
        them; 3: one per part)."""
        torch = self.torch
        word = self.words[layer]
        g, u, d = view.gate, view.up, view.down
        if u.ptr == g.ptr + g.nbytes and d.ptr == u.ptr + u.nbytes:
            key = (g.ptr, d.ptr + d.nbytes)
            span = self.spans.get(key)
            if span is None:
                if len(self.spans) >= 1 << 16:
                    self.spans.clear()
                span = self.spans[key] = self.TensorView(
                    g.ptr, g.nbytes + u.nbytes + d.nbytes, cuda=g.cuda, device_id=g.device_id, stream=g.stream
                )
            elif span.stream != g.stream:
                span.stream = g.stream
            t = torch.from_dlpack(span)
            out.append(torch.sum(t.view(word) if word is not None else t, dtype=torch.int64))
            return 1
        for part in (g, u, d):
            t = torch.from_dlpack(part)
            out.append(torch.sum(t.view(word) if word is not None else t, dtype=torch.int64))
        return 3


def _run_mode(
    loop: _Loop,
    cache,
    mode: str,
    workload,
    ids: list,
    expected: np.ndarray,
    compute_ns: int,
    progress: Callable[[str, int, int], None],
) -> TorchLoopResult:

    torch = loop.torch
    stream = loop.stream
    spin = _lib.lib.expcache_testing_spin_async
    synchronize = loop.synchronize
    perf = time.perf_counter
    result = TorchLoopResult(mode, decode_tokens=workload.decode_tokens)
    calls = workload.calls
    total = len(calls)
    label = f"torch {mode}"
    first_bad = None
    with loop.active():
        for c, call in enumerate(calls):
            layer = call.layer
            cid = ids[c]
            outs: list = []
            counts: list = []  # per expert, in launch order: (index into the ids, kernels)
            launched = None  # the kernels of the call, when not one entry of counts each
            t0 = perf()
            if compute_ns:
                with cache.raw_handle() as handle:
                    spin(handle, stream or None, compute_ns)
                synchronize()  # the router's result reaches the host
            ts = perf()
            if mode == "plain":
                views = cache.select_views(layer, cid, stream)
                result.serve_seconds += perf() - ts
                for i, view in enumerate(views):
                    counts.append((i, loop.expert_kernels(layer, view, outs)))
            elif mode == "slots":
                slots = cache.select_slots(layer, cid, stream)
                result.serve_seconds += perf() - ts
                spans = loop.slot_kernels(cache, layer, slots, outs)
                # Per expert, as the other modes list their results: its sum, or its three parts'.
                outs = [torch.stack(outs, dim=1).reshape(-1)]
                counts = [(i, spans) for i in range(len(cid))]
                launched = 2 * spans  # an index_select and a reduction per span
            else:
                sel = cache.select_split(layer, cid, stream, views=True)
                result.serve_seconds += perf() - ts
                views, resident = sel.views, sel.resident.tolist()
                for i, view in enumerate(views):
                    if resident[i]:
                        counts.append((i, loop.expert_kernels(layer, view, outs)))
                sel.wait(stream)
                for i, view in enumerate(views):
                    if not resident[i]:
                        counts.append((i, loop.expert_kernels(layer, view, outs)))
            synchronize()
            result.decode_seconds += perf() - t0
            result.decode_calls += 1
            # Verification, untimed: the layer's results read back at once.
            got = (outs[0] if mode == "slots" else torch.stack(outs)).tolist() if outs else []
            want = expected[layer]
            pos = 0
            for i, n in counts:
                row = want[int(cid[i])]
                if n == 1:
                    bad = got[pos] != int(row.sum())
                else:
                    bad = got[pos : pos + 3] != row.tolist()
                pos += n
                if bad:
                    result.checksum_errors += 1
                    if first_bad is None:
                        first_bad = (c, layer, int(cid[i]))
            result.experts_checked += len(counts)
            result.kernels += pos if launched is None else launched
            if (c + 1) % PROGRESS_EVERY == 0 or c + 1 == total:
                progress(label, c + 1, total)
    decode = cache.stats().path("decode")
    result.hits, result.misses = decode.hits, decode.misses
    if first_bad is not None:
        c, layer, e = first_bad
        print(
            f"CHECKSUM MISMATCH: torch {mode}: {result.checksum_errors} experts differ from the source "
            f"(first in call {c}: layer {layer}, expert {e})",
            file=sys.stderr,
        )
    return result


def run_torch_loop(
    bench,
    *,
    traces: Sequence[str] = DEFAULT_TRACES,
    compute_us: float = 0.0,
    policy: Optional[str] = None,
    modes: Sequence[str] = MODES,
    progress: Optional[Callable[[str, int, int], None]] = None,
    expected: Optional[np.ndarray] = None,
) -> Report:
    """Replay the decode traces in a torch decode loop once per mode (see the module docstring) on
    ``bench`` (a :class:`~expcache_bench.bench.Bench`: its source, stream, budget and cache
    options), each mode with a new cache of ``policy`` (None: the library's default, which the report
    names). ``progress(label, done, total)`` (default: ``bench.progress``) is called every few
    hundred decode calls. ``expected``: the table of :func:`expected_sums` (computed here when not
    given)."""

    torch = _import_torch()
    if not 0 <= compute_us <= 1e6:
        raise ValueError(f"compute_us must be in [0, 1e6], got {compute_us}")
    modes = list(modes)
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}: expected one of {MODES}")
    if len(set(modes)) != len(modes) or not modes:
        raise ValueError(f"modes must be distinct and at least one, got {modes}")
    progress = progress or bench.progress
    workload = build_workload("decode", traces, bench.layout.moe_layers, bench.layout)
    _check_fits(bench.layout, workload)
    if expected is None:
        expected = expected_sums(bench, workload=workload, progress=progress)
    ids = [np.asarray(call.ids, dtype=np.uint32) for call in workload.calls]
    loop = _Loop(torch, bench)
    loop.warm_up()
    report = Report(
        "torch",
        "torch loop",
        **bench.report_header(),
        traces=[trace_label(t) for t in traces],
        settings=dict(
            compute_us=compute_us,
            policy=_lib.DEFAULT_POLICY if policy is None else policy,
            torch_version=str(torch.__version__),
        ),
    )
    compute_ns = int(round(compute_us * 1e3))
    for mode in modes:
        with bench.make_cache(
            budget_bytes=bench.budget_bytes, policy=policy, log_level=1, **bench.cache_options
        ) as cache:
            report.results.append(_run_mode(loop, cache, mode, workload, ids, expected, compute_ns, progress))
        loop.spans.clear()  # the next cache's slots are elsewhere
    return report


# -- the mode ---------------------------------------------------------------------------------


def check(args) -> None:
    options.need(options.has_module("torch"), "the torch loop (expcache bench torch) needs torch", "torch")
    options.synthetic_traces(args)


def device_bytes(args, budget: int, model_bytes: int) -> int:
    return budget  # one cache at a time


def run(bench, args) -> Iterator[Report]:
    yield run_torch_loop(bench, traces=args.traces, compute_us=args.layer_compute_us or 0.0, progress=bench.progress)


def describe(report: Report) -> list[str]:
    """The torch loop's lines under the header: the policy, the non-expert work, torch, the kernels."""
    st = report.settings
    return [
        f"policy {st['policy']}; {st['compute_us']:g} µs of non-expert work per layer before its select; "
        f"torch {st['torch_version']}",
        f"{KERNEL_NOTE} (int32 sum of the expert's bytes; one span over gate+up+down when they touch, "
        "else one kernel per part)",
    ]


def table(report: Report) -> str:
    """The modes side by side, with each one's ratio to ``plain`` (else to the first)."""

    by_mode = {r.mode: r for r in report.results}
    ref = by_mode.get("plain") or (report.results[0] if report.results else None)
    rows = []
    for r in report.results:
        rows.append(
            [
                r.mode + (" (hits before misses)" if r.mode == "split" else ""),
                f"{r.tokens_per_s:.2f}",
                f"{r.tokens_per_s / ref.tokens_per_s:.3f}×" if ref and ref.tokens_per_s else "—",
                f"{100 * r.hit_rate:.2f} %",
                f"{r.misses_per_token:.2f}",
                f"{r.serve_us_per_call:.1f}",
                f"{r.kernels_per_expert:g}",
                f"{r.checksum_errors} bad / {r.experts_checked} checked",
            ]
        )
    return tabulate(
        rows,
        headers=[
            "mode",
            timed(report, "decode tok/s"),
            timed(report, "vs plain"),
            "hit rate",
            "misses/token",
            timed(report, "select µs/layer"),
            "kernels/expert",
            "checksums",
        ],
        disable_numparse=True,
    )
