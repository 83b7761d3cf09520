"""The command line (expcache_bench/cli.py). First contact: every --help without a built library,
one-line errors for what a run needs (checked before it starts), Ctrl-C with status 130, and
reports that say what made them. Then `expcache bench` end to end on the host backend (every
scenario, --plot) and its refused arguments, and `expcache transfer`'s arguments and printing
(the benchmarks themselves: tests/bench/)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import pyexpcache
from expcache_bench import cli, options

# Children run in other folders: they find the package the way this process did.
PACKAGE_ROOT = str(Path(cli.__file__).resolve().parent.parent)

FAST = ["bench", "--backend", "host", "--traces", "smoke_count64", "--variants", "lru,nocache", "--quiet"]


def child_env(**extra) -> dict:
    path = os.pathsep.join(p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)


def child(*args, env_extra=None, **kw) -> subprocess.CompletedProcess:
    env = child_env(**(env_extra or {}))
    return subprocess.run(
        [sys.executable, "-m", "expcache_bench", *args], capture_output=True, text=True, env=env, timeout=300, **kw
    )


@pytest.mark.parametrize(
    "command",
    [[], ["bench"], ["transfer"], ["inspect"], ["info"]]
    + [["bench", m] for m in ("variants", "engine", "torch", "devices", "curve", "transfer")],
)
def test_every_help_works_without_the_library(tmp_path, command):
    out = child(*command, "--help", env_extra={"EXPCACHE_LIBRARY": str(tmp_path / "missing.so")}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "usage: expcache" in out.stdout and not out.stderr


def test_help_texts_name_backend_device_and_transfer():
    text = cli._parser().format_help()
    sub = cli._parser()._subparsers._group_actions[0].choices
    bench_help, transfer_help = sub["bench"].format_help(), sub["transfer"].format_help()
    assert "{bench,inspect,info}" in text and "transfer" in bench_help  # one spelling: expcache bench transfer
    assert "host backend" in bench_help and "CUDA device ordinal" in bench_help
    assert "cudaMemcpyAsync" in transfer_help and "CUDA device ordinal" in transfer_help


def test_help_texts_have_no_markup():
    # Help is read in a terminal: no reStructuredText (``literal``, :role:`x`) or Markdown backticks.
    parser = cli._parser()
    sub = parser._subparsers._group_actions[0].choices
    for name, text in [("expcache", parser.format_help())] + [(n, p.format_help()) for n, p in sub.items()]:
        assert "`" not in text, f"{name} --help: {[line for line in text.splitlines() if '`' in line]}"


@pytest.mark.parametrize(
    "argv, old, new",
    [
        (["bench", "--loop", "torch", "--traces", "no-such-trace"], "--loop torch", "'expcache bench torch'"),
        (["bench", "--loop", "graph", "--traces", "no-such-trace"], "--loop graph", "'expcache bench graph'"),
        (["bench", "--devices", "1", "--backend", "host"], "--devices", "'expcache bench devices'"),
        (["bench", "--prefetch", "cooc", "--traces", "no-such-trace"], "--prefetch", "'expcache bench engine'"),
        (["bench", "--split", "--traces", "no-such-trace"], "--split", "'expcache bench engine'"),
        (["transfer", "--gib", "0.001", "--sizes", "0.5"], "'expcache transfer'", "'expcache bench transfer'"),
    ],
    ids=["loop-torch", "loop-graph", "devices", "prefetch", "split", "transfer"],
)
def test_a_mode_chosen_the_old_way_still_runs_and_names_the_new_spelling(argv, old, new):
    """The flag spelling of a mode (and `expcache transfer`) is deprecated for one release: the
    run goes on (to the error of its arguments, which comes after the choice, or on a GPU through
    transfer's small run), and one line on stderr names the mode's spelling."""
    out = child(*argv)
    (line,) = [x for x in out.stderr.splitlines() if "deprecated" in x]
    assert line.startswith("expcache: warning: ") and old in line and new in line, out.stderr
    assert "Traceback" not in out.stderr
    # The run went on after the warning: to its arguments' error, or (transfer on a GPU) to its table.
    assert len(out.stderr.splitlines()) >= 2 or (out.returncode == 0 and out.stdout.strip()), out


def test_a_named_mode_and_the_default_are_not_deprecated():
    for argv in (["bench", "devices", "--devices", "1", "--backend", "host"], ["bench", "--variants", "nope"]):
        out = child(*argv)
        assert out.returncode == 2 and "deprecated" not in out.stderr, out.stderr


def test_python_m_pyexpcache_forwards_with_a_deprecation_warning():
    out = subprocess.run(
        [sys.executable, "-m", "pyexpcache", "bench", "--help"],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=300,
    )
    assert out.returncode == 0 and "usage: expcache bench" in out.stdout, out.stderr
    assert out.stderr.strip().startswith("expcache: warning: 'python3 -m pyexpcache' is deprecated"), out.stderr
    assert "'expcache'" in out.stderr and "'python3 -m expcache_bench'" in out.stderr


def test_info_without_the_library_is_one_error_not_a_traceback(tmp_path):
    out = child("info", env_extra={"EXPCACHE_LIBRARY": str(tmp_path / "missing.so")})
    assert out.returncode == 1
    assert "Traceback" not in out.stderr and "libexpcache not found" in out.stderr


def test_variants_are_checked_against_the_library_when_parsed(tmp_path):
    """--variants names the library's policies, read when the option is parsed (never for --help):
    without the library that is one usage error, not a traceback."""
    out = child("bench", "--variants", "lru", env_extra={"EXPCACHE_LIBRARY": str(tmp_path / "missing.so")})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "argument --variants: libexpcache not found" in out.stderr
    out = child("bench", "--variants", "lru,belady")
    assert out.returncode == 2
    from expcache_bench import variants

    assert f"expected a comma list of default, {', '.join(variants())}; got 'lru,belady'" in out.stderr


def test_variants_default_names_the_librarys_default_policy():
    from expcache_bench.modes.variants import resolve_variants
    from pyexpcache import _lib

    assert resolve_variants(["default", "lru", _lib.DEFAULT_POLICY]) == [_lib.DEFAULT_POLICY, "lru"]


def run_main(capsys, argv):
    started = time.monotonic()
    rc = cli.main(argv)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err, time.monotonic() - started


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--json", "{tmp}"], "is a directory"),
        (["--json", "{tmp}/no/such/folder/r.json"], "does not exist"),
        (["--plot", "{tmp}"], "is a directory"),
    ],
)
def test_bad_output_paths_fail_before_the_run(capsys, tmp_path, argv, fragment):
    argv = [a.format(tmp=tmp_path) for a in argv]
    rc, out, err, _ = run_main(capsys, FAST + argv)
    if "--plot" in argv and not options.has_module("matplotlib"):
        fragment = "matplotlib"
    assert rc == 2
    assert fragment in err and len(err.strip().splitlines()) == 1
    assert "expcache bench —" not in out  # nothing was run


def test_an_output_file_that_cannot_be_created_fails_before_the_run(monkeypatch, capsys):
    # /proc takes no new file, not even from root, whom a check of permissions lets through:
    # before, the whole benchmark ran, then "[Errno 2]", status 1 and the results lost.
    from expcache_bench import bench  # the module the command line makes its Bench with

    if not os.path.isdir("/proc/self"):
        pytest.skip("needs Linux's /proc")
    monkeypatch.setattr(bench, "Bench", lambda *a, **kw: pytest.fail("the run started"))
    rc, out, err, _ = run_main(capsys, FAST + ["--json", "/proc/x.json"])
    assert rc == 2 and not out and len(err.strip().splitlines()) == 1
    assert err.startswith("expcache bench: --json /proc/x.json: cannot write it (")


def interrupt_scenario(monkeypatch, number: int) -> None:
    """The variants table's run of a scenario raises KeyboardInterrupt from its ``number``-th call on
    (1: every call)."""
    from expcache_bench.modes import variants

    real, calls = variants.run_scenario, []

    def run(*args, **kwargs):
        calls.append(1)
        if len(calls) >= number:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(variants, "run_scenario", run)


def test_an_interrupted_run_keeps_the_scenarios_it_finished(monkeypatch, capsys, tmp_path):
    path = tmp_path / "r.json"
    interrupt_scenario(monkeypatch, 2)
    rc, out, err, _ = run_main(capsys, FAST + ["--scenario", "decode,prefill", "--json", str(path)])
    assert rc == 130
    assert [r["scenario"] for r in json.loads(path.read_text())] == ["decode"]


def test_a_run_that_wrote_nothing_leaves_no_file_and_an_old_file_unchanged(monkeypatch, capsys, tmp_path):
    new, old = tmp_path / "new.json", tmp_path / "old.json"
    old.write_text("x" * 100_000)  # the results of an earlier run, longer than this run's
    interrupt_scenario(monkeypatch, 1)
    for path in (new, old):
        assert run_main(capsys, FAST + ["--json", str(path)])[0] == 130
    assert not new.exists() and old.read_text() == "x" * 100_000
    monkeypatch.undo()
    assert run_main(capsys, FAST + ["--json", str(old)])[0] == 0
    assert [r["scenario"] for r in json.loads(old.read_text())] == ["decode"]  # replaced, not overwritten in part


def test_a_plot_format_matplotlib_cannot_write_fails_before_the_run(monkeypatch, capsys, tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib, an optional dependency")
    from expcache_bench import bench  # the module the command line makes its Bench with

    monkeypatch.setattr(bench, "Bench", lambda *a, **kw: pytest.fail("the run started"))
    rc, out, err, _ = run_main(capsys, FAST + ["--plot", str(tmp_path / "curve.pnx")])
    assert rc == 2 and "matplotlib writes no .pnx files; name a .png, .svg or .pdf file" in err
    assert not (tmp_path / "curve.pnx").exists()


def test_plot_without_matplotlib_names_the_extra(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(options, "has_module", lambda name: name != "matplotlib")
    rc, out, err, _ = run_main(capsys, FAST + ["--plot", str(tmp_path / "x.png")])
    assert rc == 2 and "expcache[plot]" in err and not out


def test_cuda_backend_without_cuda_python_names_the_extra(monkeypatch, capsys):
    monkeypatch.setattr(options, "has_cuda_python", lambda: False)
    rc, out, err, _ = run_main(capsys, ["bench", "--backend", "cuda", "--quiet"])
    assert rc == 2 and "cuda-python" in err and "expcache[cuda]" in err and len(err.strip().splitlines()) == 1
    rc, out, err, _ = run_main(capsys, ["bench", "transfer"])
    assert rc == 2 and "expcache[cuda]" in err


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "0", "lots"])
def test_budget_must_be_a_finite_positive_number(capsys, value):
    with pytest.raises(SystemExit) as exit_:
        cli.main(FAST + ["--budget-gib", value])
    assert exit_.value.code == 2
    assert "--budget-gib must be a finite number" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--layers", "abc"], "argument --layers: expected layer numbers like 3-42 or 5,7,9, got 'abc'"),
        (["--layers", "-3"], "argument --layers: expected layer numbers like 3-42 or 5,7,9, got '-3'"),
        (["--layers", "9-5"], "argument --layers: expected layer numbers like 3-42 or 5,7,9, got '9-5'"),
        (["--scale", "0"], "argument --scale: expected a whole number >= 1, got '0'"),
        (["--copy-threads", "-1"], "argument --copy-threads: expected a whole number >= 0, got '-1'"),
        (["--device", "-1"], "argument --device: expected a whole number >= 0, got '-1'"),
    ],
)
def test_unparsable_options_name_the_option_and_the_form(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        cli.main(FAST + argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"expcache bench: error: {message}"


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--scale", "5"],
            "--scale 5: layer 0: part sizes (2162688, 2162688, 2752512) are not divisible by 5; "
            "use a power of two up to 65536, e.g. 256",
        ),
        (["--copy-threads", "100"], "--copy-threads: copy_threads must be 0..64, got 100"),
        (
            ["--staging-chunk", "1K"],
            "--staging-chunk: staging_chunk_bytes must be a multiple of 4096 in 64 KiB..64 MiB, got 1024",
        ),
        (
            ["--prefetch", "cooc", "--prefetch-piece", "1K"],
            "--prefetch-piece: prefetch_piece_bytes must be a multiple of 4096 in 4 KiB..64 MiB, got 1024",
        ),
    ],
)
def test_option_values_the_run_cannot_take_fail_before_it(monkeypatch, capsys, argv, message):
    # Before: a library or layout error once the source was filled, naming no option.
    from expcache_bench import bench  # the module the command line makes its Bench with

    monkeypatch.setattr(bench, "Bench", lambda *a, **kw: pytest.fail("the run started"))
    rc, out, err, _ = run_main(capsys, FAST + argv)
    assert rc == 2 and err.strip() == f"expcache bench: {message}" and not out


def test_scale_the_host_cannot_hold_names_one_that_fits(monkeypatch, capsys):
    # Before: numpy's "Unable to allocate 27.6 GiB" (--scale 3 on a 22 GiB host), or the OOM killer.
    from expcache_bench import bench  # the module the command line makes its Bench with

    monkeypatch.setattr(options, "host_memory_available", lambda: 1 << 30)
    monkeypatch.setattr(bench, "Bench", lambda *a, **kw: pytest.fail("the run started"))
    rc, out, err, _ = run_main(capsys, FAST + ["--scale", "16"])
    # At /16 the mixed experts are 5.2 GiB; at /128, 0.65 GiB and a 0.09 GiB budget fit in 1 GiB.
    assert rc == 2 and not out
    assert err.strip() == (
        "expcache bench: --scale 16: the generated experts and the host backend's emulated device "
        "memory need 5.9 GiB of host memory and 1.0 GiB is available; use --scale 128 or more"
    )


@pytest.mark.parametrize(
    "layers, message",
    [
        (
            "0-2",
            "--layers 0-2: the traces have none of these layers; they have layers 3-42 (layers 0-2 of DeepSeek V4 "
            "Flash are hash-routed: no trace has them)",
        ),
        (
            "0,1",
            "--layers 0-1: the traces have none of these layers; they have layers 3-42 (layers 0-2 of DeepSeek V4 "
            "Flash are hash-routed: no trace has them)",
        ),
        ("45,50-52", "--layers: 45,50-52 not in 0..42, the model's layers"),
    ],
)
def test_layers_no_trace_has_fail_before_the_run(monkeypatch, capsys, layers, message):
    # Before, 0-2: a traceback once every variant had run ("library hit rate 0.0 differs from the
    # simulator's nan ... a bug").
    from expcache_bench import bench  # the module the command line makes its Bench with

    monkeypatch.setattr(bench, "Bench", lambda *a, **kw: pytest.fail("the run started"))
    rc, out, err, _ = run_main(capsys, FAST + ["--layers", layers])
    assert rc == 2 and err.strip() == f"expcache bench: {message}" and not out


def test_scale_with_gguf_is_refused(capsys, tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    rc, out, err, _ = run_main(capsys, FAST + ["--gguf", str(model), "--scale", "4"])
    assert rc == 2 and "--scale cannot be combined with --gguf" in err


def test_transfer_options_fail_before_the_run(monkeypatch, capsys):
    from expcache_bench.modes import transfer

    monkeypatch.setattr(options, "has_cuda_python", lambda: True)
    monkeypatch.setattr(transfer, "measure", lambda **kw: pytest.fail("the run started"))
    rc, out, err, _ = run_main(capsys, ["bench", "transfer", "--copy-threads", "2,100"])
    assert rc == 2 and err.strip() == "expcache bench transfer: --copy-threads: copy_threads must be 0..64, got 100"
    rc, out, err, _ = run_main(capsys, ["bench", "transfer", "--chunks", "1K"])
    assert rc == 2 and "--chunks: staging_chunk_bytes must be a multiple of 4096" in err
    monkeypatch.setattr(options, "host_memory_available", lambda: 8 << 30)
    rc, out, err, _ = run_main(capsys, ["bench", "transfer", "--gib", "100"])
    assert rc == 2 and err.strip() == (
        "expcache bench transfer: --gib 100: a measurement holds 200.0 GiB of host memory "
        "and 8.0 GiB is available; lower --gib"
    )
    with pytest.raises(SystemExit):
        cli.main(["bench", "transfer", "--copy-threads", "x"])
    assert (
        "argument --copy-threads: expected a comma list of thread counts such as 1,4,8, got 'x'"
        in capsys.readouterr().err
    )


def test_inspect_a_directory_is_one_line(capsys, tmp_path):
    pytest.importorskip("gguf")
    folder = tmp_path / "some_dir.gguf"
    folder.mkdir()
    rc, out, err, _ = run_main(capsys, ["inspect", str(folder)])
    assert rc == 2 and "is a directory" in err and len(err.strip().splitlines()) == 1


def test_unreadable_trace_fails_before_the_run(capsys, tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_bytes(os.urandom(4096))
    rc, out, err, _ = run_main(capsys, FAST + ["--traces", str(bad)])
    assert rc == 1 and str(bad) in err and len(err.strip().splitlines()) == 1
    assert "expcache bench —" not in out


def test_json_report_records_what_made_it(capsys, tmp_path):
    path = tmp_path / "r.json"
    rc, out, err, _ = run_main(capsys, FAST + ["--json", str(path)])
    assert rc == 0, err
    (report,) = json.loads(path.read_text())

    assert report["version"] == pyexpcache.__version__
    assert report["library"].startswith(pyexpcache.__version__ + " (") and ".so" in report["library"]
    assert report["argv"] == ["expcache"] + FAST + ["--json", str(path)]
    assert report["traces"] == ["smoke_count64"]
    assert report["device"].startswith("host")
    commit = report["git_commit"]
    assert commit is None or len(commit.split("-")[0]) == 40


def test_ctrl_c_in_the_replay_stops_it_and_raises(monkeypatch):
    # The replay runs in C; its progress callback turns Ctrl-C into a stop request and the
    # interrupt is raised again once the loop returned (before: "Exception ignored on calling
    # ctypes callback function", and the run went on).
    import expcache_bench as bench
    from expcache_bench.modes.variants import run_variant
    from pyexpcache.layout import ModelLayout

    layout = ModelLayout.preset("q2", scale=4096)
    b = bench.Bench(layout, backend="host", budget_bytes=64 << 20)
    calls = []

    def progress(label, done, total):
        calls.append((done, total))
        if len(calls) == 2:
            raise KeyboardInterrupt

    b.progress = progress
    workload = bench.build_workload("decode", ["podA_a_coffee_full"], layout.moe_layers)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_variant(b, "lru", workload)
    finally:
        b.close()
    assert len(calls) == 2 and calls[-1][0] < calls[-1][1]  # stopped early, at the second report


# Runs `python ARGS` with SIGINT as a shell gives it (delivered: not blocked, not ignored), whatever
# this process hands down: a child inherits the signal mask and an ignored SIGINT. In CI, under
# pytest-xdist, a worker once handed down one or the other (the command ran to the end and exited 0;
# blocking SIGINT in the parent reproduces that exactly; which it was, a single-process run of the
# suite watching the mask after every test did not find).
AS_FROM_A_SHELL = (
    "import os, signal, sys; "
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
    "signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


def test_ctrl_c_stops_the_command_with_130(tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            AS_FROM_A_SHELL,
            "-m",
            "expcache_bench",
            "bench",
            "--backend",
            "host",
            "--scenario",
            "all",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=child_env(),
    )
    time.sleep(6)  # the first scenario's replay is running by now
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert time.monotonic() - sent < 10, "Ctrl-C was not prompt"
    assert "Exception ignored" not in err and "Traceback" not in err
    assert err.strip().splitlines()[-1] == "expcache bench: interrupted"


# ---------------------------------------------------------------------------
# expcache bench and expcache transfer, end to end and their arguments


def test_cli_bench_host_end_to_end(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pyexpcache",
            "bench",
            "--backend",
            "host",
            "--traces",
            "podA_b_json_full",
            "--layers",
            "3-12",
            "--scenario",
            "all",
            "--json",
            str(out),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("expcache bench") == 3
    data = json.loads(out.read_text())
    assert [d["scenario"] for d in data] == ["decode", "prefill", "turns"]
    assert all(r["checksum_errors"] == 0 for d in data for r in d["results"])


def test_cli_rejects_bad_arguments():
    proc = subprocess.run(
        [sys.executable, "-m", "expcache_bench", "bench", "--variants", "nope"],
        capture_output=True,
        text=True,
        env=child_env(),
    )
    assert proc.returncode == 2 and "expected a comma list" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "expcache_bench", "bench", "--layers", "40-50", "--backend", "host"],
        capture_output=True,
        text=True,
        env=child_env(),
    )
    assert proc.returncode != 0 and "not in 0..42" in proc.stderr


def test_cli_plot_hit_rate_curve(tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib, an optional dependency")
    png = tmp_path / "curve.png"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pyexpcache",
            "bench",
            "--backend",
            "host",
            "--traces",
            "podA_b_json_full",
            "--variants",
            "lru",
            "--layers",
            "3-8",
            "--plot",
            str(png),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_transfer_size_lists_parse():
    import argparse

    from expcache_bench.options import sizes as _sizes

    assert _sizes("256K,1M,2MiB,4096") == [256 << 10, 1 << 20, 2 << 20, 4096]
    for bad in ("", "x", "1M,,2M", "1Q"):
        with pytest.raises(argparse.ArgumentTypeError):
            _sizes(bad)


def test_transfer_cli_sizes_are_the_benchmarks():
    from expcache_bench import cli
    from expcache_bench.modes import transfer

    parser = cli._mode_parser(transfer)  # expcache bench transfer
    assert {f"{s} MiB" for s in parser.parse_args([]).sizes} == set(transfer.SIZES)
    assert parser.parse_args(["--sizes", "0.5,13.5"]).sizes == ["0.5", "13.5"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--sizes", "0.7"])


def test_transfer_cli_detail_prints_the_host_copy_rate(monkeypatch, capsys):
    # The CLI's printing, without a GPU: the table's rows stand in for a run's.
    from expcache_bench import cli
    from expcache_bench.modes import transfer

    rows = [
        transfer.TransferRow("pinned", 0, 0, "0.5 MiB", "tensor", 50.0, 42.0, 42.0, 1 << 20),
        transfer.TransferRow("pageable", 4, 1 << 20, "0.5 MiB", "expert", 21.0, 14.0, 42.0, 1 << 20),
    ]
    asked = {}
    monkeypatch.setattr(options, "has_cuda_python", lambda: True)
    monkeypatch.setattr(transfer, "resolve_backend", lambda *a: "cuda")
    monkeypatch.setattr(transfer, "device_name", lambda *a: "a GPU")
    monkeypatch.setattr(transfer, "measure", lambda **kw: asked.update(kw) or rows)
    real = transfer.host_copy_rates
    monkeypatch.setattr(
        transfer, "host_copy_rates", lambda counts: real(counts, piece=64 << 10, buffer_bytes=8 << 20, total=8 << 20)
    )
    assert cli.main(["bench", "transfer", "--sizes", "0.5", "--sources", "pinned,pageable", "--detail"]) == 0
    out = capsys.readouterr().out
    assert asked["sizes"] == ["0.5 MiB"] and asked["sources"] == ["pinned", "pageable"]
    assert "119 %" in out and "50 %" in out
    assert re.search(r"host copy, 512 KiB pieces .*: 1 thread [0-9.]+, 4 threads [0-9.]+$", out.strip())


# -- --layout: presets, layout files, Hugging Face configs, GGUF files --------------------------------

from support import hf_configs  # noqa: E402

EXAMPLE_LAYOUT = Path(PACKAGE_ROOT) / "examples" / "layouts" / "mixtral-8x7b-q4k.json"


def test_layout_help_lists_every_preset_and_form():
    from pyexpcache.layout import PRESETS

    text = options.LAYOUT.kwargs["help"]
    assert all(name in text for name in PRESETS)
    assert all(form in text for form in ("layout file", "Hugging Face config.json", "GGUF file", "CONFIG.json:TYPE"))
    assert "--layout NAME|FILE" in cli._parser()._subparsers._group_actions[0].choices["bench"].format_help()


def test_layout_kind_decides_what_a_file_is(tmp_path):
    hf = hf_configs.write(tmp_path, "Mixtral-8x7B-v0.1")
    (tmp_path / "model.gguf").write_bytes(b"")
    (tmp_path / "no-suffix").write_bytes(b"GGUF" + bytes(20))
    assert options.layout_kind("mixtral-8x7b-q4k") == ("preset", "mixtral-8x7b-q4k", None)
    assert options.layout_kind(str(EXAMPLE_LAYOUT)) == ("file", str(EXAMPLE_LAYOUT), None)
    assert options.layout_kind(str(hf)) == ("hf", str(hf), None)
    assert options.layout_kind(f"{hf}:Q4_K") == ("hf", str(hf), "Q4_K")
    assert options.layout_kind(str(hf.parent)) == ("hf", str(hf), None)
    assert options.layout_kind(str(tmp_path / "model.gguf"))[0] == "gguf"
    assert options.layout_kind(str(tmp_path / "no-suffix"))[0] == "gguf"


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: "mixtral", "mixtral: not a preset or a file; --layout takes a preset name, a layout file"),
        (lambda d: f"{d}/missing.json", "missing.json: no such file; --layout takes"),
        (lambda d: str(d), "a folder without a config.json"),
        (lambda d: _write(d / "notes.txt", "hello"), "notes.txt: neither JSON nor a GGUF file; --layout takes"),
        (
            lambda d: _write(d / "x.json", '{"a": 1}'),
            'x.json: JSON without a "layers" list, "model_type" or "architectures"; --layout takes',
        ),
        (
            lambda d: _write(d / "l.json", EXAMPLE_LAYOUT.read_text()) + ":Q4_K",
            "l.json:Q4_K: a :TYPE suffix applies to a Hugging Face config.json only",
        ),
    ],
)
def test_a_layout_that_names_nothing_usable_lists_the_forms(capsys, tmp_path, make, message):
    with pytest.raises(SystemExit) as exit_:
        cli.main(FAST + ["--layout", make(tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("expcache bench: error: argument --layout: ") and message in err, err


def _write(path, text) -> str:
    path.write_text(text)
    return str(path)


def _trace_of(tmp_path, layers) -> str:
    """A generic-format trace of two tokens routing experts 0 and 1 in each of ``layers``: one
    that fits any layout whose MoE layers include them (the bundled traces are DeepSeek V4 Flash's)."""
    from expcache_bench.traces import write_trace
    from pyexpcache.routing import Trace

    layers = list(layers)
    path = tmp_path / f"routing-{layers[0]}-{layers[-1]}.jsonl"
    ids = np.tile(np.array([0, 1], dtype=np.int32), (2, len(layers), 1))
    write_trace(
        path, Trace("fits", ids=ids, weights=None, first_layer=layers[0], positions=np.arange(2), num_experts=2)
    )
    return str(path)


def _layout_given_to_the_bench(monkeypatch, capsys, argv, trace=None):
    """The layout and scale the run would have started with (the run itself stopped)."""
    from expcache_bench import bench  # the module the command line makes its Bench with

    if trace is not None:
        argv = argv + ["--traces", trace]

    seen = []

    def stop(layout, **kw):
        seen.append((layout, kw["scale"]))
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "Bench", stop)
    rc, out, err, _ = run_main(capsys, FAST + argv)
    assert rc == 130 and len(seen) == 1, err
    return seen[0]


def test_each_layout_form_reaches_the_bench(monkeypatch, capsys, tmp_path):
    from pyexpcache import ModelLayout

    mixtral = ModelLayout.preset("mixtral-8x7b-q4k")
    routing = _trace_of(tmp_path, range(32))
    layout, scale = _layout_given_to_the_bench(monkeypatch, capsys, ["--layout", "mixtral-8x7b-q4k"], routing)
    assert scale == 256 and layout == mixtral.scaled(256)
    layout, _ = _layout_given_to_the_bench(
        monkeypatch, capsys, ["--layout", str(EXAMPLE_LAYOUT), "--scale", "16"], routing
    )
    assert layout == mixtral.scaled(16)
    hf = hf_configs.write(tmp_path, "Mixtral-8x7B-v0.1")
    layout, _ = _layout_given_to_the_bench(monkeypatch, capsys, ["--layout", f"{hf}:Q4_K", "--scale", "16"], routing)
    assert layout.layers == mixtral.scaled(16).layers and layout.name == "Mixtral-8x7B-v0.1-q4_k/16"
    layout, _ = _layout_given_to_the_bench(monkeypatch, capsys, ["--layout", str(hf.parent), "--scale", "16"], routing)
    assert layout == ModelLayout.from_hf_config(hf).scaled(16)
    layout, _ = _layout_given_to_the_bench(
        monkeypatch,
        capsys,
        ["--layout", "deepseek-v3-q4k", "--layers", "3-5", "--scale", "16"],
        _trace_of(tmp_path, range(3, 6)),
    )
    assert layout.moe_layers == [3, 4, 5] and layout[3] == ModelLayout.preset("deepseek-v3-q4k", scale=16)[3]


def test_a_gguf_files_layout(monkeypatch, capsys, tmp_path):
    pytest.importorskip("gguf")
    from pyexpcache.gguf import layout_from_gguf

    from support.gguf_files import write_model

    model = write_model(tmp_path / "tiny.gguf", [None, {}, {}])
    layout, _ = _layout_given_to_the_bench(
        monkeypatch, capsys, ["--layout", str(model), "--scale", "1"], _trace_of(tmp_path, range(1, 3))
    )
    assert layout == layout_from_gguf(model)


@pytest.mark.parametrize(
    "contents, message",
    [
        (
            {"layers": [{"experts": 0, "gate_bytes": 1, "up_bytes": 1, "down_bytes": 1}]},
            "layers[0].experts: must be 1..65536 (the library's limit), got 0",
        ),
        (
            {"type": "Q4_K", "layers": [{"experts": 8, "gate": {"shape": [8, 100]}, "up_bytes": 1, "down_bytes": 1}]},
            "layers[0].gate: a row of 100 weights is not a multiple of the Q4_K block of 256 weights "
            "(in a [rows, cols] matrix, cols is the row length)",
        ),
    ],
)
def test_a_bad_layout_file_is_one_line_before_the_run(monkeypatch, capsys, tmp_path, contents, message):
    from expcache_bench import bench  # the module the command line makes its Bench with

    monkeypatch.setattr(bench, "Bench", lambda *a, **kw: pytest.fail("the run started"))
    path = _write(tmp_path / "bad.json", json.dumps(contents))
    rc, out, err, _ = run_main(capsys, FAST + ["--layout", path])
    assert rc == 2 and err.strip() == f"expcache bench: --layout {path}: {message}" and not out


def test_a_hugging_face_config_without_a_key_is_one_line(monkeypatch, capsys, tmp_path):
    from expcache_bench import bench  # the module the command line makes its Bench with

    monkeypatch.setattr(bench, "Bench", lambda *a, **kw: pytest.fail("the run started"))
    config = {k: v for k, v in hf_configs.CONFIGS["gpt-oss-20b"].items() if k != "intermediate_size"}
    path = hf_configs.write(tmp_path, "gpt-oss-20b", config)
    rc, out, err, _ = run_main(capsys, FAST + ["--layout", str(path)])
    assert rc == 2 and err.strip() == (
        f"expcache bench: --layout {path}: no 'moe_intermediate_size' or 'intermediate_size' key (an expert's FFN "
        "width) in this gpt_oss config; a layout file describes any model (docs/models.md)"
    )


def test_layout_with_gguf_is_refused(capsys, tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    rc, out, err, _ = run_main(capsys, FAST + ["--gguf", str(model), "--layout", "q2"])
    assert rc == 2 and "--layout cannot be combined with --gguf: the GGUF file gives the layout" in err


def test_a_scale_that_does_not_divide_a_presets_parts_names_one_that_does(monkeypatch, capsys, tmp_path):
    from expcache_bench import bench  # the module the command line makes its Bench with

    monkeypatch.setattr(bench, "Bench", lambda *a, **kw: pytest.fail("the run started"))
    rc, out, err, _ = run_main(
        capsys, FAST + ["--layout", "gpt-oss-20b-mxfp4", "--traces", _trace_of(tmp_path, range(24))]
    )
    assert rc == 2 and err.strip() == (
        "expcache bench: --scale 256 (the default on the host backend): layer 0: part sizes (4406400, 4406400, "
        "4406400) are not divisible by 256; use a power of two up to 128"
    )


@pytest.mark.parametrize("quiet", [[], ["--quiet"]])
def test_a_cap_zero_class_is_one_line_per_class(quiet):
    # The warning went out through warnings and the logger both, each line prefixed twice.
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pyexpcache",
            "bench",
            "--backend",
            "host",
            "--reserve-gib",
            "70",
            "--traces",
            "synthetic:8",
            *quiet,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if "cap 0" in line]
    assert len(lines) == 2, out.stderr  # the mixed layout's two classes
    assert all(line.startswith("expcache: warning: class ") for line in lines), lines
