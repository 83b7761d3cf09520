"""`pip install .` (not editable) gives a working package: setup.py's build step runs
the Makefile and puts the shared libraries into the wheel.

One host-only wheel (NVCC= : g++ only) is built per session from a copy of the
checkout (the files `git ls-files` names: tracked plus untracked-not-ignored, as
in a fresh clone with the local edits), installed into a fresh venv that sees the
system's numpy etc., and run from a folder outside the repository.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# The wheel's build compiles the whole host library again (about 20 s of 2 cores): make test-long.
pytestmark = pytest.mark.long


def _clean_env(**extra) -> dict:
    """The environment minus whatever could point the child at the source tree's library."""
    env = {k: v for k, v in os.environ.items() if k not in ("EXPCACHE_LIBRARY", "PYTHONPATH")}
    env.update(extra)
    return env


def _run(cmd, *, timeout=600, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kwargs)
    assert proc.returncode == 0, (
        f"{' '.join(map(str, cmd))} exited {proc.returncode}\n"
        f"--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    )
    return proc


def _setuptools_builds_wheels() -> bool:
    """Whether this Python's setuptools can build our wheel without downloading anything: the
    build-system's floor (setuptools >= 77: the SPDX license, its own bdist_wheel)."""
    try:
        major = int(importlib.metadata.version("setuptools").split(".")[0])
    except Exception:  # not installed, or a version string of another form
        return False
    return major >= 77


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A host-only wheel built from a copy of the checkout."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout (the copy is what `git ls-files` names)")
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    src = tmp_path_factory.mktemp("src")
    for name in filter(None, listed):
        path = REPO / name
        if path.is_file():  # a tracked file deleted in the work tree is listed too
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / name)
    out = tmp_path_factory.mktemp("wheels")
    cmd = [sys.executable, "-m", "pip", "wheel", src, "--no-deps", "-w", out]
    # Offline where this Python's setuptools can do it; otherwise pip fetches the
    # build requirements (pyproject.toml) into an isolated build environment.
    if _setuptools_builds_wheels():
        cmd += ["--no-build-isolation", "--no-index"]
    _run(cmd, env=_clean_env(NVCC=""), cwd=src)
    (whl,) = out.glob("expcache-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv_dir(wheel, tmp_path_factory) -> Path:
    """A fresh venv (numpy etc. from the system) with the wheel installed."""
    where = tmp_path_factory.mktemp("venv")
    # No pip of its own: the system's, seen through --system-site-packages, installs into it.
    venv.create(where, system_site_packages=True, with_pip=False, symlinks=True)
    # Where this Python is itself a venv, --system-site-packages reaches only the base
    # Python's packages: a .pth adds this one's site folders too (after the venv's own,
    # and without running their .pth files, so an editable expcache there stays out).
    outer = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    (inner,) = (where / "lib").glob("python3*/site-packages")
    (inner / "_outer_site.pth").write_text("".join(f"{p}\n" for p in outer if Path(p).is_dir()))
    # --force-reinstall: the system may hold expcache already (an editable install);
    # pip leaves that one alone, as it lies outside the venv.
    _run(
        [where / "bin" / "python", "-m", "pip", "install", "--no-deps", "--no-index", "--force-reinstall", wheel],
        env=_clean_env(),
    )
    return where


def test_wheel_holds_the_libraries(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        tags = [
            line.split(":", 1)[1].strip()
            for line in z.read(next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode().splitlines()
            if line.startswith("Tag:")
        ]
    # Each library in the folder of the package that loads it: the suite's replay loop with the suite.
    assert {"pyexpcache/libexpcache_host.so", "expcache_bench/libexpcache_replay.so"} <= names, sorted(names)
    assert "pyexpcache/libexpcache.so" not in names  # NVCC= : host library only
    assert not any(n.startswith("pyexpcache/") and "replay" in n for n in names), sorted(names)
    # Both packages, the bundled traces with their attribution beside them.
    assert {"pyexpcache/__init__.py", "pyexpcache/routing/format.py", "expcache_bench/cli.py"} <= names
    bundled = "expcache_bench/data/traces/ds4-flash-reap-loop/"
    assert {bundled + "ATTRIBUTION.md", bundled + "README.md", bundled + "decode/smoke_count64.route.csv"} <= names
    assert tags and all(not t.endswith("-any") for t in tags), tags  # a platform wheel
    assert not wheel.name.endswith("-none-any.whl"), wheel.name


def test_installed_package_runs_outside_the_repository(venv_dir, tmp_path):
    env = _clean_env()
    python = venv_dir / "bin" / "python"
    _run([venv_dir / "bin" / "expcache", "--help"], env=env, cwd=tmp_path)
    out = _run(
        [python, "-c", "import pyexpcache; print(pyexpcache.__file__); print(pyexpcache.library_version())"],
        env=env,
        cwd=tmp_path,
    ).stdout.splitlines()
    package_file, version = out[-2], out[-1]
    library = Path(version[version.index("(") + 1 : version.rindex(")")])
    assert Path(package_file).resolve().is_relative_to(venv_dir.resolve()), package_file
    assert library.resolve().is_relative_to(venv_dir.resolve()), version
    assert library.name == "libexpcache_host.so", version
    replay = _run(
        [
            python,
            "-c",
            "from expcache_bench import replay; print(next(p for p in replay.candidate_paths() if p.exists()))",
        ],
        env=env,
        cwd=tmp_path,
    ).stdout.splitlines()[-1]
    assert Path(replay).resolve().parent.name == "expcache_bench", replay
    assert Path(replay).resolve().is_relative_to(venv_dir.resolve()), replay
    _run(
        [python, "-m", "expcache_bench", "bench", "--traces", "smoke_count64", "--variants", "lru,nocache", "--quiet"],
        env=env,
        cwd=tmp_path,
    )
