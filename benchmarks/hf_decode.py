"""Greedy decoding of a transformers MoE model with its experts served by ``pyexpcache.hf``,
side by side with the unmodified model, in one process.

The model is a random ``Qwen3MoeForCausalLM`` of real layer geometry (default: 16 layers of 128
experts, top-8, hidden 2048, expert FFN 768, 32 query and 4 key-value heads of 128, vocabulary
151,936, bf16: Qwen3-30B-A3B's layers, 16 of its 48), or with ``--model gpt_oss`` a random
``GptOssForCausalLM`` of GPT-OSS-20B's layer geometry (6 of its 24 layers: 32 experts, top-4,
hidden and expert FFN 2880, vocabulary 201,088; its sliding window as long as the static KV
cache, which GraphDecoder captures only then). Two copies of it are made: the unmodified
one (every expert resident on the GPU) and one offloaded at each ``--budgets`` fraction of its
experts in turn (1.0 holds the working set, every expert; 0.25 streams). ``--quant bf16,fp8``
runs it twice: its experts as built, then quantized to transformers' ``FP8Experts`` (blocks of
128, by transformers' own ``Fp8Quantize``; its Triton kernel from ``--fp8-kernel``), and prints
the FP8 model's tok/s over the bf16 one's; ``--model gpt_oss --quant bf16,mxfp4`` likewise with
transformers' MXFP4 experts (``Mxfp4GptOssExperts``, quantized and swizzled by transformers' own
functions; triton_kernels from ``--mxfp4-kernel``). Two modes:

- eager: ``model.generate`` (greedy, dynamic KV cache);
- graph: :class:`pyexpcache.hf.GraphDecoder`, a static KV cache and every decode step one CUDA
  graph replay (eager on the CPU).

Eager decoding is bound by the host's time per launch, which drifted between 22 and 37 ms a
token within a minute, in one process, on the H200's host: the two copies are timed in
alternation, ``--rounds`` runs each, and each round's ratio compares runs made seconds apart.
The table gives the median rate of each copy, the median of the rounds' ratios and their range.
The weights are drawn at a scale (``--weight-scale``) where greedy tokens vary and each layer
routes over nearly all its experts: locality is low, a hard case for a cache. A run's decode
rate is the tokens after the first over the time after the first (the prompt's forward and the
first token are timed apart and left out). Per budget it prints the hit rate of the timed runs,
and the link bound: the unmodified graph step plus the misses' bytes per token at the measured
host-to-device rate (``cudaMemcpyAsync`` of 64 MiB from pinned memory). The offloaded model's
tokens must equal the unmodified model's in every run, or it exits 1.

Run (from the repository root, after ``make lib``):
    python3 benchmarks/hf_decode.py [--device cuda] [--json PATH]
    python3 benchmarks/hf_decode.py --device cpu --layers 2 --experts 8 --top-k 2 --hidden 64 --ffn 32 \\
        --heads 4 --kv-heads 2 --head-dim 16 --vocab 256 --tokens 8 --rounds 2   # a check of the script
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import transformers
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _fp8_experts
import _mxfp4_experts

from expcache_bench.link import measure
from pyexpcache import HostSource, LayerSpec, ModelLayout
from pyexpcache.hf import GraphDecoder, find_experts, offload

#: The experts' formats --quant takes.
QUANTS = ("bf16", "fp8", "mxfp4")
#: --model: each model's config class and the layer geometry its defaults take (the arguments
#: given on the command line replace them).
MODELS = {
    "qwen3_moe": ("Qwen3MoeConfig", {}),
    "gpt_oss": (
        "GptOssConfig",
        dict(experts=32, top_k=4, hidden=2880, ffn=2880, heads=64, kv_heads=8, head_dim=64, vocab=201088, layers=6),
    ),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="qwen3_moe",
        help="the model family; gpt_oss defaults to GPT-OSS-20B's layer geometry (6 of its 24 layers: 32 experts, "
        "top-4, hidden and expert FFN 2880, 64 query and 8 key-value heads of 64, vocabulary 201,088)",
    )
    p.add_argument("--layers", type=int)
    p.add_argument("--experts", type=int)
    p.add_argument("--top-k", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--ffn", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--prompt", type=int, default=8, help="prompt tokens (random ids)")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per timed run")
    p.add_argument(
        "--weight-scale",
        type=float,
        default=3.0,
        help="every weight matrix N(0, scale / sqrt(fan-in)); at 3 greedy tokens vary and each layer "
        "routes over nearly all its experts (at transformers' init, 0.02, the tokens repeat and "
        "a layer uses a fifth of its experts)",
    )
    p.add_argument("--budgets", default="1.0,0.25", help="fractions of the experts the cache holds")
    p.add_argument(
        "--quant",
        default="bf16",
        help="the experts' formats, run in turn, comma-separated: bf16 (the model's float dtype), "
        "fp8 (transformers' FP8Experts, blocks of 128, quantized from the same weights) and, for gpt_oss, "
        "mxfp4 (transformers' Mxfp4GptOssExperts, quantized and swizzled from the same weights)",
    )
    p.add_argument(
        "--fp8-kernel",
        default=os.environ.get("EXPCACHE_FP8_KERNEL_DIR"),
        help="a directory holding transformers' FP8 kernel package (finegrained_fp8), for a machine "
        "without the Hugging Face hub (default: $EXPCACHE_FP8_KERNEL_DIR)",
    )
    p.add_argument(
        "--mxfp4-kernel",
        default=os.environ.get("EXPCACHE_MXFP4_KERNEL_DIR"),
        help="a directory holding triton_kernels (the gpt_oss_triton_kernels package), which transformers' MXFP4 "
        "experts compute with, for a machine without the Hugging Face hub (default: $EXPCACHE_MXFP4_KERNEL_DIR)",
    )
    p.add_argument("--rounds", type=int, default=5, help="timed runs of each copy per mode and budget, in alternation")
    p.add_argument("--json", type=Path, help="write the results here")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error("--rounds must be at least 1")
    a.quant = a.quant.split(",")
    if any(q not in QUANTS for q in a.quant):
        p.error(f"--quant: comma-separated of {', '.join(QUANTS)}, got {','.join(a.quant)}")
    if "mxfp4" in a.quant and a.model != "gpt_oss":
        p.error("--quant mxfp4: transformers has MXFP4 experts for GPT-OSS only: give --model gpt_oss")
    geometry = dict(
        layers=16, experts=128, top_k=8, hidden=2048, ffn=768, heads=32, kv_heads=4, head_dim=128, vocab=151936
    )
    for name, value in {**geometry, **MODELS[a.model][1]}.items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    return a


def build_model(a, device: torch.device):
    common = dict(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        num_experts_per_tok=a.top_k,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim,
        max_position_embeddings=max(4096, a.prompt + a.tokens),
    )
    if a.model == "gpt_oss":  # GraphDecoder captures a sliding window only when it holds every position
        config = transformers.GptOssConfig(
            **common, intermediate_size=a.ffn, num_local_experts=a.experts, sliding_window=max_len(a)
        )
    else:
        config = transformers.Qwen3MoeConfig(
            **common,
            intermediate_size=4 * a.ffn,
            moe_intermediate_size=a.ffn,
            num_experts=a.experts,
            norm_topk_prob=True,
        )
    cls = transformers.GptOssForCausalLM if a.model == "gpt_oss" else transformers.Qwen3MoeForCausalLM
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(0)
        with device:
            model = cls(config)
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


def timed(run, device, tokens: int, stats):
    """One decode run: its tokens, its decode rate ((N - 1) tokens over the time of N tokens less
    the time of 1: the prompt's forward and the first token) and the counters' change over the
    run of N (``stats``: a function returning counters with ``hits`` and ``misses``, or None)."""
    sync(device)
    t0 = time.perf_counter()
    run(1)
    sync(device)
    first = time.perf_counter() - t0
    before = stats() if stats else None
    t0 = time.perf_counter()
    out = run(tokens)
    sync(device)
    seconds = time.perf_counter() - t0 - first
    after = stats() if stats else None
    counts = (after.hits - before.hits, after.misses - before.misses) if stats else (0, 0)
    return out, (tokens - 1) / max(seconds, 1e-9), counts


class Paired:
    """One mode's decode rates, the unmodified copy's and the offloaded copy's, timed in
    alternation: after one untimed run of N tokens each (a graph decoder captures its step there,
    kernels are chosen, the cache is warmed to its steady state), ``rounds`` rounds of one timed
    run each. ``stats`` (the offload's ``total_stats``) gives the counters of the offloaded
    copy's timed runs (``self.hits``, ``self.misses``); ``tokens_equal`` is whether every run's
    tokens equal the unmodified copy's."""

    def __init__(self, unmodified, offloaded, device, tokens: int, rounds: int, stats):
        want = unmodified(tokens)
        outs = [offloaded(tokens)]
        self.unmodified, self.offloaded, self.ratios = [], [], []
        self.hits = self.misses = 0
        for _ in range(rounds):
            out, rate, _ = timed(unmodified, device, tokens, None)
            outs.append(out)
            self.unmodified.append(rate)
            out, rate, (hits, misses) = timed(offloaded, device, tokens, stats)
            outs.append(out)
            self.offloaded.append(rate)
            self.ratios.append(self.offloaded[-1] / self.unmodified[-1])
            self.hits += hits
            self.misses += misses
        self.tokens_equal = all(torch.equal(o.cpu(), want.cpu()) for o in outs)

    @property
    def runs(self) -> int:
        return len(self.ratios)

    @property
    def unmodified_tok_s(self) -> float:
        return statistics.median(self.unmodified)

    @property
    def tok_s(self) -> float:
        return statistics.median(self.offloaded)

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    @property
    def hit_rate(self) -> float:
        return self.hits / max(self.hits + self.misses, 1)


def max_len(a) -> int:
    """GraphDecoder's static KV cache's positions."""
    return a.prompt + 512


def runs(model, prompt, device, a):
    """The two modes as functions of the number of new tokens, returning the tokens."""
    decoder = GraphDecoder(model, max_len=max_len(a))

    def eager(n):
        with torch.no_grad():
            return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    return {"eager": eager, "graph": lambda n: decoder.generate(prompt, n)}


def link_rate(device) -> float:
    """The host-to-device rate of the benchmark's link (``expcache_bench.link``: cudaMemcpyAsync
    of 64 MiB from pinned memory); 0 on the CPU."""
    if device.type != "cuda":
        return 0.0
    probe = ModelLayout((LayerSpec(64, 1 << 19, 1 << 19, 1 << 19),))
    with HostSource(probe, pinned=True) as pinned:
        return measure(pinned, 64 << 20, cuda=True, device=device.index or 0).bytes_per_s


def run_format(a, quant: str, device, rate: float, rows: list, results: list) -> int:
    """Every budget and mode of the model with its experts in ``quant``: a row and a result each
    (appended); returns the runs whose tokens differ from the unmodified model's."""
    budgets = [float(f) for f in a.budgets.split(",")]
    model = build_model(a, device)
    if quant == "fp8":
        _fp8_experts.quantize_experts(model, block=(128, 128))
    elif quant == "mxfp4":
        _mxfp4_experts.quantize_experts(model)
    layers = find_experts(model)
    expert_bytes = sum(w[0].numel() * w.element_size() for e in layers for w in e.weights) / len(layers)
    prompt = torch.randint(0, a.vocab, (1, a.prompt), generator=torch.Generator().manual_seed(1)).to(device)
    print(
        f"{type(model).__name__}: {a.layers} layers x {a.experts} experts, top-{a.top_k}, hidden {a.hidden}, "
        f"expert FFN {a.ffn}, experts in {quant}, {expert_bytes / 2**20:.2f} MiB per expert, "
        f"{len(layers) * a.experts * expert_bytes / 2**30:.2f} GiB of experts; prompt {a.prompt}, "
        f"{a.tokens} new tokens; {device}"
    )
    served = copy.deepcopy(model)  # the same weights, offloaded at each budget in turn
    unmodified = runs(model, prompt, device, a)
    bad = 0
    for fraction in budgets:
        with offload(served, budget_fraction=fraction) as handle:
            sync(device)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the experts' device copies, freed by the first offload
            paired = {
                mode: Paired(unmodified[mode], run, device, a.tokens, a.rounds, handle.total_stats)
                for mode, run in runs(served, prompt, device, a).items()
            }
        step_s = 1 / paired["graph"].unmodified_tok_s
        for mode, p in paired.items():
            bad += not p.tokens_equal
            # Misses per token forward of the timed runs: each run's prompt P and N - 1 steps.
            miss_bytes = p.misses * expert_bytes / (p.runs * (a.prompt + a.tokens - 1))
            bound = 1 / (step_s + miss_bytes / rate) if rate else float("nan")
            rows.append(
                [
                    quant,
                    f"{fraction:g}",
                    mode,
                    f"{p.unmodified_tok_s:.2f}",
                    f"{p.tok_s:.2f}",
                    f"{p.ratio:.2f} ({min(p.ratios):.2f}-{max(p.ratios):.2f})",
                    f"{100 * p.hit_rate:.1f} %",
                    f"{bound:.2f}" if rate else "",
                    f"{100 * p.tok_s / bound:.1f} %" if rate else "",
                ]
            )
            results.append(
                {
                    "quant": quant,
                    "expert_bytes": expert_bytes,
                    "budget": fraction,
                    "mode": mode,
                    "rounds": p.runs,
                    "unmodified_tok_s": p.unmodified_tok_s,
                    "tok_s": p.tok_s,
                    "ratio": p.ratio,
                    "ratios": p.ratios,
                    "unmodified_runs_tok_s": p.unmodified,
                    "runs_tok_s": p.offloaded,
                    "hit_rate": p.hit_rate,
                    "bound_tok_s": bound if rate else None,
                    "link_bytes_per_s": rate,
                    "tokens_equal": p.tokens_equal,
                }
            )
            if not p.tokens_equal:
                print(
                    f"{quant} offload {fraction:g} {mode}: tokens differ from the unmodified model's", file=sys.stderr
                )
    return bad


def main(argv=None) -> int:
    a = parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device for torch: run with --device cpu", file=sys.stderr)
        return 2
    kernels = {  # --quant: (its kernel's directory, what runs it, the package, where it goes)
        "fp8": (a.fp8_kernel, "transformers' FP8 Triton kernel", "finegrained_fp8", _fp8_experts),
        "mxfp4": (a.mxfp4_kernel, "triton_kernels' matmul", "gpt_oss_triton_kernels", _mxfp4_experts),
    }
    for quant, (where, what, package, module) in kernels.items():
        if quant not in a.quant:
            continue
        if device.type != "cuda" or not where:
            print(
                f"--quant {quant} runs {what}: on a CUDA device, with --{quant}-kernel DIR (or "
                f"$EXPCACHE_{quant.upper()}_KERNEL_DIR) naming a directory that holds its {package} package",
                file=sys.stderr,
            )
            return 2
        module.install_kernel(where)
    rate = link_rate(device)
    rows, results, bad = [], [], 0
    for quant in a.quant:
        bad += run_format(a, quant, device, rate, rows, results)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(
        tabulate(
            rows,
            headers=[
                "experts",
                "budget",
                "mode",
                "unmodified tok/s",
                "offloaded tok/s",
                "x unmodified (range)",
                "hits",
                "link bound tok/s",
                "of bound",
            ],
            disable_numparse=True,
        )
    )
    print(f"medians of {a.rounds} rounds; each round times the unmodified copy, then the offloaded one")
    if device.type == "cuda":
        print(f"link: {rate / 1e9:.1f} GB/s (cudaMemcpyAsync from pinned memory, 64 MiB)")
    rates = {(r["quant"], r["budget"], r["mode"]): r["tok_s"] for r in results}
    for (quant, fraction, mode), rate in rates.items():
        if quant != "bf16" and ("bf16", fraction, mode) in rates:
            ratio = rate / rates["bf16", fraction, mode]
            print(f"budget {fraction:g}, {mode}: {quant} experts {ratio:.2f}x bf16's tok/s in the same run")
    print("tokens equal to the unmodified model's in every run" if not bad else f"{bad} runs' tokens differ")
    if a.json:
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "results": results}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
