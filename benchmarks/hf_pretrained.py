"""A checkpoint served from its own files (``pyexpcache.hf.offload_pretrained``), beside the same
checkpoint loaded whole on the GPU, with the disk's and the link's rates measured in the run.

The model is hf_decode.py's random ``Qwen3MoeForCausalLM`` of Qwen3-30B-A3B's layer geometry (16
layers of 128 experts, top-8, hidden 2048, expert FFN 768, bf16: 18 GiB of experts), written with
``save_pretrained`` into ``--dir`` (the checkpoint's shards, 2 GB each). Then:

1. the unmodified model, every weight on the GPU: :class:`~pyexpcache.hf.GraphDecoder` decodes
   ``--tokens`` tokens (a first run captures the step; the second is timed): the reference tokens
   and the step's time;
2. a child process (its peak resident memory is its own): the checkpoint's pages dropped from the
   page cache, ``offload_pretrained`` at ``--budget-fraction`` of the experts' bytes with a host
   pool of ``--host-fraction`` of them, the same decode (warm-up run, then timed), the counters of
   the timed run (device misses, pool hits, reads from the files) and the peak RSS;
3. the disk's read rate, read as the served run reads (O_DIRECT by default; buffered after the
   pages are dropped with ``--file-reads buffered``): experts' sizes at random offsets of the
   largest shard, the best of the library's shape (its default copy threads in the feed's
   pieces) and of more threads and larger pieces up to whole experts
   (:func:`expcache_bench.disk.measure`); and the link's (:func:`hf_decode.link_rate`).

The bound of a token: the unmodified step, plus the bytes read from the files at the lower of
the disk's and the link's rates, plus the bytes the pool served at the link's. Exits 1 when the
tokens differ from the unmodified model's.

Run (from the repository root, after ``make lib``, on a GPU; it writes about 20 GB to --dir):
    python3 benchmarks/hf_pretrained.py [--dir DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_decode

from expcache_bench.disk import measure
from pyexpcache import LayerPlacement, staging_defaults
from pyexpcache.hf import GraphDecoder, find_experts


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", help="where the checkpoint is written (default: a temporary folder here), removed after")
    p.add_argument("--budget-fraction", type=float, default=0.25, help="the device cache's share of the experts")
    p.add_argument("--host-fraction", type=float, default=0.25, help="the host pool's share of the experts")
    p.add_argument(
        "--file-reads",
        choices=("buffered", "direct"),
        default="direct",
        help="how the misses read the shards (offload_pretrained's file_reads), and how the disk's rate "
        "is measured: with O_DIRECT (default) or buffered, after the page cache is dropped",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)  # the served run, in its own process
    p.add_argument("--json", type=Path, help="write the results here")
    a, rest = p.parse_known_args(argv)
    a.model = hf_decode.parse_args(rest)  # the model's geometry, --tokens, --prompt
    return a


def decode(model, prompt, tokens: int, device):
    """GraphDecoder's tokens of two runs (the first captures) and the second's decode rate."""
    decoder = GraphDecoder(model, max_len=prompt.shape[1] + tokens + 8)
    decoder.generate(prompt, tokens)
    out, rate, _ = hf_decode.timed(lambda n: decoder.generate(prompt, n), device, tokens, None)
    return out, rate


def drop_page_cache(paths) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def served_run(a) -> dict:
    """The child: the checkpoint served from its files; what it measured, as a dict."""
    from pyexpcache.hf import offload_pretrained

    info = json.loads(a.child)
    drop_page_cache(info["shards"])
    m = a.model
    device = torch.device(m.device)
    prompt = torch.randint(0, m.vocab, (1, m.prompt), generator=torch.Generator().manual_seed(1)).to(device)
    t0 = time.perf_counter()
    handle = offload_pretrained(
        info["dir"],
        budget_fraction=a.budget_fraction,
        host_budget_bytes=int(a.host_fraction * info["experts_bytes"]),
        file_reads=a.file_reads,
        device=device,
        dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
    )
    load_s = time.perf_counter() - t0
    with handle:
        decoder = GraphDecoder(handle.model, max_len=prompt.shape[1] + m.tokens + 8)
        decoder.generate(prompt, m.tokens)
        before = [c.stats() for c in handle.caches]
        out, rate, _ = hf_decode.timed(lambda n: decoder.generate(prompt, n), device, m.tokens, None)
        after = [c.stats() for c in handle.caches]
    diff = lambda f: sum(f(y) - f(x) for x, y in zip(before, after))  # noqa: E731
    return {
        "tokens": out.cpu().tolist(),
        "tok_s": rate,
        "load_s": load_s,
        "misses": diff(lambda s: s.total.misses),
        "hits": diff(lambda s: s.total.hits),
        "pool_hits": diff(lambda s: s.pool.hits),
        "pool_bytes": diff(lambda s: s.pool.bytes_hit),
        "read_bytes": diff(lambda s: s.pool.bytes_source),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.child:
        print(json.dumps(served_run(a)))
        return 0
    m = a.model
    device = torch.device(m.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device for torch: run with --device cpu (a check of the script)", file=sys.stderr)
        return 2
    work = Path(a.dir or tempfile.mkdtemp(prefix="hf_pretrained.", dir="."))
    work.mkdir(parents=True, exist_ok=True)
    try:
        model = hf_decode.build_model(m, device)
        experts_bytes = sum(w.numel() * w.element_size() for e in find_experts(model) for w in e.weights)
        prompt = torch.randint(0, m.vocab, (1, m.prompt), generator=torch.Generator().manual_seed(1)).to(device)
        want, unmodified_tok_s = decode(model, prompt, m.tokens, device)
        t0 = time.perf_counter()
        model.save_pretrained(work, max_shard_size="2GB")
        save_s = time.perf_counter() - t0
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        shards = sorted(str(p) for p in work.glob("*.safetensors"))
        info = {"dir": str(work), "shards": shards, "experts_bytes": experts_bytes}
        child = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(info), *(argv if argv is not None else sys.argv[1:])],
            capture_output=True,
            text=True,
        )
        if child.returncode:
            print(child.stdout + child.stderr, file=sys.stderr)
            return 1
        served = json.loads(child.stdout.strip().splitlines()[-1])
        expert = experts_bytes // (m.layers * m.experts)
        biggest = max(shards, key=os.path.getsize)
        drop_page_cache(shards)
        disk = measure(
            biggest,
            [(LayerPlacement((0,), (expert,), (expert,)), os.path.getsize(biggest) // expert)],
            threads=staging_defaults()[0],  # offload_pretrained's caches: the library's default
            direct=a.file_reads == "direct",
        )
        link = hf_decode.link_rate(device)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    steps = m.tokens - 1  # the timed run's decode steps (hf_decode.timed leaves the first token out)
    runs = m.prompt + m.tokens - 1  # token forwards whose misses the counters hold
    read_per_token = served["read_bytes"] / runs
    pool_per_token = served["pool_bytes"] / runs
    # On the CPU (no link) the bound is the disk's alone, and the pool's hits cost nothing.
    rate = min(disk.bytes_per_s, link) if link else disk.bytes_per_s
    bound = 1 / (1 / unmodified_tok_s + read_per_token / rate + (pool_per_token / link if link else 0.0))
    equal = served["tokens"] == want.cpu().tolist()
    rows = [
        ("experts", f"{experts_bytes / 2**30:.2f} GiB in {len(shards)} shards (written in {save_s:.0f} s)"),
        ("unmodified (every weight loaded)", f"{unmodified_tok_s:.2f} tok/s"),
        ("served from the files", f"{served['tok_s']:.2f} tok/s ({served['load_s']:.1f} s to load)"),
        ("device hits", f"{100 * served['hits'] / max(served['hits'] + served['misses'], 1):.1f} %"),
        ("of the device's misses, from the pool", f"{100 * served['pool_hits'] / max(served['misses'], 1):.1f} %"),
        ("read from the files per token", f"{read_per_token / 2**20:.1f} MiB"),
        (
            f"disk ({'O_DIRECT' if disk.direct else 'buffered'}, best of {len(disk.tried)} shapes)",
            f"{disk.bytes_per_s / 1e9:.2f} GB/s ({disk.shape})",
        ),
        ("link", f"{link / 1e9:.1f} GB/s"),
        ("disk-and-link bound", f"{bound:.2f} tok/s; served at {100 * served['tok_s'] / bound:.1f} % of it"),
        (
            "peak host memory (served process)",
            f"{served['peak_rss_bytes'] / 2**30:.2f} GiB, "
            f"{served['peak_rss_bytes'] / experts_bytes:.2f}x the experts' bytes",
        ),
        ("tokens", "equal to the unmodified model's" if equal else "DIFFER from the unmodified model's"),
    ]
    width = max(len(k) for k, _ in rows)
    print(
        f"{m.layers} layers x {m.experts} experts, budget {a.budget_fraction:g}, host pool {a.host_fraction:g}, "
        f"{m.tokens} tokens ({steps} timed steps)"
    )
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if a.json:
        a.json.write_text(
            json.dumps(
                {
                    "experts_bytes": experts_bytes,
                    "unmodified_tok_s": unmodified_tok_s,
                    "served": served,
                    "disk_bytes_per_s": disk.bytes_per_s,
                    "disk_direct": disk.direct,
                    "disk_threads": disk.shape.threads,
                    "disk_piece_bytes": disk.shape.piece,
                    "link_bytes_per_s": link,
                    "bound_tok_s": bound,
                    "tokens_equal": equal,
                },
                indent=1,
            )
        )
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
