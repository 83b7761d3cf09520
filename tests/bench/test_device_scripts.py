"""benchmarks/verify_step.py and benchmarks/flashlib_side_by_side.py (issue 37's GPU benchmarks)
kept runnable: their host-backend check (``--device cpu``) serves every step byte-exactly, and the
side by side says it skipped, and why, where flashlib is not installed."""

from __future__ import annotations

import importlib.util

import pytest

from support.scripts import load_benchmark_script


def test_verify_step_checks_every_step_on_the_host_backend(capsys):
    pytest.importorskip("torch", reason="the script runs its steps with torch")
    verify_step = load_benchmark_script("verify_step")
    assert verify_step.main(["--device", "cpu", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "0 bad /" in out and "bad / 0" not in out
    assert "misses in the timed selects: 0" in out


@pytest.mark.skipif(importlib.util.find_spec("flashlib") is not None, reason="flashlib is installed here")
def test_flashlib_side_by_side_skips_without_flashlib(capsys):
    pytest.importorskip("torch", reason="the script runs its steps with torch")
    side = load_benchmark_script("flashlib_side_by_side")
    assert side.main(["--device", "cpu", "--quick"]) == 0
    assert "SKIPPED:" in capsys.readouterr().out
