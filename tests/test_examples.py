"""examples/: each example runs end to end in a child process, at small sizes.

examples/torch_moe_decode.py decodes through the cache (plain select_views, --split, --prefetch,
--graph: select_device and the banks, the step captured in a CUDA graph on the GPU)
and through an all-resident reference, and must report bit-identical logits: on the host backend
always, on CUDA when torch and the CUDA library both have a device.

examples/torch_moe_decode_ep.py decodes the same model expert-parallel over spawned ranks (gloo
on the CPU and when ranks share a GPU, NCCL with a GPU per rank) and must match the one-device
run bit for bit."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.cache import CUDA_OK, CUDA_REASON

torch = pytest.importorskip("torch", reason="examples/torch_moe_decode.py needs PyTorch (pip install torch)")

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "torch_moe_decode.py"
EXAMPLE_EP = REPO / "examples" / "torch_moe_decode_ep.py"
SMALL = ["--layers", "3", "--experts", "16", "--hidden", "64", "--ffn", "32", "--vocab", "256", "--tokens", "6"]
MODES = [
    pytest.param([], id="plain"),
    pytest.param(["--split"], id="split"),
    pytest.param(["--prefetch"], id="prefetch"),
    pytest.param(["--graph"], id="graph"),
]

if not torch.cuda.is_available():
    TORCH_CUDA_REASON = "torch has no CUDA device (a CPU build, or no GPU)"
elif not CUDA_OK:
    TORCH_CUDA_REASON = CUDA_REASON
else:
    TORCH_CUDA_REASON = ""


def run_example(*args: str, script: Path = EXAMPLE) -> subprocess.CompletedProcess:
    # The child finds the package the way this process did; one intra-op thread keeps small
    # bf16 matmuls fast (and the run time steady) on a busy machine.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(script), *SMALL, *args], capture_output=True, text=True, env=env, timeout=300
    )


def check_output(proc: subprocess.CompletedProcess, device: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"the example failed (rc {proc.returncode}):\n{out}"
    assert "logits bit-identical: yes" in proc.stdout, out
    assert f"device: {device}" in proc.stdout, out
    misses = re.search(r"(\d+) misses", proc.stdout)
    assert misses and int(misses.group(1)) > 0, f"the budget should leave misses:\n{out}"


@pytest.mark.parametrize("mode", MODES)
def test_torch_moe_decode_host(mode):
    check_output(run_example("--device", "cpu", *mode), "cpu")


@pytest.mark.skipif(bool(TORCH_CUDA_REASON), reason=TORCH_CUDA_REASON or "CUDA usable")
@pytest.mark.parametrize("mode", MODES + [pytest.param(["--split", "--prefetch"], id="split+prefetch")])
def test_torch_moe_decode_cuda(mode):
    check_output(run_example("--device", "cuda", *mode), "cuda")


def check_ep_output(proc: subprocess.CompletedProcess, ranks: int) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"the example failed (rc {proc.returncode}):\n{out}"
    assert "logits bit-identical to the one-device run: yes" in proc.stdout, out
    served = re.findall(r"rank (\d+) on \S+: .*\((\d+) hits, (\d+) misses", proc.stdout)
    assert sorted(int(r) for r, _, _ in served) == list(range(ranks)), out
    assert all(int(h) + int(m) > 0 for _, h, m in served), f"every rank serves its experts:\n{out}"


@pytest.mark.parametrize("ranks, placement", [(2, "round-robin"), (3, "balanced")])
def test_torch_moe_decode_expert_parallel_host(ranks, placement):
    proc = run_example("--device", "cpu", "--ranks", str(ranks), "--placement", placement, script=EXAMPLE_EP)
    check_ep_output(proc, ranks)


@pytest.mark.skipif(bool(TORCH_CUDA_REASON), reason=TORCH_CUDA_REASON or "CUDA usable")
def test_torch_moe_decode_expert_parallel_cuda():
    """Two ranks: NCCL with two GPUs, gloo when they share one."""
    proc = run_example("--device", "cuda", "--ranks", "2", script=EXAMPLE_EP)
    check_ep_output(proc, 2)
    want = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    assert f"exchange over {want}" in proc.stdout, proc.stdout
