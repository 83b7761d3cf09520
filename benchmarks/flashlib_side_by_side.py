"""expcache's device select beside flashlib 0.4.0's ``lru_ensure`` plus a copy kernel, in one
process, each decode step one CUDA graph (issue #37's target: at least 1.2x at a budget holding
every expert, at least 1.0x at 25 %).

The model: 16 layers of 128 experts, top-8, 9 MiB experts (three 3 MiB parts), in page-locked
host memory (every word a known pattern); the routing: the synthetic decode trace (Zipf
popularity, the bundled traces' reuse of the previous token's experts). At each budget
(``--budgets``, fractions of all experts) two caches of the same number of slots serve the same
steps; a step is, per layer:

- expcache: ``ExpertCache(..., lookup="device").select_device(layer, ids)`` (lookup, eviction,
  the misses' copies by the GPU from the pinned source), then the reading kernel over the
  layer's bank by slot id;
- flashlib: ``lru_ensure`` over one table for all layers (ids offset by ``layer * experts``, its
  maps and LRU clock on the device), then a copy kernel moving its plan's rows from the same
  pinned source into the table (:func:`_expert_kernels.copy_plan`: a fixed grid, one program per
  SM, reading ``num_copy`` on the device), then the same reading kernel over the table.

The reading kernel (:func:`_expert_kernels.read_experts`, one Triton kernel for both) reads every
byte of each routed expert and sums it as expcache's checksum does. Each step's graph is
captured after one eager step and replayed per token; a step's time runs from the copy of its
ids into the graph's input to the end of a synchronize. One pass over the trace warms both
caches (at the budget holding every expert the timed pass is then all hits), then the timed
pass: ``--rounds`` blocks of consecutive tokens, the two caches taking turns in each. After every
step, outside the timing, the served experts are checked: every reading kernel's sum against the
source's, and the bytes of every served slot no later select of the step filled again against the
source's (on the GPU, against a device copy; a policy other than LRU may evict, for a later layer's
miss, a slot an earlier layer of the step used, as the validity rule allows). Printed: time per step
(median over rounds), hits, the ratio of the times per step, and the time of an all-hit select per
layer (a graph of one select per layer replayed ``--replays`` times: expcache's, ``lru_ensure``
alone, ``lru_ensure`` plus the copy kernel), and how fast the copy kernel given to flashlib moves a
step's experts of one layer from the pinned source next to the copy engine (``cudaMemcpyAsync``), to
show it is a fair one. ``--no-read`` leaves the reading kernel out of the steps: the selects and
copies alone.

Skips (exit 0, saying so) when flashlib cannot be imported; exits 1 without a GPU (``--device
cpu`` checks the logic on expcache's host backend with Triton's interpreter, ``TRITON_INTERPRET=1``,
which this script sets; times mean nothing there) or when a check fails.

Run (from the repository root, after ``make lib``; flashlib needs torch and Triton):
    pip install --no-deps --target /tmp/site flashlib-0.4.0-py3-none-any.whl
    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/flashlib_side_by_side.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _device_step as ds
from tabulate import tabulate

from pyexpcache import ExpertCache

FLASHLIB_VERSION = "0.4.0"
TARGETS = {1.0: 1.2, 0.25: 1.0}  # budget fraction -> the ratio target


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ds.add_device_option(p)
    ds.add_geometry_options(p)
    p.add_argument("--budgets", default="1.0,0.25", help="fractions of all experts the caches hold (default 1.0,0.25)")
    p.add_argument("--tokens", type=int, help="tokens of the trace (default 256; --quick 64; cpu 6)")
    p.add_argument("--rounds", type=int, help="timed blocks, the caches taking turns (default 8; --quick 4; cpu 2)")
    p.add_argument("--replays", type=int, help="replays of the all-hit select graphs (default 200; --quick 50; cpu 1)")
    p.add_argument("--copy-programs", type=int, help="programs of flashlib's copy kernel (default: the GPU's SMs)")
    p.add_argument("--policy", help="expcache's policy (default: the library's default for a device lookup)")
    p.add_argument(
        "--no-read",
        dest="read",
        action="store_false",
        help="steps without the reading kernel: the selects and copies alone (served bytes still checked)",
    )
    ds.add_run_options(p)
    a = p.parse_args(argv)
    ds.fill_counts(a, (("tokens", 256, 64, 6), ("rounds", 8, 4, 2), ("replays", 200, 50, 1)))
    try:
        a.budgets = [float(x) for x in a.budgets.split(",") if x.strip()]
    except ValueError:
        p.error(f"--budgets must be fractions separated by commas, got {a.budgets!r}")
    if not a.budgets or not all(0 < b <= 1 for b in a.budgets):
        p.error("--budgets must be fractions in (0, 1]")
    if a.tokens < 2 or a.rounds < 1 or a.replays < 1 or a.rounds > a.tokens:
        p.error("need --tokens >= 2, 1 <= --rounds <= --tokens, --replays >= 1")
    return a


def import_flashlib():
    """(lru_ensure, N_STATS, Stat, version) or the reason flashlib cannot be used (a string)."""
    try:
        import flashlib
        from flashlib.kernels.slot_cache import N_STATS, Stat, lru_ensure
    except ImportError as exc:
        return f"flashlib could not be imported ({exc}; it needs torch and Triton)"
    return lru_ensure, N_STATS, Stat, getattr(flashlib, "__version__", "?")


class Flashlib:
    """flashlib's slot cache over ``slots`` rows for every layer: its maps, LRU clock and stats
    (the tensors ``lru_ensure`` takes, owned here), its plan, and the table."""

    def __init__(self, fl, a, slots: int, row_bytes: int, device):
        self.lru_ensure, n_stats, self.stat = fl[0], fl[1], fl[2]
        i32 = dict(dtype=torch.int32, device=device)
        self.slot_of_id = torch.full((a.layers * a.experts,), -1, **i32)
        self.id_of_slot = torch.full((slots,), -1, **i32)
        self.usage = torch.zeros(slots, dtype=torch.int64, device=device)
        self.clock = torch.zeros((), dtype=torch.int64, device=device)
        self.stats = torch.zeros(n_stats, dtype=torch.int64, device=device)
        plan = min(a.top_k, slots)
        self.src = torch.zeros(a.layers, plan, **i32)
        self.dst = torch.zeros(a.layers, plan, **i32)
        self.num_copy = torch.zeros(a.layers, dtype=torch.int64, device=device)
        self.table = torch.zeros(slots, row_bytes, dtype=torch.uint8, device=device)

    def ensure(self, layer: int, ids, out, experts: int) -> None:
        self.lru_ensure(
            ids,
            self.slot_of_id,
            self.id_of_slot,
            self.usage,
            self.clock,
            out,
            self.src[layer],
            self.dst[layer],
            self.num_copy[layer],
            self.stats,
            id_base=layer * experts,
        )

    def hits_misses(self) -> tuple[int, int]:
        s = self.stats.tolist()
        return s[self.stat.ACTIVE] - s[self.stat.MISS], s[self.stat.MISS]


def run_budget(a, fl, kernels, layout, source, ids_host, fraction: float, cuda: bool, device) -> dict:
    """Both caches at one budget: the warm pass, the timed pass, the all-hit selects."""
    L, E, k = a.layers, a.experts, a.top_k
    want = max(1, round(fraction * L * E))
    kw = {} if a.policy is None else {"policy": a.policy}
    cache = ExpertCache(
        layout,
        source.host,
        budget_experts=want,
        backend="cuda" if cuda else "host",
        lookup="device",
        log_level=1,
        **kw,
    )
    try:
        banks = [cache.bank(layer) for layer in range(L)]  # binds every layer's class before any capture
        slots = banks[0].cap
        if slots < L * k:
            raise SystemExit(
                f"budget {fraction:g} gives {slots} slots, fewer than a step's {L * k} experts: raise the budget"
            )
        tokens = ids_host.shape[0]
        all_ids = torch.from_numpy(ids_host).to(device)
        chunks = kernels.read_chunks(source.parts)
        stream = lambda: ds.current_stream(cuda)  # noqa: E731 (torch's stream now: the capture's while capturing)

        # -- expcache ---------------------------------------------------------------------------
        x_ids = torch.zeros(L, k, dtype=torch.int32, device=device)
        x_slots = torch.zeros(L, k, dtype=torch.int32, device=device)
        x_part = torch.zeros(L, k * 3 * chunks, dtype=torch.int64, device=device)
        x_tables, x_parts, x_views = [], [], []
        for b in banks:
            views = [torch.from_dlpack(v) for v in b.parts]
            x_views.append(views)
            x_tables.append(views[0])
            x_parts.append(tuple((v.ptr - b.gate.ptr, v.nbytes // b.rows) for v in b.parts))

        def x_step():
            for layer in range(L):
                cache.select_device(layer, x_ids[layer], stream=stream(), out=x_slots[layer])
                if a.read:
                    kernels.read_experts(
                        x_tables[layer], banks[layer].slot_stride, x_parts[layer], x_slots[layer], x_part[layer]
                    )

        # -- flashlib ---------------------------------------------------------------------------
        f = Flashlib(fl, a, slots, source.row_bytes, device)
        f_ids = torch.zeros(L, k, dtype=torch.int32, device=device)
        f_slots = torch.zeros(L, k, dtype=torch.int32, device=device)
        f_part = torch.zeros(L, k * 3 * chunks, dtype=torch.int64, device=device)
        programs = a.copy_programs

        def f_step(copy=True, read=a.read):
            for layer in range(L):
                f.ensure(layer, f_ids[layer], f_slots[layer], E)
                if copy:
                    kernels.copy_plan(
                        source.rows[layer], f.table, f.src[layer], f.dst[layer], f.num_copy[layer], programs
                    )
                if read:
                    kernels.read_experts(f.table, source.row_bytes, source.parts, f_slots[layer], f_part[layer])

        def checker(slot_buf, part_buf, served):
            """check(t) of one cache: its sums, and every served slot's bytes (``served(layer, slots)``:
            the three parts of those slots), against the source's."""

            def check(t: int) -> list[str]:
                problems = []
                ids = all_ids[t]
                got = kernels.sums_of(part_buf, L * k).reshape(L, k)
                want = source.expected[np.arange(L)[:, None], ids_host[t]]
                if a.read and (got != want).any():
                    layer, j = np.argwhere(got != want)[0]
                    problems.append(
                        f"{int((got != want).sum())} sums differ (first: layer {layer}, expert {ids_host[t, layer, j]})"
                    )
                s = slot_buf.long()
                if bool((s < 0).any()):
                    problems.append("a slot id below 0")
                    return problems
                # A slot holds what its select gave it until a later select of the step fills it
                # again (every layer shares the class's bank; a policy other than LRU may evict a
                # slot an earlier layer of the step used): each layer's slots that no later layer
                # served are checked after the step, the rest by the sums read right after their
                # select.
                later = torch.zeros(s.max().item() + 1, dtype=torch.bool, device=s.device)
                for layer in reversed(range(L)):
                    keep = ~later[s[layer]]
                    later[s[layer]] = True
                    if not bool(keep.any()):
                        continue
                    rows = s[layer][keep]
                    want_rows = source.device_rows[layer].index_select(0, ids[layer].long()[keep])
                    for p, got_part in enumerate(served(layer, rows)):
                        off, nbytes = source.parts[p]
                        if not torch.equal(got_part, want_rows[:, off : off + nbytes]):
                            problems.append(f"layer {layer} part {p}: served bytes differ from the source")
                return problems

            return check

        def x_served(layer, s):
            return [view.index_select(0, s) for view in x_views[layer]]

        def f_served(layer, s):
            rows = f.table.index_select(0, s)
            return [rows[:, off : off + nbytes] for off, nbytes in source.parts]

        x = ds.Contender(
            "expcache select_device", lambda t: x_ids.copy_(all_ids[t]), None, checker(x_slots, x_part, x_served)
        )
        fc = ds.Contender(
            "flashlib lru_ensure + copy", lambda t: f_ids.copy_(all_ids[t]), None, checker(f_slots, f_part, f_served)
        )
        sync = ds.sync_of(cuda)
        for c, fn in ((x, x_step), (fc, f_step)):
            c.put(0)
            c.run = ds.Step(fn, cuda).run  # token 0 eagerly, then captured
            sync()
            c.verify(0)
        ds.alternate([x, fc], np.arange(1, tokens), a.rounds, sync, timed=False)  # the warm pass
        cache.reset_stats()
        f.stats.zero_()
        ds.alternate([x, fc], np.arange(tokens), a.rounds, sync)
        st = cache.stats().path("device")
        x_hits, x_misses = st.hits, st.misses
        f_hits, f_misses = f.hits_misses()

        # -- all-hit selects: the last token's ids, resident in both -------------------------------
        selects = {}
        for who, name, fn, misses in (
            (
                x,
                "expcache select_device",
                lambda: [cache.select_device(i, x_ids[i], stream=stream(), out=x_slots[i]) for i in range(L)],
                lambda: cache.stats().path("device").misses,
            ),
            (fc, "flashlib lru_ensure", lambda: f_step(copy=False, read=False), lambda: f.hits_misses()[1]),
            (fc, "flashlib lru_ensure + copy", lambda: f_step(read=False), lambda: f.hits_misses()[1]),
        ):
            step = ds.Step(fn, cuda)
            sync()
            before = misses()
            t0 = time.perf_counter()
            for _ in range(a.replays):
                step.run()
            sync()
            seconds = time.perf_counter() - t0
            if misses() != before:
                who.bad += 1
                who.errors.append(f"the all-hit selects of {name} missed")
            selects[name] = 1e6 * seconds / (a.replays * L)
        return dict(
            budget=fraction,
            slots=slots,
            policy=cache.policy,
            expcache=summary(x, x_hits, x_misses),
            flashlib=summary(fc, f_hits, f_misses),
            ratio=ds.ratio_summary(fc.seconds, x.seconds),
            all_hit_select_us_per_layer=selects,
        )
    finally:
        cache.close()


def copy_rates(a, kernels, source, device, programs: int, cuda: bool, repeats: int = 10) -> dict:
    """Bytes/s of moving one step's worth of a layer's experts (``top_k`` rows) from the pinned
    source to the GPU: flashlib's copy kernel (:func:`_expert_kernels.copy_plan`) and the copy
    engine (``cudaMemcpyAsync`` through torch), each the best of ``repeats``. Tells whether the
    copy kernel given to flashlib is a fair one."""
    rows = source.rows[0][: a.top_k]
    table = torch.empty(a.top_k, source.row_bytes, dtype=torch.uint8, device=device)
    plan = torch.arange(a.top_k, dtype=torch.int32, device=device)
    count = torch.full((), a.top_k, dtype=torch.int64, device=device)
    sync, out = ds.sync_of(cuda), {}
    for name, fn in (
        ("copy kernel", lambda: kernels.copy_plan(source.rows[0], table, plan, plan, count, programs)),
        ("cudaMemcpyAsync", lambda: table.copy_(rows, non_blocking=True)),
    ):
        fn()
        best = float("inf")
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            best = min(best, time.perf_counter() - t0)
        out[name] = rows.numel() / best
    if not torch.equal(table.cpu(), rows):
        raise RuntimeError("the copy kernel's rows differ from the source's")
    return out


def summary(c: ds.Contender, hits: int, misses: int) -> dict:
    """One cache's results at one budget (its timed pass)."""
    return dict(
        us_per_step=ds.median_us(c.seconds),
        rounds_us=[1e6 * s for s in c.seconds],
        hits=hits,
        misses=misses,
        checked=c.checked,
        bad=c.bad,
        errors=c.errors,
    )


def hit_rate(h, m) -> str:
    return f"{100 * h / (h + m):.2f} %" if h + m else "—"


def report(results, cuda: bool) -> None:
    rows = []
    for r in results:
        for who in ("expcache", "flashlib"):
            c = r[who]
            rows.append(
                [
                    f"{r['budget']:g}",
                    r["slots"],
                    f"expcache select_device ({r['policy']})" if who == "expcache" else "flashlib lru_ensure + copy",
                    f"{c['us_per_step']:.1f}",
                    f"{1e6 / c['us_per_step']:.1f}" if c["us_per_step"] else "—",
                    hit_rate(c["hits"], c["misses"]),
                    f"{c['hits']} / {c['misses']}",
                    f"{c['bad']} bad / {c['checked']} steps",
                ]
            )
    print(
        tabulate(
            rows,
            headers=["budget", "slots", "cache", "µs/step", "steps/s", "hit rate", "hits / misses", "checks"],
            disable_numparse=True,
        )
    )
    print()
    rows = []
    for r in results:
        med, lo, hi = r["ratio"]
        target = TARGETS.get(r["budget"])
        met = "—" if target is None or not cuda else ("met" if med >= target else "NOT met")
        rows.append([f"{r['budget']:g}", f"{med:.3f}x", f"{lo:.3f}-{hi:.3f}", f">= {target}x" if target else "—", met])
    print("ratio = flashlib µs/step ÷ expcache µs/step (above 1: expcache faster), per round, median and range:")
    print(tabulate(rows, headers=["budget", "ratio", "range", "issue's target", ""], disable_numparse=True))
    print()
    names = list(results[0]["all_hit_select_us_per_layer"])
    rows = [[f"{r['budget']:g}", *(f"{r['all_hit_select_us_per_layer'][n]:.2f}" for n in names)] for r in results]
    print(f"all-hit select per layer, µs ({'a graph of one select per layer, replayed' if cuda else 'eager'}):")
    print(tabulate(rows, headers=["budget", *names], disable_numparse=True))


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton's interpreter runs the kernels on CPU tensors
    fl = import_flashlib()
    if isinstance(fl, str):
        print(f"SKIPPED: {fl}. Install it: pip install --no-deps flashlib=={FLASHLIB_VERSION}")
        return 0
    if fl[3] != FLASHLIB_VERSION:
        print(f"note: flashlib {fl[3]} is installed; the issue's comparison is with {FLASHLIB_VERSION}")
    why = ds.pick_device(a, "the flashlib side-by-side")
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 1
    import _expert_kernels as kernels  # Triton: after TRITON_INTERPRET is settled

    shrunk = ds.fill_geometry(a)
    cuda = a.device == "cuda"
    device = torch.device("cuda" if cuda else "cpu")
    layout = ds.layout_of(a)
    print(
        f"{a.layers} layers x {a.experts} experts, top-{a.top_k}, {a.expert_bytes / 2**20:.2f} MiB experts "
        f"({layout.total_bytes / 2**30:.2f} GiB, pinned); {a.tokens} tokens (synthetic routing, seed {a.seed}); "
        f"{a.rounds} rounds; "
        + (
            f"GPU {torch.cuda.get_device_name()}"
            if cuda
            else "CPU (expcache host backend, Triton interpreter: times mean nothing)"
        )
        + f"; flashlib {fl[3]}; steps {'with' if a.read else 'WITHOUT'} the reading kernel"
    )
    if shrunk:
        print(f"note: the CPU check's geometry: {', '.join(shrunk)}")
    source = ds.Source(layout, device)
    ids = ds.routing(a.tokens, a, a.seed)
    results, rates = [], {}
    try:
        if not a.copy_programs:  # one per SM, as expcache's copy kernel has one block per SM
            a.copy_programs = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 2
        rates = copy_rates(a, kernels, source, device, a.copy_programs, cuda, repeats=10 if cuda else 1)
        for fraction in a.budgets:
            results.append(run_budget(a, fl, kernels, layout, source, ids, fraction, cuda, device))
            if cuda:
                gc.collect()  # the budget's bank and table, before the next budget's
                torch.cuda.empty_cache()
    except Exception as exc:
        if cuda or type(exc).__name__ != "InterpreterError":
            raise
        # Triton 3.6's interpreter takes a 1-element array for a scalar, which NumPy 2.4 refuses
        print(
            f"error: Triton's interpreter failed ({exc}); with NumPy {np.__version__} that is expected of "
            "Triton <= 3.6: run the CPU check with NumPy < 2.4 (for example pip install --target DIR "
            "numpy==2.3.5, then DIR first on PYTHONPATH)",
            file=sys.stderr,
        )
        return 1
    finally:
        source.close()
    report(results, cuda)
    if rates:
        print(
            ("" if cuda else "(meaningless on the CPU) ")
            + f"pinned source to GPU, {a.top_k} experts ({a.top_k * source.row_bytes / 2**20:.0f} MiB): "
            + ", ".join(f"{name} {rate / 1e9:.1f} GB/s" for name, rate in rates.items())
        )
    errors = [(r["budget"], who, e) for r in results for who in ("expcache", "flashlib") for e in r[who]["errors"]]
    for budget, who, e in errors:
        print(f"CHECK FAILED: budget {budget:g}, {who}: {e}", file=sys.stderr)
    if a.json:
        a.json.write_text(
            json.dumps(
                {"args": {k: str(v) for k, v in vars(a).items()}, "results": results, "copy_bytes_per_s": rates},
                indent=1,
            )
        )
        print(f"wrote {a.json}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
