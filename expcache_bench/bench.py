"""What every mode of the benchmark shares (:class:`Bench`): the layout, the source, the stream,
the expected checksums, the caches made over them, the replays through the C loop, the link, and
the header of a report; and the backend ``"auto"`` picks (:func:`resolve_backend`)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Optional

import numpy as np

from pyexpcache import _cuda, _lib
from pyexpcache.budget import class_info, unscaled
from pyexpcache.cache import ExpertCache, staging_defaults
from pyexpcache.layout import GiB, ModelLayout
from pyexpcache.progress import Progress
from pyexpcache.source import HostSource, LayerPlacement

from . import (
    disk,
    file_source,
    link,
    replay as _replay,  # the C loop's declarations (Bench.replay is a method)
)
from .budget import scaled_budget
from .disk import Disk
from .file_source import SOURCES, FileSource
from .link import Link
from .options import host_memory_available
from .report import made_by
from .workload import Workload

HOST_SCALE = 256  # host backend: expert sizes / 256, same slot counts (budget.scaled_budget)


@contextlib.contextmanager
def _sigint_deferred():
    """While a loop runs in C: Ctrl-C only sets a flag (yielded as a function) that the loop's
    progress callback reads to stop it; KeyboardInterrupt is raised when the block ends. A
    Python-level KeyboardInterrupt could fire at the callback's first instruction, outside any
    ``try``, where ctypes would print and drop it. Only on the main thread, with Python's
    default handler in place; elsewhere the flag stays down."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
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


def device_name(cuda: bool, device: int = 0) -> str:
    """A report header's device: the CUDA device's name, or the host backend's description."""
    if not cuda:
        return "host (no GPU: host backend, times are host-emulated)"
    rt = _cuda.runtime()
    props = _cuda.check(rt.cudaGetDeviceProperties(device), "cudaGetDeviceProperties")
    name = props.name.decode() if isinstance(props.name, bytes) else str(props.name)
    return name.rstrip("\x00")


def resolve_backend(backend: str = "auto", device: int = 0) -> str:
    """The backend ``"auto"`` picks here: ``"cuda"`` when the library and a device allow it."""
    if backend != "auto":
        return backend
    probe_layout = ModelLayout.preset("q2", scale=65536)
    with (
        HostSource(probe_layout) as src,
        ExpertCache(probe_layout, src, budget_experts=1, backend="auto", device=device, log_level=0) as probe,
    ):
        return probe.backend


def serve_refused(parts: Sequence[int], serve: str, split: bool = False) -> Optional[str]:
    """Why the C loop cannot replay experts of ``parts`` parts (the layout's part counts) served as
    ``serve`` (:meth:`Bench.replay`'s), with the split select when ``split``; None when it can.
    Experts of three parts only are served any way; others by slot id (select_slots,
    batch_prepare_slots, the bank's checksum), which compact loads (``nocache``) and the split
    select are not: both hand out three pointers per expert."""
    if list(parts) == [3]:
        return None
    what = "compact loads" if serve == "nocache" else "the split select" if split else None
    if what is None:
        return None
    return (
        f"the experts have {', '.join(map(str, parts))} parts, and {what} serve experts of three parts only "
        "(three pointers per expert; the C loop serves the others by slot id)"
    )


class Bench:
    """Holds what every mode shares: layout, source, stream, expected checksums.

    The source: ``source`` (an open source, e.g. a :class:`~pyexpcache.gguf.GGUFSource`), else the
    generated experts of ``layout`` in the memory or file ``kind`` names (one of
    :data:`~expcache_bench.file_source.SOURCES`; default: pinned memory where ``pinned`` is true,
    by default on CUDA, else pageable), in the ``placement`` arrangement; a file source's file is
    written in ``file_dir`` (default: a temporary folder) and read as the cache option
    ``file_reads`` says."""

    def __init__(
        self,
        layout: ModelLayout,
        *,
        backend: str = "auto",
        pinned: Optional[bool] = None,
        budget_bytes: int = 12 * GiB,
        reserve_bytes: Optional[int] = None,
        progress: Optional[Progress] = None,
        device: int = 0,
        source=None,
        kind: Optional[str] = None,
        file_dir: Optional[str] = None,
        placement: str = "expert",
        layer_sync: bool = True,
        cache_options: Optional[dict] = None,
        scale: int = 1,
    ):
        self.layout = layout
        self.scale = scale  # the layout's expert sizes and the budget were divided by this (reports say so)
        # The full-size run this one stands for: its layout and budget. At divided sizes the caches
        # get the budget that gives each class that run's slot count (budget.scaled_budget; ValueError
        # when none does), so hit rates are the full size's.
        self.full_layout = unscaled(layout, scale)
        self.full_budget_bytes = budget_bytes * scale
        self.budget_bytes = self.budget_for(self.full_budget_bytes)
        # Extra ExpertCache arguments of the policy variants and the other modes' caches (copy_threads,
        # staging_chunk_bytes, file_reads); the baselines keep the old design's.
        self.cache_options = dict(cache_options or {})
        self.backend = backend
        self.reserve_bytes = reserve_bytes
        self.layer_sync = layer_sync
        self.device = device
        self.progress = progress or Progress(False)
        self.is_cuda = self._resolve_backend() == "cuda"
        if not self.is_cuda:
            # A host "upload" is one memcpy: no link for staging threads to overlap with.
            self.cache_options.setdefault("copy_threads", 0)
        if kind is not None and kind not in SOURCES:
            raise ValueError(f"kind must be one of {', '.join(SOURCES)}, got {kind!r}")
        if source is not None:
            self.pinned = source.pinned
        elif kind is not None:
            self.pinned = kind == "pinned"
        else:
            # Pinned on the host backend: emulated where no CUDA device is (HostSource), as a device
            # select's source must be on either backend.
            self.pinned = self.is_cuda if pinned is None else pinned
        self.stream = self._make_stream()
        if source is None and kind in file_source.READS:

            def write(done, total):
                self.progress("writing the file source, MiB", done >> 20, total >> 20)

            source = FileSource(layout, reads=kind, arrangement=placement, directory=file_dir, progress=write)
        elif source is None:

            def fill(done, total):
                self.progress(f"filling {'pinned' if self.pinned else 'pageable'} source", done, total)

            source = HostSource(layout, pinned=self.pinned, arrangement=placement, progress=fill)
        self.source = source
        if getattr(source, "path", None):  # a file: mapped, or read with pread
            self.kind = "file" if source.file_path else "mmap"
        else:
            self.kind = "pinned" if self.pinned else "pageable"
        self.placement = getattr(source, "arrangement", "tensor (GGUF file)")
        # What the page cache could hold of a file source when the run began (it changes as it runs).
        self.memory_available = host_memory_available() if self.kind in file_source.READS else None
        # Experts of other than three parts (a quantized checkpoint's weights and scales) anywhere:
        # the C loop serves every layer by slot id (replay.MODE_SLOTS), the three-part path untouched.
        self.parts = sorted({len(layout[i].class_key) for i in layout.moe_layers})
        self.by_slot = self.parts != [3]
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
        return device_name(self.is_cuda, self.device)

    def close(self) -> None:
        if self.is_cuda and self.stream:
            _cuda.runtime().cudaStreamDestroy(self.stream)
            self.stream = 0
        self.source.close()

    def budget_for(self, full_budget_bytes: int) -> int:
        """The budget a cache of the bench's layout gets for a full-size budget of
        ``full_budget_bytes``: the same at scale 1, else the one that keeps each class's slot count
        (:func:`~expcache_bench.budget.scaled_budget`)."""
        return scaled_budget(self.layout, full_budget_bytes, self.scale)

    def report_header(self) -> dict:
        """The :class:`~expcache_bench.report.Report` fields the bench fills for every mode: where
        it runs, on what layout, source and budget (the caches' in bytes, the full-size run's whose
        slot counts they have, and that as a fraction of the model's experts' bytes), and the
        version, library and commit."""
        return dict(
            backend="cuda" if self.is_cuda else "host",
            device=self.device_name(),
            layout=self.layout.name,
            parts=self.parts_header(),
            source=self.kind,
            source_file=self.file_header(),
            placement=self.placement,
            budget_bytes=self.budget_bytes,
            budget_fraction=self.full_budget_bytes / self.full_layout.total_bytes,
            host_scale=self.scale,
            full_budget_bytes=self.full_budget_bytes if self.scale != 1 else None,
            **made_by(),
        )

    def parts_header(self) -> Optional[str]:
        """The experts' parts for a report's header where any layer's are not three (None where
        every layer's are): each distinct set's count and names, and that the C loop serves them
        by slot id."""
        if not self.by_slot:
            return None
        kinds = []
        for layer in self.layout.moe_layers:
            spec = self.layout[layer]
            kind = f"{spec.num_parts} parts: {', '.join(spec.part_names)}"
            if kind not in kinds:
                kinds.append(kind)
        return "; ".join(kinds) + "; served by slot id"

    def full_slot_bytes(self) -> list[int]:
        """The slot bytes of each size class of the full-size layout (the library's)."""
        return [c.slot_bytes for c in class_info(self.full_layout, self.full_budget_bytes)]

    # -- the link ----------------------------------------------------------------
    @property
    def link_chunk_bytes(self) -> int:
        """The piece a link measurement copies: the largest expert."""
        return max(s.expert_bytes for s in self.layout.layers if s)

    def measure_link(self, device: Optional[int] = None) -> Link:
        """The link of ``device`` (default: the bench's), measured now (:func:`~expcache_bench.link.measure`
        of :attr:`link_chunk_bytes` pieces): on the host backend, memcpy bandwidth."""
        device = self.device if device is None else device
        return link.measure(
            self.source,
            self.link_chunk_bytes,
            cuda=self.is_cuda,
            device=device,
            stream=self.stream if device == self.device else None,
        )

    # -- a source in a file ------------------------------------------------------
    def _file_layers(self) -> list[tuple[LayerPlacement, int]]:
        """Per MoE layer of a file source: where its parts are in the file (offsets) and its
        expert count."""
        layers = self.layout.moe_layers
        if isinstance(self.source, FileSource):
            places = [self.source.file_placements[i] for i in layers]
        else:  # a GGUF file
            places = [LayerPlacement(r.offsets, r.strides, r.sizes) for r in (self.source.records[i] for i in layers)]
        return [(p, self.layout[i].num_experts) for p, i in zip(places, layers)]

    @property
    def file_reads(self) -> str:
        """How a file source's misses read it: ``"mmap"``, ``"buffered"``, ``"direct"`` or
        ``"direct refused"`` (O_DIRECT asked for, refused by the file system: buffered reads)."""
        if self.kind == "mmap":
            return "mmap"
        if self.cache_options.get("file_reads", "buffered") != "direct":
            return "buffered"
        return "direct" if disk.direct_allowed(self.source.path) else "direct refused"

    def file_header(self) -> Optional[dict]:
        """A file source's :attr:`~expcache_bench.report.Report.source_file`: its path and bytes,
        how misses read it, the memory the page cache could take when the run began, and whether
        the bench drops its pages before each cache (a file it wrote); None for a source in memory."""
        if self.kind not in file_source.READS:
            return None
        return dict(
            path=self.source.path,
            bytes=os.path.getsize(self.source.path),
            reads=self.file_reads,
            memory_available=self.memory_available,
            dropped=isinstance(self.source, FileSource),
        )

    @property
    def reader_threads(self) -> int:
        """The caches' file readers: one per copy thread (--copy-threads, else the library's default)."""
        return self.cache_options.get("copy_threads") or staging_defaults()[0]

    def measure_disk(self) -> Optional[Disk]:
        """A file source's read rate, measured now (:func:`~expcache_bench.disk.measure`: O_DIRECT
        reads of random experts of its file, the best of the caches' shape, one reader per copy
        thread in the feed's pieces, and of more readers and larger pieces up to whole experts);
        None for a source in memory."""
        if self.kind not in file_source.READS:
            return None
        return disk.measure(self.source.path, self._file_layers(), threads=self.reader_threads)

    def replay_disk(self, misses: Sequence[tuple[int, int]]) -> Disk:
        """A file source's read rate on a run's own misses (``(layer, expert)`` each, in its
        order): :func:`~expcache_bench.disk.replay` with the caches' reader count, O_DIRECT as
        :meth:`measure_disk`. Called after the loop whose misses they are."""
        places = {layer: p for layer, (p, _) in zip(self.layout.moe_layers, self._file_layers())}
        return disk.replay(self.source.path, places, misses, threads=self.reader_threads)

    def measure_bounds(self) -> dict:
        """The link (:meth:`measure_link`) and a file source's disk (:meth:`measure_disk`), measured
        now, as the :class:`~expcache_bench.report.Report` fields that hold them (a bound is taken
        at the lower: :func:`~expcache_bench.report.bound`)."""
        measured = self.measure_link()
        found = self.measure_disk()
        return dict(
            link_bytes_per_s=measured.bytes_per_s,
            link_label=measured.label,
            disk_bytes_per_s=found.bytes_per_s if found else None,
            disk_label=found.label if found else None,
        )

    def page_cache_fraction(self) -> Optional[float]:
        """The share of a file source's file in the page cache now; None for a source in memory,
        or where it cannot be read (a file the bench did not write)."""
        return self.source.page_cache_fraction() if isinstance(self.source, FileSource) else None

    # -- variants --------------------------------------------------------------
    def make_cache(self, **kwargs) -> ExpertCache:
        """A new :class:`~pyexpcache.ExpertCache` over the bench's layout and source, on its backend
        and device, with the bench's reserve unless ``reserve_bytes`` is given; ``kwargs`` go to
        ExpertCache (the log level defaults to notices; ``max_classes`` to ExpertCache's, every size
        class of the layout). A file the bench wrote is dropped from the page cache first, so each
        cache starts from the disk."""
        if isinstance(self.source, FileSource):
            self.source.drop_page_cache()
        kwargs.setdefault("log_level", _lib.LOG_NOTICE)
        if self.reserve_bytes is not None:
            kwargs.setdefault("reserve_bytes", self.reserve_bytes)
        return ExpertCache(self.layout, self.source, backend=self.backend, device=self.device, **kwargs)

    def run_c_loop(self, name: str, loop):
        """Run one C replay loop, ``loop(dll, api, progress, out)``, with a progress callback that
        shows ``name`` and asks the loop to stop on Ctrl-C (deferred meanwhile) or when the display
        fails; returns the loop's ReplayResult, or raises what stopped it once it has returned."""
        out = _replay.ReplayResult()
        failed: list[BaseException] = []
        with _sigint_deferred() as interrupted:

            def on_progress(done: int, total: int) -> int:
                # A ctypes callback cannot raise into C: Ctrl-C (noted by the handler above) or an
                # error of the display asks the loop to stop, and is raised once it has returned.
                try:
                    self.progress(name, done, total)
                except BaseException as exc:
                    failed.append(exc)
                return 1 if failed or interrupted() else 0

            dll, api = _replay.load()
            loop(dll, api, _replay.PROGRESS_FN(on_progress), out)
        if failed:
            raise failed[0]
        if out.stopped:  # asked by the callback and not raised above: only an interrupt does that
            raise KeyboardInterrupt
        return out

    def replay(self, cache: ExpertCache, workload: Workload, *, label: str, serve: str = "cache", options=None):
        """Replay ``workload`` on ``cache`` through the C loop, every expert served checksummed
        against the source (a mismatch is also printed to stderr, with ``label``, which the
        progress bar shows too), each layer waited for unless the bench's ``layer_sync`` is off.
        ``serve``: ``"cache"`` (select, prefill batches), ``"nocache"`` (compact loads) or ``"slab"``
        (select, the cache released before each batch). A layout whose experts are not all of three
        parts (:attr:`by_slot`) is served by slot id (select_slots, batch_prepare_slots, the bank's
        checksum of every part), not ``"nocache"`` nor with the split select (:func:`serve_refused`:
        ValueError). ``options`` (a
        :class:`~expcache_bench.replay.ReplayOptions`, kept alive by the caller with its arrays)
        makes each decode call an engine's layer. Returns the loop's
        :class:`~expcache_bench.replay.ReplayResult`."""
        modes = {"cache": _replay.MODE_CACHE, "nocache": _replay.MODE_NOCACHE, "slab": _replay.MODE_SLAB}
        if serve not in modes:
            raise ValueError(f"serve must be one of {', '.join(modes)}, got {serve!r}")
        refused = serve_refused(self.parts, serve, split=bool(options is not None and options.split))
        if refused:
            raise ValueError(f"{label}: {refused}")
        calls, ids = workload.arrays()

        def loop(dll, api, progress, out):
            expected = np.ascontiguousarray(self.expected)
            with cache.raw_handle() as handle:
                dll.expcache_replay(
                    ctypes.byref(api),
                    handle,
                    ctypes.addressof(calls),
                    len(calls),
                    ids.ctypes.data,
                    modes[serve] | (_replay.BY_SLOT if self.by_slot else 0),
                    self.stream,
                    expected.ctypes.data,
                    expected.shape[1],
                    cache.max_classes,
                    int(self.layer_sync),
                    ctypes.byref(options) if options is not None else None,
                    progress,
                    ctypes.byref(out),
                )

        out = self.run_c_loop(label, loop)
        if out.checksum_errors:
            print(
                f"CHECKSUM MISMATCH: {label}: {out.checksum_errors} experts differ from the source "
                f"(first in call {out.first_bad_call})",
                file=sys.stderr,
            )
        return out
