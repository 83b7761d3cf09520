"""A speculative verification step through expcache's device select, beside the same step over a
bank with a fixed slot map (issue #37's target: at least 0.95x).

The step verifies ``--rows`` draft tokens (default 4) at once: per layer, ``[rows, k]`` routed
ids (default 16 layers of 128 experts, top-8, 9 MiB experts in page-locked host memory; the
rows are consecutive tokens of the synthetic decode trace, so they share experts). One
``ExpertCache(..., lookup="device")`` holds every expert (its working set is cached: it is
warmed with every id, so every select of the timed pass hits), and three ways to serve a step
read the same bank, each step one CUDA graph:

- ``select_device``: per layer ``cache.select_device(layer, ids)`` of the ``[rows, k]`` ids, then
  expcache's bank checksum kernel reading every routed expert (all ``rows * k``, repeats too) by
  the slots it returned;
- ``select_device + counts``: the same with ``counts=`` (the union's distinct experts and its
  misses written on the device, for choosing the next draft's length);
- ``fixed slot map``: no select; each step's slots were looked up once, before the timing, in the
  slot map the warming left (the ids' slots never move: every select hits), and the same kernel
  reads the same experts through the same bank.

A step's time runs from the copy of its ids (or its slots) into the graph's input to the end of a
synchronize; the three take turns in ``--rounds`` blocks of consecutive steps. After every step,
outside the timing: the kernel's sums against the source's, the selects' slots against the fixed
map, the counts against the ids' union. Printed: time per step (median of the rounds), the ratio
to the fixed map's (the fixed map's µs/step ÷ the step's: 1 is free, the target 0.95), and an
all-hit ``select_device`` of ``[rows, k]`` per layer (a graph of one select per layer replayed).

Exits 1 without a GPU (``--device cpu`` runs the same steps on expcache's host backend, eagerly:
a check of the logic whose times mean nothing) or when a check fails.

Run (from the repository root, after ``make lib``):
    python3 benchmarks/verify_step.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _device_step as ds
from tabulate import tabulate

from pyexpcache import ExpertCache, testing

TARGET = 0.95  # the issue's: the select_device step at least 0.95x the fixed map's


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ds.add_device_option(p)
    ds.add_geometry_options(p)
    p.add_argument("--rows", type=int, default=4, help="draft tokens verified per step (default 4)")
    p.add_argument("--steps", type=int, help="verification steps timed (default 128; --quick 32; cpu 6)")
    p.add_argument("--rounds", type=int, help="timed blocks, the ways taking turns (default 8; --quick 4; cpu 2)")
    p.add_argument("--replays", type=int, help="replays of the all-hit select graph (default 200; --quick 50; cpu 1)")
    ds.add_run_options(p)
    a = p.parse_args(argv)
    ds.fill_counts(a, (("steps", 128, 32, 6), ("rounds", 8, 4, 2), ("replays", 200, 50, 1)))
    if a.steps < 1 or a.rounds < 1 or a.replays < 1 or a.rounds > a.steps or a.rows < 1:
        p.error("need --rows >= 1, --steps >= 1, 1 <= --rounds <= --steps, --replays >= 1")
    return a


def warm(cache: ExpertCache, a, device, stream) -> np.ndarray:
    """Every expert of every layer made resident; returns the slot map, int32 [layers, experts]."""
    slot_map = np.zeros((a.layers, a.experts), np.int32)
    every = torch.arange(a.experts, dtype=torch.int32, device=device)
    for layer in range(a.layers):
        slot_map[layer] = cache.select_device(layer, every, stream=stream).cpu().numpy()
    if (slot_map < 0).any() or len(np.unique(slot_map)) != slot_map.size:
        raise RuntimeError("warming did not give every expert its own slot")
    return slot_map


def main(argv=None) -> int:
    a = parse_args(argv)
    why = ds.pick_device(a, "the verification step benchmark")
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 1
    shrunk = ds.fill_geometry(a)
    L, E, k, n = a.layers, a.experts, a.top_k, a.rows
    if n * k > 1024:
        sys.exit(f"--rows x --top-k must be at most 1024 (a select's ids), got {n * k}")
    cuda = a.device == "cuda"
    device = torch.device("cuda" if cuda else "cpu")
    layout = ds.layout_of(a)
    print(
        f"{L} layers x {E} experts, top-{k}, {n} rows per step, {a.expert_bytes / 2**20:.2f} MiB experts "
        f"({layout.total_bytes / 2**30:.2f} GiB, pinned); {a.steps} steps (synthetic routing, seed {a.seed}); "
        f"{a.rounds} rounds; "
        + (f"GPU {torch.cuda.get_device_name()}" if cuda else "CPU (expcache host backend: times mean nothing)")
    )
    if shrunk:
        print(f"note: the CPU check's geometry: {', '.join(shrunk)}")
    source = ds.Source(layout, device, device_copy=False)  # the checksums check the reads
    # [steps * rows, L, k] -> [steps, L, rows, k]: step s verifies tokens s*rows .. s*rows + rows - 1
    ids = ds.routing(a.steps * n, a, a.seed).reshape(a.steps, n, L, k).transpose(0, 2, 1, 3).copy()
    stream = lambda: ds.current_stream(cuda)  # noqa: E731 (torch's stream now: the capture's while capturing)
    sync = ds.sync_of(cuda)
    cache = ExpertCache(
        layout, source.host, budget_experts=L * E, backend="cuda" if cuda else "host", lookup="device", log_level=1
    )
    try:
        for layer in range(L):
            cache.bank(layer)  # binds every class before any capture
        slot_map = warm(cache, a, device, stream())
        sync()
        fixed = slot_map[np.arange(L)[None, :, None, None], ids]  # [steps, L, rows, k]
        want_sums = source.expected[np.arange(L)[None, :, None, None], ids].reshape(a.steps, L * n * k)
        union = np.array([[len(np.unique(ids[s, layer])) for layer in range(L)] for s in range(a.steps)])
        all_ids = torch.from_numpy(ids).to(device)
        all_slots = torch.from_numpy(fixed).to(device)

        def read(slots_of) -> None:
            for layer in range(L):
                testing.bank_checksum_async(cache, layer, slots_of(layer), first=layer * n * k, stream=stream())

        def sums_ok(t: int) -> list[str]:
            got = testing.checksum_results(cache, 0, L * n * k)
            bad = np.flatnonzero(got != want_sums[t])
            if not bad.size:
                return []
            layer, rest = divmod(int(bad[0]), n * k)
            return [f"{bad.size} sums differ (first: layer {layer}, expert {ids[t, layer].ravel()[rest]})"]

        ways = []
        for counted in (False, True):
            x_ids = torch.zeros(L, n, k, dtype=torch.int32, device=device)
            x_slots = torch.zeros(L, n, k, dtype=torch.int32, device=device)
            counts = torch.zeros(L, 2, dtype=torch.int32, device=device) if counted else None

            def step(x_ids=x_ids, x_slots=x_slots, counts=counts):
                for layer in range(L):
                    kw = {} if counts is None else {"counts": counts[layer]}
                    cache.select_device(layer, x_ids[layer], stream=stream(), out=x_slots[layer], **kw)
                    testing.bank_checksum_async(cache, layer, x_slots[layer], first=layer * n * k, stream=stream())

            def check(t, x_slots=x_slots, counts=counts) -> list[str]:
                problems = sums_ok(t)
                if not np.array_equal(x_slots.cpu().numpy(), fixed[t]):
                    problems.append("the select's slots differ from the fixed map (an expert moved)")
                if counts is not None:
                    got = counts.cpu().numpy()
                    if not (np.array_equal(got[:, 0], union[t]) and not got[:, 1].any()):
                        problems.append(f"counts {got.tolist()} differ from the union {union[t].tolist()} and 0 misses")
                return problems

            name = "select_device + counts" if counted else "select_device"
            ways.append((ds.Contender(name, lambda t, x_ids=x_ids: x_ids.copy_(all_ids[t]), None, check), step))
        b_slots = torch.zeros(L, n, k, dtype=torch.int32, device=device)
        ways.append(
            (
                ds.Contender("fixed slot map (no select)", lambda t: b_slots.copy_(all_slots[t]), None, sums_ok),
                lambda: read(lambda layer: b_slots[layer]),
            )
        )
        contenders = [c for c, _ in ways]
        for c, fn in ways:
            c.put(0)
            c.run = ds.Step(fn, cuda).run  # step 0 eagerly, then captured
            sync()
            c.verify(0)
        misses_before = cache.stats().path("device").misses
        ds.alternate(contenders, np.arange(a.steps), a.rounds, sync)
        timed_misses = cache.stats().path("device").misses - misses_before

        # an all-hit select_device of [rows, k] per layer: the last step's ids
        sel_ids = torch.from_numpy(ids[-1]).to(device)
        sel_out = torch.zeros_like(sel_ids)
        sel = ds.Step(
            lambda: [cache.select_device(i, sel_ids[i], stream=stream(), out=sel_out[i]) for i in range(L)], cuda
        )
        sync()
        t0 = time.perf_counter()
        for _ in range(a.replays):
            sel.run()
        sync()
        select_us = 1e6 * (time.perf_counter() - t0) / (a.replays * L)
        if cache.stats().path("device").misses != misses_before + timed_misses:
            contenders[0].bad += 1
            contenders[0].errors.append("the all-hit select graph missed")
    finally:
        cache.close()
        source.close()

    base = contenders[-1]
    rows, results = [], []
    for c in contenders:
        med, lo, hi = ds.ratio_summary(base.seconds, c.seconds)
        us = ds.median_us(c.seconds)
        results.append(
            dict(
                way=c.name,
                us_per_step=us,
                rounds_us=[1e6 * s for s in c.seconds],
                ratio=(med, lo, hi),
                checked=c.checked,
                bad=c.bad,
                errors=c.errors,
            )
        )
        is_base = c is base
        met = "—" if is_base or not cuda else ("met" if med >= TARGET else "NOT met")
        rows.append(
            [
                c.name,
                f"{us:.1f}",
                "1" if is_base else f"{med:.3f}x",
                "—" if is_base else f"{lo:.3f}-{hi:.3f}",
                met if c is contenders[0] else "—",
                f"{c.bad} bad / {c.checked} steps",
            ]
        )
    print(
        tabulate(
            rows,
            headers=["way", "µs/step", "vs fixed map", "range", f"target >= {TARGET}x", "checks"],
            disable_numparse=True,
        )
    )
    print(
        f"ratio = the fixed map's µs/step ÷ the way's, per round (median and range); misses in the timed "
        f"selects: {timed_misses} (the working set is cached: 0 expected)"
    )
    print(
        f"all-hit select_device of [{n}, {k}] per layer: {select_us:.2f} µs"
        + (" (graph replay)" if cuda else " (host backend: meaningless as a time)")
    )
    failed = [(c.name, e) for c in contenders for e in c.errors]
    if timed_misses:
        failed.append(("select_device", f"{timed_misses} misses in the timed pass: the working set was not cached"))
    for name, e in failed:
        print(f"CHECK FAILED: {name}: {e}", file=sys.stderr)
    if a.json:
        a.json.write_text(
            json.dumps(
                {
                    "args": {key: str(v) for key, v in vars(a).items()},
                    "results": results,
                    "timed_misses": timed_misses,
                    "all_hit_select_us_per_layer": select_us,
                },
                indent=1,
            )
        )
        print(f"wrote {a.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
