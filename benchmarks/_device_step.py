"""What the device-step benchmarks share (``flashlib_side_by_side.py``, ``verify_step.py``): the
model's geometry and its pinned source, the routing, the choice of device, one decode step
captured in a CUDA graph, and the timing of several contenders in alternation.

A contender is one way to serve a step: ``put(t)`` writes step ``t``'s inputs where its step
reads them (one device-to-device copy, timed), ``run()`` replays its captured step (eagerly on
the CPU), and ``check(t)`` verifies what the step served, after it and outside the timing.
:func:`alternate` times the contenders over the same steps in rounds, taking turns, so each
round's ratio compares runs made moments apart.

Not a module of the asv package (that is ``benchmarks/benchmarks/``): the scripts beside it
import it by its file's folder, which Python puts first on ``sys.path``.
"""

from __future__ import annotations

import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: pyexpcache, expcache_bench

from expcache_bench.traces.synthetic import synthetic_trace
from pyexpcache import ExpertCache, HostSource, LayerSpec, ModelLayout

#: The issue's geometry: Qwen3-30B-A3B-like layers (hidden 2048, expert FFN 768, bf16).
LAYERS, EXPERTS, TOP_K = 16, 128, 8
EXPERT_BYTES = 9 << 20  # gate, up and down, 3 MiB each
#: A check of the logic on the CPU (expcache's host backend): small enough to run in seconds.
CPU_GEOMETRY = dict(layers=2, experts=8, top_k=2, expert_bytes=3 * 2048)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]i?b?)?\s*$", re.I)


def size(text: str) -> int:
    """``"9M"``, ``"48K"``, ``"9437184"``: bytes (K, M, G are binary)."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (a number of bytes, optionally with K, M or G)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[(m.group(2) or "")[:1].lower()]
    return int(float(m.group(1)) * scale)


def add_device_option(p) -> None:
    """--device: the GPU, or a check of the same steps on expcache's host backend."""
    p.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cuda (default) or cpu: a check on the host backend"
    )


def add_run_options(p) -> None:
    """--seed, --quick and --json, as both scripts take them."""
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic routing (default 0)")
    p.add_argument("--quick", action="store_true", help="fewer steps, rounds and replays")
    p.add_argument("--json", type=Path, help="write the results here")


def fill_counts(a, defaults) -> None:
    """The count options left unset (None): ``defaults`` is ``(name, full, quick, cpu)`` rows, the
    value on the GPU, with ``--quick``, and with ``--device cpu``."""
    for name, full, fast, tiny in defaults:
        if getattr(a, name) is None:
            setattr(a, name, tiny if a.device == "cpu" else fast if a.quick else full)


def add_geometry_options(p, default_layers=LAYERS, default_k=TOP_K) -> None:
    """--layers, --experts, --top-k, --expert-bytes (defaults: the issue's geometry on the GPU,
    :data:`CPU_GEOMETRY` with ``--device cpu``)."""
    p.add_argument("--layers", type=int, help=f"MoE layers (default {default_layers})")
    p.add_argument("--experts", type=int, help=f"routed experts per layer (default {EXPERTS})")
    p.add_argument("--top-k", type=int, help=f"experts per token and layer (default {default_k})")
    p.add_argument(
        "--expert-bytes",
        type=size,
        help="bytes of one expert, split in three equal parts (gate, up, down), each a multiple of 256 "
        f"(default {EXPERT_BYTES >> 20}M)",
    )


def fill_geometry(a, default_layers=LAYERS, default_k=TOP_K) -> list[str]:
    """Set the geometry options left unset, from the GPU defaults or :data:`CPU_GEOMETRY`;
    returns a note per default the CPU shrank. SystemExit for an impossible geometry."""
    gpu = dict(layers=default_layers, experts=EXPERTS, top_k=default_k, expert_bytes=EXPERT_BYTES)
    defaults = CPU_GEOMETRY if a.device == "cpu" else gpu
    shrunk = []
    for name, value in defaults.items():
        if getattr(a, name) is None:
            setattr(a, name, value)
            if value != gpu[name]:
                shrunk.append(f"{name.replace('_', '-')} {value}")
    if not (a.layers >= 1 and a.experts >= 2 and 1 <= a.top_k <= a.experts // 2):
        sys.exit("need --layers >= 1, --experts >= 2 and 1 <= --top-k <= experts / 2")
    if a.expert_bytes % (3 * 256) or a.expert_bytes <= 0:
        sys.exit(
            "--expert-bytes must be a positive multiple of 768 (three parts of 256-byte multiples), "
            f"got {a.expert_bytes}"
        )
    return shrunk


def layout_of(a) -> ModelLayout:
    part = a.expert_bytes // 3
    return ModelLayout(tuple(LayerSpec(a.experts, part, part, part) for _ in range(a.layers)), name="bench-moe")


def cuda_unusable_reason() -> Optional[str]:
    """None when torch sees a GPU and expcache's CUDA backend opens a device-lookup cache on it,
    else why not (a sentence)."""
    if not torch.cuda.is_available():
        return "torch sees no CUDA device (torch.cuda.is_available() is False)"
    layout = ModelLayout((LayerSpec(2, 256, 256, 256),))
    try:
        source = HostSource(layout, pinned=True, arrangement="expert")
        ExpertCache(layout, source, budget_experts=2, backend="cuda", lookup="device", log_level=1).close()
        source.close()
    except Exception as exc:  # the library's own message says why (no CUDA build, no device, ...)
        return f"expcache's CUDA backend does not open ({type(exc).__name__}: {exc}); build it with make lib"
    return None


def pick_device(a, what: str) -> Optional[str]:
    """``a.device`` checked: None when it can run, else the message to exit with (no GPU)."""
    if a.device == "cpu":
        return None
    reason = cuda_unusable_reason()
    if reason is None:
        return None
    return (
        f"{what} needs a CUDA GPU: {reason}.\n"
        "  --device cpu runs the same steps on expcache's host backend, a check of the logic whose "
        "times mean nothing."
    )


class Source:
    """The experts in page-locked host memory (:class:`~pyexpcache.HostSource`, each expert's
    three parts together, every word a known pattern), with each layer seen as a uint8 tensor
    ``rows[layer]`` of ``[experts, stride]`` and, on the GPU, a device copy ``device_rows`` to
    compare served bytes against (on the CPU, or without ``device_copy``, the same tensors)."""

    def __init__(self, layout: ModelLayout, device: torch.device, device_copy: bool = True):
        self.host = HostSource(layout, pinned=True, arrangement="expert")  # emulated pinning on the host backend
        buffer = torch.from_numpy(self.host.buffer)
        origin = self.host.buffer.ctypes.data
        self.rows, parts = [], None
        for layer in range(layout.num_layers):
            place = self.host.placement(layer)
            stride = place.strides[0]
            offs = tuple(b - place.bases[0] for b in place.bases)
            if parts is None:
                parts = tuple(zip(offs, place.sizes))
            start = place.bases[0] - origin
            self.rows.append(buffer[start : start + stride * layout[layer].num_experts].view(-1, stride))
        #: (offset in the row, bytes) of gate, up and down
        self.parts: tuple[tuple[int, int], ...] = parts
        self.row_bytes = self.rows[0].shape[1]
        self.device_rows = [r.to(device) for r in self.rows] if device.type == "cuda" and device_copy else self.rows
        self.expected = np.array(
            [
                [self.host.expected_checksum(layer, e) for e in range(layout[layer].num_experts)]
                for layer in range(layout.num_layers)
            ],
            dtype=np.uint64,
        )

    def close(self) -> None:
        self.device_rows = self.rows = []
        self.host.close()


def routing(tokens: int, a, seed: int) -> np.ndarray:
    """int32 ``[tokens, layers, top_k]`` ids: the synthetic decode trace (Zipf popularity and the
    bundled traces' reuse of the previous token's experts, expcache_bench.traces.synthetic)."""
    return synthetic_trace(tokens, a.layers, a.experts, a.top_k, seed=seed, first_layer=0).ids


class Step:
    """``fn`` (one decode step's kernels on torch's current stream) run once eagerly, then, on the
    GPU, captured in a CUDA graph that :meth:`run` replays; on the CPU :meth:`run` calls it."""

    def __init__(self, fn: Callable[[], None], cuda: bool):
        self.fn, self.graph = fn, None
        fn()  # binds classes, compiles kernels, allocates scratch: nothing of that may happen in a capture
        if cuda:
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: calls other threads make meanwhile (the cache's own) do not void the capture
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                fn()

    def run(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.fn()


def current_stream(cuda: bool) -> Optional[int]:
    """The stream torch's work goes to now (a capture's while capturing), for expcache's calls."""
    return torch.cuda.current_stream().cuda_stream if cuda else None


@dataclass
class Contender:
    """One way to serve the steps (see the module docstring). ``seconds``: per round, the mean
    time per step; ``errors``: what :meth:`check` found, as sentences."""

    name: str
    put: Callable[[int], None]
    run: Callable[[], None]
    check: Callable[[int], list[str]]
    seconds: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # the first few
    checked: int = 0  # steps checked
    bad: int = 0  # steps with a problem

    def verify(self, t: int) -> None:
        """``check(t)``, counted."""
        problems = self.check(t)
        self.checked += 1
        if problems:
            self.bad += 1
            self.errors.extend(f"step {t}: {p}" for p in problems[: max(0, 10 - len(self.errors))])


def alternate(contenders: list[Contender], steps: np.ndarray, rounds: int, sync, timed: bool = True) -> None:
    """Serve ``steps`` (indices) with every contender, in ``rounds`` blocks of consecutive steps:
    in each block every contender serves the block's steps in turn (the first in one round goes
    last in the next). A step's time runs from its ``put`` to the end of a synchronize; ``check``
    runs after it, untimed. Appends the mean time per step of each round to ``seconds`` when
    ``timed``."""
    perf = time.perf_counter
    for r, block in enumerate(np.array_split(steps, rounds)):
        if not block.size:
            continue
        order = contenders if r % 2 == 0 else contenders[::-1]
        for c in order:
            total = 0.0
            for t in block.tolist():
                t0 = perf()
                c.put(t)
                c.run()
                sync()
                total += perf() - t0
                c.verify(t)
            if timed:
                c.seconds.append(total / block.size)


def ratio_summary(num: list[float], den: list[float]) -> tuple[float, float, float]:
    """Median, min and max over rounds of ``num[r] / den[r]``."""
    ratios = [n / d for n, d in zip(num, den) if d]
    if not ratios:
        return 0.0, 0.0, 0.0
    return statistics.median(ratios), min(ratios), max(ratios)


def sync_of(cuda: bool) -> Callable[[], None]:
    return torch.cuda.synchronize if cuda else (lambda: None)


def median_us(seconds: list[float]) -> float:
    return 1e6 * statistics.median(seconds) if seconds else 0.0
