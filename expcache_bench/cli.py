"""The expcache command line: bench (the main job, in modes), inspect (a GGUF model), info.

`expcache bench MODE [options]` runs one of the benchmark's modes (expcache_bench/modes/), each
with the options it lists; `expcache bench [options]` runs the default mode, the variants table.
Deprecated for one release, each with a DeprecationWarning naming the mode's spelling: a mode
chosen by an option of the flag spelling (`expcache bench --loop torch`, `--devices N`,
`--prefetch ...`) and `expcache transfer` (`expcache bench transfer`).

Nothing here loads libexpcache or cuda-python before a command runs, so every --help
works on a fresh clone. What a run needs (output paths, optional packages, the traces) is
checked before the run starts; errors are one line; Ctrl-C stops with status 130.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import stat
import sys
import warnings

from pyexpcache import library_version
from pyexpcache._errors import ExpcacheError
from pyexpcache.gguf import GGUFSource, inspect_table
from pyexpcache.layout import FIRST_ROUTED_LAYER, GiB
from pyexpcache.progress import Progress

from . import bench, file_source, modes, options
from .modes import format_report
from .options import NotAvailable, UsageError
from .traces import check_layout
from .workload import decode_trace

INTERRUPTED = 130  # the shell's status for a process stopped by SIGINT


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
    return json.dumps(value, indent=2).encode()


def _parser() -> argparse.ArgumentParser:
    """The top-level parser: bench (a mode's name is the first argument, read by :func:`_parse`),
    inspect, info, and the deprecated transfer."""
    # The module docstring is the top help's description: plain text, as every help text here.
    p = argparse.ArgumentParser(prog="expcache", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="{bench,inspect,info}")
    b = sub.add_parser(
        "bench",
        help="replay real routing through the cache; tokens/s and hit rate vs baselines",
        usage="%(prog)s [MODE] [options]",
        description="Replay bundled DeepSeek V4 Flash routing through the cache on the GPU (or on "
        "the host backend when there is none) and compare with the baselines. Modes: "
        + "; ".join(
            f"{n}{' (the default)' if n == modes.DEFAULT else ''}: {modes.by_name(n).HELP}" for n in modes.NAMES
        )
        + ". 'expcache bench MODE --help' lists a mode's options. Without a mode, it runs the "
        f"{modes.by_name(modes.DEFAULT).TITLE}, with the options below.",
    )
    _add_flag_options(b)
    transfer = modes.by_name("transfer")
    t = sub.add_parser(
        "transfer",
        description=transfer.DESCRIPTION + " Deprecated: the same as 'expcache bench transfer', the one spelling.",
    )
    for option in transfer.OPTIONS:
        option.add_to(t)
    i = sub.add_parser("inspect", help="layers, size classes and bytes of a GGUF model's routed experts")
    i.add_argument("model", metavar="MODEL.gguf")
    sub.add_parser("info", help="library version, path and available backends")
    return p


def _add_flag_options(parser) -> None:
    """`expcache bench`'s options without a mode's name: the default mode's, shown in the help, and
    every other option of the flag spelling, which chooses its mode (deprecated: parsed, not
    shown; :func:`~expcache_bench.modes.choose` warns)."""
    default = modes.by_name(modes.DEFAULT)
    for option in default.OPTIONS:
        option.add_to(parser)
    for option in modes.flag_options():
        if option not in default.OPTIONS:
            option.add_to(parser, hidden=True)


def _mode_parser(mode) -> argparse.ArgumentParser:
    """`expcache bench MODE`: the mode's options."""
    p = argparse.ArgumentParser(prog=f"expcache bench {mode.NAME}", description=mode.DESCRIPTION)
    for option in mode.OPTIONS:
        option.add_to(p)
    return p


def _parse(argv: list[str]) -> argparse.Namespace:
    """The command line as a namespace with ``command``, ``mode`` (a bench mode's name, None for
    the flag spelling), ``prog`` (what messages start with), ``taken`` (the options its parser
    had) and ``argv``."""
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in modes.NAMES:
        mode = modes.by_name(argv[1])
        args = _mode_parser(mode).parse_args(argv[2:])
        args.command, args.mode, args.taken = "bench", mode.NAME, list(mode.OPTIONS)
    else:
        args = _parser().parse_args(argv)
        args.mode = None
        args.taken = modes.flag_options() if args.command == "bench" else []
        if args.command == "transfer":
            args.mode, args.taken = "transfer", list(modes.by_name("transfer").OPTIONS)
    args.prog = f"expcache bench {args.mode}" if argv[:2] == ["bench", args.mode] else f"expcache {args.command}"
    args.argv = argv
    return args


# -- checks before a run ---------------------------------------------------------------------


def _check_shared(args) -> None:
    """What the shared options (a Bench's, the traces) need, checked before anything is allocated
    or run; only those the command line has."""
    taken = args.taken
    if options.BUDGET_FRACTION in taken:
        options.check_budget(args)
    if (options.BACKEND in taken and args.backend == "cuda") or (options.SOURCE in taken and args.source == "pinned"):
        options.need(
            options.has_cuda_python(),
            f"{'--backend cuda' if args.backend == 'cuda' else '--source pinned'} needs cuda-python",
            "cuda",
        )
    if options.SOURCE in taken:
        _check_file_options(args)
    if options.GGUF in taken and args.gguf:
        options.need(options.has_module("gguf"), "--gguf needs the gguf package", "gguf")
        if not os.path.isfile(args.gguf):
            raise UsageError(f"--gguf {args.gguf}: no such file")
        if args.layers is not None:
            raise UsageError("--layers cannot be combined with --gguf")
        if options.LAYOUT.given(args):
            raise UsageError("--layout cannot be combined with --gguf: the GGUF file gives the layout")
    elif options.LAYOUT in taken:
        options.model_layout(args.layout)  # the file read, its errors one line
    if options.LAYERS in taken and args.layers is not None:
        count = options.model_layout(args.layout).num_layers
        bad = [i for i in args.layers if i >= count]
        if bad:
            raise UsageError(f"--layers: {options.ranges(bad)} not in 0..{count - 1}, the model's layers")
    if options.SCALE in taken:
        if args.gguf and args.scale is not None:
            raise UsageError("--scale cannot be combined with --gguf: a GGUF model's experts keep their sizes")
        if args.scale is not None:
            options.generated_layout(args, args.scale)  # the sizes divide by it
    for option, keyword in options.CACHE_SETTINGS:
        if option in taken and getattr(args, option.dest) is not None:
            options.check_cache_setting(option.flags[0], keyword, getattr(args, option.dest))


def _check_file_options(args) -> None:
    """--source mmap|file, --file-dir and --file-reads: each where it applies."""
    from_file = args.source in file_source.READS
    if from_file and args.gguf:
        raise UsageError(
            f"--source {args.source} serves the generated experts from a file; --gguf serves its own file "
            "(--gguf-reads mmap or file): drop one"
        )
    if options.FILE_DIR.given(args):
        if not from_file:
            raise UsageError("--file-dir is where a file source is written: give --source mmap or file")
        if not os.path.isdir(args.file_dir):
            raise UsageError(f"--file-dir {args.file_dir}: no such folder")
    if options.FILE_READS.given(args) and args.source != "file" and not (args.gguf and args.gguf_reads == "file"):
        raise UsageError(
            f"--file-reads {args.file_reads} applies to reads of a file: --source file, or --gguf-reads file"
        )


def _check_traces(args) -> None:
    """Every trace loaded, once: one-line errors name the file, and a trace with (token, layer)
    records missing gives its one notice here. Each checked against the generated layout (--layout;
    a GGUF model's when the run opens it), and some of --layers traced. ``args.traces`` becomes the
    loaded traces, which the mode replays."""
    loaded = [decode_trace(t) for t in args.traces]
    routed = sorted({layer for trace in loaded for layer in trace.routed_layers})
    if options.LAYOUT in args.taken and not getattr(args, "gguf", None):
        layout = options.generated_layout(args, 1)  # the experts' counts: the sizes do not matter here
        for trace in loaded:
            check_layout(trace, layout, args.layers)
    args.traces = loaded
    if args.layers is not None and not set(args.layers) & set(routed):
        untraced = (
            f" (layers 0-{FIRST_ROUTED_LAYER - 1} of DeepSeek V4 Flash are hash-routed: no trace has them)"
            if min(args.layers) < FIRST_ROUTED_LAYER
            else ""
        )
        raise UsageError(
            f"--layers {options.ranges(args.layers)}: the traces have none of these layers; they have "
            f"layers {options.ranges(routed)}{untraced}"
        )


def _bench_host_bytes(args, mode, layout, backend: str, budget: int) -> int:
    """Host memory a bench run with the generated source holds at its peak: the source (a file
    source: one layer's experts, written one layer at a time) and, on the host backend, the
    emulated device memory (what the mode's caches hold at once; never more than one more copy of
    the source)."""
    source = layout.total_bytes
    one_layer = max(spec.num_experts * spec.expert_bytes for spec in layout.layers if spec)
    held = one_layer if args.source in file_source.READS else source
    if backend == "cuda":
        return held
    return held + min(mode.device_bytes(args, budget, source), source)


def _check_bench_memory(args, mode, backend: str, scale: int) -> None:
    """Refuse a run whose generated source (and emulated device memory) the host cannot hold,
    before allocating it, naming the --scale that fits."""
    available = options.host_memory_available()

    def need(s: int) -> int:
        layout = options.generated_layout(args, s)
        return _bench_host_bytes(args, mode, layout, backend, options.budget_bytes(args, layout, s))

    if available is None or need(scale) <= available:
        return
    fits = next((s for s in (1 << i for i in range(17)) if s > scale and need(s) <= available), None)
    what = "the generated experts" + (" and the host backend's emulated device memory" if backend == "host" else "")
    hint = f"use --scale {fits} or more" if fits else "even --scale 65536 does not fit"
    raise UsageError(
        f"--scale {scale}{'' if args.scale else ' (the default)'}: {what} need "
        f"{need(scale) / GiB:.1f} GiB of host memory and {available / GiB:.1f} GiB is available; {hint}"
    )


# -- bench -----------------------------------------------------------------------------------


def _chosen_quietly(args) -> str | None:
    """The mode the flag spelling's options choose, without its deprecation warning or usage error
    (both come where the run chooses it, after the shared options' checks); None where none is."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            return modes.choose(args).NAME
        except UsageError:
            return None


def _bench(args) -> int:
    """A bench mode (or `expcache transfer`): the checks, the output files opened before the run,
    the run."""
    args.chosen_mode = args.mode or _chosen_quietly(args)  # what generated_layout refuses depends on it
    _check_shared(args)
    if args.command == "transfer":
        warnings.warn(
            "'expcache transfer' is deprecated and goes in the next release: run 'expcache bench transfer' "
            "with the same options",
            DeprecationWarning,
            stacklevel=1,
        )
    mode = modes.by_name(args.mode) if args.mode else modes.choose(args)
    mode.check(args)
    if options.TRACES in mode.OPTIONS:
        _check_traces(args)
    with contextlib.ExitStack() as stack:
        args.outputs = {
            o.dest: stack.enter_context(_OutputFile(getattr(args, o.dest), o.flags[0]))
            for o in options.FILES
            if o in mode.OPTIONS and getattr(args, o.dest)
        }
        return _run(args, mode)


def _open_bench(args, mode):
    """The Bench of a mode that runs on one, from the shared options."""
    backend = bench.resolve_backend(args.backend, args.device)
    scale = args.scale if args.scale is not None else (1 if backend == "cuda" else bench.HOST_SCALE)
    source = None
    if args.gguf:
        scale = 1
        source = GGUFSource(args.gguf, reads=args.gguf_reads)
        layout = source.layout
    else:
        _check_bench_memory(args, mode, backend, scale)
        layout = options.generated_layout(args, scale)
        if args.source in file_source.READS:
            try:  # before anything is written
                file_source.check_space(args.file_dir, file_source.file_bytes(layout, args.placement))
            except file_source.NotEnoughSpace as exc:
                raise UsageError(
                    f"--source {args.source}: {exc}: give --file-dir on a disk with room, fewer --layers or a "
                    "larger --scale"
                ) from None
    pinned = getattr(mode, "PINNED_SOURCE", None) if args.source is None else args.source == "pinned"
    reserve = None if args.reserve_gib is None else int(args.reserve_gib * GiB)
    if backend == "host":
        print(
            "no GPU in use: running on the host backend (hit rates exact, times host-emulated, "
            f"expert sizes / {scale})",
            file=sys.stderr,
        )
    return bench.Bench(
        layout,
        backend=backend,
        pinned=pinned,
        budget_bytes=options.budget_bytes(args, layout, scale),
        reserve_bytes=reserve,
        progress=Progress(False if args.quiet else None),
        device=args.device,
        source=source,
        kind=args.source,
        file_dir=args.file_dir,
        placement=args.placement,
        layer_sync=not getattr(args, "no_layer_sync", False),
        cache_options=options.cache_options(args, scale),
        scale=scale,
    )


def _run(args, mode) -> int:
    """The mode's reports, each printed and the JSON list rewritten as it comes (an interrupted
    run keeps the reports it finished); status 1 when a served expert's bytes differed from the
    source, or a run's misses replayed on the disk were not as many as its own (disk.replay)."""
    shared = _open_bench(args, mode) if mode.USES_BENCH else None
    reports, failed = [], False
    try:
        for report in mode.run(shared, args):
            report.argv = ["expcache"] + list(args.argv)
            print(("\n" if reports else "") + format_report(report), flush=True)
            reports.append(report)
            if "json" in args.outputs:
                args.outputs["json"].write(_json_bytes([r.to_json() for r in reports]))
            if report.checksum_errors:
                print(
                    f"FAILED: {report.checksum_errors} experts served with bytes that differ from the source",
                    file=sys.stderr,
                )
                failed = True
            if (report.disk_replay or {}).get("mismatch"):
                print(f"FAILED: {report.disk_replay['skipped']}", file=sys.stderr)
                failed = True
    finally:
        if shared is not None:
            shared.close()
    return 1 if failed else 0


# -- the other commands ----------------------------------------------------------------------


def _info() -> int:
    print(f"libexpcache {library_version()}")
    print(f"auto backend here: {bench.resolve_backend()}")
    return 0


def _inspect(args) -> int:
    options.need(options.has_module("gguf"), "expcache inspect needs the gguf package", "gguf")
    if os.path.isdir(args.model):
        raise UsageError(f"{args.model}: is a directory, not a GGUF file")
    print(inspect_table(args.model))
    return 0


_COMMANDS = {"bench": _bench, "transfer": _bench, "inspect": _inspect, "info": lambda args: _info()}


def _show_warning(message, category, filename, lineno, file=None, line=None):
    # One line per warning (the library's and the traces' notices), not Python's two-line form.
    text = str(message).removeprefix("expcache: ")  # the library's warnings carry the prefix already
    print(f"expcache: warning: {text}", file=sys.stderr if file is None else file)


def show_warnings() -> None:
    """Warnings printed one line each on stderr, this command's DeprecationWarnings (a deprecated
    spelling) among them unless -W options say otherwise."""
    warnings.showwarning = _show_warning
    if not sys.warnoptions:
        warnings.filterwarnings("always", category=DeprecationWarning, module=r"expcache_bench\.")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse(argv)
    show_warnings()
    if args.command == "bench":
        logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(name)s: %(message)s")
    try:
        return _COMMANDS[args.command](args)
    except KeyboardInterrupt:
        # A progress bar may own the current line.
        print(("\n" if sys.stderr.isatty() else "") + f"{args.prog}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except UsageError as exc:
        print(f"{args.prog}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        if isinstance(exc, (ValueError, OSError, MemoryError, ImportError, ExpcacheError, NotAvailable)):
            print(f"{args.prog}: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
