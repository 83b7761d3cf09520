"""The main job: replay real routing through the cache and report decode
tokens/s and hit rate next to the baselines it replaces and the optimum.

Every layer of every token does what an engine does: select the router's
experts, run a kernel that reads every byte of them (the memory-bound floor
of the expert GEMVs) and checksums them against the source, and wait for it
before the next layer (the next layer's ids depend on this layer's output).

Variants, side by side in one process on the same source and stream:

``expcache``  this library: one cache per size class, LRU decode, batches that never evict.
``oppclass``  the same with the OppClassLRU policy (docs/policy.md).
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

from __future__ import annotations

import contextlib
import ctypes
import json
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from . import __version__, _cuda, _lib, library_version
from .cache import ExpertCache, StagingStats
from .layout import ModelLayout
from .sim import BATCH, DECODE, Call, simulate_belady, simulate_lru, simulate_policy
from .source import HostSource
from .traces import list_traces, load_decode_trace, load_prefill_trace, synthetic_trace

GiB = 1 << 30
VARIANTS = ("expcache", "oppclass", "slab", "nocache", "resident")
SCENARIOS = ("decode", "prefill", "turns")
DEFAULT_TRACES = ("podA_a_coffee_full", "podA_b2_json_long_full", "podA_c_python_full", "podA_b_json_full",
                  "oracle50_k0w", "livemask_forensic_k0", "smoke_count64")
HOST_SCALE = 256  # host backend: expert sizes / 256, same slot counts


# ---------------------------------------------------------------------------
# Workloads


@dataclass
class Workload:
    """An ordered list of calls (decode: one token at one layer; batch: a prompt's layer)."""

    name: str
    calls: list[Call]
    decode_tokens: int
    prefill_tokens: int

    @property
    def has_batches(self) -> bool:
        return any(c.kind == BATCH for c in self.calls)

    def arrays(self):
        """The calls as the C replay loop takes them: a ctypes replay_call_t array and all ids."""
        from ._replay import BATCH as C_BATCH, DECODE as C_DECODE, ReplayCall

        calls = (ReplayCall * len(self.calls))()
        offset = 0
        for c, call in zip(calls, self.calls):
            c.kind = C_BATCH if call.kind == BATCH else C_DECODE
            c.layer, c.offset, c.count = call.layer, offset, len(call.ids)
            offset += len(call.ids)
        ids = np.fromiter((e for call in self.calls for e in call.ids), dtype=np.uint32, count=offset)
        return calls, ids


def _decode_calls(trace, layers: Optional[set]) -> list[Call]:
    out = []
    for t in range(trace.num_tokens):
        for i, layer in enumerate(trace.layers):
            if layers is None or layer in layers:
                out.append(Call(DECODE, layer, tuple(trace.ids[t, i].tolist())))
    return out


def _prefill_calls(prompt, layers: Optional[set]) -> list[Call]:
    return [Call(BATCH, layer, tuple(prompt.prefill[layer].ravel().tolist()))
            for layer in range(prompt.num_layers) if layers is None or layer in layers]


def _decode_trace(name: str):
    """A bundled trace, a CSV path, or ``synthetic:TOKENS[:SEED]`` (fitted to the real traces'
    locality: per-layer popularity skew plus reuse of the previous token's experts)."""
    if name.startswith("synthetic:"):
        fields = name.split(":")
        try:
            tokens = int(fields[1])
            seed = int(fields[2]) if len(fields) > 2 else 0
        except (IndexError, ValueError):
            raise ValueError(f"expected synthetic:TOKENS[:SEED], got {name!r}") from None
        if tokens <= 0 or len(fields) > 3:
            raise ValueError(f"expected synthetic:TOKENS[:SEED] with TOKENS > 0, got {name!r}")
        return synthetic_trace(tokens, seed=seed, name=name)
    return load_decode_trace(name)


def build_workload(scenario: str, traces: Sequence[str] = DEFAULT_TRACES,
                   layers: Optional[Sequence[int]] = None) -> Workload:
    """The calls of a scenario.

    ``decode``: the decode traces one after another (a server answering requests).
    ``prefill``: each bundled prefill prompt's batches (layers 0-42) then its decode token,
    each followed by one of the decode traces, in turn: prompts never flush decode state.
    ``turns``: two conversation turns per decode trace: decode, the prefill of a new prompt,
    then the same decode again.
    """
    keep = set(layers) if layers is not None else None
    decode = [_decode_trace(name) for name in traces]
    calls: list[Call] = []
    dec_tokens = pre_tokens = 0

    def add_decode(trace):
        nonlocal dec_tokens
        calls.extend(_decode_calls(trace, keep))
        dec_tokens += trace.num_tokens

    def add_prompt(prompt):
        nonlocal pre_tokens
        calls.extend(_prefill_calls(prompt, keep))
        pre_tokens += prompt.num_prefill_tokens
        add_decode(prompt.decode)

    if scenario == "decode":
        for trace in decode:
            add_decode(trace)
    elif scenario in ("prefill", "turns"):
        prompts = [p for info in list_traces() if info.kind == "prefill" for p in load_prefill_trace(info.name)]
        if scenario == "prefill":
            for i, prompt in enumerate(prompts):
                add_prompt(prompt)
                add_decode(decode[i % len(decode)])
        else:
            for i, trace in enumerate(decode):
                add_decode(trace)
                add_prompt(prompts[i % len(prompts)])
                add_decode(trace)
    else:
        raise ValueError(f"unknown scenario {scenario!r}: expected one of {SCENARIOS}")
    return Workload(scenario, calls, dec_tokens, pre_tokens)


# ---------------------------------------------------------------------------
# Results


@dataclass
class VariantResult:
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
    belady_hit_rate: Optional[float] = None
    skipped: Optional[str] = None
    staging: Optional[StagingStats] = None  # pageable or file sources: the staging ring's counters

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

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
    def hit_rate(self) -> float:
        asked = self.hits + self.misses
        return self.hits / asked if asked else 0.0

    @property
    def gib_per_token(self) -> float:
        """Host-to-device GiB per decode token, counting decode calls only."""
        return self.decode_bytes_h2d / GiB / self.decode_tokens if self.decode_tokens else 0.0


@dataclass
class Report:
    backend: str
    device: str
    layout: str
    scenario: str
    source: str
    placement: str
    budget_bytes: int
    host_scale: int
    decode_tokens: int
    prefill_tokens: int
    link_bytes_per_s: float
    link_label: str
    layer_sync: bool
    results: list[VariantResult] = field(default_factory=list)
    # What a kept report needs to be read later: which traces, which code, which command.
    traces: list[str] = field(default_factory=list)
    version: str = ""                 # pyexpcache's version
    library: str = ""                 # the loaded libexpcache: version and path
    git_commit: Optional[str] = None  # of the source tree the package runs from, when it is one
    argv: Optional[list[str]] = None  # the command line, when run from it

    @property
    def checksum_errors(self) -> int:
        return sum(r.checksum_errors for r in self.results)

    def to_json(self) -> dict:
        out = asdict(self)
        for r, d in zip(self.results, out["results"]):
            d.update(tokens_per_s=r.tokens_per_s, hit_rate=r.hit_rate, gib_per_token=r.gib_per_token,
                     serve_us_per_call=r.serve_us_per_call, after_serve_us_per_call=r.after_serve_us_per_call)
        return out


# ---------------------------------------------------------------------------
# Progress


class Progress:
    """A one-line progress bar on stderr (nothing when stderr is not a terminal, unless forced)."""

    def __init__(self, enabled: Optional[bool] = None, stream=sys.stderr):
        self.stream = stream
        self.enabled = stream.isatty() if enabled is None else enabled
        self._last = 0.0

    def __call__(self, label: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        width = 30
        filled = width * done // max(total, 1)
        self.stream.write(f"\r{label:<28} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()


# ---------------------------------------------------------------------------
# Running


@contextlib.contextmanager
def _sigint_deferred():
    """While a loop runs in C: Ctrl-C only sets a flag (yielded as a function) that the loop's
    progress callback reads to stop it; KeyboardInterrupt is raised when the block ends. A
    Python-level KeyboardInterrupt could fire at the callback's first instruction, outside any
    ``try``, where ctypes would print and drop it. Only on the main thread, with Python's
    default handler in place; elsewhere the flag stays down."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield lambda: False
        return
    hits = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: hits.append(signum))
    try:
        yield lambda: bool(hits)
    finally:
        signal.signal(signal.SIGINT, previous)
    if hits:
        raise KeyboardInterrupt


def git_commit() -> Optional[str]:
    """The commit of the git work tree this package runs from (``-dirty`` when tracked files
    changed), or None for an installed package or without git."""
    import subprocess
    from pathlib import Path

    tree = Path(__file__).resolve().parent.parent
    if not (tree / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def resolve_backend(backend: str = "auto", device: int = 0) -> str:
    """The backend ``"auto"`` picks here: ``"cuda"`` when the library and a device allow it."""
    if backend != "auto":
        return backend
    probe_layout = ModelLayout.preset("q2", scale=65536)
    with HostSource(probe_layout) as src, ExpertCache(probe_layout, src, budget_experts=1, backend="auto",
                                                       device=device, log_level=0) as probe:
        return probe.backend


class Bench:
    """Holds what every variant shares: layout, source, stream, expected checksums."""

    def __init__(self, layout: ModelLayout, *, backend: str = "auto", pinned: Optional[bool] = None,
                 budget_bytes: int = 12 * GiB, reserve_bytes: Optional[int] = None,
                 progress: Optional[Progress] = None, device: int = 0, source=None, placement: str = "expert",
                 layer_sync: bool = True, cache_options: Optional[dict] = None):
        self.layout = layout
        # Extra ExpertCache arguments of the expcache and oppclass variants (copy_threads,
        # staging_chunk_bytes, file_reads); the baselines keep the old design's.
        self.cache_options = dict(cache_options or {})
        self.backend = backend
        self.budget_bytes = budget_bytes
        self.reserve_bytes = reserve_bytes
        self.layer_sync = layer_sync
        self.device = device
        self.progress = progress or Progress(False)
        self.is_cuda = self._resolve_backend() == "cuda"
        if not self.is_cuda:
            # A host "upload" is one memcpy: no link for staging threads to overlap with.
            self.cache_options.setdefault("copy_threads", 0)
        if source is not None:
            self.pinned = source.pinned
        else:
            self.pinned = self.is_cuda if pinned is None else pinned
        if self.pinned and not self.is_cuda:
            raise ValueError("a pinned source needs the CUDA backend")
        self.stream = self._make_stream()
        if source is None:
            fill = (lambda done, total: self.progress(
                f"filling {'pinned' if self.pinned else 'pageable'} source", done, total))
            source = HostSource(layout, pinned=self.pinned, arrangement=placement, progress=fill)
        self.source = source
        self.placement = getattr(source, "arrangement", "tensor (GGUF file)")
        self.expected = np.zeros((layout.num_layers, max(s.num_experts for s in layout.layers if s)), np.uint64)
        for layer in layout.moe_layers:
            for e in range(layout[layer].num_experts):
                self.expected[layer, e] = self.source.expected_checksum(layer, e)

    def _resolve_backend(self) -> str:
        return resolve_backend(self.backend, self.device)

    def _make_stream(self) -> int:
        if not self.is_cuda:
            return 0
        rt = _cuda.runtime()
        _cuda.check(rt.cudaSetDevice(self.device), "cudaSetDevice")
        stream = _cuda.check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreate")
        return int(stream)

    def device_name(self) -> str:
        if not self.is_cuda:
            return "host (no GPU: host backend, times are host-emulated)"
        rt = _cuda.runtime()
        props = _cuda.check(rt.cudaGetDeviceProperties(self.device), "cudaGetDeviceProperties")
        name = props.name.decode() if isinstance(props.name, bytes) else str(props.name)
        return name.rstrip("\x00")

    def close(self) -> None:
        if self.is_cuda and self.stream:
            _cuda.runtime().cudaStreamDestroy(self.stream)
            self.stream = 0
        self.source.close()

    # -- the link ----------------------------------------------------------------
    def measure_link(self, chunk_bytes: int, repeats: int = 20) -> tuple[float, str]:
        """Raw host-to-device bandwidth (bytes/s) with plain cudaMemcpyAsync of ``chunk_bytes``
        pieces from pinned memory (the source's own when it is pinned), whatever the source kind:
        the link bound is what the link allows; on the host backend, memcpy bandwidth."""
        chunk = min(chunk_bytes, self.source.nbytes)
        if self.is_cuda and not self.source.pinned:
            from .layout import LayerSpec

            spec = next(s for s in self.layout.layers if s)
            probe = ModelLayout((LayerSpec(max(1, -(-chunk // spec.expert_bytes)), *spec.class_key),))
            with HostSource(probe, pinned=True) as pinned:
                saved, self.source = self.source, pinned
                try:
                    return self.measure_link(chunk_bytes, repeats)
                finally:
                    self.source = saved
        if not self.is_cuda:
            dst = np.empty(chunk, np.uint8)
            src = self.source.buffer[:chunk]
            t0 = time.perf_counter()
            for _ in range(repeats):
                np.copyto(dst, src)
            return chunk * repeats / (time.perf_counter() - t0), "host memcpy (emulated link)"
        rt = _cuda.runtime()
        dev = _cuda.check(rt.cudaMalloc(chunk), "cudaMalloc")
        try:
            src = self.source.buffer.ctypes.data
            kind = rt.cudaMemcpyKind.cudaMemcpyHostToDevice
            start = _cuda.check(rt.cudaEventCreate(), "cudaEventCreate")
            stop = _cuda.check(rt.cudaEventCreate(), "cudaEventCreate")
            _cuda.check(rt.cudaMemcpyAsync(dev, src, chunk, kind, self.stream), "cudaMemcpyAsync")
            _cuda.check(rt.cudaEventRecord(start, self.stream), "cudaEventRecord")
            for _ in range(repeats):
                _cuda.check(rt.cudaMemcpyAsync(dev, src, chunk, kind, self.stream), "cudaMemcpyAsync")
            _cuda.check(rt.cudaEventRecord(stop, self.stream), "cudaEventRecord")
            _cuda.check(rt.cudaEventSynchronize(stop), "cudaEventSynchronize")
            ms = _cuda.check(rt.cudaEventElapsedTime(start, stop), "cudaEventElapsedTime")
            rt.cudaEventDestroy(start)
            rt.cudaEventDestroy(stop)
            label = f"cudaMemcpyAsync from pinned memory, {chunk / (1 << 20):.2f} MiB chunks"
            return chunk * repeats / (ms / 1e3), label
        finally:
            rt.cudaFree(dev)

    # -- variants --------------------------------------------------------------
    def _cache(self, **kwargs) -> ExpertCache:
        kwargs.setdefault("log_level", _lib.LOG_NOTICE)
        if self.reserve_bytes is not None:
            kwargs.setdefault("reserve_bytes", self.reserve_bytes)
        return ExpertCache(self.layout, self.source, backend=self.backend, device=self.device, **kwargs)

    def class_capacities(self, cache: ExpertCache) -> tuple[list[int], list[int]]:
        """(runtime cap per class index, class index per layer) of a cache, for the simulators."""
        layer_class = [0] * self.layout.num_layers
        for layer in self.layout.moe_layers:
            layer_class[layer] = cache.layer_class(layer)
        caps = {c.index: c.cap_experts for c in cache.classes()}
        return [caps.get(i, 0) for i in range(max(caps) + 1)], layer_class

    def run_variant(self, variant: str, workload: Workload) -> VariantResult:
        result = VariantResult(variant, decode_tokens=workload.decode_tokens, prefill_tokens=workload.prefill_tokens)
        if variant in ("expcache", "oppclass"):
            cache = self._cache(budget_bytes=self.budget_bytes, policy="lru" if variant == "expcache" else variant,
                                log_level=_lib.LOG_NOTICE if variant == "expcache" else _lib.LOG_WARNING,
                                **self.cache_options)
        elif variant == "slab":
            # The old design also copied pageable memory with plain cudaMemcpyAsync (copy_threads=0).
            biggest = max(sum(-(-b // 256) * 256 for b in s.class_key) for s in self.layout.layers if s)
            cache = self._cache(budget_experts=max(1, self.budget_bytes // biggest), max_classes=1,
                                log_level=_lib.LOG_WARNING, copy_threads=0)
        elif variant == "nocache":
            cache = self._cache(budget_experts=1, log_level=_lib.LOG_WARNING, copy_threads=0)
        elif variant == "resident":
            need = sum(s.num_experts * sum(-(-b // 256) * 256 for b in s.class_key) for s in self.layout.layers if s)
            try:
                cache = self._cache(budget_bytes=need + (1 << 20), reserve_bytes=0, log_level=_lib.LOG_WARNING)
                self._preload(cache)
            except MemoryError as exc:
                cache.close()
                result.skipped = f"the model does not fit in device memory ({exc})"
                return result
            if any(c.resident_experts < sum(self.layout[i].num_experts for i in self.layout.moe_layers
                                            if self.layout[i].class_key == c.key) for c in cache.classes()):
                cache.close()
                result.skipped = "the model does not fit in device memory minus the reserve"
                return result
            cache.reset_stats()
        else:
            raise ValueError(f"unknown variant {variant!r}: expected one of {VARIANTS}")
        with cache:
            self._replay(cache, variant, workload, result)
            if variant in ("expcache", "oppclass"):
                self.capacities = self.class_capacities(cache)
            stats = cache.stats()
            total = stats.total
            result.hits, result.misses = total.hits, total.misses
            result.bytes_h2d, result.bytes_d2d, result.releases = total.bytes_h2d, total.bytes_d2d, total.releases
            staging = cache.staging_stats()
            result.staging = staging if staging.calls else None
        return result

    def _preload(self, cache: ExpertCache) -> None:
        layers = self.layout.moe_layers
        for n, layer in enumerate(layers):
            experts = self.layout[layer].num_experts
            for start in range(0, experts, 256):
                cache.select(layer, np.arange(start, min(start + 256, experts)), self.stream)
            self.progress("preloading all experts", n + 1, len(layers))
        cache.synchronize(self.stream)

    def _replay(self, cache: ExpertCache, variant: str, workload: Workload, result: VariantResult) -> None:
        from . import _replay

        calls, ids = workload.arrays()
        mode = {"nocache": _replay.MODE_NOCACHE, "slab": _replay.MODE_SLAB}.get(variant, _replay.MODE_CACHE)
        out = _replay.ReplayResult()
        failed: list[BaseException] = []

        with _sigint_deferred() as interrupted:
            def on_progress(done: int, total: int) -> int:
                # A ctypes callback cannot raise into C: Ctrl-C (noted by the handler above) or an
                # error of the display asks the loop to stop, and is raised once it has returned.
                try:
                    self.progress(variant, done, total)
                except BaseException as exc:
                    failed.append(exc)
                return 1 if failed or interrupted() else 0

            progress = _replay.PROGRESS_FN(on_progress)
            expected = np.ascontiguousarray(self.expected)
            with cache.raw_handle() as handle:
                _replay.lib.expcache_replay(handle, ctypes.addressof(calls), len(calls), ids.ctypes.data, mode,
                                            self.stream, expected.ctypes.data, expected.shape[1],
                                            cache.max_classes, int(self.layer_sync), progress, ctypes.byref(out))
        if failed:
            raise failed[0]
        if out.stopped:  # asked by the callback and not raised above: only an interrupt does that
            raise KeyboardInterrupt
        result.decode_seconds += out.decode_seconds
        result.prefill_seconds += out.prefill_seconds
        result.decode_calls += out.decode_calls
        result.decode_serve_seconds += out.decode_serve_seconds
        result.checksum_errors += out.checksum_errors
        result.experts_checked += out.experts_checked
        result.decode_bytes_h2d += out.decode_bytes_h2d
        if out.checksum_errors:
            print(f"CHECKSUM MISMATCH: {variant}: {out.checksum_errors} experts differ from the source "
                  f"(first in call {out.first_bad_call})", file=sys.stderr)


def belady_hit_rate(workload: Workload, capacities: list[int], layer_class: list[int]) -> Optional[float]:
    """The clairvoyant optimum at the library's per-class capacities (decode-only workloads)."""
    if workload.has_batches:
        return None
    return simulate_belady(workload.calls, capacities, layer_class).hit_rate


def run(layout: ModelLayout, scenario: str = "decode", *, variants: Sequence[str] = VARIANTS,
        traces: Sequence[str] = DEFAULT_TRACES, budget_bytes: int = 12 * GiB, backend: str = "auto",
        pinned: Optional[bool] = None, reserve_bytes: Optional[int] = None, host_scale: int = 1,
        progress: Optional[Progress] = None, device: int = 0, source=None,
        bench: Optional[Bench] = None) -> Report:
    """Run the benchmark and return a :class:`Report` (see the module docstring). ``source``
    (e.g. a :class:`~pyexpcache.gguf.GGUFSource`) replaces the generated host source; an
    existing ``bench`` (whose source is then reused, and left open) replaces both."""
    workload = build_workload(scenario, traces, layout.moe_layers)
    for call in workload.calls:
        spec = layout[call.layer] if call.layer < layout.num_layers else None
        if spec is None or max(call.ids) >= spec.num_experts:
            raise ValueError(f"the traces route to layer {call.layer}, expert {max(call.ids)}, which layout "
                             f"{layout.name} does not have: they are DeepSeek V4 Flash traces (43 layers, 256 "
                             "experts)")
    own = bench is None
    if own:
        bench = Bench(layout, backend=backend, pinned=pinned, budget_bytes=budget_bytes,
                      reserve_bytes=reserve_bytes, progress=progress, device=device, source=source)
    try:
        chunk = max(s.expert_bytes for s in layout.layers if s)
        link, link_label = bench.measure_link(chunk)
        report = Report(backend="cuda" if bench.is_cuda else "host", device=bench.device_name(),
                        layout=layout.name, scenario=scenario,
                        source="pinned" if bench.pinned else "pageable", placement=bench.placement,
                        budget_bytes=budget_bytes,
                        host_scale=host_scale, decode_tokens=workload.decode_tokens,
                        prefill_tokens=workload.prefill_tokens, link_bytes_per_s=link, link_label=link_label,
                        layer_sync=bench.layer_sync, traces=list(traces), version=__version__,
                        library=library_version(), git_commit=git_commit())
        for variant in variants:
            r = bench.run_variant(variant, workload)
            if r.skipped is None and r.decode_bytes_h2d:
                # Decode tokens/s is timed over decode calls only, so its bound counts their bytes only.
                r.link_bound_tokens_per_s = workload.decode_tokens / (r.decode_bytes_h2d / link)
            if variant in ("expcache", "oppclass"):
                capacities, layer_class = bench.capacities
                r.belady_hit_rate = belady_hit_rate(workload, capacities, layer_class)
                # The offline simulator of the same policy must agree with the library's counters.
                sim = (simulate_lru(workload.calls, capacities, layer_class) if variant == "expcache"
                       else simulate_policy(workload.calls, capacities, layer_class, policy=variant,
                                            layers=layout.moe_layers))
                if sim.hit_rate != r.hit_rate:
                    raise RuntimeError(f"{variant}: library hit rate {r.hit_rate} differs from the simulator's "
                                       f"{sim.hit_rate} at the same capacities: a bug")
            report.results.append(r)
        return report
    finally:
        if own:
            bench.close()


def format_report(report: Report) -> str:
    """The report as text tables (tabulate)."""
    from tabulate import tabulate

    timing = "host-emulated" if report.backend == "host" else "measured on the GPU"
    head = [
        f"expcache bench — {report.scenario} on {report.device}",
        f"layout {report.layout}, {report.source} source ({report.placement} placement), "
        f"budget {report.budget_bytes / GiB:.2f} GiB"
        + (f" (sizes and budget / {report.host_scale}, same slot counts)" if report.host_scale != 1 else ""),
        f"{report.decode_tokens} decode tokens, {report.prefill_tokens} prefill tokens; "
        f"{'a wait after every layer' if report.layer_sync else 'one wait per token (--no-layer-sync)'}; "
        f"times {timing}; "
        f"link {report.link_bytes_per_s / 1e9:.1f} GB/s ({report.link_label})",
    ]
    base = {r.variant: r for r in report.results if r.skipped is None}
    ref = base.get("slab")
    rows = []
    for r in report.results:
        if r.skipped:
            rows.append([r.variant] + ["—"] * 7 + [f"skipped: {r.skipped}"])
            continue
        link_ratio = r.tokens_per_s / r.link_bound_tokens_per_s if r.link_bound_tokens_per_s else None
        rows.append([
            r.variant,
            f"{r.tokens_per_s:.2f}",
            f"{100 * r.hit_rate:.1f} %",
            f"{100 * r.belady_hit_rate:.1f} %" if r.belady_hit_rate is not None else "—",
            f"{r.gib_per_token:.3f}",
            f"{r.link_bound_tokens_per_s:.2f}" if r.link_bound_tokens_per_s else "∞",
            f"{100 * link_ratio:.0f} %" if link_ratio else "—",
            f"{r.tokens_per_s / ref.tokens_per_s:.2f}×" if ref and ref.tokens_per_s else "—",
            f"{r.checksum_errors} bad / {r.experts_checked}",
        ])
    table = tabulate(rows, headers=["variant", "decode tok/s", "hit rate", "Belady", "GiB/decode token",
                                    "link-bound tok/s", "of link bound", "vs slab", "checksums"],
                     disable_numparse=True)
    return "\n".join(head) + "\n\n" + table


def write_json(report: Report, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report.to_json(), f, indent=2)


def hit_rate_curve(workload: Workload, layout: ModelLayout, fractions: Sequence[float]) -> dict:
    """LRU (the library's policy) and Belady hit rates at fractions of each class's experts."""
    keys = list(layout.classes())
    layer_class = [keys.index(s.class_key) if s else 0 for s in layout.layers]
    sizes = [sum(layout[i].num_experts for i in layers) for layers in layout.classes().values()]
    out = {"fraction": list(fractions), "lru": [], "oppclass": [], "belady": []}
    for f in fractions:
        caps = [int(f * n) for n in sizes]
        out["lru"].append(simulate_lru(workload.calls, caps, layer_class).hit_rate)
        out["oppclass"].append(simulate_policy(workload.calls, caps, layer_class, policy="oppclass",
                                               layers=layout.moe_layers).hit_rate)
        out["belady"].append(simulate_belady(workload.calls, caps, layer_class).hit_rate
                             if not workload.has_batches else float("nan"))
    return out


def plot_curve(curve: dict, path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("--plot needs matplotlib (pip install matplotlib)") from exc
    x = [100 * f for f in curve["fraction"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(x, [100 * v for v in curve["lru"]], "o-", label="LRU (expcache default)")
    ax.plot(x, [100 * v for v in curve["oppclass"]], "^-", label="OppClassLRU (policy=\"oppclass\")")
    ax.plot(x, [100 * v for v in curve["belady"]], "s--", label="Belady (optimum)")
    ax.set_xlabel("experts cached (% of each class)")
    ax.set_ylabel("hit rate (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
