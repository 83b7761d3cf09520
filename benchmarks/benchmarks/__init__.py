"""expcache's asv benchmarks (benchmark_dir of benchmarks/asv.conf.json).

``bench_*.py``  asv suites (benchmark history; see benchmarks/README.md). asv imports every
module of this package, so nothing here may import pytest; the pytest-benchmark micro
benchmarks (``benchmarks/test_micro.py``), the C programs (``benchmarks/c/``) and the scripts
(``benchmarks/*.py``) live beside it, outside the package.

This package also holds what the suites share (test_micro.py imports it too): which
backend runs, the layouts and traces each backend uses, and :class:`Rig`, the small cache
set-up the hot-path benchmarks time. Nothing here touches CUDA at import time: asv forks
benchmark processes from the process that imported this package, and a CUDA
context does not survive a fork.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: benchmarks/benchmarks/__init__.py

# In the environments asv builds per commit (virtualenv; asv sets ASV_ENV_TYPE there)
# the commit's installed pyexpcache must run, so nothing is added. Everywhere else
# (`asv run --python=same`, where ASV_ENV_TYPE is "existing", and pytest) the checkout this
# folder belongs to runs: its pyexpcache, which loads the libraries `make lib` put in its build/.
if os.environ.get("ASV_ENV_TYPE", "existing") == "existing" and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GiB = 1 << 30

#: The two layouts every suite runs: uniform 2-bit and the mixed q2-q4 model.
LAYOUTS = ["q2", "mixed"]

#: Values of every asv suite's ``backend`` parameter. Both are always declared (asv keeps one
#: parameter list per benchmark for all machines, so results of a GPU machine and a host can
#: only be published together this way); the one that does not run here is skipped.
BACKENDS = ["host", "cuda"]

#: Expert cache budget of the replay benchmarks (GiB of the full-size model; divided by the scale).
BUDGET_GIB = 12.0

#: Environment overrides (see benchmarks/README.md).
ENV_BACKEND = "EXPCACHE_BENCH_BACKEND"  # "host" or "cuda": skip the probe
ENV_SCALE = "EXPCACHE_BENCH_SCALE"  # expert size divisor of the replay benchmarks
ENV_TRACES = "EXPCACHE_BENCH_TRACES"  # comma list of bundled decode traces

#: Replay defaults per backend: the host backend runs scaled-down experts (same slot
#: counts, so the same hit rates) over one trace, so a whole asv run takes a couple of
#: minutes; the GPU runs the real sizes over the seven bundled decode traces.
HOST_TRACES = ("podA_c_python_full",)
HOST_SCALE = 256  # expcache_bench.HOST_SCALE; not imported: asv loads this file against older commits too
MICRO_HOST_SCALE = 4096

_PROBE = """
import sys
sys.path[:0] = {path!r}
from pyexpcache import ExpertCache, HostSource, ModelLayout
layout = ModelLayout.preset("q2", scale=65536)
with HostSource(layout) as source, ExpertCache(layout, source, budget_experts=1, log_level=0) as cache:
    print(cache.backend)
"""


@functools.cache
def backend() -> str:
    """The backend the benchmarks run on: ``"cuda"`` when the loaded library and a device
    allow it, else ``"host"``. ``EXPCACHE_BENCH_BACKEND`` forces one.

    The CUDA build is probed in a child process so this one never creates a CUDA
    context. Every benchmark passes the backend explicitly to the library, so the
    label in the results is always the backend that really ran.
    """
    forced = os.environ.get(ENV_BACKEND, "").strip()
    if forced:
        if forced not in ("host", "cuda"):
            raise ValueError(f"{ENV_BACKEND} must be 'host' or 'cuda', got {forced!r}")
        return forced
    try:
        from pyexpcache._lib import library_path
    except Exception:  # no library (a failed build): nothing will run anyway
        return "host"
    if library_path.name == "libexpcache_host.so":
        return "host"
    # asv imports this package once per benchmark process: remember the answer for this
    # library file, interpreter, visible devices and boot (a temporary file).
    lib_stat = library_path.stat()
    key = "|".join(
        [
            str(library_path),
            str(lib_stat.st_mtime_ns),
            str(lib_stat.st_size),
            sys.executable,
            os.environ.get("CUDA_VISIBLE_DEVICES", "-"),
            _boot_id(),
        ]
    )
    memo = Path(tempfile.gettempdir()) / f"expcache-bench-backend-{hashlib.sha1(key.encode()).hexdigest()[:16]}"
    try:
        known = memo.read_text().strip()
        if known in ("host", "cuda"):
            return known
    except OSError:
        pass
    try:
        out = subprocess.run(
            [sys.executable, "-c", _PROBE.format(path=[p for p in sys.path if p])],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "host"
    words = out.stdout.split()
    if out.returncode != 0 or not words or words[-1] not in ("host", "cuda"):
        return "host"
    try:
        memo.write_text(words[-1])
    except OSError:
        pass
    return words[-1]


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "-"


def skip_other_backends(*params) -> list[tuple]:
    """asv ``skip_params`` for a suite whose params are ``(BACKENDS, *params)``: every
    combination with a backend other than :func:`backend`'s (shown as n/a, not failed)."""
    import itertools

    here = backend()
    return [combo for combo in itertools.product(BACKENDS, *params) if combo[0] != here]


def replay_scale(which: str) -> int:
    """Expert size divisor of the replay benchmarks: 1 on the GPU, 256 on the host."""
    value = os.environ.get(ENV_SCALE, "").strip()
    return int(value) if value else (1 if which == "cuda" else HOST_SCALE)


def suite_module(name: str = ""):
    """A module of the commit's benchmark suite: ``expcache_bench[.name]``, or, at a commit from
    before the library and the suite were two packages, ``pyexpcache.bench[.name]`` (the
    simulator and traces were ``pyexpcache.sim`` and ``pyexpcache.traces``). ImportError where
    neither exists (a commit from before the benchmark)."""
    import importlib

    try:
        return importlib.import_module("expcache_bench" + (f".{name}" if name else ""))
    except ImportError:
        old = name if name.split(".")[0] in ("sim", "traces") else "bench" + (f".{name}" if name else "")
        return importlib.import_module(f"pyexpcache.{old}")


def replay_traces(which: str) -> list[str]:
    """Decode traces of the replay benchmarks: all seven on the GPU, one on the host."""
    value = os.environ.get(ENV_TRACES, "").strip()
    if value:
        return [t.strip() for t in value.split(",") if t.strip()]
    if which == "cuda":
        return list(suite_module().DEFAULT_TRACES)
    return list(HOST_TRACES)


# ---------------------------------------------------------------------------
# The hot-path rig


class Rig:
    """A two-layer model (layers 5 and 40: in ``mixed``, layer 40 is 4-bit, so the two
    layers are two size classes) and caches over it, for timing single calls.

    Real expert sizes on the GPU (a pinned source of 3.4 GiB for q2, 5.1 GiB for
    mixed); sizes / 4096 on the host. Calls alternate between the two layers.
    """

    LAYERS = (5, 40)
    K = 6

    def __init__(self, quant: str, which: str):
        import numpy as np

        from pyexpcache import HostSource, ModelLayout

        self.np = np
        self.backend = which
        scale = 1 if which == "cuda" else MICRO_HOST_SCALE
        full = ModelLayout.preset(quant, scale=scale)
        self.layout = ModelLayout(
            tuple(s if i in self.LAYERS else None for i, s in enumerate(full.layers)), name=f"{full.name}[layers 5, 40]"
        )
        self.source = HostSource(self.layout, pinned=which == "cuda")
        self.caches = []
        experts = self.layout[self.LAYERS[0]].num_experts
        # Disjoint groups of K ids: consecutive calls never share an expert.
        self.groups = [np.arange(g, g + self.K, dtype=np.uint32) for g in range(0, experts - self.K + 1, self.K)]
        self.hot_ids = self.groups[0]
        self.turn = 0

    def cache(self, **kwargs):
        from pyexpcache import ExpertCache

        kwargs.setdefault("log_level", 0)
        if "policy" in inspect.signature(ExpertCache).parameters:
            # These series measured LRU before OppClassLRU became the default: kept LRU, so each
            # graph stays one policy across commits (oppclass has series of its own).
            kwargs.setdefault("policy", "lru")
        cache = ExpertCache(self.layout, self.source, backend=self.backend, **kwargs)
        self.caches.append(cache)
        return cache

    def close(self) -> None:
        for cache in reversed(self.caches):
            cache.close()
        self.caches.clear()
        self.source.close()

    def next_call(self):
        """(layer, ids) of the next all-miss call: the layer alternates, the group advances."""
        n = self.turn
        self.turn += 1
        return self.LAYERS[n % 2], self.groups[(n // 2) % len(self.groups)]

    # -- the four hot paths, each set up in a steady state -----------------------------
    def hits_cache(self):
        """A cache where ``hot_ids`` of both layers are resident: every select hits."""
        cache = self.cache(budget_experts=64)
        for layer in self.LAYERS:
            cache.select(layer, self.hot_ids)
        cache.synchronize()
        return cache

    def misses_cache(self):
        """Six slots per class: with :meth:`next_call` ids every select misses all six."""
        return self.cache(budget_experts=self.K)

    def compact_cache(self):
        """One slot per class (the ``nocache`` baseline): compact loads copy from the host."""
        return self.cache(budget_experts=1)

    def batch_cache(self):
        """32 slots per class, filled by decode: a prompt's batch hits what is resident and
        serves the rest from staging (batches append only into free slots, never evict),
        the same way every time."""
        cache = self.cache(budget_experts=32)
        for layer in self.LAYERS:
            for group in self.groups[:6]:
                cache.select(layer, group)
        cache.synchronize()
        return cache

    def prompt_ids(self, layer: int):
        """[tokens, 6] ids of the first bundled prefill prompt at ``layer``."""
        traces = suite_module("traces")
        list_traces, load_prefill_trace = traces.list_traces, traces.load_prefill_trace
        name = next(t.name for t in list_traces() if t.kind == "prefill")
        return self.np.ascontiguousarray(load_prefill_trace(name)[0].prefill[layer], dtype=self.np.uint32)

    # -- single operations ----------------------------------------------------------
    def select_hit(self, cache) -> None:
        layer = self.LAYERS[self.turn % 2]
        self.turn += 1
        cache.select(layer, self.hot_ids)

    def select_miss(self, cache) -> None:
        layer, ids = self.next_call()
        cache.select(layer, ids)
        cache.synchronize()  # the copies are the cost of a miss

    def load_compact(self, cache) -> None:
        layer, ids = self.next_call()
        cache.load_compact(layer, ids)
        cache.synchronize()

    def prepare_batch(self, cache, prompts: dict) -> None:
        layer = self.LAYERS[self.turn % 2]
        self.turn += 1
        with cache.prepare_batch(layer, prompts[layer]):
            pass
        cache.synchronize()
