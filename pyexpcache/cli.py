"""The expcache command line: bench (the main job), transfer, inspect (a GGUF model), info.

Nothing here loads libexpcache or cuda-python before a command runs, so every --help
works on a fresh clone. What a run needs (output paths, optional packages, the traces) is
checked before the run starts; errors are one line; Ctrl-C stops with status 130.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import math
import os
import stat
import sys
from typing import Optional

from .layout import FIRST_ROUTED_LAYER, NUM_LAYERS, GiB

INTERRUPTED = 130  # the shell's status for a process stopped by SIGINT


class UsageError(Exception):
    """A command line that cannot run: printed as one line, status 2 (as argparse does)."""


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package is missing
        return False


def _has_cuda_python() -> bool:
    return _has_module("cuda.bindings") or _has_module("cuda.cudart")


def _need(ok: bool, what: str, extra: str) -> None:
    if not ok:
        raise UsageError(f"{what}; install it with: pip install 'expcache[{extra}]'")


class _OutputFile:
    """An output file (bench --json, --plot), opened before the run so that a path which cannot
    be written fails at once rather than after hours of benchmark (a check of permissions alone
    passes /proc or a read-only mount for root); the run writes into it. A file created here
    that nothing was written to is removed on close, so a failed or interrupted run leaves no
    empty file; an existing file keeps its contents until the run writes."""

    def __init__(self, path: str, option: str):
        self.path = path
        try:
            try:
                fd, self.created = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), True
            except FileExistsError:
                fd, self.created = os.open(path, os.O_WRONLY), False  # not truncated yet
        except IsADirectoryError:
            raise UsageError(f"{option} {path}: is a directory; give a file name") from None
        except OSError as exc:
            parent = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(parent):
                raise UsageError(f"{option} {path}: folder {parent} does not exist") from None
            raise UsageError(f"{option} {path}: cannot write it ({exc.strerror})") from None
        self.regular = stat.S_ISREG(os.fstat(fd).st_mode)  # not a pipe or a device: truncated on write
        self.file = os.fdopen(fd, "wb")
        self.written = False

    def write(self, data: bytes) -> None:
        """Replace the file's contents by ``data``."""
        if self.regular:
            self.file.seek(0)
            self.file.truncate()
        self.file.write(data)
        self.file.flush()
        self.written = True

    def close(self) -> None:
        self.file.close()
        if self.created and not self.written:
            os.unlink(self.path)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _json_bytes(value) -> bytes:
    import json

    return json.dumps(value, indent=2).encode()


def _gib(option: str, minimum_exclusive: bool):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or (minimum_exclusive and value == 0) or value > 1e6:
            raise argparse.ArgumentTypeError(
                f"{option} must be a finite number of GiB {'>' if minimum_exclusive else '>='} 0 (at most 1e6), "
                f"got {text!r}")
        return value
    return parse


def _whole(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text!r}")
        return value
    return parse


def _layers(text: str) -> list[int]:
    """Layer numbers and ranges: 3-42, 5,7,9, 3-10,40."""
    out: list[int] = []
    try:
        for part in (p.strip() for p in text.split(",")):
            first, dash, last = part.partition("-")
            if part:
                lo, hi = int(first), int(last if dash else first)
                if not 0 <= lo <= hi:
                    raise ValueError
                out.extend(range(lo, hi + 1))
    except ValueError:
        out = []
    if not out:
        raise argparse.ArgumentTypeError(f"expected layer numbers like 3-42 or 5,7,9, got {text!r}")
    return sorted(set(out))


def _ranges(numbers: list[int]) -> str:
    """Sorted numbers as --layers spells them: [3, 4, 5, 9] is 3-5,9."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _thread_counts(text: str) -> list[int]:
    try:
        counts = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 0:
        raise argparse.ArgumentTypeError(f"expected a comma list of thread counts such as 1,4,8, got {text!r}")
    return counts


def _csv(choices):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if choices and t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(choices)}; got {text!r}")
        return items
    return parse


def _sizes(text: str) -> list[int]:
    """A comma list of byte sizes: 262144, 256K, 1M."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20}
    out = []
    for item in (t.strip().upper().removesuffix("IB").removesuffix("B") for t in text.split(",")):
        number, unit = (item[:-1], item[-1]) if item[-1:] in ("K", "M") else (item, "")
        try:
            value = int(float(number) * units[unit])
        except ValueError:
            value = 0
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a comma list of sizes such as 256K,1M; got {text!r}")
        out.append(value)
    return out


def _size(text: str) -> int:
    sizes = _sizes(text)
    if len(sizes) != 1:
        raise argparse.ArgumentTypeError(f"expected one size such as 512K; got {text!r}")
    return sizes[0]


def _nonnegative_us(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of µs, got {text!r}") from None
    if not 0 <= value <= 1e6:
        raise argparse.ArgumentTypeError(f"must be in [0, 1e6] µs, got {text}")
    return value


def _prefetch_specs(text: str) -> list[str]:
    from .bench.predict import parse_prefetch

    specs = [s.strip() for s in text.split(",") if s.strip()]
    if not specs:
        raise argparse.ArgumentTypeError("expected a comma list of none, cooc, oracle:R")
    for spec in specs:
        try:
            parse_prefetch(spec)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return specs


def _engine_mode(args) -> bool:
    return (args.layer_compute_us is not None or args.prefetch is not None or args.hints or args.split
            or args.loop == "torch")


def _parser() -> argparse.ArgumentParser:
    from .bench import DEFAULT_TRACES, SCENARIOS, VARIANTS

    # The module docstring is the top help's description: plain text, as every help text here.
    p = argparse.ArgumentParser(prog="expcache", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="replay real routing through the cache; tokens/s and hit rate vs baselines",
                       description="Replay bundled DeepSeek V4 Flash routing through the cache on the GPU (or on "
                                   "the host backend when there is none) and compare with the baselines.")
    b.add_argument("--layout", default="mixed", choices=("q2", "q4", "mixed"),
                   help="DeepSeek V4 Flash expert layout (default: mixed q2-q4)")
    b.add_argument("--gguf", metavar="MODEL.gguf", help="use a GGUF model file's experts instead of a generated "
                   "layout; its layers and experts must match the traces")
    b.add_argument("--gguf-reads", choices=("mmap", "file"), default="mmap",
                   help="with --gguf: copy misses from a mapping of the file (pageable) or read them from the file "
                        "(pread; see --file-reads)")
    b.add_argument("--scenario", type=_csv(SCENARIOS + ("all",)), default=["decode"],
                   help=f"comma list of {', '.join(SCENARIOS)}, or all (default: decode)")
    b.add_argument("--traces", type=_csv(None), default=list(DEFAULT_TRACES),
                   help="comma list of bundled decode traces, CSV paths, or synthetic:TOKENS[:SEED] "
                        "(default: the seven bundled traces)")
    b.add_argument("--budget-gib", type=_gib("--budget-gib", True), default=12.0,
                   help="expert cache budget in GiB (default 12)")
    b.add_argument("--reserve-gib", type=_gib("--reserve-gib", False), default=None,
                   help="device memory kept free (default 1 GiB)")
    b.add_argument("--variants", type=_csv(VARIANTS), default=list(VARIANTS),
                   help=f"comma list of {', '.join(VARIANTS)} (default: all)")
    b.add_argument("--backend", default="auto", choices=("auto", "host", "cuda"),
                   help="auto: the GPU when the CUDA build of the library and a device are usable, else the "
                        "host backend (host memory with an emulated capacity); cuda needs cuda-python "
                        "(the [cuda] extra)")
    b.add_argument("--device", type=_whole(0), default=0, help="CUDA device ordinal (default 0)")
    b.add_argument("--source", choices=("pinned", "pageable"), default=None,
                   help="host memory of the experts (default: pinned on the GPU, pageable on the host)")
    b.add_argument("--placement", choices=("expert", "tensor"), default="expert",
                   help="host placement of the generated source: each expert's parts together (default, as "
                        "an engine stages experts in pinned memory) or one tensor per part (as in a GGUF)")
    b.add_argument("--no-layer-sync", action="store_true",
                   help="enqueue a token's layers back to back and wait once per token, instead of after every "
                        "layer (an engine waits per layer: the next layer's ids come from this one's output)")
    b.add_argument("--layers", type=_layers, default=None,
                   help=f"MoE layers to keep, e.g. 3-10 or 5,7,9 (default: all; the bundled traces have layers "
                        f"{FIRST_ROUTED_LAYER}-{NUM_LAYERS - 1})")
    b.add_argument("--scale", type=_whole(1), default=None,
                   help="divide expert sizes and the budget by this, a power of two up to 65536 (default: 1 on the "
                        "GPU, 256 on the host); the generated experts must fit in host memory")
    b.add_argument("--copy-threads", type=_whole(0), default=None,
                   help="threads staging pageable and file misses (default: the cores less 4, 2 to 12)")
    b.add_argument("--staging-chunk", type=_size, default=None,
                   help="largest staging piece one thread fills and one transfer moves, e.g. 1M (default 512K)")
    b.add_argument("--file-reads", choices=("buffered", "direct"), default="buffered",
                   help="with --gguf-reads file: through the page cache (default) or O_DIRECT")
    e = b.add_argument_group("engine model", "any of these replaces the variants table by the engine "
                             "comparison (decode scenario, the library's default policy): each setting side by "
                             "side with none in one run")
    e.add_argument("--layer-compute-us", type=_nonnegative_us, default=None, metavar="N",
                   help="N µs of non-expert work per layer (a GPU kernel that only takes time) before the layer's "
                        "select, as attention at batch 1 would be (default 0)")
    e.add_argument("--prefetch", type=_prefetch_specs, default=None, metavar="SPECS",
                   help="comma list of none, cooc (an online next-layer predictor learning only from earlier "
                        "tokens) and oracle:R (simulated: knows each next-layer expert with probability R); each "
                        "prefetches its predictions of the next layer while this one computes")
    e.add_argument("--prefetch-top", type=int, default=6, metavar="K",
                   help="experts each prediction names, most likely first (default 6; a layer takes at most 8)")
    e.add_argument("--prefetch-piece", type=_size, default=None, metavar="SIZE",
                   help="most prefetch bytes in flight at once, what a demand miss shares the link with, "
                        "e.g. 1M (default 4M; a multiple of 4K in 4K..64M)")
    e.add_argument("--hints", action="store_true",
                   help="also run each --prefetch predictor as hints only (refresh resident experts, no copy)")
    e.add_argument("--split", action="store_true",
                   help="serve with the split select: the hits' work runs while the misses cross")
    e.add_argument("--loop", choices=("c", "torch"), default="c",
                   help="c: the C replay loop (default); torch: a torch decode loop (one torch kernel per expert "
                        "over its view, a synchronize per layer), plain select against hits before misses")
    m = b.add_argument_group("several devices", "replaces the variants table by one device, one device at N "
                             "times the budget, and N devices side by side (decode scenario, the library's "
                             "default policy; --budget-gib is each device's)")
    m.add_argument("--devices", type=int, default=None, metavar="N",
                   help="spread the experts over N devices (2..64; the host backend emulates them; with fewer "
                        "GPUs than N the caches share a GPU and its link)")
    m.add_argument("--device-placement", choices=("balanced", "round-robin"), default="balanced",
                   help="which device owns each expert: balanced by the replayed traces' request counts "
                        "(default), or expert e on device e mod N")
    b.add_argument("--json", metavar="FILE", help="also write the report as JSON, rewritten after each scenario (an "
                   "interrupted run keeps the scenarios it finished)")
    b.add_argument("--plot", metavar="FILE.png",
                   help="plot hit rate vs budget for LRU, OppClassLRU and Belady (needs matplotlib: the [plot] extra)")
    b.add_argument("--quiet", action="store_true", help="no progress bar or notices")
    t = sub.add_parser("transfer", help="miss throughput per source kind and expert size vs raw cudaMemcpyAsync (GPU)",
                       description="Measure how fast the library moves misses to the GPU from pinned memory, "
                                   "pageable memory (staged through its pinned ring) and a file (pread, through "
                                   "the page cache or O_DIRECT), for each expert size, next to plain "
                                   "cudaMemcpyAsync of the same chunks in the same run. Needs a CUDA device, "
                                   "the CUDA build of libexpcache and cuda-python.")
    t.add_argument("--gib", type=_gib("--gib", True), default=1.0,
                   help="bytes moved per measurement, GiB (default 1); each measurement holds about twice as "
                        "much host memory")
    t.add_argument("--device", type=_whole(0), default=0, help="CUDA device ordinal (default 0)")
    t.add_argument("--copy-threads", type=_thread_counts, default=None,
                   help="comma list of copy thread counts for staged sources (default: the library's)")
    t.add_argument("--chunks", type=_sizes, default=None,
                   help="comma list of staging chunk sizes for staged sources, e.g. 256K,1M (default: the library's)")
    t.add_argument("--sources", type=_csv(("pinned", "pageable", "file", "file-direct")),
                   default=["pinned", "pageable", "file", "file-direct"],
                   help="file: reads served from the page cache; file-direct: O_DIRECT reads, from the disk")
    t.add_argument("--sizes", type=_csv(("0.5", "6.75", "13.5")), default=["0.5", "6.75", "13.5"],
                   help="comma list of expert sizes in MiB, of 0.5, 6.75, 13.5 (default: all)")
    t.add_argument("--file-dir", default=None, help="folder for the file source's temporary file")
    t.add_argument("--detail", action="store_true",
                   help="also show where staged calls spend their time (the staging ring's counters)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    i = sub.add_parser("inspect", help="layers, size classes and bytes of a GGUF model's routed experts")
    i.add_argument("model", metavar="MODEL.gguf")
    sub.add_parser("info", help="library version, path and available backends")
    return p


# The bench options that are ExpertCache settings: (option, attribute of args, ExpertCache keyword).
_CACHE_SETTINGS = (("--copy-threads", "copy_threads", "copy_threads"),
                   ("--staging-chunk", "staging_chunk", "staging_chunk_bytes"),
                   ("--prefetch-piece", "prefetch_piece", "prefetch_piece_bytes"))


def _cache_options(args) -> dict:
    options = {"file_reads": args.file_reads}
    for _, attribute, keyword in _CACHE_SETTINGS:
        if getattr(args, attribute) is not None:
            options[keyword] = getattr(args, attribute)
    return options


def _check_cache_setting(option: str, keyword: str, value: int) -> None:
    """Let the library judge a cache setting before the run (its ranges are its own): a cache of
    one tiny expert on the host backend is made with it."""
    from ._errors import ExpcacheError
    from .cache import ExpertCache
    from .layout import LayerSpec, ModelLayout
    from .source import HostSource

    layout = ModelLayout((LayerSpec(1, 256, 256, 256),))
    with HostSource(layout) as source:
        try:
            ExpertCache(layout, source, budget_experts=1, backend="host", log_level=0, **{keyword: value}).close()
        except ExpcacheError as exc:
            raise UsageError(f"{option}: {exc.message.removeprefix('expcache_create: ')}") from None


def _host_memory_available() -> Optional[int]:
    """Bytes of host memory a run may take: the kernel's MemAvailable, at most a cgroup v2
    memory limit (a container's); None where neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/proc/self/cgroup") as f:
            group = next(line.strip()[3:] for line in f if line.startswith("0::"))
        with open(os.path.join("/sys/fs/cgroup", group.lstrip("/"), "memory.max")) as f:
            limit = f.read().strip()
        if limit != "max":
            found.append(int(limit))
    except (OSError, ValueError, StopIteration):
        pass
    return min(found) if found else None


def _bench_host_bytes(args, layout, backend: str, budget: int) -> int:
    """Host memory a bench run with the generated source holds at its peak: the source and, on
    the host backend, the emulated device memory (the budgets of the caches alive at once, or
    the resident variant's whole model; never more than one more copy of the source)."""
    source = layout.total_bytes
    if backend == "cuda":
        return source
    device = budget * (args.devices or 1)
    if "resident" in args.variants and args.devices is None and not _engine_mode(args):
        device = source
    return source + min(device, source)


def _generated_layout(args, scale: int):
    """The --layout preset at ``scale``, less the layers --layers leaves out."""
    from .layout import ModelLayout

    try:
        layout = ModelLayout.preset(args.layout, scale=scale)
    except ValueError as exc:
        raise UsageError(f"--scale {scale}: {exc}; use a power of two up to 65536, e.g. 256") from None
    if args.layers is None:
        return layout
    return ModelLayout(tuple(s if i in args.layers else None for i, s in enumerate(layout.layers)),
                       name=f"{layout.name}[layers {args.layers[0]}..{args.layers[-1]}]")


def _check_bench_memory(args, backend: str, scale: int) -> None:
    """Refuse a run whose generated source (and emulated device memory) the host cannot hold,
    before allocating it, naming the --scale that fits."""
    available = _host_memory_available()

    def need(s: int) -> int:
        return _bench_host_bytes(args, _generated_layout(args, s), backend, int(args.budget_gib * GiB / s))

    if available is None or need(scale) <= available:
        return
    fits = next((s for s in (1 << i for i in range(17)) if s > scale and need(s) <= available), None)
    what = "the generated experts" + (" and the host backend's emulated device memory" if backend == "host" else "")
    hint = f"use --scale {fits} or more" if fits else "even --scale 65536 does not fit"
    raise UsageError(f"--scale {scale}{'' if args.scale else ' (the default)'}: {what} need "
                     f"{need(scale) / GiB:.1f} GiB of host memory and {available / GiB:.1f} GiB is available; {hint}")


def _check_bench(args) -> None:
    """What `bench` needs, checked before anything is allocated or run."""
    from .layout import ModelLayout

    if args.backend == "cuda" or args.source == "pinned":
        _need(_has_cuda_python(), f"{'--backend cuda' if args.backend == 'cuda' else '--source pinned'} needs "
              "cuda-python", "cuda")
    if args.gguf:
        _need(_has_module("gguf"), "--gguf needs the gguf package", "gguf")
        if not os.path.isfile(args.gguf):
            raise UsageError(f"--gguf {args.gguf}: no such file")
        if args.layers is not None:
            raise UsageError("--layers cannot be combined with --gguf")
    if args.layers is not None:
        count = ModelLayout.preset(args.layout).num_layers
        bad = [i for i in args.layers if i >= count]
        if bad:
            raise UsageError(f"--layers: {_ranges(bad)} not in 0..{count - 1}, the model's layers")
    if args.plot:
        _need(_has_module("matplotlib"), "--plot needs matplotlib", "plot")
        from matplotlib.figure import Figure

        if _image_format(args.plot) not in Figure().canvas.get_supported_filetypes():
            raise UsageError(f"--plot {args.plot}: matplotlib writes no .{_image_format(args.plot)} files; name a "
                             ".png, .svg or .pdf file")
    if args.gguf and args.scale is not None:
        raise UsageError("--scale cannot be combined with --gguf: a GGUF model's experts keep their sizes")
    if args.scale is not None:
        _generated_layout(args, args.scale)  # the sizes divide by it
    for option, attribute, keyword in _CACHE_SETTINGS:
        if getattr(args, attribute) is not None:
            _check_cache_setting(option, keyword, getattr(args, attribute))
    if args.devices is not None:
        if not 2 <= args.devices <= 64:
            raise UsageError(f"--devices must be 2..64, got {args.devices}")
        if _engine_mode(args):
            raise UsageError("--devices runs the plain decode loop: drop the engine model's options")
        if args.scenario != ["decode"] or args.no_layer_sync:
            raise UsageError("--devices replays the decode scenario, waiting after every layer")
    if _engine_mode(args):
        if args.scenario != ["decode"]:
            raise UsageError("the engine model (--layer-compute-us, --prefetch, --hints, --split, --loop torch) "
                             "replays the decode scenario only")
        if args.no_layer_sync:
            raise UsageError("the engine model waits after every layer: drop --no-layer-sync")
        if not 1 <= args.prefetch_top <= 256:
            raise UsageError(f"--prefetch-top must be 1..256, got {args.prefetch_top}")
        if args.hints and not args.prefetch:
            raise UsageError("--hints gives the --prefetch predictors as hints: name them, e.g. --prefetch cooc")
        if args.loop == "torch":
            _need(_has_module("torch"), "--loop torch needs torch", "torch")
            if args.prefetch or args.hints:
                raise UsageError("--loop torch compares plain and split selects; --prefetch and --hints run in "
                                 "the C loop (--loop c)")
    from . import bench

    # Every trace readable (one-line errors name the file), and some of --layers traced.
    routed = sorted({call.layer for call in bench.build_workload("decode", args.traces).calls})
    if args.layers is not None and not set(args.layers) & set(routed):
        untraced = (f" (layers 0-{FIRST_ROUTED_LAYER - 1} of DeepSeek V4 Flash are hash-routed: no trace has them)"
                    if min(args.layers) < FIRST_ROUTED_LAYER else "")
        raise UsageError(f"--layers {_ranges(args.layers)}: the traces have none of these layers; they have layers "
                         f"{_ranges(routed)}{untraced}")


def _image_format(path: str) -> str:
    """--plot's image format: the file name's extension, png without one."""
    return os.path.splitext(path)[1][1:].lower() or "png"


def _bench(args) -> int:
    _check_bench(args)
    with contextlib.ExitStack() as outputs:
        json_out = outputs.enter_context(_OutputFile(args.json, "--json")) if args.json else None
        plot_out = outputs.enter_context(_OutputFile(args.plot, "--plot")) if args.plot else None
        return _run_bench(args, json_out, plot_out)


def _run_bench(args, json_out: Optional[_OutputFile], plot_out: Optional[_OutputFile]) -> int:
    """The bench run, into the output files opened before it; the JSON report is written after
    each scenario, so an interrupted run keeps the scenarios it finished."""
    from . import bench

    backend = bench.resolve_backend(args.backend, args.device)
    scale = args.scale if args.scale is not None else (1 if backend == "cuda" else bench.HOST_SCALE)
    source = None
    if args.gguf:
        from .gguf import GGUFSource

        scale = 1
        source = GGUFSource(args.gguf, reads=args.gguf_reads)
        layout = source.layout
    else:
        _check_bench_memory(args, backend, scale)
        layout = _generated_layout(args, scale)
    pinned = None if args.source is None else args.source == "pinned"
    budget = int(args.budget_gib * GiB / scale)
    reserve = None if args.reserve_gib is None else int(args.reserve_gib * GiB)
    if backend == "host":
        print("no GPU in use: running on the host backend (hit rates exact, times host-emulated, "
              f"expert sizes / {scale})", file=sys.stderr)
    progress = bench.Progress(False if args.quiet else None)
    scenarios = bench.SCENARIOS if "all" in args.scenario else tuple(args.scenario)
    reports, failed = [], False
    shared = bench.Bench(layout, backend=backend, pinned=pinned, budget_bytes=budget, reserve_bytes=reserve,
                         progress=progress, device=args.device, source=source, placement=args.placement,
                         layer_sync=not args.no_layer_sync, cache_options=_cache_options(args), scale=scale)
    try:
        if args.devices is not None:
            return _devices(args, shared, json_out)
        if _engine_mode(args):
            return _engine(args, shared, json_out)
        for scenario in scenarios:
            report = bench.run(layout, scenario, variants=args.variants, traces=args.traces, budget_bytes=budget,
                               host_scale=scale, bench=shared)
            report.argv = ["expcache"] + list(args.argv)
            print(bench.format_report(report))
            print(flush=True)
            reports.append(report)
            if json_out:
                json_out.write(_json_bytes([r.to_json() for r in reports]))
            if report.checksum_errors:
                print(f"FAILED: {report.checksum_errors} experts served with bytes that differ from the source",
                      file=sys.stderr)
                failed = True
    finally:
        shared.close()
    if plot_out:
        import io

        workload = bench.build_workload("decode", args.traces, layout.moe_layers)
        curve = bench.hit_rate_curve(workload, layout, [0.02, 0.05, 0.1, 0.15, 0.25, 0.35, 0.5])
        image = io.BytesIO()
        bench.plot_curve(curve, image, f"{layout.name}: {workload.decode_tokens} decode tokens",
                         image_format=_image_format(args.plot))
        plot_out.write(image.getvalue())
        print(f"wrote {args.plot}", file=sys.stderr)
    return 1 if failed else 0


def _engine(args, shared, json_out: Optional[_OutputFile]) -> int:
    """The engine comparison (``--layer-compute-us``, ``--prefetch``, ``--hints``, ``--split``,
    ``--loop torch``) on the bench's source: one table, each setting against the first."""
    compute = args.layer_compute_us or 0.0
    if args.loop == "torch":
        from .bench.modes.torch_loop import run_torch_loop

        report = run_torch_loop(shared, traces=args.traces, compute_us=compute, progress=shared.progress)
    else:
        from .bench.modes.engine import run_engine

        report = run_engine(shared, traces=args.traces, prefetch=args.prefetch or ["none"], hints=args.hints,
                            compute_us=compute, split=args.split, top=args.prefetch_top)
    return _print_report(args, report, json_out)


def _devices(args, shared, json_out: Optional[_OutputFile]) -> int:
    """``--devices N``: one device, one at N times the budget, N devices, in one table."""
    from .bench.modes.devices import run_devices

    report = run_devices(shared, args.devices, traces=args.traces, placement=args.device_placement)
    return _print_report(args, report, json_out)


def _print_report(args, report, json_out: Optional[_OutputFile]) -> int:
    """A one-table report (engine model, devices): printed, written as JSON with --json, and
    exit status 1 when a served expert's bytes differed from the source."""
    from .bench import format_report

    report.argv = ["expcache"] + list(args.argv)
    print(format_report(report), flush=True)
    if json_out:
        json_out.write(_json_bytes([report.to_json()]))
    errors = sum(r.checksum_errors for r in report.results)
    if errors:
        print(f"FAILED: {errors} experts served with bytes that differ from the source", file=sys.stderr)
        return 1
    return 0


def _info() -> int:
    from . import library_version
    from .bench import resolve_backend

    print(f"libexpcache {library_version()}")
    print(f"auto backend here: {resolve_backend()}")
    return 0


def _transfer(args) -> int:
    _need(_has_cuda_python(), "expcache transfer needs cuda-python", "cuda")
    threads = args.copy_threads or []
    if args.file_dir is not None and not os.path.isdir(args.file_dir):
        raise UsageError(f"--file-dir {args.file_dir}: no such folder")
    for count in threads:
        _check_cache_setting("--copy-threads", "copy_threads", count)
    for chunk in args.chunks or []:
        _check_cache_setting("--chunks", "staging_chunk_bytes", chunk)
    from .bench.modes import transfer
    from .bench import Progress, resolve_backend

    need = max(transfer.measured_layout(f"{s} MiB", int(args.gib * GiB)).total_bytes for s in args.sizes)
    available = _host_memory_available()
    if available is not None and need > available:
        raise UsageError(f"--gib {args.gib:g}: a measurement holds {need / GiB:.1f} GiB of host memory and "
                         f"{available / GiB:.1f} GiB is available; lower --gib")

    if resolve_backend("auto", args.device) != "cuda":
        print("expcache transfer: needs a CUDA device and the CUDA build of libexpcache", file=sys.stderr)
        return 1
    staged = max(1, len(threads)) * len(args.chunks or [0])
    total = len(args.sizes) * len(transfer.ARRANGEMENTS) * sum(1 if k == "pinned" else staged for k in args.sources)
    bar = Progress(False if args.quiet else None)
    done = [0]

    def progress(row) -> None:
        done[0] += 1
        bar(f"transfer {row.size} {row.source}", done[0], total)

    rows = transfer.run(sizes=[f"{s} MiB" for s in args.sizes], total_bytes=int(args.gib * GiB),
                        device=args.device, copy_threads=threads, chunks=args.chunks, sources=args.sources,
                        file_dir=args.file_dir, progress=progress)
    print(transfer.format_rows(rows, detail=args.detail))
    if args.detail:
        # The host's side of the staged rows' bound, in this run: it moves between machines and
        # leases more than the library does.
        rates = transfer.host_copy_rates(sorted(set([1] + [r.copy_threads for r in rows if r.copy_threads])))
        print(f"\nhost copy, {transfer.HOST_COPY_PIECE >> 10} KiB pieces of a {transfer.HOST_COPY_BUFFER >> 30} GiB "
              "pageable buffer (numpy), GB/s together: "
              + ", ".join(f"{t} {'thread' if t == 1 else 'threads'} {gb_s:.1f}" for t, gb_s in rates.items()))
    return 0


def _inspect(args) -> int:
    _need(_has_module("gguf"), "expcache inspect needs the gguf package", "gguf")
    if os.path.isdir(args.model):
        raise UsageError(f"{args.model}: is a directory, not a GGUF file")
    from .gguf import inspect_table

    print(inspect_table(args.model))
    return 0


_COMMANDS = {"bench": _bench, "transfer": _transfer, "inspect": _inspect, "info": lambda args: _info()}


def _show_warning(message, category, filename, lineno, file=None, line=None):
    # One line per warning (the library's and the traces' notices), not Python's two-line form.
    print(f"expcache: warning: {message}", file=sys.stderr if file is None else file)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    args.argv = argv
    import warnings

    warnings.showwarning = _show_warning
    if args.command == "bench":
        logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(name)s: %(message)s")
    try:
        return _COMMANDS[args.command](args)
    except KeyboardInterrupt:
        # A progress bar may own the current line.
        print(("\n" if sys.stderr.isatty() else "") + f"expcache {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except UsageError as exc:
        print(f"expcache {args.command}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        from ._errors import ExpcacheError

        if isinstance(exc, (ValueError, OSError, MemoryError, ImportError, ExpcacheError)):
            print(f"expcache {args.command}: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
