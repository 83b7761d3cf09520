"""The graph loop (``expcache bench graph``; ``expcache bench --loop graph``, deprecated): the decode traces
served from the GPU, each token's step captured once in a CUDA graph and replayed per token.

The traces' ids are put on the device once, as a router would leave them; before each replay one
device-to-device copy puts the token's ids ([layers, k] int32) where the graph reads them. The
step, per layer: ``compute_us`` of non-expert work (the library's spin kernel), the device-side
select (``ExpertCache.select_device``: lookup, the policy's update and victims, the misses' copies
by the select's kernel, from the pinned source it maps or, with ``--source pageable``, ``mmap``
or ``file`` (or ``--gguf``), from the rows the library's feed threads read the misses into, the
counters) and one kernel reading every routed expert through the bank by slot id
(``expcache_testing_bank_checksum_async``, the memory-bound floor of the expert GEMVs, whose sums
are checked against the source after each token, outside the timing). A token's time runs from
its ids' copy to the end of a synchronize after the replay.

A trace may lack records (a token not logged at some layer, traces of different layers): a
missing (token, layer) record is no select, as in the C loop. The step is then one per set of
layers the tokens have records of, captured after the first token with that set runs it eagerly
(untimed, as the first token of a complete trace), and replayed for the later tokens with it.

Side by side in one run, with the same budget, policy and layers: the C loop serving each layer
with the host select (``expcache_select_async``; the ids on the host), the same non-expert work and
the same reading kernel (the checksum over the served addresses; for experts of other than three
parts, a quantized checkpoint's, ``expcache_select_slots_async`` and the bank's checksum of the
slots it wrote to the host). The policy is the library's
default (duel) unless one is given; the device lookup runs it with the host's rules, so the two
loops' hit counts are equal (the report says whether they are). Then the time of an all-hit
``select_device`` per layer, in a graph of one select per layer replayed many times: of one
token's ids, and of ``ALL_HIT_IDS`` (8) distinct ids per layer, those routed last.

Each loop's bound is its timed tokens' miss bytes at the link's rate, plus their non-expert work;
from a file the disk's read rate is measured too (:mod:`~expcache_bench.disk`) and the bound is
taken at the lower of the two (the table says which). The disk's rate is the faster of two: the
best cold shape before the loops, and the C loop's own misses read again after both loops, in its
order (:func:`~expcache_bench.disk.replay`; the misses are the simulator's of the same policy at
the C loop's caps, checked equal in number to the C loop's: the command fails where they are not),
since a disk whose host caches it reads the experts a run keeps missing faster than cold ones;
the header gives both rates and which one the disk bound uses, the table's column names it. The
bench drops a file it wrote from the page cache before each loop, and the report gives the share
of it the page cache held after.

On the host backend the same loop runs without capture (its "device" memory is host memory).
"""

from __future__ import annotations

import ctypes
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Callable, ClassVar, Optional

import numpy as np
from tabulate import tabulate

from pyexpcache import _cuda, _lib, testing
from pyexpcache.routing import MISSING
from pyexpcache.views import TensorView

from .. import disk as _disk, options, replay as _replay
from ..options import BENCH, LAYER_COMPUTE_US, OUTPUT
from ..report import DecodeRate, HitRate, Report, share, timed
from ..sim import KEY_SHIFT, simulate_policy
from ..workload import DEFAULT_TRACES, decode_trace, decode_workload, trace_label
from .torch_loop import LOOP

NAME = "graph"
TITLE = "graph loop"
HELP = "each token's step in one CUDA graph: select_device and a kernel reading the experts through the bank"
DESCRIPTION = (
    "The decode traces served from the GPU: the ids stay on the device, each token's step (per layer: "
    "non-expert work, select_device, a kernel reading every routed expert through the bank) captured "
    "once in a CUDA graph and replayed per token, next to the C loop's host select (one policy, the "
    "library's default); then the "
    "all-hit select_device time per layer under replay."
)
RUNS = "replays the decode scenario with the device-side select in a CUDA graph, next to the C loop"
USES_BENCH = True
OPTIONS = BENCH + (LAYER_COMPUTE_US,) + OUTPUT
SELECTED_BY = (LOOP,)  # --loop graph, in the flag spelling

ALL_HIT_REPLAYS = 200  # replays of the all-hit graph timed
ALL_HIT_IDS = 8  # ids per layer of the second all-hit figure (fewer only where a layer has fewer experts)
PROGRESS_EVERY = 16  # tokens between two progress reports


@dataclass
class GraphLoopResult(DecodeRate, HitRate):
    loop: str
    decode_tokens: int = 0  # timed
    decode_seconds: float = 0.0
    served_tokens: int = 0  # those the hits and misses count (the graph loop's eager first token too)
    hits: int = 0
    misses: int = 0
    bytes_h2d: int = 0  # of the timed tokens
    link_bytes_per_s: float = 0.0
    disk_bytes_per_s: float = 0.0  # a file source's read rate (0: a source in memory)
    compute_seconds: float = 0.0  # the non-expert work the timed tokens contain
    checksum_errors: int = 0
    experts_checked: int = 0
    page_cache_after: Optional[float] = None  # a file source: the share of its file in the page cache after the loop
    pool_hits: int = 0  # --host-budget-gib: the misses the host pool served, of pool_lookups (the loop's misses)
    pool_lookups: int = 0

    DERIVED: ClassVar[tuple[str, ...]] = (
        "tokens_per_s",
        "hit_rate",
        "misses_per_token",
        "link_bound_tokens_per_s",
        "of_link_bound",
        "bound_by",
        "bound_tokens_per_s",
        "of_bound",
    )
    # Hits and misses count every token served; times, bytes and the bound the timed ones.

    @property
    def misses_per_token(self) -> float:
        return self.misses / self.served_tokens if self.served_tokens else 0.0

    @property
    def disk_bytes(self) -> float:
        """Of the timed tokens' miss bytes, those read from the source: all of them, or with a
        host pool its misses' share (the pool's hits come from RAM)."""
        if not self.pool_lookups:
            return float(self.bytes_h2d)
        return self.bytes_h2d * (1 - self.pool_hits / self.pool_lookups)

    def _bound_at(self, bytes_per_s: float, nbytes: Optional[float] = None) -> float:
        """Tokens/s if each token took only its misses' bytes (or ``nbytes``) at ``bytes_per_s``,
        plus its non-expert work."""
        if not self.decode_tokens or not bytes_per_s:
            return 0.0
        seconds = (self.bytes_h2d if nbytes is None else nbytes) / bytes_per_s + self.compute_seconds
        return self.decode_tokens / seconds if seconds else 0.0

    def _disk_bound(self) -> float:
        """The bound at the disk's rate over the bytes read from it (0: a source in memory)."""
        return self._bound_at(self.disk_bytes_per_s, self.disk_bytes) if self.disk_bytes_per_s else 0.0

    @property
    def link_bound_tokens_per_s(self) -> float:
        """The bound at the measured link rate."""
        return self._bound_at(self.link_bytes_per_s)

    @property
    def of_link_bound(self) -> float:
        bound = self.link_bound_tokens_per_s
        return self.tokens_per_s / bound if bound else 0.0

    @property
    def bound_by(self) -> str:
        """What binds: ``"link"``, or ``"disk"`` where a file source's reads (with a host pool,
        of its misses only) take longer than the link's copies."""
        disk = self._disk_bound()
        return "disk" if disk and disk < self.link_bound_tokens_per_s else "link"

    @property
    def bound_tokens_per_s(self) -> float:
        """The lower of the link's bound and the disk's (the link's for a source in memory)."""
        disk = self._disk_bound()
        return min(disk, self.link_bound_tokens_per_s) if disk else self.link_bound_tokens_per_s

    @property
    def of_bound(self) -> float:
        limit = self.bound_tokens_per_s
        return self.tokens_per_s / limit if limit else 0.0


def _steps(bench, loaded) -> tuple[np.ndarray, list[int]]:
    """Every token's ids ([tokens, layers, k] int32, the loaded traces one after another, rows of
    ``MISSING`` where a token has no record of a layer) and the model layers of the second axis:
    every MoE layer of the layout that some trace routes. ValueError for traces of different k,
    or traces that route none of the layout's MoE layers."""
    moe = set(bench.layout.moe_layers)
    layers = sorted({layer for trace in loaded for layer in trace.routed_layers if layer in moe})
    if not layers:
        raise ValueError(f"the traces route none of layout {bench.layout.name}'s MoE layers")
    ks = {trace.k for trace in loaded}
    if len(ks) != 1:
        raise ValueError(f"the traces route different numbers of experts per layer ({sorted(ks)})")
    k = ks.pop()
    rows = []
    for trace in loaded:
        out = np.full((trace.num_tokens, len(layers), k), MISSING, np.int32)
        for j, layer in enumerate(layers):
            if layer in trace.layers:
                out[:, j] = trace.ids[:, layer - trace.first_layer]
        rows.append(out)
    return np.ascontiguousarray(np.concatenate(rows)), layers


def _recent_ids(ids: np.ndarray, present: np.ndarray, last: int, num_experts: Sequence[int]) -> np.ndarray:
    """[layers, ALL_HIT_IDS] int32: per layer (the second axis of ``ids``), the distinct ids routed
    most recently up to token ``last``, latest first, then the lowest ids not among them when the
    traces route fewer (``min(ALL_HIT_IDS, num_experts)`` of them when a layer has fewer experts;
    a layer the last token lacks keeps the lowest ids: no select reads it)."""
    width = min([ALL_HIT_IDS, *num_experts])
    out = np.zeros((ids.shape[1], width), np.int32)
    for i in range(ids.shape[1]):
        seen: dict[int, None] = {}
        for t in range(last, -1, -1):
            if present[t, i]:
                seen.update(dict.fromkeys(int(e) for e in ids[t, i]))
            if len(seen) >= width:
                break
        fill = (e for e in range(num_experts[i]) if e not in seen)
        while len(seen) < width:
            seen[next(fill)] = None
        out[i] = list(seen)[:width]
    return out


class _DeviceArrays:
    """int32 arrays where the backend's device reads them: cudaMalloc'd memory seen through
    TensorViews (the CUDA Array Interface), or numpy arrays on the host backend."""

    def __init__(self, cuda: bool, device: int):
        self.cuda, self.device = cuda, device
        self._allocations: list[int] = []

    def empty(self, count: int):
        if not self.cuda:
            return np.zeros(count, np.int32)

        rt = _cuda.runtime()
        ptr = int(_cuda.check(rt.cudaMalloc(4 * count), f"cudaMalloc({4 * count})"))
        self._allocations.append(ptr)
        return ptr

    def view(self, base, offset: int, count: int, shape):
        """``count`` int32 at element ``offset`` of ``base`` (from :meth:`empty`), shaped ``shape``."""
        if not self.cuda:
            return base[offset : offset + count].reshape(shape)

        return TensorView(base + 4 * offset, 4 * count, cuda=True, device_id=self.device, dtype=np.int32, shape=shape)

    def upload(self, base, host: np.ndarray) -> None:
        if not self.cuda:
            base[: host.size] = host.ravel()
            return

        rt = _cuda.runtime()
        _cuda.check(
            rt.cudaMemcpy(base, host.ctypes.data, host.nbytes, rt.cudaMemcpyKind.cudaMemcpyHostToDevice), "cudaMemcpy"
        )

    def close(self) -> None:
        if self._allocations:
            rt = _cuda.runtime()
            for ptr in self._allocations:
                rt.cudaFree(ptr)
            self._allocations = []


class _Graph:
    """A CUDA graph captured from the calls ``fn`` makes on ``stream`` (cuda-python's runtime)."""

    def __init__(self, stream: int, fn: Callable[[], None]):

        rt = self._rt = _cuda.runtime()
        _cuda.check(
            rt.cudaStreamBeginCapture(stream, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal),
            "cudaStreamBeginCapture",
        )
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

        _cuda.check(self._rt.cudaGraphLaunch(self._exec, self._stream), "cudaGraphLaunch")

    def close(self) -> None:
        if self._exec is not None:
            self._rt.cudaGraphExecDestroy(self._exec)
            self._exec = None


def _sync(bench) -> None:
    if bench.is_cuda:
        _cuda.check(_cuda.runtime().cudaStreamSynchronize(bench.stream), "cudaStreamSynchronize")


def _c_loop(bench, workload, compute_ns: int, link: float, disk: float, policy: str) -> tuple[GraphLoopResult, tuple]:
    """The C loop with the host select, the same policy and non-expert work per layer, and its
    cache's capacities (:func:`~expcache_bench.modes.variants.class_capacities`)."""
    from .variants import class_capacities

    options_ = _replay.ReplayOptions()
    options_.struct_size = ctypes.sizeof(options_)
    options_.compute_ns = compute_ns
    with bench.make_cache(budget_bytes=bench.budget_bytes, policy=policy, log_level=1, **bench.cache_options) as cache:
        out = bench.replay(cache, workload, label="C loop, host select", options=options_)
        decode = cache.stats().path("decode")
        pool = cache.pool_stats()
        capacities = class_capacities(bench.layout, cache)
    result = GraphLoopResult(
        "C loop, host select",
        decode_tokens=workload.decode_tokens,
        decode_seconds=out.decode_seconds,
        served_tokens=workload.decode_tokens,
        hits=decode.hits,
        misses=decode.misses,
        bytes_h2d=out.decode_bytes_h2d,
        link_bytes_per_s=link,
        disk_bytes_per_s=disk,
        compute_seconds=len(workload.calls) * compute_ns * 1e-9,
        checksum_errors=out.checksum_errors,
        experts_checked=out.experts_checked,
        page_cache_after=bench.page_cache_fraction(),
        pool_hits=pool.hits if pool.budget_bytes else 0,
        pool_lookups=pool.lookups if pool.budget_bytes else 0,
    )
    return result, capacities


def _replayed_disk(bench, workload, misses: int, capacities: tuple, policy: str) -> dict:
    """The disk's rate on the C loop's own misses (:meth:`~expcache_bench.bench.Bench.replay_disk`),
    as the report's :attr:`~expcache_bench.report.Report.disk_replay` fields (less ``bound``): the
    simulator's misses of ``policy`` at the C loop's ``capacities``, read in order. Where their
    number is not the C loop's ``misses``, nothing is read: ``{"skipped": why, "mismatch": True}``
    (the command then fails)."""
    caps, layer_class = capacities
    keys: list[int] = []
    simulate_policy(workload.calls, caps, layer_class, policy=policy, layers=bench.layout.moe_layers, misses=keys)
    if len(keys) != misses:
        return dict(
            skipped=(
                f"the replay of the run's misses was skipped: the simulator of the same policy and caps gives "
                f"{len(keys):,} misses, the C loop had {misses:,}"
            ),
            mismatch=True,
        )
    mask = (1 << KEY_SHIFT) - 1
    found = bench.replay_disk([(k >> KEY_SHIFT, k & mask) for k in keys])
    return dict(
        bytes_per_s=found.bytes_per_s,
        bytes=found.read_bytes,
        reads=found.reads,
        misses=found.misses,
        of_misses=found.of_misses,
        direct=found.direct,
        label=f"{found.label} (the simulator's misses, as many as the C loop's {misses:,}: checked)",
    )


def _bound_disk(report: Report, replay: dict) -> None:
    """Record ``replay`` (:func:`_replayed_disk`'s, or a skip) in ``report``: the disk's rate
    becomes the faster of the cold shapes' and the replay's, in the header and in every row."""
    cold = report.disk_bytes_per_s
    report.disk_cold_bytes_per_s = cold
    if "skipped" not in replay:
        rate, which = _disk.faster(cold, replay["bytes_per_s"])
        replay["bound"] = which
        report.disk_bytes_per_s = rate
        for r in report.results:
            r.disk_bytes_per_s = rate
    report.disk_replay = replay


def run_graph_loop(
    bench,
    *,
    traces: Sequence[str] = DEFAULT_TRACES,
    compute_us: float = 0.0,
    progress: Optional[Callable[[str, int, int], None]] = None,
    c_loop: bool = True,
    policy: Optional[str] = None,
) -> Report:
    """Replay the decode traces in the graph loop (see the module docstring) on ``bench`` (a
    :class:`~expcache_bench.bench.Bench`; pinned, emulated on the host backend, or pageable or a file:
    fed), next to
    the C loop's host select unless ``c_loop`` is false; both caches evict by ``policy`` (a name of
    ``pyexpcache._lib.POLICIES``; None: the library's default)."""

    if not 0 <= compute_us <= 1e6:
        raise ValueError(f"compute_us must be in [0, 1e6], got {compute_us}")
    policy = _lib.DEFAULT_POLICY if policy is None else policy
    if policy not in _lib.POLICIES:
        raise ValueError(f"policy must be one of {sorted(_lib.POLICIES)}, got {policy!r}")
    progress = progress or bench.progress
    loaded = [decode_trace(t, bench.layout) for t in traces]  # parsed once: the graph's ids, the C loop's calls
    ids, layers = _steps(bench, loaded)
    tokens, num_layers, k = ids.shape
    if tokens < 2:
        raise ValueError("the graph loop needs at least 2 tokens (the first binds and warms up)")
    compute_ns = int(round(compute_us * 1e3))
    report = Report(
        "graph",
        "graph loop",
        **bench.report_header(),
        **bench.measure_bounds(),
        traces=[trace_label(t) for t in traces],
        settings=dict(compute_us=compute_us, policy=policy, layers=options.ranges(layers), k=k, capture=bench.is_cuda),
    )
    link, disk = report.link_bytes_per_s, report.disk_bytes_per_s or 0.0
    workload, capacities = None, ((), ())
    if c_loop:
        workload = decode_workload(loaded, layers)
        result, capacities = _c_loop(bench, workload, compute_ns, link, disk, policy)
        report.results.append(result)

    arrays = _DeviceArrays(bench.is_cuda, bench.device)
    graphs: list[_Graph] = []
    stream = bench.stream
    present = ids[:, :, 0] >= 0  # [tokens, layers]: the records a token has
    try:
        with bench.make_cache(
            budget_bytes=bench.budget_bytes, lookup="device", policy=policy, log_level=1, **bench.cache_options
        ) as cache:
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

                rt = _cuda.runtime()
                _cuda.check(
                    rt.cudaMemcpyAsync(
                        cur, all_ids + t * step_bytes, step_bytes, rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice, stream
                    ),
                    "cudaMemcpyAsync",
                )

            def step_of(rows: tuple[int, ...]) -> Callable[[], None]:
                """A token's step over the layers (indices into ``layers``) it has records of: a
                missing record is no select, as in the C loop."""

                def step() -> None:
                    for i in rows:
                        if compute_ns:
                            with cache.raw_handle() as handle:
                                _lib.lib.expcache_testing_spin_async(handle, stream or None, compute_ns)
                        cache.select_device(layers[i], cur_views[i], stream=stream, out=slot_views[i])
                        testing.bank_checksum_async(cache, layers[i], slot_views[i], first=i * k, stream=stream)

                return step

            expected = np.stack(
                [bench.expected[layer][np.maximum(ids[:, i, :], 0)] for i, layer in enumerate(layers)], axis=1
            )
            result = GraphLoopResult(
                "graph loop, select_device", served_tokens=tokens, link_bytes_per_s=link, disk_bytes_per_s=disk
            )
            first_bad = None

            def verify(t: int, rows: tuple[int, ...]) -> None:
                nonlocal first_bad
                got = testing.checksum_results(cache, 0, num_layers * k).reshape(num_layers, k)[list(rows)]
                bad = got != expected[t, list(rows)]
                result.experts_checked += got.size
                if bad.any():
                    result.checksum_errors += int(bad.sum())
                    if first_bad is None:
                        i, j = np.argwhere(bad)[0]
                        first_bad = (t, layers[rows[i]], int(ids[t, rows[i], j]))

            # One step per set of layers the tokens have records of (one set for a complete trace),
            # made when a token first has it: that token runs it eagerly, untimed (binding the
            # layers' classes, their banks and the kernels' scratch), then it is captured in a graph
            # (on the host backend it runs eagerly every time) and replayed for the later tokens.
            steps: dict[tuple[int, ...], Callable[[], None]] = {}
            untimed_bytes = 0
            perf = time.perf_counter
            for t in range(tokens):
                rows = tuple(np.flatnonzero(present[t]).tolist())
                if rows not in steps:
                    before = cache.stats().path("device").bytes_h2d
                    step = step_of(rows)
                    put_token(t)
                    step()
                    _sync(bench)
                    verify(t, rows)
                    untimed_bytes += cache.stats().path("device").bytes_h2d - before
                    if bench.is_cuda and rows:
                        graphs.append(_Graph(stream, step))
                        step = graphs[-1].launch
                    steps[rows] = step
                    continue
                t0 = perf()
                put_token(t)
                steps[rows]()
                _sync(bench)
                result.decode_seconds += perf() - t0
                result.decode_tokens += 1
                result.compute_seconds += len(rows) * compute_ns * 1e-9
                verify(t, rows)
                if t % PROGRESS_EVERY == 0 or t + 1 == tokens:
                    progress("graph loop", t, tokens - 1)
            after = cache.stats().path("device")
            result.hits, result.misses = after.hits, after.misses
            result.bytes_h2d = after.bytes_h2d - untimed_bytes
            result.page_cache_after = bench.page_cache_fraction()
            pool = cache.pool_stats()
            if pool.budget_bytes:
                result.pool_hits, result.pool_lookups = pool.hits, pool.lookups
            totals = (after.hits, after.misses)
            report.results.append(result)
            report.settings["steps"] = len(steps)
            if first_bad is not None:
                t, layer, e = first_bad
                print(
                    f"CHECKSUM MISMATCH: graph loop: {result.checksum_errors} experts differ from the source "
                    f"(first at token {t}: layer {layer}, expert {e})",
                    file=sys.stderr,
                )

            # The all-hit select, one per layer the last token has: its ids, then ALL_HIT_IDS
            # distinct ids per layer (the ones routed last). Each set is selected once outside
            # the timing (the last token's are resident already; the others come in then), so the
            # replays hit; a miss among them is an error.
            last = int(np.flatnonzero(present.any(axis=1))[-1])
            rows = tuple(np.flatnonzero(present[last]).tolist())
            if last != tokens - 1:
                put_token(last)

            def all_hit_us(id_views, out_views, what: str, required: bool = True) -> Optional[float]:
                def selects() -> None:
                    for i in rows:
                        cache.select_device(layers[i], id_views[i], stream=stream, out=out_views[i])

                selects()
                _sync(bench)
                if bench.is_cuda:
                    graphs.append(_Graph(stream, selects))
                go = graphs[-1].launch if bench.is_cuda else selects
                go()
                _sync(bench)
                misses_before = cache.stats().path("device").misses
                t0 = perf()
                for _ in range(ALL_HIT_REPLAYS):
                    go()
                _sync(bench)
                seconds = perf() - t0
                if cache.stats().path("device").misses != misses_before:
                    if not required:  # a budget smaller than the wider sets: no figure, said so
                        return None
                    raise RuntimeError(f"the all-hit selects of {what} missed: the budget cannot hold them")
                return 1e6 * seconds / (ALL_HIT_REPLAYS * len(rows))

            report.settings["all_hit_select_us"] = all_hit_us(cur_views, slot_views, "one token's ids")
            wide = _recent_ids(ids, present, last, [bench.layout[layer].num_experts for layer in layers])
            wide_ids, wide_slots = arrays.empty(wide.size), arrays.empty(wide.size)
            arrays.upload(wide_ids, wide)
            width = wide.shape[1]
            views = [arrays.view(wide_ids, i * width, width, (width,)) for i in range(num_layers)]
            outs = [arrays.view(wide_slots, i * width, width, (width,)) for i in range(num_layers)]
            report.settings["all_hit_ids"] = width
            report.settings["all_hit_select_wide_us"] = all_hit_us(
                views, outs, f"{width} ids per layer", required=False
            )
            report.settings["same_hits_as_c_loop"] = (
                None if not c_loop else totals == (report.results[0].hits, report.results[0].misses)
            )
    finally:
        for g in graphs:
            g.close()
        arrays.close()
    # The disk's rate on the run's own misses, read again after both loops (the conditions the
    # later one saw): the faster of that and the cold shapes' bounds both rows.
    if not disk:
        report.skipped.append("the replay of the run's misses: the source is not a file (no disk bound)")
    elif not c_loop:
        report.skipped.append("the replay of the run's misses: no C loop to check the simulator's misses against")
    elif not report.results[0].misses:
        report.skipped.append("the replay of the run's misses: the C loop missed nothing")
    else:
        _bound_disk(report, _replayed_disk(bench, workload, report.results[0].misses, capacities, policy))
    return report


# -- the mode ---------------------------------------------------------------------------------

#: The source this mode's Bench gets by default: a device select maps pinned memory (on the host
#: backend, emulated); --source pageable, mmap and file have their misses fed.
PINNED_SOURCE = True


def check(args) -> None:
    options.synthetic_traces(args)


def device_bytes(args, budget: int, model_bytes: int) -> int:
    return budget  # one cache at a time


def run(bench, args) -> Iterator[Report]:
    yield run_graph_loop(bench, traces=args.traces, compute_us=args.layer_compute_us or 0.0, progress=bench.progress)


def describe(report: Report) -> list[str]:
    st = report.settings
    sets = st.get("steps", 1)
    capture = "captured once in a CUDA graph, replayed per token" if st["capture"] else "run eagerly (host backend)"
    if sets > 1:
        capture += (
            f"; {sets} steps, one per set of layers the tokens have records of (a missing record selects "
            "nothing; each set's first token untimed)"
        )
    same = st.get("same_hits_as_c_loop")
    lines = [
        f"policy {st['policy']}; layers {st['layers']}, k {st['k']}; {st['compute_us']:g} µs of non-expert work "
        f"per layer; each token's step {capture}",
        f"all-hit select_device: {st['all_hit_select_us']:.2f} µs per layer"
        + (
            f" ({st['k']} ids), "
            + (
                f"{st['all_hit_select_wide_us']:.2f} µs ({st['all_hit_ids']} ids)"
                if st["all_hit_select_wide_us"] is not None
                else f"{st['all_hit_ids']} ids: not timed, the budget cannot hold them"
            )
            if "all_hit_select_wide_us" in st
            else ""
        )
        + (" (graph replay)" if st["capture"] else " (host backend: meaningless as a time)"),
    ]
    if same is not None:
        lines.append(
            f"hits and misses equal to the C loop's (both {st['policy']})"
            if same
            else f"HITS DIFFER from the C loop's (both {st['policy']}): a bug"
        )
    pooled = [r for r in report.results if r.pool_lookups]
    if pooled:
        lines.append(
            "host pool (--host-budget-gib): the share of each loop's misses it served, the rest read from the "
            "file (the disk bound counts those): "
            + "; ".join(f"{r.loop}: {100 * r.pool_hits / r.pool_lookups:.1f} %" for r in pooled)
        )
    cached = [r for r in report.results if r.page_cache_after is not None]
    if cached:
        lines.append(
            "the file in the page cache after each loop (dropped before it): "
            + "; ".join(f"{r.loop}: {100 * r.page_cache_after:.1f} %" for r in cached)
        )
    return lines


def table(report: Report) -> str:

    ref = report.results[0] if report.results else None
    rows = []
    for r in report.results:
        rows.append(
            [
                r.loop,
                f"{r.tokens_per_s:.2f}",
                f"{r.tokens_per_s / ref.tokens_per_s:.3f}×" if ref and ref.tokens_per_s else "—",
                f"{100 * r.hit_rate:.2f} %",
                f"{r.misses_per_token:.2f}",
                share(r.of_bound, 1) if r.of_bound else "—",
                f"{r.checksum_errors} bad / {r.experts_checked} checked",
            ]
        )
    versus = timed(report, f"vs {ref.loop if ref else '—'}")
    return tabulate(
        rows,
        headers=[
            "loop",
            timed(report, "decode tok/s"),
            versus,
            "hit rate",
            "misses/token",
            timed(report, f"of {report.bound_name} bound"),
            "checksums",
        ],
        disable_numparse=True,
    )
