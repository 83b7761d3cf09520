"""Where a served model's decode step spends its GPU time: the kernels of the unmodified model and
of the same model offloaded by ``pyexpcache.hf``, side by side, from the torch profiler.

The model is ``hf_decode.py``'s (the same flags: geometry, ``--quant``, ``--fp8-kernel``), at one
budget fraction. Each copy decodes ``--tokens`` tokens once untimed (the graph is captured, the
Triton autotuner settles, the cache warms), then once under ``torch.profiler``; the table gives
each kernel's GPU time per decoded token in each copy and the difference, largest first, and the
totals. In graph mode the profiler sees the kernels of each replay (CUPTI reports a graph's kernel
nodes); eager mode adds the launches' gaps, which this table does not show. Tokens of the two
copies must be equal, or it exits 1.

Run (from the repository root, after ``make lib``, on a CUDA device):
    python3 benchmarks/hf_kernel_times.py --quant fp8 --fp8-kernel .whl/kernels --budget 1.0
"""

from __future__ import annotations

import argparse
import collections
import copy
import sys
from pathlib import Path

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_decode
from _fp8_experts import install_kernel, quantize_experts

from pyexpcache.hf import offload


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", type=float, default=1.0, help="fraction of the experts' bytes the cache holds")
    p.add_argument("--mode", choices=("graph", "eager"), default="graph")
    p.add_argument("--top", type=int, default=25, help="kernels listed (by the largest time in either copy)")
    p.add_argument("--width", type=int, default=70, help="characters of a kernel's name shown")
    ours, rest = p.parse_known_args(argv)
    a = hf_decode.parse_args(rest)
    if len(a.quant) != 1:
        p.error("--quant: one format")
    for k, v in vars(ours).items():
        setattr(a, k, v)
    return a


def kernel_times(run, tokens: int) -> tuple[dict[str, float], torch.Tensor]:
    """GPU microseconds per token of each kernel name over one run of ``tokens`` tokens, and its tokens."""
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        out = run(tokens)
        torch.cuda.synchronize()
    times: dict[str, float] = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            times[ev.name] += ev.device_time / tokens  # device_time: microseconds
    return times, out


def main(argv=None) -> int:
    a = parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel times need a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    quant = a.quant[0]
    if quant == "fp8":
        if not a.fp8_kernel:
            print("--quant fp8 needs --fp8-kernel DIR (transformers' finegrained_fp8 package)", file=sys.stderr)
            return 2
        install_kernel(a.fp8_kernel)
    model = hf_decode.build_model(a, device)
    if quant == "fp8":
        quantize_experts(model, block=(128, 128))
    served = copy.deepcopy(model)
    prompt = torch.randint(0, a.vocab, (1, a.prompt), generator=torch.Generator().manual_seed(1)).to(device)
    unmodified = hf_decode.runs(model, prompt, device)[a.mode]
    with offload(served, budget_fraction=a.budget) as handle:
        offloaded = hf_decode.runs(served, prompt, device)[a.mode]
        unmodified(a.tokens), offloaded(a.tokens)  # captured, tuned, warm
        before = handle.total_stats()
        base, want = kernel_times(unmodified, a.tokens)
        ours, got = kernel_times(offloaded, a.tokens)
        after = handle.total_stats()
    names = sorted(set(base) | set(ours), key=lambda n: -max(base.get(n, 0.0), ours.get(n, 0.0)))
    rows = [
        [
            n[: a.width],
            f"{base.get(n, 0.0):.1f}",
            f"{ours.get(n, 0.0):.1f}",
            f"{ours.get(n, 0.0) - base.get(n, 0.0):+.1f}",
        ]
        for n in names[: a.top]
    ]
    total_base, total_ours = sum(base.values()), sum(ours.values())
    rows.append(["all kernels", f"{total_base:.1f}", f"{total_ours:.1f}", f"{total_ours - total_base:+.1f}"])
    hits, misses = after.hits - before.hits, after.misses - before.misses
    print(
        f"{torch.cuda.get_device_name()}: {a.layers} layers x {a.experts} experts, top-{a.top_k}, experts in "
        f"{quant}; budget {a.budget:g}, {a.mode} mode, {a.tokens} tokens profiled; hits "
        f"{100 * hits / max(hits + misses, 1):.1f} %"
    )
    print(tabulate(rows, headers=["kernel", "unmodified µs/token", "offloaded µs/token", "difference"]))
    equal = torch.equal(want.cpu(), got.cpu())
    print("tokens equal" if equal else "tokens differ")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
