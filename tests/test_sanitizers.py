"""The C stress driver (tests/c/stress/) under AddressSanitizer + UBSan and
under ThreadSanitizer and valgrind, through the targets of tests/sanitize.mk: a long seeded random
sequence of every exported function on the host backend (tight memory, odd
part sizes, file sources, injected faults, bad input, destroyed handles),
checked call by call against the header's promises. The driver's counts are
printed, and are part of the assertion message when a run fails. Also the unit tests of the
staging ring (tests/c/ring_test.cpp) and of the prefetch thread (tests/c/prefetch_test.cpp) over a
fake link, each under ASan + UBSan and under TSan, and the memory references' test
(tests/c/memory_test.c: memory kept past release_all and destroy, a cache inherited by fork())
under ASan + UBSan, and OppClassLRU's arithmetic of a count (its class, its decay) against the
simulator's expressions (tests/c/oppclass_count_test.cpp) under ASan + UBSan."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 600  # a hang fails the test instead of stalling the suite


def make_command(target: str) -> list[str]:
    """`make target` (the Makefile includes tests/sanitize.mk)."""
    jobs = max(1, min(4, os.cpu_count() or 1))
    return ["make", "--no-print-directory", f"-j{jobs}", target]


def run_make(target: str) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    proc = subprocess.run(make_command(target), cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    return proc.returncode, proc.stdout, proc.stderr


def report(target: str, rc: int, stdout: str, stderr: str) -> str:
    """The driver's counts first, then the end of everything else (divergences, sanitizer reports)."""
    counts = [line for line in stdout.splitlines() if line.startswith("stress:")]
    build = re.compile(r"^(\S*/)?(cc|gcc|g\+\+|c\+\+|clang|clang\+\+)\s")  # compiler command lines
    rest = [
        line
        for line in (stdout + "\n" + stderr).splitlines()
        if line and not line.startswith("stress:") and not build.match(line)
    ]
    tail = "\n".join(rest[-80:])
    return (
        f"make {target} exited {rc}\n"
        + ("\n".join(counts) or "(the driver printed no counts: it crashed or a sanitizer stopped it; see below)")
        + f"\n--- output (last lines) ---\n{tail}"
    )


@functools.cache  # one probe build per flag set, not one per test
def sanitizer_unavailable(flags: str) -> str:
    """'' when the C++ compiler builds and runs a threaded program with -fsanitize=`flags`, else why not."""
    cxx = os.environ.get("CXX") or "g++"
    if not shutil.which(cxx):
        return f"no C++ compiler ({cxx})"
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "t.cpp", Path(tmp) / "t"
        src.write_text(
            "#include <thread>\n#include <vector>\nint main() { std::vector<int> v(4); "
            "std::thread t([&] { v[1] = 1; }); t.join(); return v[3]; }\n"
        )
        build = subprocess.run(
            [cxx, f"-fsanitize={flags}", "-fno-omit-frame-pointer", str(src), "-o", str(exe), "-lpthread"],
            capture_output=True,
            text=True,
        )
        if build.returncode != 0:
            return f"{cxx} cannot build with -fsanitize={flags}: {build.stderr.strip()[-300:]}"
        ran = subprocess.run([str(exe)], capture_output=True, text=True)
        if ran.returncode != 0:
            return f"a program built with -fsanitize={flags} does not run here: {ran.stderr.strip()[-300:]}"
    return ""


def require_sanitizer(flags: str) -> None:
    """Skip the calling test, with the reason, when -fsanitize=`flags` cannot build or run here."""
    reason = sanitizer_unavailable(flags)
    if reason:
        pytest.skip(reason)


# make test-long runs these (the `long` marker). Targets that build into one folder share a pytest-xdist
# group, so that two workers never build the same objects at once: ASan's, TSan's, valgrind's.
pytestmark = [pytest.mark.long, pytest.mark.skipif(shutil.which("make") is None, reason="make not found")]
ASAN_BUILD = pytest.mark.xdist_group("build/asan")
TSAN_BUILD = pytest.mark.xdist_group("build/tsan")
VALGRIND_BUILD = pytest.mark.xdist_group("build/valgrind")


def assert_stress_clean(target: str) -> None:
    """`make target` exits 0 and the driver reports no divergence; its counts are printed."""
    rc, out, err = run_make(target)
    message = report(target, rc, out, err)
    print(message)
    assert rc == 0, message
    assert re.search(r"\b0 errors found\b", out), message


@ASAN_BUILD
def test_stress_under_asan_and_ubsan():
    require_sanitizer("address,undefined")
    assert_stress_clean("asan-test")


@VALGRIND_BUILD
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind not installed (apt-get install valgrind)")
def test_stress_under_valgrind():
    assert_stress_clean("valgrind-test")


@TSAN_BUILD
def test_stress_under_tsan():
    # The staging ring's threads fill chunks while the calling thread queues and waits.
    require_sanitizer("thread")
    assert_stress_clean("tsan-test")


def assert_unit_test_clean(target: str, program: str = "ring_test") -> None:
    """`make target` builds and runs tests/c/<program>.cpp: every check passes, no sanitizer report."""
    rc, out, err = run_make(target)
    lines = (out + "\n" + err).splitlines()
    summary = [line for line in lines if line.startswith((f"{program}:", "FAILED"))]
    message = f"make {target} exited {rc}\n" + "\n".join(summary or lines[-60:])
    print(message)
    assert rc == 0, message
    assert re.search(rf"^{program}: \d+ checks, 0 failed$", out, re.M), message


@ASAN_BUILD
def test_staging_ring_unit_under_asan_and_ubsan():
    # The ring over a fake link whose transfers land only when waited for, and that refuses some.
    require_sanitizer("address,undefined")
    assert_unit_test_clean("ring-test")


@TSAN_BUILD
def test_staging_ring_unit_under_tsan():
    require_sanitizer("thread")
    assert_unit_test_clean("ring-tsan-test")


@ASAN_BUILD
def test_prefetch_thread_unit_under_asan_and_ubsan():
    # At most one piece in flight, exact progress of cancelled jobs, bounce memory never refilled
    # under a transfer, refused transfers, pause, drain and destruction with transfers in flight.
    require_sanitizer("address,undefined")
    assert_unit_test_clean("prefetch-test", "prefetch_test")


@TSAN_BUILD
def test_prefetch_thread_unit_under_tsan():
    # The calling thread's first sends and cancels against the prefetch thread.
    require_sanitizer("thread")
    assert_unit_test_clean("prefetch-tsan-test", "prefetch_test")


@ASAN_BUILD
def test_memory_kept_past_the_cache_under_asan_and_ubsan():
    # Kept memory read after release_all and destroy (a use-after-free report if it was freed),
    # freed by its last reference (a leak report if not), and a cache inherited by fork().
    require_sanitizer("address,undefined")
    assert_unit_test_clean("memory-test", "memory_test")


@ASAN_BUILD
def test_oppclass_count_arithmetic_unit_under_asan_and_ubsan():
    # The library's class of a count (found by comparisons) and decay (whole tokens from a table)
    # equal the simulator's logarithm and power, double for double: else the two part ways.
    require_sanitizer("address,undefined")
    assert_unit_test_clean("oppclass-test", "oppclass_count_test")
