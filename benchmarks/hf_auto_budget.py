"""budget="auto" on a real-size model: does the budget it chooses leave room for what it counted?

A random Qwen3MoeForCausalLM of Qwen3-30B-A3B's layer geometry (hf_decode.py's model: 16 layers
of 128 experts, bf16, 18 GiB of experts), drawn on the GPU and moved to the host (as loaded),
then offloaded with ``budget="auto"`` for ``--batch`` x ``--max-len`` with the device filled but
``--leave-gib`` (so that the budget is a share of the experts; 0: the whole device). At that
budget: ``generate`` of ``--batch`` prompts of ``max_len - new`` tokens and ``GraphDecoder`` of
the same, each with torch's peak allocation against the terms counted for it (KV cache and
activation peak) and the device's free memory at the end. Exit status 1 when a run ran out of
memory or a cache holds fewer experts than its budget asked.

    python3 benchmarks/hf_auto_budget.py --max-len 8192 --batch 4 --leave-gib 20
"""

from __future__ import annotations

import argparse
import sys
import time

import hf_decode
import torch

from pyexpcache.hf import GraphDecoder, offload

GiB = 1 << 30


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--new", type=int, default=32, help="new tokens; the prompts are max_len - new long")
    p.add_argument("--leave-gib", type=float, default=20.0, help="device memory left free for the model (0: all)")
    a = p.parse_args(argv)
    device = torch.device("cuda")
    model_args = hf_decode.parse_args(["--prompt", str(a.max_len - a.new), "--tokens", str(a.new)])
    model = hf_decode.build_model(model_args, device).cpu()  # drawn on the GPU (fast), then on the host
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    ballast = torch.empty(max(0, int(free - a.leave_gib * GiB)) if a.leave_gib else 0, dtype=torch.uint8, device=device)
    ok = True
    with offload(model, budget="auto", max_len=a.max_len, batch=a.batch, device=device) as handle:
        b = handle.auto_budget
        for cache in handle.caches:
            for c in cache.classes():
                print(f"cache class {c.index}: cap {c.cap_experts} of target {c.target_experts} experts")
                ok = ok and c.cap_experts == c.target_experts
        prompt = torch.randint(model_args.vocab, (a.batch, a.max_len - a.new), device=device)
        runs = {
            "generate": lambda: model.generate(
                prompt, max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False, pad_token_id=0
            ),
            "GraphDecoder": lambda: GraphDecoder(model, max_len=a.max_len, batch=a.batch).generate(prompt, a.new),
        }
        for name, run in runs.items():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            try:
                run()
                torch.cuda.synchronize()
            except torch.OutOfMemoryError as e:
                print(f"{name}: OUT OF MEMORY: {e}")
                ok = False
                continue
            peak = torch.cuda.max_memory_allocated() - before
            free, _ = torch.cuda.mem_get_info()
            print(
                f"{name}: {time.perf_counter() - start:.1f} s; torch's peak {peak / GiB:.2f} GiB against KV cache + "
                f"activation peak {(b.kv_bytes + b.activation_bytes) / GiB:.2f} GiB (margin {b.margin_bytes / GiB:.2f} "
                f"GiB); free at the end {free / GiB:.2f} GiB; hits {handle.total_stats().hit_rate:.1%}"
            )
    del ballast
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
