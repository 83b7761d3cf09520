"""The device select's miss rate from a source the GPU cannot read (the feed) beside the same
select from pinned memory the GPU maps, in one process: selects of `misses` distinct experts that
all miss (a bank of `cap` slots cycled through more experts than it holds), timed on the device
stream, at several misses per select. Prints GB/s of expert bytes and the fed/pinned ratio.

    python3 benchmarks/feed_rate.py [--expert-mib 7.4] [--misses 1,4,8,32] [--backend cuda]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from tabulate import tabulate

from pyexpcache import ExpertCache, HostSource, LayerSpec, ModelLayout


def _rate(cache, layer, experts, misses, rounds, sync):
    # Every select's ids on the device before the clock starts: a copy from pageable memory per
    # select would wait for the select before it, and time the host's round trips.
    ids_all = np.arange(experts, dtype=np.int64)
    ids = [_dev(cache, np.take(ids_all, range(r * misses, (r + 1) * misses), mode="wrap")) for r in range(rounds + 1)]
    cache.select_device(layer, ids[0])  # the feed's threads started, the first select's overheads paid
    sync()
    t0 = time.perf_counter()
    for r in range(1, rounds + 1):
        cache.select_device(layer, ids[r])
    sync()
    return rounds * misses, time.perf_counter() - t0


def _dev(cache, ids):
    if cache.backend == "host":
        return ids
    import torch

    return torch.from_numpy(ids).to("cuda")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--expert-mib", type=float, default=7.4)
    ap.add_argument("--misses", default="1,4,8,32")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--backend", default="cuda", choices=("cuda", "host"))
    args = ap.parse_args()
    part = int(args.expert_mib * 2**20 / 3) // 256 * 256
    counts = [int(m) for m in args.misses.split(",")]
    cap = max(counts) + 8
    experts = 2 * cap + 8  # every select misses: the bank cycles through more experts than it holds
    layout = ModelLayout([LayerSpec(experts, part, part, part)])
    if args.backend == "cuda":
        import torch

        sync = torch.cuda.synchronize
    else:
        sync = lambda: None  # noqa: E731
    rows = []
    with (
        HostSource(layout, pinned=False) as pageable,
        HostSource(layout, pinned=args.backend == "cuda") as pinned,
        ExpertCache(layout, pageable, budget_experts=cap, backend=args.backend, lookup="device", policy="lru") as fed,
        ExpertCache(layout, pinned, budget_experts=cap, backend=args.backend, lookup="device", policy="lru") as mapped,
    ):
        for m in counts:
            rounds = max(4, args.rounds * 8 // m)
            n1, t1 = _rate(fed, 0, experts, m, rounds, sync)
            n2, t2 = _rate(mapped, 0, experts, m, rounds, sync)
            gb = 3 * part / 1e9
            f, p = n1 * gb / t1, n2 * gb / t2
            rows.append([m, f"{t1 / (n1 / m) * 1e3:.3f}", f"{f:.1f}", f"{p:.1f}", f"{f / p:.3f}×"])
        assert fed.stats().path("device").misses == mapped.stats().path("device").misses
    print(f"expert {3 * part / 2**20:.2f} MiB, bank {cap} slots, {args.backend}; every select misses every id")
    print(
        tabulate(
            rows,
            headers=["misses/select", "fed ms/select", "fed GB/s", "pinned GB/s", "fed / pinned"],
            disable_numparse=True,
        )
    )


if __name__ == "__main__":
    main()
