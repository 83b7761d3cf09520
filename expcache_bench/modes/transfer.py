"""The transfer table (``expcache bench transfer``; ``expcache transfer``, deprecated): how fast the library
moves misses, next to the raw link, from pinned memory, pageable memory (through the pinned ring)
and a file (pread into the ring: ``file`` through the page cache, ``file-direct`` with O_DIRECT,
from the disk).

For each source kind and expert size, every select is all misses (distinct
experts, a cache large enough to hold them all), six experts per call as in
decode; the library's throughput is bytes moved over the time from the first
call to the end of the stream. The raw figure is plain ``cudaMemcpyAsync`` of
the same expert-sized chunks from the same kind of memory, in the same run.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar, Optional

import numpy as np
from tabulate import tabulate

from pyexpcache import _cuda, _lib
from pyexpcache.cache import ExpertCache, StagingStats, staging_defaults
from pyexpcache.layout import GiB, LayerSpec, ModelLayout
from pyexpcache.progress import Progress
from pyexpcache.source import HostSource, LayerPlacement

from .. import link, options
from ..bench import device_name, resolve_backend
from ..options import DEVICE, FILE_DIR, OUTPUT, NotAvailable, Option, UsageError, csv, gib, sizes, thread_counts
from ..report import Report, made_by

MiB = 1 << 20
# Expert sizes of the issue: a small expert, DeepSeek V4 Flash q2 and q4 (gate, up, down bytes).
SIZES = {
    "0.5 MiB": (160 * 1024, 160 * 1024, 192 * 1024),
    "6.75 MiB": (2162688, 2162688, 2752512),
    "13.5 MiB": (4718592, 4718592, 4718592),
}
SOURCES = ("pinned", "pageable", "file", "file-direct")

NAME = "transfer"
TITLE = "transfer table"
HELP = "miss throughput per source kind and expert size vs raw cudaMemcpyAsync (GPU)"
DESCRIPTION = (
    "Measure how fast the library moves misses to the GPU from pinned memory, pageable memory (staged "
    "through its pinned ring) and a file (pread, through the page cache or O_DIRECT), for each expert "
    "size, next to plain cudaMemcpyAsync of the same chunks in the same run. Needs a CUDA device, the "
    "CUDA build of libexpcache and cuda-python."
)
RUNS = "measures miss throughput per source kind and expert size"
USES_BENCH = False

GIB = Option(
    "--gib",
    type=gib("--gib", True),
    default=1.0,
    help="bytes moved per measurement, GiB (default 1); each measurement holds about twice as much host memory",
)
COPY_THREADS = Option(
    "--copy-threads",
    type=thread_counts,
    default=None,
    help="comma list of copy thread counts for staged sources (default: the library's)",
)
CHUNKS = Option(
    "--chunks",
    type=sizes,
    default=None,
    help="comma list of staging chunk sizes for staged sources, e.g. 256K,1M (default: the library's)",
)
SOURCES_OPTION = Option(
    "--sources",
    type=csv(SOURCES),
    default=list(SOURCES),
    help="file: reads served from the page cache; file-direct: O_DIRECT reads, from the disk",
)
SIZES_OPTION = Option(
    "--sizes",
    type=csv(("0.5", "6.75", "13.5")),
    default=["0.5", "6.75", "13.5"],
    help="comma list of expert sizes in MiB, of 0.5, 6.75, 13.5 (default: all)",
)
DETAIL = Option(
    "--detail", action="store_true", help="also show where staged calls spend their time (the staging ring's counters)"
)
OPTIONS = (GIB, DEVICE, COPY_THREADS, CHUNKS, SOURCES_OPTION, SIZES_OPTION, FILE_DIR, DETAIL) + OUTPUT
SELECTED_BY = ()  # named only: expcache bench transfer (expcache transfer: deprecated)


@dataclass
class TransferRow:
    source: str
    copy_threads: int
    chunk_bytes: int  # staging chunk (0 for a pinned source: no staging)
    size: str
    arrangement: str
    library_gb_s: float
    raw_same_gb_s: float
    raw_pinned_gb_s: float
    bytes_moved: int
    staging: Optional[StagingStats] = None  # staged sources: where the time went

    DERIVED: ClassVar[tuple[str, ...]] = ("of_raw_pinned",)

    @property
    def of_raw_pinned(self) -> float:
        return self.library_gb_s / self.raw_pinned_gb_s


def host_copy_gb_s(buffer: np.ndarray, piece: int, threads: int, total: int = 4 << 30, seed: int = 0) -> float:
    """GB/s of ``threads`` threads copying ``total`` bytes as random, 4 KiB-aligned ``piece``-byte
    pieces of ``buffer`` into a buffer of their own (numpy copies, which release the GIL): how
    fast staging threads could fill chunks from that memory, the host's side of a staged
    source's bound. It moves with the machine's load more than the library does."""
    flat = buffer.reshape(-1).view(np.uint8)
    if threads < 1 or piece < 1 or piece + 4096 > flat.nbytes:
        raise ValueError(
            f"host_copy_gb_s: need threads >= 1 and 1 <= piece <= {flat.nbytes - 4096} bytes, "
            f"got {threads} threads, {piece}-byte pieces"
        )
    n = max(threads, total // piece)
    starts = np.random.default_rng(seed).integers(0, (flat.nbytes - piece) // 4096, n) * 4096

    def work(mine: np.ndarray) -> None:
        dst = np.empty(piece, np.uint8)
        for start in mine:
            np.copyto(dst, flat[start : start + piece])

    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(work, np.array_split(starts, threads)))
        return n * piece / (time.perf_counter() - t0) / 1e9


HOST_COPY_PIECE = 512 << 10  # host_copy_rates' defaults: the staging chunk's default size,
HOST_COPY_BUFFER = 1 << 30  # over a buffer far larger than the host's caches


def host_copy_rates(
    thread_counts: Sequence[int],
    piece: int = HOST_COPY_PIECE,
    buffer_bytes: int = HOST_COPY_BUFFER,
    total: int = 4 << 30,
) -> dict[int, float]:
    """:func:`host_copy_gb_s` for each thread count, over one pageable buffer of ``buffer_bytes``
    whose pages are touched first (so no first-touch fault is timed)."""
    buffer = np.full(buffer_bytes, 1, dtype=np.uint8)
    return {t: host_copy_gb_s(buffer, piece, t, total) for t in thread_counts}


def _raw_copy_gb_s(src_ptr: int, chunk: int, total: int, stream: int) -> float:
    """GB/s of plain cudaMemcpyAsync of ``total`` bytes in ``chunk``-byte copies from ``src_ptr``:
    the link as every bound of the benchmark measures it (:func:`~expcache_bench.link.copy_rate`)."""
    return link.copy_rate(src_ptr, chunk, max(1, total // chunk), stream) / 1e9


class _FileCopy:
    """A HostSource's bytes written to a file: the same layout, read back with pread
    (buffered reads are served from the page cache right after writing; the file is
    flushed first, so that O_DIRECT reads time the disk and not the write-back)."""

    pinned = False

    def __init__(self, source: HostSource, path: str):
        with open(path, "wb") as f:
            source.buffer.tofile(f)
            f.flush()
            os.fsync(f.fileno())
        self.layout = source.layout
        self.file_path = path
        base = source.buffer.ctypes.data
        self._placements = [
            LayerPlacement(tuple(a - base for a in p.bases), p.strides, p.sizes) if p else None
            for p in (source.placement(i) for i in range(source.layout.num_layers))
        ]

    def placement(self, layer: int):
        return self._placements[layer]


def library_gb_s(layout: ModelLayout, source: HostSource, stream: int, k: int = 6, **cache_kwargs):
    """The library's miss throughput from ``source`` (CUDA): ``(GB/s, bytes moved, StagingStats)``
    of all-miss selects of ``k`` experts of layer 1 into slots that layer 0 filled, on ``stream``;
    ``cache_kwargs`` go to :class:`ExpertCache` (copy_threads, staging_chunk_bytes, ...). Every
    timed miss evicts and reuses an allocated slot, so slab allocation is not timed."""
    n = layout[0].num_experts
    with ExpertCache(
        layout, source, budget_experts=n, backend="cuda", reserve_bytes=0, log_level=0, **cache_kwargs
    ) as cache:
        for start in range(0, n, 256):
            cache.select(0, np.arange(start, min(n, start + 256)), stream)
        cache.synchronize(stream)
        cache.reset_stats()
        ids = np.arange(n, dtype=np.uint32)
        t0 = time.perf_counter()
        for i in range(0, n, k):
            cache.select(1, ids[i : i + k], stream)
        cache.synchronize(stream)
        dt = time.perf_counter() - t0
        st = cache.stats().total
        staging = cache.staging_stats()
        if st.hits or st.misses != n:
            raise RuntimeError(f"transfer benchmark: expected {n} misses, got {st.misses} (hits {st.hits})")
    return st.bytes_h2d / dt / 1e9, st.bytes_h2d, staging


ARRANGEMENTS = ("tensor", "expert")  # host placements measured: one tensor per part, or each expert's parts together


def measured_bytes(size: str, total_bytes: int) -> int:
    """Host bytes of :func:`measured_layout`'s experts (what a measurement holds at once)."""
    parts = SIZES[size]
    return 2 * max(64, total_bytes // sum(parts)) * sum(parts)


def measured_layout(size: str, total_bytes: int) -> ModelLayout:
    """What one measurement of ``size`` experts selects from, all in host memory at once: two
    layers of ``total_bytes`` of experts each (at least 64 experts; ValueError past the
    library's experts per layer)."""
    parts = SIZES[size]
    n = max(64, total_bytes // sum(parts))
    if n > _lib.MAX_EXPERTS_LIMIT:
        raise ValueError(
            f"{total_bytes / 2**30:g} GiB of {size} experts is {n} experts per layer, more than the "
            f"library's {_lib.MAX_EXPERTS_LIMIT}; at most "
            f"{_lib.MAX_EXPERTS_LIMIT * sum(parts) / 2**30:.1f} GiB"
        )
    return ModelLayout((LayerSpec(n, *parts),) * 2, name=f"transfer-{size}")


def measure(
    sizes: Sequence[str] = tuple(SIZES),
    total_bytes: int = 1 << 30,
    arrangements=ARRANGEMENTS,
    sources: Sequence[str] = SOURCES,
    copy_threads: Optional[Sequence[int]] = None,
    chunks: Optional[Sequence[int]] = None,
    device: int = 0,
    progress=None,
    file_dir: Optional[str] = None,
) -> list[TransferRow]:
    """The transfer table (CUDA only). ``file`` writes each source to a file in ``file_dir``
    (default: the system's temporary folder) and reads misses back from it, from the page cache;
    ``file-direct`` reads it with O_DIRECT. Staged sources are measured for every copy thread
    count and staging chunk size given (default: the library's defaults)."""
    default_threads, default_chunk = staging_defaults()
    copy_threads = list(copy_threads or [default_threads])
    chunks = list(chunks or [default_chunk])
    unknown = set(sources) - set(SOURCES)
    if unknown:
        raise ValueError(f"unknown sources {sorted(unknown)}; choose from {SOURCES}")
    rt = _cuda.runtime()
    _cuda.check(rt.cudaSetDevice(device), "cudaSetDevice")
    stream = int(_cuda.check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreate"))
    rows = []
    try:
        for size in sizes:
            parts = SIZES[size]
            expert = sum(parts)
            layout = measured_layout(size, total_bytes)
            pinned_raw: Optional[float] = None
            for kind in sources:
                for arrangement in arrangements:
                    with HostSource(layout, pinned=kind == "pinned", arrangement=arrangement) as src:
                        # raw same-kind: cudaMemcpyAsync from this memory (pageable for a file source)
                        raw_same = _raw_copy_gb_s(src.buffer.ctypes.data, expert, total_bytes, stream)
                        if kind == "pinned" and pinned_raw is None:
                            pinned_raw = raw_same
                        if pinned_raw is None:
                            with HostSource(ModelLayout((LayerSpec(2, *parts),)), pinned=True) as p:
                                pinned_raw = _raw_copy_gb_s(p.buffer.ctypes.data, expert, total_bytes, stream)
                        staged = [(t, c) for t in copy_threads for c in chunks] if kind != "pinned" else [(0, 0)]
                        with tempfile.TemporaryDirectory(dir=file_dir) as tmp:
                            measured = src
                            if kind.startswith("file"):
                                measured = _FileCopy(src, os.path.join(tmp, "x"))
                            for threads, chunk in staged:
                                extra = {"copy_threads": threads}
                                if chunk:
                                    extra["staging_chunk_bytes"] = chunk
                                if kind == "file-direct":
                                    extra["file_reads"] = "direct"
                                lib_gb_s, moved, staging = library_gb_s(layout, measured, stream, **extra)
                                rows.append(
                                    TransferRow(
                                        kind,
                                        threads,
                                        chunk,
                                        size,
                                        arrangement,
                                        lib_gb_s,
                                        raw_same,
                                        pinned_raw,
                                        moved,
                                        staging if staging.calls else None,
                                    )
                                )
                                if progress:
                                    progress(rows[-1])
    finally:
        rt.cudaStreamDestroy(stream)
    return rows


def format_rows(rows: Sequence[TransferRow], detail: bool = False) -> str:
    """The table; ``detail`` adds where a staged call's time goes (per call of 6 experts: the whole
    call, then :meth:`StagingStats.columns`: pieces, its staging span from first piece queued to
    last sent, the wait for its first piece, the calling thread's wait for workers, threads filling
    on average; per piece: fill and send times; the pieces the calling thread filled)."""

    headers = [
        "source",
        "copy threads",
        "chunk",
        "expert",
        "placement",
        "library GB/s",
        "raw same-kind GB/s",
        "raw pinned GB/s",
        "library / raw pinned",
    ]
    if detail:
        headers += ["µs/call", *StagingStats.COLUMNS]
    table = []
    for r in rows:
        row = [
            r.source,
            r.copy_threads if r.chunk_bytes else "—",
            f"{r.chunk_bytes >> 10} KiB" if r.chunk_bytes else "—",
            r.size,
            r.arrangement,
            f"{r.library_gb_s:.1f}",
            f"{r.raw_same_gb_s:.1f}",
            f"{r.raw_pinned_gb_s:.1f}",
            f"{100 * r.of_raw_pinned:.0f} %",
        ]
        if detail:
            st = r.staging
            call_us = st.bytes / st.calls / r.library_gb_s / 1e3 if st and st.calls and r.library_gb_s else 0.0
            row += ["—"] * (1 + len(StagingStats.COLUMNS)) if st is None else [f"{call_us:.1f}", *st.columns()]
        table.append(row)
    return tabulate(table, headers=headers, disable_numparse=True) + "\n\n" + LEGEND


LEGEND = (
    "raw: plain cudaMemcpyAsync of one expert at a time, measured in the same run. The library sends "
    "a call's pinned copies in one cudaMemcpyBatchAsync,\nso it can exceed that; staged sources are "
    "copied by the copy threads into pinned chunks first."
)


# -- the mode ---------------------------------------------------------------------------------


def check(args) -> None:
    options.need(options.has_cuda_python(), "the transfer table needs cuda-python", "cuda")
    if args.file_dir is not None and not os.path.isdir(args.file_dir):
        raise UsageError(f"--file-dir {args.file_dir}: no such folder")
    for count in args.copy_threads or []:
        options.check_cache_setting("--copy-threads", "copy_threads", count)
    for chunk in args.chunks or []:
        options.check_cache_setting("--chunks", "staging_chunk_bytes", chunk)
    need = max(measured_bytes(f"{s} MiB", int(args.gib * GiB)) for s in args.sizes)
    available = options.host_memory_available()
    if available is not None and need > available:
        raise UsageError(
            f"--gib {args.gib:g}: a measurement holds {need / GiB:.1f} GiB of host memory and "
            f"{available / GiB:.1f} GiB is available; lower --gib"
        )
    for s in args.sizes:
        try:
            measured_layout(f"{s} MiB", int(args.gib * GiB))
        except ValueError as exc:
            raise UsageError(f"--gib {args.gib:g}: {exc}; lower --gib") from None


def run(bench, args) -> Iterator[Report]:
    """The table as a report (``bench``: unused, None); with --detail, the host's copy rate too."""
    if resolve_backend("auto", args.device) != "cuda":
        raise NotAvailable("needs a CUDA device and the CUDA build of libexpcache")
    threads = args.copy_threads or []
    staged = max(1, len(threads)) * len(args.chunks or [0])
    total = len(args.sizes) * len(ARRANGEMENTS) * sum(1 if k == "pinned" else staged for k in args.sources)
    bar = Progress(False if args.quiet else None)
    done = [0]

    def progress(row) -> None:
        done[0] += 1
        bar(f"transfer {row.size} {row.source}", done[0], total)

    rows = measure(
        sizes=[f"{s} MiB" for s in args.sizes],
        total_bytes=int(args.gib * GiB),
        device=args.device,
        copy_threads=threads,
        chunks=args.chunks,
        sources=args.sources,
        file_dir=args.file_dir,
        progress=progress,
    )
    rates = None
    if args.detail:
        # The host's side of the staged rows' bound, in this run: it moves between machines and
        # leases more than the library does.
        rates = host_copy_rates(sorted(set([1] + [r.copy_threads for r in rows if r.copy_threads])))
    yield Report(
        NAME,
        "transfer",
        backend="cuda",
        device=device_name(True, args.device),
        results=rows,
        settings=dict(bytes_per_measurement=int(args.gib * GiB), detail=args.detail, host_copy_gb_s=rates),
        **made_by(),
    )


def describe(report: Report) -> list[str]:
    return [
        f"{report.settings['bytes_per_measurement'] / GiB:g} GiB moved per measurement; every select all "
        "misses, 6 experts per call"
    ]


def table(report: Report) -> str:
    text = format_rows(report.results, detail=report.settings["detail"])
    rates = report.settings["host_copy_gb_s"]
    if rates:
        text += (
            f"\n\nhost copy, {HOST_COPY_PIECE >> 10} KiB pieces of a {HOST_COPY_BUFFER >> 30} GiB pageable "
            "buffer (numpy), GB/s together: "
            + ", ".join(f"{t} {'thread' if t == 1 else 'threads'} {gb_s:.1f}" for t, gb_s in rates.items())
        )
    return text
