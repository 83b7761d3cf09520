"""The MoE of torch_moe_decode.py decoded expert-parallel over several ranks, each with its own cache.

Each rank (a process, one GPU each when there are enough) owns a share of every layer's experts
(a ``pyexpcache.Placement``: expert e on rank e mod N by default, or balanced by the request counts
of a first decode) and serves them from its own ``ExpertCache`` over its own link. Per layer,
rank 0 runs the dense part and the router, then the expert-parallel exchange goes through
``torch.distributed``: the hidden state and the routed ids are broadcast to every rank (dispatch),
each rank runs the experts it owns from zero-copy views and writes their outputs into its rows of
a [k, H] buffer, and a sum-reduce to rank 0 gathers the rows (combine; each row comes from its one
owner, the others add zeros). Rank 0 then combines them in router order as the one-device model
does, so its logits must equal the all-resident one-device run bit for bit.

NCCL moves the tensors when every rank has a GPU of its own (NVLink multicast off:
``NCCL_NVLS_ENABLE=0``); otherwise gloo does, through host memory (several ranks sharing one GPU,
or the CPU and expcache's host backend).

Run:  python3 examples/torch_moe_decode_ep.py [--ranks 2] [--device auto|cuda|cpu] [...]
      torchrun --nproc-per-node 2 examples/torch_moe_decode_ep.py   (the ranks from torchrun)
Model sizes and --budget-fraction (here: of each rank's own experts) as in torch_moe_decode.py.
Exits 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_moe_decode import (
    BF16,
    CPU_DEFAULTS,
    DEFAULTS,
    Model,
    TorchHostSource,
    cuda_unusable_reason,
    decode,
    expert_ffn,
)

from expcache_bench.sim import DECODE, Call
from pyexpcache import ExpertCache, LayerSpec, ModelLayout, Placement, loads_from_calls


def setup(a, rank, world):
    """The rank's torch device and the tensors' device for the exchange."""
    if a.on_cuda:
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    comm = device if a.dist_backend == "nccl" else torch.device("cpu")
    return device, comm


def run_rank(rank, world, a, init):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # the machines' notes: no NVLink multicast
    dist.init_process_group(a.dist_backend, init_method=init, rank=rank, world_size=world)
    try:
        return _decode_rank(rank, world, a)
    finally:
        dist.destroy_process_group()


def _decode_rank(rank, world, a):
    device, comm = setup(a, rank, world)
    model = Model(a, device)  # the same seed on every rank: the same weights
    part = a.ffn * a.hidden * 2
    layout = ModelLayout(tuple(LayerSpec(a.experts, part, part, part) for _ in range(a.layers)), name="torch-moe")
    sync = torch.cuda.synchronize if a.on_cuda else (lambda: None)

    # The reference, on rank 0 only: every expert resident, one device. It also gives the request
    # counts a balanced placement uses (a profile of the same prompt: say so in the output).
    ref = None
    seen = []

    def resident(layer, h, ids):
        seen.append(Call(DECODE, layer, tuple(ids.tolist())))
        return [expert_ffn(h, *(t[e] for t in model.resident[layer])) for e in ids.tolist()]

    if rank == 0:
        model.step(a.prompt, 0, resident)
        seen.clear()
        ref = decode(model, resident, a, sync)
    if a.placement == "balanced":
        box = [loads_from_calls(layout, seen) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        placement = Placement.balanced(layout, world, box[0])
    else:
        placement = Placement.round_robin(layout, world)
    owned = sum(int((o == rank).sum()) for o in placement.owners) * layout[0].expert_bytes
    budget = max(1, int(a.budget_fraction * owned))
    shapes = ((a.ffn, a.hidden), (a.ffn, a.hidden), (a.hidden, a.ffn))
    source = TorchHostSource(layout, model.host, model.pinned)
    stream = torch.cuda.current_stream().cuda_stream if a.on_cuda else None
    h_buf = torch.empty(1, a.hidden, dtype=BF16, device=comm)
    ids_buf = torch.empty(a.top_k, dtype=torch.int64, device=comm)

    with ExpertCache(
        layout,
        source,
        budget_bytes=budget,
        backend="cuda" if a.on_cuda else "host",
        device=device.index or 0,
        log_level=1,
    ) as cache:

        def exchange(layer, h, ids):
            """Dispatch h and ids from rank 0, run this rank's experts, combine the rows on rank 0."""
            if rank == 0:
                h_buf.copy_(h)
                ids_buf.copy_(torch.from_numpy(ids.astype(np.int64)))
            dist.broadcast(h_buf, src=0)
            dist.broadcast(ids_buf, src=0)
            hl = h_buf.to(device)
            mine = ids_buf.cpu().numpy()
            pos = np.flatnonzero(placement.owners[layer][mine] == rank)
            rows = torch.zeros(a.top_k, a.hidden, dtype=BF16, device=device)
            if pos.size:
                views = cache.select_views(layer, mine[pos].astype(np.uint32), stream, dtype="bfloat16", shapes=shapes)
                for i, view in zip(pos.tolist(), views):
                    rows[i] = expert_ffn(hl, *(torch.from_dlpack(p) for p in view))[0]
            out = rows.to(comm)
            dist.reduce(out, dst=0, op=dist.ReduceOp.SUM)
            return [out[i : i + 1].to(device) for i in range(a.top_k)] if rank == 0 else None

        if rank == 0:
            got = decode(model, exchange, a, sync)
        else:  # serve rank 0's layers, as many as it runs
            sync()
            t0 = time.perf_counter()
            for _ in range(a.tokens):
                for layer in range(a.layers):
                    exchange(layer, None, None)
            sync()
            got = (None, None, time.perf_counter() - t0)
        st = cache.stats().path("decode")
    stats = [None] * world
    dist.all_gather_object(stats, (rank, str(device), st.hits, st.misses, st.bytes_h2d, budget))
    if rank != 0:
        return 0
    (ref_logits, ref_tokens, ref_s), (got_logits, got_tokens, got_s) = ref, got
    print(f"{'reference (one device, all resident):':40}{a.tokens / ref_s:8.1f} tok/s")
    print(
        f"{f'expcache, {world} ranks expert-parallel:':40}{a.tokens / got_s:8.1f} tok/s "
        f"(exchange over {a.dist_backend})"
    )
    for r, dev, hits, misses, moved, b in stats:
        print(
            f"  rank {r} on {dev}: budget {b / 2**20:.1f} MiB, hit rate {hits / max(1, hits + misses):.1%} "
            f"({hits} hits, {misses} misses, {moved / 2**20:.1f} MiB host to device)"
        )
    print(f"tokens: {got_tokens}")
    for step, (want, have) in enumerate(zip(ref_logits, got_logits)):
        if not torch.equal(want, have):
            print(
                f"MISMATCH at step {step}: logits differ (max |diff| {(want - have).abs().max().item():.3g}; "
                f"reference token {ref_tokens[step]}, expert-parallel token {got_tokens[step]})"
            )
            return 1
    print(f"logits bit-identical to the one-device run: yes ({a.tokens} steps)")
    return 0


def _spawned(rank, world, a, init, results):
    results[rank] = run_rank(rank, world, a, init)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="processes to spawn (default 2; ignored under torchrun)")
    p.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="cuda: one GPU per rank where there are enough, shared otherwise; cpu: the host\n"
        "backend; auto: cuda when usable (default)",
    )
    p.add_argument(
        "--dist-backend",
        choices=("auto", "nccl", "gloo"),
        default="auto",
        help="auto: nccl when every rank has its own GPU, else gloo (default)",
    )
    p.add_argument(
        "--placement",
        choices=("round-robin", "balanced"),
        default="round-robin",
        help="which rank owns each expert (balanced: by the reference run's request counts)",
    )
    for name in ("layers", "experts", "hidden", "ffn", "vocab"):
        p.add_argument(
            f"--{name}",
            type=int,
            help=f"as in torch_moe_decode.py (default {DEFAULTS[name]}; {CPU_DEFAULTS[name]} on cpu)",
        )
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt", type=int, default=1)
    p.add_argument(
        "--budget-fraction",
        type=float,
        default=0.25,
        help="each rank's cache budget as a fraction of the experts it owns (default 0.25)",
    )
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.split = a.prefetch = False  # Model takes the single-device example's arguments

    reason = cuda_unusable_reason() if a.device != "cpu" else "asked for cpu"
    if a.device == "cuda" and reason:
        sys.exit(f"--device cuda: {reason}")
    a.on_cuda = reason is None
    defaults = DEFAULTS if a.on_cuda else CPU_DEFAULTS
    for n, v in defaults.items():
        setattr(a, n, v if getattr(a, n) is None else getattr(a, n))
    if not 1 <= a.top_k <= a.experts or not 0 < a.budget_fraction <= 1 or not 0 <= a.prompt < a.vocab:
        sys.exit("need 1 <= --top-k <= --experts, 0 < --budget-fraction <= 1 and 0 <= --prompt < --vocab")
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else a.ranks
    if not 1 <= world <= 64:
        sys.exit(f"--ranks must be 1..64, got {world}")
    gpus = torch.cuda.device_count() if a.on_cuda else 0
    if a.dist_backend == "auto":
        a.dist_backend = "nccl" if a.on_cuda and gpus >= world else "gloo"
    if a.dist_backend == "nccl" and not (a.on_cuda and gpus >= world):
        sys.exit(f"--dist-backend nccl needs a GPU per rank ({world} ranks, {gpus} GPUs)")
    if not under_torchrun or int(os.environ["RANK"]) == 0:
        where = f"{gpus} GPU(s)" if a.on_cuda else f"the CPU (expcache host backend; {reason})"
        print(
            f"{world} ranks on {where}; exchange over {a.dist_backend}; placement {a.placement}; model "
            f"{a.layers} layers x {a.experts} experts (top-{a.top_k}), hidden {a.hidden}, ffn {a.ffn}, bf16"
        )
    if under_torchrun:
        return run_rank(int(os.environ["RANK"]), world, a, "env://")
    with tempfile.TemporaryDirectory() as tmp:
        results = mp.Manager().list([1] * world)
        mp.spawn(_spawned, args=(world, a, f"file://{tmp}/rendezvous", results), nprocs=world, join=True)
        return max(results)


if __name__ == "__main__":
    sys.exit(main())
