"""First contact with the command line: every --help without a built library, one-line
errors for what a run needs (checked before it starts), Ctrl-C with status 130, and reports
that say what made them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pyexpcache import cli

# Children run in other folders: they find the package the way this process did.
PACKAGE_ROOT = str(Path(cli.__file__).resolve().parent.parent)

FAST = ["bench", "--backend", "host", "--traces", "smoke_count64", "--variants", "expcache,nocache", "--quiet"]


def child_env(**extra) -> dict:
    path = os.pathsep.join(p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)


def child(*args, env_extra=None, **kw) -> subprocess.CompletedProcess:
    env = child_env(**(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "pyexpcache", *args], capture_output=True, text=True, env=env,
                          timeout=300, **kw)


@pytest.mark.parametrize("command", [[], ["bench"], ["transfer"], ["inspect"], ["info"]])
def test_every_help_works_without_the_library(tmp_path, command):
    out = child(*command, "--help", env_extra={"EXPCACHE_LIBRARY": str(tmp_path / "missing.so")}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "usage: expcache" in out.stdout and not out.stderr


def test_help_texts_name_backend_device_and_transfer():
    text = cli._parser().format_help()
    sub = cli._parser()._subparsers._group_actions[0].choices
    bench_help, transfer_help = sub["bench"].format_help(), sub["transfer"].format_help()
    assert "transfer" in text
    assert "host backend" in bench_help and "CUDA device ordinal" in bench_help
    assert "cudaMemcpyAsync" in transfer_help and "CUDA device ordinal" in transfer_help


def test_info_without_the_library_is_one_error_not_a_traceback(tmp_path):
    out = child("info", env_extra={"EXPCACHE_LIBRARY": str(tmp_path / "missing.so")})
    assert out.returncode == 1
    assert "Traceback" not in out.stderr and "libexpcache not found" in out.stderr


def run_main(capsys, argv):
    started = time.monotonic()
    rc = cli.main(argv)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err, time.monotonic() - started


@pytest.mark.parametrize("argv, fragment", [
    (["--json", "{tmp}"], "is a directory"),
    (["--json", "{tmp}/no/such/folder/r.json"], "does not exist"),
    (["--plot", "{tmp}"], "is a directory"),
])
def test_bad_output_paths_fail_before_the_run(capsys, tmp_path, argv, fragment):
    argv = [a.format(tmp=tmp_path) for a in argv]
    rc, out, err, _ = run_main(capsys, FAST + argv)
    if "--plot" in argv and not cli._has_module("matplotlib"):
        fragment = "matplotlib"
    assert rc == 2
    assert fragment in err and len(err.strip().splitlines()) == 1
    assert "expcache bench —" not in out  # nothing was run


def test_plot_without_matplotlib_names_the_extra(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli, "_has_module", lambda name: name != "matplotlib")
    rc, out, err, _ = run_main(capsys, FAST + ["--plot", str(tmp_path / "x.png")])
    assert rc == 2 and "expcache[plot]" in err and not out


def test_cuda_backend_without_cuda_python_names_the_extra(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_has_cuda_python", lambda: False)
    rc, out, err, _ = run_main(capsys, ["bench", "--backend", "cuda", "--quiet"])
    assert rc == 2 and "cuda-python" in err and "expcache[cuda]" in err and len(err.strip().splitlines()) == 1
    rc, out, err, _ = run_main(capsys, ["transfer"])
    assert rc == 2 and "expcache[cuda]" in err


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "0", "lots"])
def test_budget_must_be_a_finite_positive_number(capsys, value):
    with pytest.raises(SystemExit) as exit_:
        cli.main(FAST + ["--budget-gib", value])
    assert exit_.value.code == 2
    assert "--budget-gib must be a finite number" in capsys.readouterr().err


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
    import pyexpcache

    assert report["version"] == pyexpcache.__version__
    assert report["library"].startswith("0.1.0 (") and ".so" in report["library"]
    assert report["argv"] == ["expcache"] + FAST + ["--json", str(path)]
    assert report["traces"] == ["smoke_count64"]
    assert report["device"].startswith("host")
    commit = report["git_commit"]
    assert commit is None or len(commit.split("-")[0]) == 40


def test_ctrl_c_in_the_replay_stops_it_and_raises(monkeypatch):
    # The replay runs in C; its progress callback turns Ctrl-C into a stop request and the
    # interrupt is raised again once the loop returned (before: "Exception ignored on calling
    # ctypes callback function", and the run went on).
    from pyexpcache import bench
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
            b.run_variant("expcache", workload)
    finally:
        b.close()
    assert len(calls) == 2 and calls[-1][0] < calls[-1][1]  # stopped early, at the second report


def test_ctrl_c_stops_the_command_with_130(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "pyexpcache", "bench", "--backend", "host", "--scenario", "all"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env=child_env())
    time.sleep(6)  # the first scenario's replay is running by now
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert time.monotonic() - sent < 10, "Ctrl-C was not prompt"
    assert "Exception ignored" not in err and "Traceback" not in err
    assert err.strip().splitlines()[-1] == "expcache bench: interrupted"
