"""The graph loop (``expcache bench graph``; ``expcache bench --loop graph``): the decode traces
served from the GPU, each token's step captured once in a CUDA graph and replayed per token.

The traces' ids are put on the device once, as a router would leave them; before each replay one
device-to-device copy puts the token's ids ([layers, k] int32) where the graph reads them. The
step, per layer: ``compute_us`` of non-expert work (the library's spin kernel), the device-side
select (``ExpertCache.select_device``: lookup, LRU, the misses' copies from the pinned source by a
kernel reading mapped memory, the counters) and one kernel reading every routed expert through the
bank by slot id (``expcache_testing_bank_checksum_async``, the memory-bound floor of the expert
GEMVs, whose sums are checked against the source after each token, outside the timing). A token's
time runs from its ids' copy to the end of a synchronize after the replay.

Side by side in one run, with the same budget, LRU and layers: the C loop serving each layer with
the host select (``expcache_select_async``; the ids on the host), the same non-expert work and the
same reading kernel (the checksum over the served addresses). Both caches evict by LRU with the
same rules, so their hit counts are equal (the report says whether they are). Then the time of an
all-hit ``select_device`` of one token's ids per layer, in a graph of one select per layer
replayed many times.

On the host backend the same loop runs without capture (its "device" memory is host memory).
"""

from __future__ import annotations

import ctypes
import sys
import time
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterator, Optional, Sequence

import numpy as np

from .. import options
from ..options import BENCH, LAYER_COMPUTE_US, OUTPUT
from ..report import DecodeRate, HitRate, Report, share, timed
from ..workload import DEFAULT_TRACES, decode_trace, decode_workload, trace_label
from .torch_loop import LOOP

NAME = "graph"
TITLE = "graph loop"
HELP = "each token's step in one CUDA graph: select_device and a kernel reading the experts through the bank"
DESCRIPTION = ("The decode traces served from the GPU: the ids stay on the device, each token's step (per layer: "
               "non-expert work, select_device, a kernel reading every routed expert through the bank) captured "
               "once in a CUDA graph and replayed per token, next to the C loop's host select (both LRU); then the "
               "all-hit select_device time per layer under replay.")
RUNS = "replays the decode scenario with the device-side select in a CUDA graph, next to the C loop"
USES_BENCH = True
OPTIONS = BENCH + (LAYER_COMPUTE_US,) + OUTPUT
SELECTED_BY = (LOOP,)  # --loop graph, in the flag spelling

ALL_HIT_REPLAYS = 200  # replays of the all-hit graph timed
PROGRESS_EVERY = 16    # tokens between two progress reports


@dataclass
class GraphLoopResult(DecodeRate, HitRate):
    loop: str
    decode_tokens: int = 0      # timed
    decode_seconds: float = 0.0
    served_tokens: int = 0      # those the hits and misses count (the graph loop's eager first token too)
    hits: int = 0
    misses: int = 0
    bytes_h2d: int = 0          # of the timed tokens
    link_bytes_per_s: float = 0.0
    compute_seconds: float = 0.0  # the non-expert work the timed tokens contain
    checksum_errors: int = 0
    experts_checked: int = 0

    DERIVED: ClassVar[tuple[str, ...]] = ("tokens_per_s", "hit_rate", "misses_per_token", "link_bound_tokens_per_s",
                                          "of_link_bound")
    # Hits and misses count every token served; times, bytes and the bound the timed ones.

    @property
    def misses_per_token(self) -> float:
        return self.misses / self.served_tokens if self.served_tokens else 0.0

    @property
    def link_bound_tokens_per_s(self) -> float:
        """Tokens/s if each token took only its misses' bytes at the measured link rate, plus its
        non-expert work."""
        if not self.decode_tokens or not self.link_bytes_per_s:
            return 0.0
        seconds = self.bytes_h2d / self.link_bytes_per_s + self.compute_seconds
        return self.decode_tokens / seconds if seconds else 0.0

    @property
    def of_link_bound(self) -> float:
        bound = self.link_bound_tokens_per_s
        return self.tokens_per_s / bound if bound else 0.0


def _steps(bench, loaded) -> tuple[np.ndarray, list[int]]:
    """Every token's ids ([tokens, layers, k] int32, the loaded traces one after another) and the
    model layers of the second axis: the layout's MoE layers the traces route. ValueError for
    traces a captured step cannot replay (a missing record, layers or k that differ between traces)."""
    moe = set(bench.layout.moe_layers)
    rows, layers = [], None
    for trace in loaded:
        if not trace.complete:
            raise ValueError(f"trace {trace.name} misses {trace.missing_records} (token, layer) records: a captured "
                             "step replays the same layers every token (the variants table replays incomplete "
                             "traces)")
        keep = [i for i, layer in enumerate(trace.layers) if layer in moe]
        these = [trace.layers[i] for i in keep]
        if layers is None:
            layers = these
        elif these != layers:
            raise ValueError(f"trace {trace.name} routes layers {these[0]}-{these[-1]}, the first trace "
                             f"{layers[0]}-{layers[-1]}: one captured step serves one set of layers")
        rows.append(trace.ids[:, keep, :])
    if not layers:
        raise ValueError(f"the traces route none of layout {bench.layout.name}'s MoE layers")
    ks = {r.shape[2] for r in rows}
    if len(ks) != 1:
        raise ValueError(f"the traces route different numbers of experts per layer ({sorted(ks)})")
    return np.ascontiguousarray(np.concatenate(rows), dtype=np.int32), layers


class _DeviceArrays:
    """int32 arrays where the backend's device reads them: cudaMalloc'd memory seen through
    TensorViews (the CUDA Array Interface), or numpy arrays on the host backend."""

    def __init__(self, cuda: bool, device: int):
        self.cuda, self.device = cuda, device
        self._allocations: list[int] = []

    def empty(self, count: int):
        if not self.cuda:
            return np.zeros(count, np.int32)
        from ... import _cuda

        rt = _cuda.runtime()
        ptr = int(_cuda.check(rt.cudaMalloc(4 * count), f"cudaMalloc({4 * count})"))
        self._allocations.append(ptr)
        return ptr

    def view(self, base, offset: int, count: int, shape):
        """``count`` int32 at element ``offset`` of ``base`` (from :meth:`empty`), shaped ``shape``."""
        if not self.cuda:
            return base[offset:offset + count].reshape(shape)
        from ...views import TensorView

        return TensorView(base + 4 * offset, 4 * count, cuda=True, device_id=self.device, dtype=np.int32, shape=shape)

    def upload(self, base, host: np.ndarray) -> None:
        if not self.cuda:
            base[:host.size] = host.ravel()
            return
        from ... import _cuda

        rt = _cuda.runtime()
        _cuda.check(rt.cudaMemcpy(base, host.ctypes.data, host.nbytes, rt.cudaMemcpyKind.cudaMemcpyHostToDevice),
                    "cudaMemcpy")

    def close(self) -> None:
        if self._allocations:
            from ... import _cuda

            rt = _cuda.runtime()
            for ptr in self._allocations:
                rt.cudaFree(ptr)
            self._allocations = []


class _Graph:
    """A CUDA graph captured from the calls ``fn`` makes on ``stream`` (cuda-python's runtime)."""

    def __init__(self, stream: int, fn: Callable[[], None]):
        from ... import _cuda

        rt = self._rt = _cuda.runtime()
        _cuda.check(rt.cudaStreamBeginCapture(stream, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal),
                    "cudaStreamBeginCapture")
        try:
            fn()
        except BaseException:
            rt.cudaStreamEndCapture(stream)  # ends the failed capture; its graph is dropped
            raise
        graph = _cuda.check(rt.cudaStreamEndCapture(stream), "cudaStreamEndCapture")
        try:
            self._exec = _cuda.check(rt.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")
        finally:
            rt.cudaGraphDestroy(graph)
        self._stream = stream

    def launch(self) -> None:
        from ... import _cuda

        _cuda.check(self._rt.cudaGraphLaunch(self._exec, self._stream), "cudaGraphLaunch")

    def close(self) -> None:
        if self._exec is not None:
            self._rt.cudaGraphExecDestroy(self._exec)
            self._exec = None


def _sync(bench) -> None:
    if bench.is_cuda:
        from ... import _cuda

        _cuda.check(_cuda.runtime().cudaStreamSynchronize(bench.stream), "cudaStreamSynchronize")


def _c_loop(bench, workload, num_layers: int, compute_ns: int, link: float) -> GraphLoopResult:
    """The C loop with the host select (LRU), the same non-expert work per layer."""
    from .. import replay as _replay

    options_ = _replay.ReplayOptions()
    options_.struct_size = ctypes.sizeof(options_)
    options_.compute_ns = compute_ns
    with bench.make_cache(budget_bytes=bench.budget_bytes, policy="lru", log_level=1, **bench.cache_options) as cache:
        out = bench.replay(cache, workload, label="C loop, host select", options=options_)
        decode = cache.stats().path("decode")
    return GraphLoopResult("C loop, host select", decode_tokens=workload.decode_tokens,
                           decode_seconds=out.decode_seconds, served_tokens=workload.decode_tokens,
                           hits=decode.hits, misses=decode.misses,
                           bytes_h2d=out.decode_bytes_h2d, link_bytes_per_s=link,
                           compute_seconds=workload.decode_tokens * num_layers * compute_ns * 1e-9,
                           checksum_errors=out.checksum_errors, experts_checked=out.experts_checked)


def run_graph_loop(bench, *, traces: Sequence[str] = DEFAULT_TRACES, compute_us: float = 0.0,
                   progress: Optional[Callable[[str, int, int], None]] = None, c_loop: bool = True) -> Report:
    """Replay the decode traces in the graph loop (see the module docstring) on ``bench`` (a
    :class:`~pyexpcache.bench.bench.Bench`; its source must be pinned on the CUDA backend), next to
    the C loop's host select unless ``c_loop`` is false."""
    from ... import _lib, testing

    if not 0 <= compute_us <= 1e6:
        raise ValueError(f"compute_us must be in [0, 1e6], got {compute_us}")
    if bench.is_cuda and not bench.pinned:
        raise ValueError("the graph loop's device select reads the experts from pinned memory: use --source pinned")
    progress = progress or bench.progress
    loaded = [decode_trace(t, bench.layout) for t in traces]  # parsed once: the graph's ids and the C loop's calls
    ids, layers = _steps(bench, loaded)
    tokens, num_layers, k = ids.shape
    if tokens < 2:
        raise ValueError("the graph loop needs at least 2 tokens (the first binds and warms up)")
    compute_ns = int(round(compute_us * 1e3))
    link = bench.measure_link()
    report = Report("graph", "graph loop", **bench.report_header(), traces=[trace_label(t) for t in traces],
                    link_bytes_per_s=link.bytes_per_s, link_label=link.label,
                    settings=dict(compute_us=compute_us, policy="lru", layers=f"{layers[0]}-{layers[-1]}", k=k,
                                  capture=bench.is_cuda))
    if c_loop:
        report.results.append(_c_loop(bench, decode_workload(loaded, layers), num_layers, compute_ns,
                                      link.bytes_per_s))

    arrays = _DeviceArrays(bench.is_cuda, bench.device)
    graph = all_hit = None
    stream = bench.stream
    try:
        with bench.make_cache(budget_bytes=bench.budget_bytes, lookup="device", log_level=1,
                              **bench.cache_options) as cache:
            all_ids = arrays.empty(ids.size)
            arrays.upload(all_ids, ids)
            cur = arrays.empty(num_layers * k)
            slots = arrays.empty(num_layers * k)
            cur_views = [arrays.view(cur, i * k, k, (k,)) for i in range(num_layers)]
            slot_views = [arrays.view(slots, i * k, k, (k,)) for i in range(num_layers)]
            step_bytes = 4 * num_layers * k

            def put_token(t: int) -> None:
                if not bench.is_cuda:
                    cur[:] = ids[t].ravel()
                    return
                from ... import _cuda

                rt = _cuda.runtime()
                _cuda.check(rt.cudaMemcpyAsync(cur, all_ids + t * step_bytes, step_bytes,
                                               rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync")

            def step() -> None:
                for i, layer in enumerate(layers):
                    if compute_ns:
                        with cache.raw_handle() as handle:
                            _lib.lib.expcache_testing_spin_async(handle, stream or None, compute_ns)
                    cache.select_device(layer, cur_views[i], stream=stream, out=slot_views[i])
                    testing.bank_checksum_async(cache, layer, slot_views[i], first=i * k, stream=stream)

            expected = np.stack([bench.expected[layer][ids[:, i, :]] for i, layer in enumerate(layers)], axis=1)
            result = GraphLoopResult("graph loop, select_device", decode_tokens=tokens - 1, served_tokens=tokens,
                                     link_bytes_per_s=link.bytes_per_s,
                                     compute_seconds=(tokens - 1) * num_layers * compute_ns * 1e-9)
            first_bad = None

            def verify(t: int) -> None:
                nonlocal first_bad
                got = testing.checksum_results(cache, 0, num_layers * k).reshape(num_layers, k)
                bad = got != expected[t]
                result.experts_checked += got.size
                if bad.any():
                    result.checksum_errors += int(bad.sum())
                    if first_bad is None:
                        i, j = np.argwhere(bad)[0]
                        first_bad = (t, layers[i], int(ids[t, i, j]))

            # Token 0, eagerly: binds every layer's class (its bank) and makes the kernels' scratch.
            put_token(0)
            step()
            _sync(bench)
            verify(0)
            if bench.is_cuda:
                graph = _Graph(stream, step)
            run = graph.launch if graph is not None else step
            before = cache.stats().path("device")
            perf = time.perf_counter
            for t in range(1, tokens):
                t0 = perf()
                put_token(t)
                run()
                _sync(bench)
                result.decode_seconds += perf() - t0
                verify(t)
                if t % PROGRESS_EVERY == 0 or t + 1 == tokens:
                    progress("graph loop", t, tokens - 1)
            after = cache.stats().path("device")
            result.hits, result.misses = after.hits, after.misses
            result.bytes_h2d = after.bytes_h2d - before.bytes_h2d
            totals = (after.hits, after.misses)
            report.results.append(result)
            if first_bad is not None:
                t, layer, e = first_bad
                print(f"CHECKSUM MISMATCH: graph loop: {result.checksum_errors} experts differ from the source "
                      f"(first at token {t}: layer {layer}, expert {e})", file=sys.stderr)

            # The all-hit select: the last token's ids, resident now, one select per layer.
            def selects() -> None:
                for i, layer in enumerate(layers):
                    cache.select_device(layer, cur_views[i], stream=stream, out=slot_views[i])

            selects()
            _sync(bench)
            if bench.is_cuda:
                all_hit = _Graph(stream, selects)
            go = all_hit.launch if all_hit is not None else selects
            go()
            _sync(bench)
            misses_before = cache.stats().path("device").misses
            t0 = perf()
            for _ in range(ALL_HIT_REPLAYS):
                go()
            _sync(bench)
            seconds = perf() - t0
            if cache.stats().path("device").misses != misses_before:
                raise RuntimeError("the all-hit selects missed: the budget cannot hold one token's experts")
            report.settings["all_hit_select_us"] = 1e6 * seconds / (ALL_HIT_REPLAYS * num_layers)
            report.settings["same_hits_as_c_loop"] = (
                None if not c_loop else
                totals == (report.results[0].hits, report.results[0].misses))
    finally:
        for g in (graph, all_hit):
            if g is not None:
                g.close()
        arrays.close()
    return report


# -- the mode ---------------------------------------------------------------------------------

def check(args) -> None:
    if getattr(args, "source", None) not in (None, "pinned") and args.backend != "host":
        raise options.UsageError("the graph loop's device select reads the experts from pinned memory: use "
                                 "--source pinned (the default on the GPU)")
    options.synthetic_traces(args)


def device_bytes(args, budget: int, model_bytes: int) -> int:
    return budget  # one cache at a time


def run(bench, args) -> Iterator[Report]:
    yield run_graph_loop(bench, traces=args.traces, compute_us=args.layer_compute_us or 0.0,
                         progress=bench.progress)


def describe(report: Report) -> list[str]:
    st = report.settings
    capture = "captured once in a CUDA graph, replayed per token" if st["capture"] else "run eagerly (host backend)"
    same = st.get("same_hits_as_c_loop")
    lines = [f"policy lru; layers {st['layers']}, k {st['k']}; {st['compute_us']:g} µs of non-expert work per layer; "
             f"each token's step {capture}",
             f"all-hit select_device: {st['all_hit_select_us']:.2f} µs per layer"
             + (" (graph replay)" if st["capture"] else " (host backend: meaningless as a time)")]
    if same is not None:
        lines.append("hits and misses equal to the C loop's (both LRU)" if same else
                     "HITS DIFFER from the C loop's (both LRU): a bug")
    return lines


def table(report: Report) -> str:
    from tabulate import tabulate

    ref = report.results[0] if report.results else None
    rows = []
    for r in report.results:
        rows.append([r.loop, f"{r.tokens_per_s:.2f}",
                     f"{r.tokens_per_s / ref.tokens_per_s:.3f}×" if ref and ref.tokens_per_s else "—",
                     f"{100 * r.hit_rate:.2f} %", f"{r.misses_per_token:.2f}",
                     share(r.of_link_bound, 1) if r.of_link_bound else "—",
                     f"{r.checksum_errors} bad / {r.experts_checked} checked"])
    versus = timed(report, f"vs {ref.loop if ref else '—'}")
    return tabulate(rows, headers=["loop", timed(report, "decode tok/s"), versus, "hit rate", "misses/token",
                                   timed(report, "of link bound"), "checksums"],
                    disable_numparse=True)
