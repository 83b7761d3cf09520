"""The process around a cache: fork(), interpreter exit with calls still in flight, and views
(and the arrays made from them) that outlive the cache's memory. Each failure these guard
against was a crash or a hang, so every case runs in a child interpreter with a timeout: before
the fixes, a forked child hung in its exit 5 times of 5, a daemon thread left selecting at exit
ended in SIGSEGV in 6 runs of 8, and a view read after close() faulted."""

from __future__ import annotations

import pytest

from support.cache import CUDA_OK, CUDA_REASON
from support.child import run_child

# Per backend: the source kind its misses come from, and the stale-memory reader of a view.
_SOURCES = {"host": "pinned=False", "cuda": "pinned=True"}

_FORK = """
import os, sys, time
import numpy as np
from pyexpcache import ExpertCache, ForkedError, HostSource, ModelLayout, testing
lay = ModelLayout.preset("q2", scale=4096)
for attempt in range(5):
    src = HostSource(lay, {source})
    cache = ExpertCache(lay, src, budget_experts=8, backend="{backend}", log_level=0, copy_threads=3)
    cache.select(5, [1, 2, 3])     # a pageable source: the staging ring's threads are running
    cache.prefetch(6, [4, 5])      # and the prefetch thread
    pid = os.fork()
    if pid == 0:
        code = 0
        for call in (lambda: cache.select(5, [1]), lambda: cache.stats(), lambda: src.part(5, 1, 0),
                     lambda: ExpertCache(lay, src, budget_experts=8, backend="{backend}")):
            try:
                call()
                code = 3
            except ForkedError as exc:
                if "fork" not in str(exc) or "in the child" not in str(exc):
                    code = 4
        assert cache.closed
        {child_end}
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            print("child hung"); sys.exit(1)
        time.sleep(0.01)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert (testing.read_expert(cache, 5, 2) == src.expert_bytes(5, 2)).all()   # the parent's cache still works
    cache.close(); src.close()
print("ok")
"""

_CHILD_ENDS = {
    "close_then_exit": "cache.close(); src.close(); sys.exit(code)",
    "exit_only": "sys.exit(code)",
    "new_cache_in_child": """src2 = HostSource(lay, pinned=False)
        with ExpertCache(lay, src2, budget_experts=8, backend="host", log_level=0) as fresh:
            fresh.select(5, [1, 2])
            code = code or int(not (testing.read_expert(fresh, 5, 2) == src2.expert_bytes(5, 2)).all())
        src2.close(); sys.exit(code)""",
}

_BACKENDS = ["host", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA_OK, reason=CUDA_REASON))]


@pytest.mark.parametrize("backend", _BACKENDS)
@pytest.mark.parametrize("end", sorted(_CHILD_ENDS))
def test_a_forked_child_refuses_the_parents_cache_and_exits_cleanly(backend, end):
    out = run_child(
        _FORK.format(
            backend=backend,
            source=_SOURCES[backend] if end != "new_cache_in_child" else "pinned=False",
            child_end=_CHILD_ENDS[end],
        ),
        timeout=300,
    )
    assert out.returncode == 0, f"rc {out.returncode}: {out.stdout[-500:]} {out.stderr[-2000:]}"
    assert out.stdout.strip() == "ok"


_EXIT = """
import threading, time
import numpy as np
from pyexpcache import ExpertCache, HostSource, ModelLayout
lay = ModelLayout.preset("q2", scale=4096)
src = HostSource(lay, {source})
cache = ExpertCache(lay, src, budget_experts=64, backend="{backend}", log_level=0)
ids = np.arange(6, dtype=np.uint32)
def loop(seed):
    i = seed
    while True:
        cache.select(3 + i % 40, (ids * 7 + i) % 256)
        {extra}
        i += 1
for t in range(4):
    threading.Thread(target=loop, args=(t,), daemon=True).start()
time.sleep(0.1)
print("leaving")
"""


@pytest.mark.parametrize("backend", _BACKENDS)
@pytest.mark.parametrize("extra", ["pass", "cache.select_views(3, ids[:2])", "cache.prefetch(4, ids)"])
def test_exit_with_daemon_threads_inside_calls(backend, extra):
    for run in range(8):
        out = run_child(_EXIT.format(backend=backend, source=_SOURCES[backend], extra=extra), timeout=60)
        assert out.returncode == 0, f"run {run}: rc {out.returncode}: {out.stderr[-2000:]}"
        assert out.stdout.strip() == "leaving" and out.stderr == "", out.stderr[-2000:]


_VIEWS_AFTER_CLOSE = """
import gc
import numpy as np
from pyexpcache import ExpertCache, HostSource, ModelLayout
lay = ModelLayout.preset("q2", scale=4096)
src = HostSource(lay, {source})
cache = ExpertCache(lay, src, budget_experts=8, backend="{backend}", log_level=0)
views = cache.select_views(5, [1, 2, 3])
want = [src.part(5, e, p).copy() for e in (1, 2, 3) for p in range(3)]
{export}
del views
cache.select(5, [1, 2, 3])
cache.release_all()                     # the exports keep the bank mapped: emptied, bytes untouched
print("equal", all((read(a) == w).all() for a, w in zip(arrays, want)))
cache.select(7, list(range(8)))         # may reuse those slots: the exports still read mapped memory
cache.close(); src.close()
gc.collect()
print("readable", all(read(a).size == w.size for a, w in zip(arrays, want)))
del arrays; gc.collect()
print("freed")
"""

_EXPORTS = {
    "numpy": ("import numpy\narrays = [np.asarray(p) for v in views for p in v]\nread = lambda a: a", "host"),
    "dlpack": ("arrays = [np.from_dlpack(p) for v in views for p in v]\nread = lambda a: a", "host"),
    "torch": (
        "import torch\narrays = [torch.from_dlpack(p) for v in views for p in v]\nread = lambda a: a.cpu().numpy()",
        "cuda",
    ),
    "torch_cai": (
        "import torch\narrays = [torch.as_tensor(p, device='cuda') for v in views for p in v]\n"
        "read = lambda a: a.cpu().numpy()",
        "cuda",
    ),
}


@pytest.mark.parametrize("export", sorted(_EXPORTS))
def test_arrays_from_views_outlive_release_and_close(export):
    code, backend = _EXPORTS[export]
    if backend == "cuda":
        if not CUDA_OK:
            pytest.skip(CUDA_REASON)
        pytest.importorskip("torch")
    out = run_child(_VIEWS_AFTER_CLOSE.format(backend=backend, source=_SOURCES[backend], export=code))
    assert out.returncode == 0, f"rc {out.returncode}: {out.stderr[-2000:]}"
    assert out.stdout.split() == ["equal", "True", "readable", "True", "freed"]


def test_views_kept_by_the_cache_do_not_hold_released_memory(make_cache):
    # The views the cache keeps for reuse go when it lets go of their memory, so their references
    # do not keep a released slab allocated; a view still held elsewhere keeps its own.
    import gc
    import weakref

    from pyexpcache import ModelLayout

    from support.cache import SCALE

    # One class at a time: serving the q4 layer 40 releases the q2 class inside the library.
    cache, src = make_cache(ModelLayout.preset("mixed", scale=SCALE), budget_experts=8, max_classes=1)
    pins = [weakref.ref(v.gate.owner) for v in cache.select_views(5, [1, 2, 3])]
    held = cache.select_views(6, [4])[0]
    assert all(p() is not None for p in pins)  # kept by the cache's reusable views
    cache.select_views(40, [1])
    gc.collect()
    assert all(p() is None for p in pins) and held.gate.owner is not None
    if cache.backend == "host":
        import numpy as np

        assert (np.asarray(held.gate) == src.part(6, 4, 0)).all()
