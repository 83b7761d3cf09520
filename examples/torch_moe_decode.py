"""A real MoE forward through expcache: greedy decoding whose routed experts live in host memory.

A small Mixture-of-Experts decoder with random weights (default 8 layers of 64 experts, top-6
routing, hidden 1024, expert FFN 512, bf16). Each layer's experts are three host tensors, gate
[E, F, H], up [E, F, H] and down [E, H, F] (pinned on CUDA). A ``Source`` tells the cache where
each expert's bytes are (addresses from ``data_ptr()``, stride = bytes per expert), and an
``ExpertCache`` with a budget of a fraction of all experts serves the routed ones as zero-copy
views (``torch.from_dlpack(view.gate)``), so some are misses copied over the link. The same
tokens are decoded by the reference, the same model with every expert resident as torch tensors,
through the same expert function; the logits must be equal bit for bit at every step.

Modes: plain ``select_views``; ``--split`` (``select_split``: the hits' experts run first, the
misses' after ``sel.wait(stream)``, summed in router order all the same); ``--prefetch`` (after
routing layer L, prefetch layer L+1's experts of the previous token). The attention is a stand-in
(a fixed random [H, H] matmul plus residual); RMSNorm has no weights.

``--graph``: served from the GPU. The cache is made with ``lookup="device"``; the router's ids
never leave the device: ``cache.select_device(layer, ids)`` turns them into slot ids in the
layer's bank, and the experts are read in place through the bank by slot id (``index_select`` +
``bmm``, one batched expert function). On CUDA the whole decode step (embedding, every layer, the
greedy argmax feeding the next step) is captured once in a CUDA graph and replayed per token. The
reference runs the same batched function over the resident experts indexed by id, so the logits
must again be equal bit for bit. Printed side by side in the same run: the resident model eager
and captured in a graph, today's ``select_views`` path, and the captured ``select_device`` step,
with the misses' bytes at the measured link rate (a lower bound on the time per token).

Run:  python3 examples/torch_moe_decode.py [--device auto|cuda|cpu] [--split] [--prefetch] [--graph]
On the CPU (expcache's host backend) the defaults shrink (bf16 matmuls are slow there): give
sizes explicitly (--layers --experts --hidden --ffn ...) to override. Exits 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

try:
    import pyexpcache  # noqa: F401
except ImportError:  # run from a checkout without installing it: the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pyexpcache import ExpertCache, LayerSpec, ModelLayout
from pyexpcache.source import LayerPlacement

BF16 = torch.bfloat16
DEFAULTS = dict(layers=8, experts=64, hidden=1024, ffn=512, vocab=4096)
CPU_DEFAULTS = dict(DEFAULTS, hidden=512, ffn=256, vocab=2048)  # bf16 matmuls are slow on the CPU


class TorchHostSource:
    """A cache source (it has what the ``pyexpcache.source.Source`` protocol asks) over existing
    host tensors: per layer (gate, up, down), each [E, ...] and contiguous. The cache copies misses
    from these addresses and keeps this object (so the tensors) alive while it is open. pinned: the
    tensors are page-locked (torch's pin_memory), so misses cross the link without staging."""

    file_path = None  # bytes come from memory, not a file

    def __init__(self, layout: ModelLayout, parts: list[tuple[torch.Tensor, ...]], pinned: bool):
        assert all(t.is_contiguous() and t.device.type == "cpu" for p in parts for t in p)
        self.layout, self.parts, self.pinned = layout, parts, pinned

    def placement(self, layer: int) -> LayerPlacement:
        ts = self.parts[layer]
        per_expert = tuple(t[0].numel() * t.element_size() for t in ts)
        return LayerPlacement(bases=tuple(t.data_ptr() for t in ts), strides=per_expert, sizes=per_expert)


def rms_norm(x):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def expert_ffn(x, gate, up, down):
    """One expert, from three tensors: the one function both models use."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def combine(outs, weights):
    """Sum the experts' outputs in router order (a fixed order keeps results bit-identical)."""
    y = weights[0] * outs[0]
    for w, o in zip(weights[1:], outs[1:]):
        y = y + w * o
    return y


class Model:
    """Random weights: dense ones on ``device``; routed experts in host memory (``host``) and,
    for the reference, resident on ``device`` (the same tensors when the device is the CPU)."""

    def __init__(self, a, device: torch.device):
        g = torch.Generator().manual_seed(a.seed)
        H, Fd, E = a.hidden, a.ffn, a.experts

        def rnd(*shape, fan_in):
            return (torch.randn(*shape, generator=g) / fan_in**0.5).to(BF16)

        self.embed = rnd(a.vocab, H, fan_in=1).to(device)
        self.pos = rnd(a.tokens + 1, H, fan_in=1).to(device)  # varies the routing from step to step
        self.attn = [rnd(H, H, fan_in=H).to(device) for _ in range(a.layers)]
        self.router = [rnd(H, E, fan_in=H).to(device) for _ in range(a.layers)]
        self.lm_head = rnd(H, a.vocab, fan_in=H).to(device)
        self.pinned = device.type == "cuda"
        self.host = []
        for _ in range(a.layers):
            parts = (rnd(E, Fd, H, fan_in=H), rnd(E, Fd, H, fan_in=H), rnd(E, H, Fd, fan_in=Fd))
            if self.pinned:
                try:
                    parts = tuple(t.pin_memory() for t in parts)
                except RuntimeError as exc:  # the cache then stages pageable misses itself
                    print(f"note: pinning failed ({exc}); experts stay in pageable memory")
                    self.pinned = False
            self.host.append(parts)
        self.resident = [tuple(t.to(device) for t in p) for p in self.host]
        self.top_k = a.top_k

    def step(self, token: int, pos: int, experts) -> torch.Tensor:
        """Logits (float32 [1, vocab]) for ``token``; ``experts(layer, h, ids)`` returns the
        selected experts' outputs in router order."""
        x = (self.embed[token] + self.pos[pos]).unsqueeze(0)
        for layer, (attn, router) in enumerate(zip(self.attn, self.router)):
            x = x + rms_norm(x) @ attn  # the attention stand-in
            h = rms_norm(x)
            top, ids = torch.topk((h @ router).float(), self.top_k, dim=-1)
            weights = torch.softmax(top, dim=-1).to(BF16)[0]
            x = x + combine(experts(layer, h, ids[0].cpu().numpy().astype(np.uint32)), weights)
        return (rms_norm(x) @ self.lm_head).float()


def batched_experts(h, parts, index, weights):
    """The routed experts as one batched function: ``parts`` (gate [N, F, H], up [N, F, H], down
    [N, H, F]: the resident experts, or a bank's slots) gathered at ``index`` ([k] on the device),
    then bmm; the outputs weighted and summed. Both the reference and the bank path use it."""
    k = index.shape[0]
    g, u, d = (t.index_select(0, index) for t in parts)
    x = h.expand(k, 1, h.shape[-1])
    y = torch.bmm(F.silu(torch.bmm(x, g.transpose(1, 2))) * torch.bmm(x, u.transpose(1, 2)), d.transpose(1, 2))
    return (weights[:, None, None] * y).sum(0)


class GraphStep:
    """One greedy decode step that never leaves the device: the token and the position are device
    tensors the step advances itself, so it can be captured once and replayed (``--graph``).
    ``experts(layer, h, ids, weights)`` gives the layer's weighted expert output from device ids."""

    def __init__(self, model, a, device, experts):
        self.model, self.experts = model, experts
        self.token = torch.full((1,), a.prompt, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.logits = None

    def __call__(self):
        m = self.model
        x = m.embed.index_select(0, self.token) + m.pos.index_select(0, self.pos)
        for layer, (attn, router) in enumerate(zip(m.attn, m.router)):
            x = x + rms_norm(x) @ attn
            h = rms_norm(x)
            top, ids = torch.topk((h @ router).float(), m.top_k, dim=-1)
            weights = torch.softmax(top, dim=-1).to(BF16)[0]
            x = x + self.experts(layer, h, ids[0], weights)
        self.logits = (rms_norm(x) @ m.lm_head).float()
        self.token.copy_(self.logits.argmax(-1))
        self.pos.add_(1)
        return self.logits


def run_graph_steps(step, a, on_cuda, capture: bool, before_timing=lambda: None):
    """Decode a.tokens tokens with ``step`` (a GraphStep), captured in a CUDA graph when
    ``capture`` (after warm-up steps on a side stream, as torch asks), twice: the first pass warms
    the cache (at a budget that holds the working set, the second pass is all hits), the second
    is timed; ``before_timing()`` runs between them. Returns the timed pass's (logits, tokens,
    seconds)."""
    graph = None
    if capture:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    else:
        step()  # warm-up: kernel setup, and a device-lookup cache binds its layers
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    for timed in (False, True):
        step.token.fill_(a.prompt)
        step.pos.zero_()
        logits = []
        if timed:
            before_timing()
        sync()
        t0 = time.perf_counter()
        for _ in range(a.tokens):
            if graph is not None:
                graph.replay()
            else:
                step()
            logits.append(step.logits.clone())
        sync()
        seconds = time.perf_counter() - t0
    return logits, [int(x.argmax()) for x in logits], seconds


def link_rate(on_cuda) -> float:
    """Host-to-device bytes/s of a 256 MiB copy from pinned memory (0 on the CPU)."""
    if not on_cuda:
        return 0.0
    src = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(4):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 4 * src.numel() / (time.perf_counter() - t0)


def graph_main(a, model, layout, budget, on_cuda, device) -> int:
    """--graph: the resident reference (eager, captured), today's select_views path, select_slots
    on a host-lookup cache (eager: the ids reach the host), and the captured select_device step, in
    one run; the logits of the slot and device paths equal the reference's."""

    def resident(layer, h, ids, weights):
        return batched_experts(h, model.resident[layer], ids, weights)

    ref_logits, ref_tokens, ref_eager_s = run_graph_steps(
        GraphStep(model, a, device, resident), a, on_cuda, capture=False
    )
    rows = [("resident, eager", ref_eager_s)]
    if on_cuda:
        _, _, ref_graph_s = run_graph_steps(GraphStep(model, a, device, resident), a, on_cuda, capture=True)
        rows.append(("resident, one CUDA graph", ref_graph_s))

    # A device select reads pinned memory; the host backend emulates page-locking, so there the
    # tensors count as pinned.
    source = TorchHostSource(layout, model.host, model.pinned or not on_cuda)
    backend = "cuda" if on_cuda else "host"
    dev = torch.cuda.current_device() if on_cuda else 0
    # Today's path, for comparison: ids to the host every layer, a view and a kernel chain per expert;
    # a first pass warms the cache, as for the device path.
    with ExpertCache(layout, source, budget_bytes=budget, backend=backend, device=dev, log_level=1) as cache:
        stream = torch.cuda.current_stream().cuda_stream if on_cuda else None
        experts = cache_experts(cache, a, stream)
        sync = torch.cuda.synchronize if on_cuda else (lambda: None)
        decode(model, experts, a, sync)
        _, _, views_s = decode(model, experts, a, sync)
    rows.append(("expcache select_views, eager", views_s))

    # By slot id from a host select: ids to the host, int32 slots back, the bank read in place
    # (select_slots on a host-lookup cache; every cache has banks).
    with ExpertCache(layout, source, budget_bytes=budget, backend=backend, device=dev, log_level=1) as cache:
        stream = torch.cuda.current_stream().cuda_stream if on_cuda else None
        host_banks = [
            tuple(torch.from_dlpack(p) for p in cache.bank(layer, dtype="bfloat16", shapes=part_shapes(a)).parts)
            for layer in range(a.layers)
        ]

        def slot_experts(layer, h, ids, weights):
            slots = cache.select_slots(layer, ids.cpu().numpy(), stream)  # the ids reach the host
            return batched_experts(h, host_banks[layer], torch.from_numpy(slots).to(device), weights)

        step = GraphStep(model, a, device, slot_experts)
        slots_logits, slots_tokens, slots_s = run_graph_steps(step, a, on_cuda, capture=False)
    rows.append(("expcache select_slots, eager", slots_s))

    with ExpertCache(
        layout, source, budget_bytes=budget, backend=backend, device=dev, log_level=1, lookup="device"
    ) as cache:
        banks = [
            tuple(torch.from_dlpack(p) for p in cache.bank(layer, dtype="bfloat16", shapes=part_shapes(a)).parts)
            for layer in range(a.layers)
        ]

        def bank_experts(layer, h, ids, weights):
            slots = cache.select_device(layer, ids)  # on torch's current stream (the capture's too)
            return batched_experts(h, banks[layer], slots, weights)

        step = GraphStep(model, a, device, bank_experts)
        got_logits, got_tokens, got_s = run_graph_steps(
            step, a, on_cuda, capture=on_cuda, before_timing=cache.reset_stats
        )
        st = cache.stats().path("device")  # the timed pass's
    rows.append(("expcache select_device" + (", one CUDA graph" if on_cuda else ", eager"), got_s))
    miss_bytes = st.bytes_h2d
    rate = link_rate(on_cuda)
    print(f"{'path':38}{'tok/s':>9}{'vs resident graph' if on_cuda else 'vs resident':>20}")
    base = rows[1][1] if on_cuda else rows[0][1]
    for name, seconds in rows:
        print(f"{name:38}{a.tokens / seconds:9.1f}{base / seconds:19.2f}x")
    print(
        f"select_device: hit rate {st.hit_rate:.1%} ({st.hits} hits, {st.misses} misses over {st.calls} selects "
        "of the timed pass; the first pass warmed the cache)"
    )
    if on_cuda and rate:
        bound = (base + miss_bytes / rate) / a.tokens
        print(
            f"misses' bytes per token {miss_bytes / a.tokens / 2**20:.1f} MiB at {rate / 1e9:.1f} GB/s: "
            f"resident graph + link = {1e3 * bound:.3f} ms/token; select_device graph {1e3 * got_s / a.tokens:.3f} "
            f"ms/token = {got_s / a.tokens / bound:.2f}x that"
        )
        print(f"select_device graph vs select_views: {views_s / got_s:.1f}x")
    print(f"select_slots vs select_views (both eager, ids to the host): {views_s / slots_s:.2f}x")
    slots_rc = check_logits(ref_logits, ref_tokens, slots_logits, slots_tokens)
    return check_logits(ref_logits, ref_tokens, got_logits, got_tokens) or slots_rc


def part_shapes(a):
    """Each expert part's [rows, cols] in the cache: gate and up [F, H], down [H, F]."""
    return (a.ffn, a.hidden), (a.ffn, a.hidden), (a.hidden, a.ffn)


def check_logits(ref_logits, ref_tokens, got_logits, got_tokens) -> int:
    """Print the tokens, exit 1 at the first step whose logits differ from the reference's, else 0."""
    print(f"tokens: {got_tokens}")
    for step, (want, got) in enumerate(zip(ref_logits, got_logits)):
        if not torch.equal(want, got):
            sys.exit(
                f"MISMATCH at step {step}: logits differ (max |diff| {(want - got).abs().max().item():.3g}; "
                f"reference token {ref_tokens[step]}, expcache token {got_tokens[step]})"
            )
    print(f"logits bit-identical: yes ({len(got_logits)} steps)")
    return 0


def cache_experts(cache, a, stream):
    """``experts()`` for Model.step, served by the cache: plain, --split, with --prefetch."""
    shapes = part_shapes(a)
    last_ids = [None] * a.layers  # each layer's latest experts: the guess for its next select

    def run(h, view):
        return expert_ffn(h, *(torch.from_dlpack(part) for part in view))  # zero-copy

    def experts(layer, h, ids):
        # The views are valid until the cache's next select: use them before the next layer's.
        if a.split:
            sel = cache.select_split(layer, ids, stream, views=True, dtype="bfloat16", shapes=shapes)
        else:
            views = cache.select_views(layer, ids, stream, dtype="bfloat16", shapes=shapes)
        if a.prefetch:  # after the select (which cancels queued prefetches), overlapping this layer
            last_ids[layer] = ids
            nxt = (layer + 1) % a.layers
            if last_ids[nxt] is not None:
                cache.prefetch(nxt, last_ids[nxt], stream)
        if not a.split:
            return [run(h, v) for v in views]
        outs = [None] * len(ids)
        for i in sel.hits:  # resident: usable at once
            outs[i] = run(h, sel.views[i])
        sel.wait(stream)  # the misses' bytes, copied on the cache's own stream
        for i in sel.misses:
            outs[i] = run(h, sel.views[i])
        return outs

    return experts


def decode(model, experts, a, sync):
    """Greedy decoding of a.tokens tokens from a.prompt: (logits per step, tokens, seconds)."""
    token, logits, tokens = a.prompt, [], []
    sync()
    t0 = time.perf_counter()
    for pos in range(a.tokens):
        out = model.step(token, pos, experts)
        token = int(out.argmax())
        logits.append(out)
        tokens.append(token)
    sync()
    return logits, tokens, time.perf_counter() - t0


def cuda_unusable_reason():
    """None when torch has CUDA and expcache's CUDA backend opens, else why not."""
    if not torch.cuda.is_available():
        return "torch.cuda is not available"
    t = torch.zeros(2, 256, dtype=torch.uint8)
    layout = ModelLayout((LayerSpec(2, 256, 256, 256),))
    try:
        ExpertCache(layout, TorchHostSource(layout, [(t, t, t)], False), budget_experts=1, backend="cuda").close()
    except Exception as exc:
        return f"expcache's CUDA backend: {exc}"
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="cuda: torch CUDA and expcache's CUDA backend; cpu: expcache's host backend;\n"
        "auto: cuda when both work, else cpu (default)",
    )
    for name, help_ in (
        ("layers", "MoE layers"),
        ("experts", "routed experts per layer"),
        ("hidden", "hidden size H"),
        ("ffn", "expert FFN size F"),
        ("vocab", "vocabulary size"),
    ):
        cpu = f"; {CPU_DEFAULTS[name]} on cpu" if CPU_DEFAULTS[name] != DEFAULTS[name] else ""
        p.add_argument(f"--{name}", type=int, help=f"{help_} (default {DEFAULTS[name]}{cpu})")
    p.add_argument("--top-k", type=int, default=6, help="experts per token and layer (default 6)")
    p.add_argument("--tokens", type=int, default=32, help="tokens to decode (default 32)")
    p.add_argument("--prompt", type=int, default=1, help="the prompt token (default 1)")
    p.add_argument(
        "--budget-fraction",
        type=float,
        default=0.25,
        help="cache budget as a fraction of all experts' bytes (default 0.25)",
    )
    p.add_argument("--split", action="store_true", help="select_split: hits' experts first, then wait, then misses'")
    p.add_argument("--prefetch", action="store_true", help="prefetch layer L+1's previous experts after routing L")
    p.add_argument(
        "--graph",
        action="store_true",
        help="serve from the GPU: select_device and the bank, the whole step in one CUDA graph",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    a = p.parse_args(argv)
    if a.graph and (a.split or a.prefetch):
        sys.exit("--graph serves from the device: it takes neither --split nor --prefetch")

    reason = cuda_unusable_reason() if a.device != "cpu" else "asked for cpu"
    if a.device == "cuda" and reason:
        sys.exit(f"--device cuda: {reason}")
    on_cuda = reason is None
    defaults = DEFAULTS if on_cuda else CPU_DEFAULTS
    shrunk = [f"{n} {v}" for n, v in defaults.items() if getattr(a, n) is None and v != DEFAULTS[n]]
    for n, v in defaults.items():
        setattr(a, n, v if getattr(a, n) is None else getattr(a, n))
    if not 1 <= a.top_k <= a.experts or not 0 < a.budget_fraction <= 1 or not 0 <= a.prompt < a.vocab:
        sys.exit("need 1 <= --top-k <= --experts, 0 < --budget-fraction <= 1 and 0 <= --prompt < --vocab")
    device = torch.device("cuda" if on_cuda else "cpu")
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    print(f"device: {device}" + ("" if on_cuda else f" (expcache host backend; {reason})"))
    if shrunk:
        print(
            f"note: defaults reduced on cpu (bf16 matmuls are slow there): {', '.join(shrunk)}; "
            "give the sizes to override"
        )

    model = Model(a, device)
    part = a.ffn * a.hidden * 2  # bytes of one bf16 [F, H] (or [H, F]) matrix
    layout = ModelLayout(tuple(LayerSpec(a.experts, part, part, part) for _ in range(a.layers)), name="torch-moe")
    budget = int(a.budget_fraction * layout.total_bytes)
    print(
        f"model: {a.layers} layers x {a.experts} experts (top-{a.top_k}), hidden {a.hidden}, ffn {a.ffn}, "
        f"vocab {a.vocab}, bf16; experts {layout.total_bytes / 2**20:.1f} MiB in "
        f"{'pinned' if model.pinned else 'pageable'} host memory; cache budget {a.budget_fraction:.0%} "
        f"= {budget / 2**20:.1f} MiB; mode: "
        f"{'graph' if a.graph else 'split' if a.split else 'plain'}{' + prefetch' if a.prefetch else ''}"
    )
    if a.graph:
        return graph_main(a, model, layout, budget, on_cuda, device)

    # The reference: every expert resident, indexed by id. A warm-up token first (kernel setup).
    def resident(layer, h, ids):
        return [expert_ffn(h, *(t[e] for t in model.resident[layer])) for e in ids.tolist()]

    model.step(a.prompt, 0, resident)
    ref_logits, ref_tokens, ref_s = decode(model, resident, a, sync)

    source = TorchHostSource(layout, model.host, model.pinned)
    with ExpertCache(
        layout,
        source,
        budget_bytes=budget,
        backend="cuda" if on_cuda else "host",
        device=torch.cuda.current_device() if on_cuda else 0,
        log_level=1,
    ) as cache:
        stream = torch.cuda.current_stream().cuda_stream if on_cuda else None
        got_logits, got_tokens, got_s = decode(model, cache_experts(cache, a, stream), a, sync)
        decode_stats, pf = cache.stats().path("decode"), cache.prefetch_stats()

    print(f"{'reference (all experts resident):':34}{a.tokens / ref_s:8.1f} tok/s")
    print(
        f"{'expcache (' + ('select_split' if a.split else 'select_views') + '):':34}{a.tokens / got_s:8.1f} tok/s, "
        f"decode hit rate {decode_stats.hit_rate:.1%} ({decode_stats.hits} hits, {decode_stats.misses} misses, "
        f"{decode_stats.bytes_h2d / 2**20:.1f} MiB host to device)"
    )
    if a.prefetch:
        print(
            f"prefetch: {pf.calls} calls, {pf.issued} issued, {pf.used} used ({pf.accuracy:.0%}), {pf.wasted} wasted, "
            f"{pf.cancelled} cancelled, {pf.skipped} skipped, {pf.dropped} dropped"
        )
    return check_logits(ref_logits, ref_tokens, got_logits, got_tokens)


if __name__ == "__main__":
    sys.exit(main())
