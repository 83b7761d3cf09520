"""examples/c_engine: the example engine on the C ABI, end to end on a tiny model.

prepare.py writes a GGUF of DeepSeek V4 Flash's mixed q2/q4 experts (layers 35-38: two of each
size, every matrix's rows / 1024), its recorded sums and the routing of a bundled trace; the
engine (``make c-engine``) decodes it in both loops (the device select in a graph, the host select
and gather) after a prefill, on the host backend here (and on CUDA when a device is there), and
checks every expert it read against the recorded sums. A byte changed in the file after preparing
must fail the run."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from support.cache import CUDA_OK, CUDA_REASON

gguf = pytest.importorskip("gguf", reason="prepare.py writes the GGUF with the gguf package (pip install gguf)")

REPO = Path(__file__).resolve().parents[1]
PREPARE = REPO / "examples" / "c_engine" / "prepare.py"
ENGINE = REPO / "build" / "c_engine"
LAYERS = [35, 36, 37, 38]  # q2 35-36, q4 37-38: two size classes
TRACE = "podA_b_json_full"  # 37 decode tokens
PROMPT, K, MTP, MTP_EVERY = 8, 6, 3, 8  # the engine's defaults for the verification steps


@pytest.fixture(scope="module")
def engine() -> Path:
    """``make c-engine`` (the CUDA library too, when it is not built yet)."""
    if shutil.which("make") is None:
        pytest.skip("make not found")
    if not (os.environ.get("NVCC") or shutil.which("nvcc")):
        pytest.skip("nvcc not found: the example engine is CUDA C++ (it runs without a GPU, but nvcc builds it)")
    proc = subprocess.run(
        ["make", "--no-print-directory", "c-engine"], cwd=REPO, capture_output=True, text=True, timeout=1800
    )
    assert proc.returncode == 0, f"make c-engine failed:\n{proc.stdout}\n{proc.stderr}"
    return ENGINE


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("c_engine")
    proc = subprocess.run(
        [sys.executable, str(PREPARE), str(out), "--layers", "35-38", "--scale", "1024", "--trace", TRACE]
        + ["--prompt-tokens", str(PROMPT), "--alignment", "64"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"prepare.py failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def _load_prepare():
    """examples/c_engine/prepare.py as a module: its readers of the files it writes."""
    spec = importlib.util.spec_from_file_location("c_engine_prepare", PREPARE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


prepare = _load_prepare()


def read_routing(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    """(prompt [P, L, k], decode [T, L, k]) from routing.bin."""
    layers, prompt, decode = prepare.read_routing(folder / "routing.bin")
    assert layers == LAYERS
    return prompt, decode


def run(engine: Path, folder: Path, *args: str, check: bool = True) -> tuple[subprocess.CompletedProcess, dict]:
    """The engine on ``folder`` (host backend unless args say otherwise), its exit and its JSON."""
    out = folder / "result.json"
    out.unlink(missing_ok=True)
    backend = [] if "--backend" in args else ["--backend", "host"]
    proc = subprocess.run(
        [str(engine), str(folder), *backend, "--json", str(out), *args], capture_output=True, text=True, timeout=300
    )
    text = proc.stdout + proc.stderr
    if check:
        assert proc.returncode == 0, f"the engine failed (rc {proc.returncode}):\n{text}"
    return proc, json.loads(out.read_text()) if out.exists() else {}


def steps(tokens: int) -> list[tuple[int, int]]:
    """The engine's decode schedule: (first token, tokens) per step."""
    out, t, singles = [], 0, 0
    while t < tokens:
        n = MTP if singles == MTP_EVERY and t + MTP <= tokens else 1
        singles = 0 if n > 1 else singles + 1
        out.append((t, n))
        t += n
    return out


def test_prepare_records_the_sums_of_the_bytes_it_wrote(model):
    """model.gguf.sums holds the word sums of every expert part in the file (as the pyexpcache GGUF
    reader finds them), and routing.bin the bundled trace's ids."""
    from expcache_bench.traces import load_decode_trace
    from pyexpcache.gguf import describe_gguf

    layers, sums = prepare.read_sums(model / "model.gguf.sums")
    assert layers == LAYERS and sums.shape == (len(LAYERS), 256, 3)
    data = np.fromfile(model / "model.gguf", np.uint8)
    found = describe_gguf(model / "model.gguf")
    for li, layer in enumerate(LAYERS):
        spec = found[layer]
        for p, (offset, stride, size) in enumerate(zip(spec.offsets, spec.strides, spec.sizes)):
            assert offset % 64 == 0
            parts = np.lib.stride_tricks.as_strided(data[offset:], (256, size), (stride, 1))
            words = np.pad(parts, ((0, 0), (0, -size % 4))).view("<u4").sum(axis=1, dtype=np.uint64)
            assert (words == sums[li, :, p]).all(), f"layer {layer} part {p}"
    prompt, decode = read_routing(model)
    trace = load_decode_trace(TRACE)
    assert prompt.shape == (PROMPT, len(LAYERS), K)
    assert (decode == np.stack([trace.layer_ids(layer) for layer in LAYERS], axis=1)).all()


SOURCES = {
    "direct": ["--reads", "direct"],
    "buffered": ["--reads", "buffered"],
    "pinned": ["--source", "pinned"],
    "direct, bank of parts": ["--reads", "direct", "--bank", "parts"],  # a region per part, as ggml's tensors
}


@pytest.mark.parametrize("source", SOURCES.values(), ids=SOURCES.keys())
def test_every_expert_read_is_the_recorded_one(engine, model, source):
    """Both loops decode every token, read every expert of every token (prefill included) with the
    recorded sums, give no slot -1, and the graph loop copies nothing device to device; under LRU the
    device select and the host select miss the same experts."""
    proc, res = run(engine, model, *source, "--policy", "lru")
    assert res["ok"] and res["backend"] == "host" and res["tokens"] == 37
    assert res["bank"] == ("parts" if "parts" in source else "slots")
    prompt, decode = read_routing(model)
    requests = sum(len({*decode[t : t + n, li].ravel()}) for t, n in steps(37) for li in range(len(LAYERS)))
    loops = res["loops"]
    for name in ("graph", "gather"):
        r = loops[name]
        assert (r["tokens"], r["checked"], r["bad"], r["no_slot"]) == (37, 37 * len(LAYERS) * K, 0, 0), name
        assert r["hits"] + r["misses"] == requests, name  # distinct experts per select, counted once
        assert r["prefill"]["bad"] == 0
        assert r["prefill"]["checked"] == sum(len({*prompt[:, li].ravel()}) for li in range(len(LAYERS)))
        assert r["misses"] > 0 and r["evictions"] > 0, name  # 15 % of the experts: the budget is felt
    assert loops["graph"]["d2d_bytes"] == loops["graph"]["gather_bytes"] == 0
    assert loops["gather"]["gather_bytes"] > 0
    assert (loops["graph"]["hits"], loops["graph"]["misses"]) == (loops["gather"]["hits"], loops["gather"]["misses"])
    assert "hits and misses of the two loops equal" in proc.stdout
    assert "c_engine: expcache notice:" in proc.stderr  # the library's lines, through the engine's log


def test_with_every_expert_cached_only_first_uses_miss(engine, model):
    """A budget that holds every expert: the prefill appends its experts, and decode misses exactly
    the experts it uses that the prompt did not, evicting nothing."""
    _, res = run(engine, model, "--budget-frac", "1.0")
    prompt, decode = read_routing(model)
    first_uses = sum(len({*decode[:, li].ravel()} - {*prompt[:, li].ravel()}) for li in range(len(LAYERS)))
    for name, r in res["loops"].items():
        assert (r["misses"], r["evictions"], r["bad"]) == (first_uses, 0, 0), name
        assert r["prefill"]["appends"] == r["prefill"]["misses"] == r["prefill"]["checked"], name


def test_the_loops_miss_the_same_experts_under_duel_after_a_prefill(engine, model):
    """Duel's OppClassLRU shadow counts requests only (a prefill's append is not one): a
    device-lookup cache after a prefill batch misses what a host-lookup cache misses."""
    _, res = run(engine, model, "--policy", "duel")
    graph, gather = res["loops"]["graph"], res["loops"]["gather"]
    assert (graph["hits"], graph["misses"]) == (gather["hits"], gather["misses"])


def flip_a_used_byte(src: Path, dst: Path) -> tuple[int, int]:
    """A copy of the prepared folder whose model has one byte of a used expert changed."""
    from pyexpcache.gguf import describe_gguf

    shutil.copytree(src, dst)
    _, decode = read_routing(dst)
    layer, expert = LAYERS[2], int(decode[5, 2, 1])
    spec = describe_gguf(dst / "model.gguf")[layer]
    at = spec.down_offset + expert * spec.down_stride + 77
    with open(dst / "model.gguf", "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))
    return layer, expert


@pytest.mark.parametrize("source", [["--reads", "direct"], ["--source", "pinned"]], ids=["file", "pinned"])
def test_a_changed_byte_in_the_model_fails_the_run(engine, model, tmp_path, source):
    layer, expert = flip_a_used_byte(model, tmp_path / "bad")
    proc, res = run(engine, tmp_path / "bad", *source, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert not res["ok"]
    for name, r in res["loops"].items():
        assert r["bad"] > 0, name
    assert f"layer {layer}, expert {expert}" in proc.stderr and "the sums of down differ" in proc.stderr
    assert "SUMS DIFFER: the run failed" in proc.stdout


def test_a_truncated_model_is_refused_with_the_reason(engine, model, tmp_path):
    shutil.copytree(model, tmp_path / "cut")
    with open(tmp_path / "cut" / "model.gguf", "r+b") as f:
        f.truncate(5000)
    proc, _ = run(engine, tmp_path / "cut", check=False)
    assert proc.returncode == 1
    assert "runs past the end" in proc.stderr, proc.stderr


@pytest.mark.skipif(not CUDA_OK, reason=CUDA_REASON)
@pytest.mark.parametrize(
    "source",
    [["--reads", "direct"], ["--source", "pinned"], ["--reads", "direct", "--bank", "parts"]],
    ids=["file", "pinned", "file, bank of parts"],
)
def test_on_the_gpu_the_graph_loop_reads_every_expert_in_place(engine, model, source):
    _, res = run(engine, model, "--backend", "cuda", "--policy", "lru", *source)
    assert res["backend"] == "cuda" and res["ok"]
    assert res["bank"] == ("parts" if "parts" in source else "slots")
    graph, gather = res["loops"]["graph"], res["loops"]["gather"]
    assert graph["bad"] == gather["bad"] == graph["no_slot"] == 0
    assert graph["d2d_bytes"] == graph["gather_bytes"] == 0
    assert (graph["hits"], graph["misses"]) == (gather["hits"], gather["misses"])
