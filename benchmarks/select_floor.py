"""The all-hit device select per layer under CUDA graph replay, for each policy, beside the floor:
empty kernels of one block and of the select's grid (one block per SM) in graphs of the same shape.

    python3 benchmarks/select_floor.py [--policies lru,oppclass,duel] [--replays 500]

16 layers of 128 experts, 8 ids per layer, every id resident (the budget holds every expert, then a
quarter of them: the ids are resident in both). A graph holds one select per layer; it is replayed
``--replays`` times and the time per select printed, with the misses counted during the timing
(0 expected). What a select costs above the empty kernel of its grid is its own work: the table
read, the policy's bookkeeping, the counters. Needs a CUDA device, torch and cupy.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

LAYERS, EXPERTS, K = 16, 128, 8


def _timed_graph(torch, fn, replays: int) -> float:
    """µs per node of a graph of ``fn``'s LAYERS kernels, replayed ``replays`` times."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t0) / (replays * LAYERS)


def _empty_kernel_floor(torch, replays: int, sms: int) -> dict[int, float]:
    import cupy as cp

    kernel = cp.RawKernel(
        r'extern "C" __global__ void nothing(int* p) { if (p && threadIdx.x == 1023) *p = 1; }', "nothing"
    )
    out = {}
    for blocks in (1, sms):

        def fn(blocks=blocks):
            with cp.cuda.Stream.from_external(torch.cuda.current_stream()):
                for _ in range(LAYERS):
                    kernel((blocks,), (256,), (0,))

        out[blocks] = _timed_graph(torch, fn, replays)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default="lru,oppclass,duel")
    p.add_argument("--replays", type=int, default=500)
    a = p.parse_args()
    import torch

    from pyexpcache import ExpertCache, HostSource, LayerSpec, ModelLayout

    if not torch.cuda.is_available():
        raise SystemExit("select_floor.py needs a CUDA device")
    layout = ModelLayout([LayerSpec(EXPERTS, 4096, 4096, 4096)] * LAYERS, name="select-floor")
    source = HostSource(layout, pinned=True)
    rng = np.random.default_rng(0)
    ids_host = np.stack([rng.choice(EXPERTS, K, replace=False) for _ in range(LAYERS)]).astype(np.int32)
    ids = torch.from_numpy(ids_host).cuda()
    slots = torch.zeros(LAYERS, K, dtype=torch.int32, device="cuda")
    print(f"{LAYERS} layers x {EXPERTS} experts, {K} ids per select, every id resident; {a.replays} replays")
    for policy in a.policies.split(","):
        for fraction in (1.0, 0.25):
            with ExpertCache(
                layout,
                source,
                budget_experts=int(fraction * LAYERS * EXPERTS),
                backend="cuda",
                lookup="device",
                policy=policy,
                log_level=1,
            ) as cache:
                for layer in range(LAYERS):
                    cache.bank(layer)  # bound before the capture

                def step(cache=cache):
                    for layer in range(LAYERS):
                        stream = torch.cuda.current_stream().cuda_stream
                        cache.select_device(layer, ids[layer], stream=stream, out=slots[layer])

                step()  # every id resident from here on
                torch.cuda.synchronize()
                before = cache.stats().path("device").misses
                us = _timed_graph(torch, step, a.replays)
                missed = cache.stats().path("device").misses - before
                what = f"{policy:9s} budget {fraction:4g}: all-hit select {us:.2f} µs/layer"
                print(f"{what} (misses while timed: {missed})")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for blocks, us in _empty_kernel_floor(torch, a.replays, sms).items():
        print(f"empty kernel, {blocks} block{'s' if blocks > 1 else ''} of 256 threads: {us:.2f} µs/node")


if __name__ == "__main__":
    main()
