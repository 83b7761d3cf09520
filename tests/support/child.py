"""Code run in a child process, for the tests whose failure would be a crash: a crash there is a
failed test, not a dead suite. Used by test_lifetimes.py and test_multi.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run_child(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` (dedented) in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout
    )


_CLOSE_RACE = """\
import threading, time
import numpy as np
from pyexpcache import CacheClosedError, ExpertCache, HostSource, ModelLayout, MultiDeviceCache
lay = ModelLayout.preset("q2", scale=4096)
for attempt in range({attempts}):
    src = HostSource(lay)
    cache = {make}
    started, counts, errors = threading.Barrier(5), [0] * 4, []
    def work(i):
        rng = np.random.default_rng(i)
        started.wait()
        while True:
            try:
{calls}
            except CacheClosedError:
                return
            except BaseException as exc:
                errors.append(repr(exc))
                return
            counts[i] += 1
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    started.wait()
    time.sleep(0.2)
    cache.close()
    for t in threads:
        t.join(10)
    src.close()
    assert not errors, errors
    assert all(c > 0 for c in counts), counts
    assert not any(t.is_alive() for t in threads)
print("ok")
"""


def close_while_threads_call(make: str, calls: str, attempts: int = 1) -> subprocess.CompletedProcess:
    """In a child: ``attempts`` times, make ``cache = <make>`` over a q2 source (``src``, layout
    ``lay``), let four threads repeat ``calls`` on it (``rng`` is each thread's generator), close it
    under them after 0.2 s, and check that every thread ended on CacheClosedError alone, each having
    made calls, none left running. Prints "ok" when all held."""
    body = textwrap.indent(textwrap.dedent(calls).strip(), " " * 16)
    return run_child(_CLOSE_RACE.format(attempts=attempts, make=make, calls=body))
