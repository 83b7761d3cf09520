"""Greedy decoding of a transformers MoE model with its experts served by ``pyexpcache.hf``,
side by side with the unmodified model, in one process.

The model is a random ``Qwen3MoeForCausalLM`` of real layer geometry (default: 16 layers of 128
experts, top-8, hidden 2048, expert FFN 768, 32 query and 4 key-value heads of 128, vocabulary
151,936, bf16: Qwen3-30B-A3B's layers, 16 of its 48). Two modes, each timed for the unmodified
model (every expert resident on the GPU) and for the offloaded one:

- eager: ``model.generate`` (greedy, dynamic KV cache);
- graph: :class:`pyexpcache.hf.GraphDecoder`, a static KV cache and every decode step one CUDA
  graph replay (eager on the CPU).

The offloaded model runs at each ``--budgets`` fraction of its experts: 1.0 holds the working
set (every expert); 0.25 streams. The weights are drawn at a scale (``--weight-scale``) where
greedy tokens vary and each layer routes over nearly all its experts: locality is low, a hard
case for a cache. The decode rate is the tokens after the first over the time
after the first (the prompt's forward and the first token are timed apart and left out). Per
budget it prints tok/s, the ratio to the unmodified model in the same mode, the hit rate of the
timed tokens, and the link bound: the unmodified graph step plus the misses' bytes per token at
the measured host-to-device rate (``cudaMemcpyAsync`` of 64 MiB from pinned memory). The
offloaded model's tokens must equal the unmodified model's in each mode, or it exits 1.

Run (from the repository root, after ``make lib``):
    python3 benchmarks/hf_decode.py [--device cuda] [--json PATH]
    python3 benchmarks/hf_decode.py --device cpu --layers 2 --experts 8 --hidden 64 --ffn 32 \\
        --heads 4 --kv-heads 2 --head-dim 16 --vocab 256 --tokens 8      # a check of the script
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tabulate import tabulate  # noqa: E402
import transformers  # noqa: E402

from pyexpcache import HostSource, LayerSpec, ModelLayout  # noqa: E402
from pyexpcache.bench.link import measure  # noqa: E402
from pyexpcache.hf import GraphDecoder, find_experts, offload  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--prompt", type=int, default=8, help="prompt tokens (random ids)")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per timed run")
    p.add_argument("--weight-scale", type=float, default=3.0,
                   help="every weight matrix N(0, scale / sqrt(fan-in)); at 3 greedy tokens vary and each layer "
                        "routes over nearly all its experts (at transformers' init, 0.02, the tokens repeat and "
                        "a layer uses a fifth of its experts)")
    p.add_argument("--budgets", default="1.0,0.25", help="fractions of the experts the cache holds")
    p.add_argument("--json", type=Path, help="write the results here")
    return p.parse_args(argv)


def build_model(a, device: torch.device):
    config = transformers.Qwen3MoeConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=4 * a.ffn, moe_intermediate_size=a.ffn,
        num_experts=a.experts, num_experts_per_tok=a.top_k, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.head_dim,
        max_position_embeddings=max(4096, a.prompt + a.tokens), norm_topk_prob=True)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(0)
        with device:
            model = transformers.Qwen3MoeForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():  # every matrix N(0, scale / sqrt(fan-in)): see --weight-scale
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, a.weight_scale / p.shape[-1] ** 0.5)
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timed:
    """A decode run's tokens and its decode rate: (N - 1) tokens over the time of N tokens less
    the time of 1 (the prompt's forward and the first token), after one untimed run of N (a
    graph decoder captures its step there, kernels are chosen, a cache is warmed to its steady
    state). ``stats`` (the offload's ``total_stats``, or None) gives the counters of the timed run of N
    (``self.hits``, ``self.misses``)."""

    def __init__(self, run, device, tokens: int, stats=None):
        run(tokens)
        sync(device)
        t0 = time.perf_counter()
        run(1)
        sync(device)
        first = time.perf_counter() - t0
        before = stats() if stats else None
        t0 = time.perf_counter()
        self.tokens = run(tokens)
        sync(device)
        self.seconds = max(time.perf_counter() - t0 - first, 1e-9)
        self.tok_s = (tokens - 1) / self.seconds
        if stats:
            after = stats()
            self.hits, self.misses = after.hits - before.hits, after.misses - before.misses


def runs(model, prompt, device):
    """The two modes as functions of the number of new tokens, returning the tokens."""
    decoder = GraphDecoder(model, max_len=prompt.shape[1] + 512)

    def eager(n):
        with torch.no_grad():
            return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    return {"eager": eager, "graph": lambda n: decoder.generate(prompt, n)}


def link_rate(device) -> float:
    """The host-to-device rate of the benchmark's link (``pyexpcache.bench.link``: cudaMemcpyAsync
    of 64 MiB from pinned memory); 0 on the CPU."""
    if device.type != "cuda":
        return 0.0
    probe = ModelLayout((LayerSpec(64, 1 << 19, 1 << 19, 1 << 19),))
    with HostSource(probe, pinned=True) as pinned:
        return measure(pinned, 64 << 20, cuda=True, device=device.index or 0).bytes_per_s


def main(argv=None) -> int:
    a = parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device for torch: run with --device cpu", file=sys.stderr)
        return 2
    budgets = [float(f) for f in a.budgets.split(",")]
    model = build_model(a, device)
    layers = find_experts(model)
    expert_bytes = sum(e.first[0].numel() * e.first.element_size() + e.down[0].numel() * e.down.element_size()
                       for e in layers) / len(layers)
    prompt = torch.randint(0, a.vocab, (1, a.prompt), generator=torch.Generator().manual_seed(1)).to(device)
    print(f"{type(model).__name__}: {a.layers} layers x {a.experts} experts, top-{a.top_k}, hidden {a.hidden}, "
          f"expert FFN {a.ffn}, {next(model.parameters()).dtype}, {expert_bytes / 2**20:.2f} MiB per expert, "
          f"{len(layers) * a.experts * expert_bytes / 2**30:.2f} GiB of experts; prompt {a.prompt}, "
          f"{a.tokens} new tokens; {device}")
    resident = {mode: Timed(run, device, a.tokens) for mode, run in runs(model, prompt, device).items()}
    rows, results, bad = [], [], 0
    for mode, t in resident.items():
        rows.append(["resident", mode, f"{t.tok_s:.2f}", "1.00", "", "", ""])
        results.append({"budget": None, "mode": mode, "tok_s": t.tok_s})
    step_s = 1 / resident["graph"].tok_s
    rate = link_rate(device)
    for fraction in budgets:
        with offload(model, budget_fraction=fraction) as handle:
            sync(device)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the experts' device copies, freed by the first offload
            for mode, run in runs(model, prompt, device).items():
                t = Timed(run, device, a.tokens, handle.total_stats)
                hit_rate = t.hits / max(t.hits + t.misses, 1)
                same = torch.equal(t.tokens.cpu(), resident[mode].tokens.cpu())
                bad += not same
                # Misses per token forward of the timed run: the prompt's P and the N - 1 steps.
                miss_bytes = t.misses * expert_bytes / (a.prompt + a.tokens - 1)
                bound = 1 / (step_s + miss_bytes / rate) if rate else float("nan")
                ratio = t.tok_s / resident[mode].tok_s
                rows.append([f"offload {fraction:g}", mode, f"{t.tok_s:.2f}", f"{ratio:.2f}", f"{100 * hit_rate:.1f} %",
                             f"{bound:.2f}" if rate else "", f"{100 * t.tok_s / bound:.1f} %" if rate else ""])
                results.append({"budget": fraction, "mode": mode, "tok_s": t.tok_s, "ratio": ratio,
                                "hit_rate": hit_rate, "bound_tok_s": bound if rate else None,
                                "link_bytes_per_s": rate, "tokens_equal": same})
                if not same:
                    print(f"offload {fraction:g} {mode}: tokens differ from the unmodified model's", file=sys.stderr)
    print(tabulate(rows, headers=["experts", "mode", "tok/s", "x unmodified", "hits", "link bound tok/s",
                                  "of bound"], disable_numparse=True))
    if device.type == "cuda":
        print(f"link: {rate / 1e9:.1f} GB/s (cudaMemcpyAsync from pinned memory, 64 MiB)")
    print("tokens equal to the unmodified model's in every run" if not bad else f"{bad} runs' tokens differ")
    if a.json:
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "results": results}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
