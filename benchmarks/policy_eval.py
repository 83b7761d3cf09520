"""Evaluate expert-cache eviction policies offline (see docs/policy.md).

Replays the bundled DeepSeek V4 Flash decode traces and synthetic traces
through :func:`expcache_bench.sim.simulate_policy` (the library's exact call
semantics) and prints, with tabulate:

1. every policy x held-out trace x capacity (5, 10, 25, 50 % of the experts):
   hit rate and MiB moved per token (q2 experts, 6.75 MiB);
2. the mean over the held-out traces, with points vs LRU and vs ClassLRU and
   the share of the LRU -> Belady gap closed (and the same for the tuning
   traces, for transparency);
3. synthetic traces;
4. the mixed q2-q4 layout under a 12 GiB budget: MiB per token with a fixed
   proportional split, the best fixed split (swept on the tuning traces, and
   the per-trace hindsight best), and demand-following global budgets;
5. the targets of the issue, met or not.

``--default`` prints only the default policy's table instead (docs/policy.md, "The default:
duel"): every trace (the bundled decode traces, the synthetic ones of DEFAULT_SYNTHETIC, and
traces whose popularity shifts, SHIFTING) x 10 / 25 / 50 % of the experts x partition global and
layer: LRU, OppClassLRU, the library's default, Belady (per layer: within each layer's share)
and default - LRU in points, as Markdown; about 3 minutes on 2 cores.

Tuning traces: podA_a_coffee_full and podA_b2_json_long_full (every parameter
of our policies was chosen on these).  Held-out: the other five decode traces.

Writes a JSON (``--json``) and, when matplotlib is installed, a PNG
(``--png``).  Default run: about a minute on 2 cores; ``--quick``: held-out
traces at 10 % and a reduced mixed-layout check, under 20 s.

Run as ``python -m benchmarks.policy_eval`` or ``python benchmarks/policy_eval.py``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
from tabulate import tabulate

from expcache_bench.sim import simulate_belady, simulate_global, simulate_policy
from expcache_bench.sim.registry import simulate_belady_partitioned
from expcache_bench.traces import Trace, list_traces, load_decode_trace, synthetic_trace
from pyexpcache import _lib
from pyexpcache.layout import ModelLayout

TUNING = ("podA_a_coffee_full", "podA_b2_json_long_full")
FRACTIONS = (0.05, 0.10, 0.25, 0.50)
POLICIES = ("lru", "classlru", "lrfu", "arc", "s3fifo", "wtinylfu", "hazard", "oppclass", "belady")
QUICK_POLICIES = ("lru", "classlru", "oppclass", "belady")
WINNER = "oppclass"
MIB = 1 << 20
Q2_BYTES = int(6.75 * MIB)  # one q2 expert (uniform-layout bytes per miss)
BUDGET = 12 << 30  # mixed layout budget
SYNTHETIC = (  # (label, synthetic_trace kwargs)
    ("syn_default", dict(num_tokens=150, seed=0)),
    ("syn_flat", dict(num_tokens=150, seed=1, zipf=0.9, reuse=0.25)),
    ("syn_skewed", dict(num_tokens=150, seed=2, zipf=1.6, reuse=0.45)),
)
# The default policy's table: synthetic traces of other models' shapes (layers, experts, top-k of
# Mixtral-8x7B, OLMoE-1B-7B, Qwen3-30B-A3B), and traces whose popularity shifts: synthetic
# segments of different seeds, and four bundled prompts back to back (a server's next request).
DEFAULT_SYNTHETIC = SYNTHETIC + (
    ("syn_mixtral_32x8_top2", dict(num_tokens=600, seed=3, num_layers=32, num_experts=8, k=2, first_layer=0)),
    ("syn_olmoe_16x64_top8", dict(num_tokens=300, seed=4, num_layers=16, num_experts=64, k=8, first_layer=0)),
    ("syn_qwen3_48x128_top8", dict(num_tokens=200, seed=5, num_layers=48, num_experts=128, k=8, first_layer=0)),
)
SHIFTING = (  # (label, parts: ("syn", synthetic_trace kwargs) or ("real", bundled name))
    ("shift_syn_4x100", tuple(("syn", dict(num_tokens=100, seed=10 + i)) for i in range(4))),
    (
        "shift_syn_mixtral_4x150",
        tuple(
            ("syn", dict(num_tokens=150, seed=20 + i, num_layers=32, num_experts=8, k=2, first_layer=0))
            for i in range(4)
        ),
    ),
    (
        "shift_deepseek_4_prompts",
        tuple(("real", n) for n in ("podA_b_json_full", "smoke_count64", "podA_c_python_full", "livemask_forensic_k0")),
    ),
)
DEFAULT_FRACTIONS = (0.10, 0.25, 0.50)
PARTITIONS = ("global", "layer")
SHARES = tuple(round(0.10 + 0.025 * i, 3) for i in range(15))  # q4 share of the budget, fixed splits


# --------------------------------------------------------------------------- jobs (run in workers)


@functools.cache
def _trace(spec):
    kind, name = spec
    if kind == "real":
        return load_decode_trace(name)
    if kind == "shift":
        parts = [load_decode_trace(a) if k == "real" else synthetic_trace(**a) for k, a in dict(SHIFTING)[name]]
        ids = np.concatenate([t.ids for t in parts])
        return Trace(name, ids, None, parts[0].first_layer, np.arange(len(ids)), parts[0].num_experts)
    return synthetic_trace(**dict(DEFAULT_SYNTHETIC)[name])


def _run_partitioned(job):
    spec, policy, frac, partition = job
    tr = _trace(spec)
    cap = int(round(frac * tr.num_layers * tr.num_experts))
    if policy == "belady":
        r = simulate_belady_partitioned(tr, cap, partition=partition)
    else:
        r = simulate_policy(tr, cap, policy=policy, partition=partition)
    return job, 100.0 * r.hit_rate


@functools.cache
def _mixed():
    layout = ModelLayout.preset("mixed")
    cls = layout.layer_class_index(range(3, 43))  # decode traces hold model layers 3..42
    keys = list(layout.classes())
    sizes = [layout[layout.classes()[k][0]].expert_bytes for k in keys]
    totals = [
        len(layout.classes()[k]) * layout[layout.classes()[k][0]].num_experts * sizes[i] for i, k in enumerate(keys)
    ]
    return cls, sizes, totals


def _run_uniform(job):
    spec, policy, frac = job
    tr = _trace(spec)
    cap = int(round(frac * tr.num_layers * tr.num_experts))
    t0 = time.perf_counter()
    r = simulate_belady(tr, cap) if policy == "belady" else simulate_policy(tr, cap, policy=policy)
    return job, {
        "hits": int(r.hits.sum()),
        "misses": int(r.misses.sum()),
        "requests": r.requests,
        "tokens": tr.num_tokens,
        "capacity": cap,
        "seconds": time.perf_counter() - t0,
    }


def _run_mixed(job):
    spec, mode, policy, share = job
    tr = _trace(spec)
    cls, sizes, totals = _mixed()
    if mode == "global":
        r = simulate_global(tr, BUDGET, sizes, cls, policy=policy)
        caps = list(r.capacity)
    else:
        if mode == "proportional":
            shares = [t / sum(totals) for t in totals]
        else:
            shares = [1.0 - share, share]
        caps = [int(BUDGET * s) // b for s, b in zip(shares, sizes)]
        r = simulate_policy(tr, caps, cls, policy=policy)
    moved = sum(int(m) * b for m, b in zip(r.misses, sizes))
    return job, {"mib_per_token": moved / MIB / tr.num_tokens, "hit_rate": r.hit_rate, "slots": caps}


def _map(fn, jobs, workers):
    if workers <= 1:
        return dict(map(fn, jobs))
    with ProcessPoolExecutor(workers) as ex:
        return dict(ex.map(fn, jobs, chunksize=1))


# --------------------------------------------------------------------------- report


def _hit(res, spec, pol, f):
    r = res[(spec, pol, f)]
    return 100.0 * r["hits"] / r["requests"]


def _mib(res, spec, pol, f):
    r = res[(spec, pol, f)]
    return r["misses"] * Q2_BYTES / MIB / r["tokens"]


def _summary(res, specs, policies, fractions):
    """Mean over specs: rows of (policy, fraction, hit, mib, d_lru, d_classlru, gap closed)."""
    rows = []
    for f in fractions:
        mean = {p: np.mean([_hit(res, s, p, f) for s in specs]) for p in policies}
        mib = {p: np.mean([_mib(res, s, p, f) for s in specs]) for p in policies}
        lru, bel = mean.get("lru"), mean.get("belady")
        for p in policies:
            gap = (mean[p] - lru) / (bel - lru) if bel is not None and bel - lru > 1e-9 else float("nan")
            rows.append(
                {
                    "policy": p,
                    "fraction": f,
                    "hit": mean[p],
                    "mib_per_token": mib[p],
                    "vs_lru": mean[p] - lru,
                    "vs_classlru": mean[p] - mean.get("classlru", np.nan),
                    "gap_closed": gap,
                }
            )
    return rows


def _summary_table(rows, title):
    print(f"\n## {title}\n")
    print(
        tabulate(
            [
                [
                    r["policy"],
                    f"{r['fraction']:.0%}",
                    f"{r['hit']:.2f}",
                    f"{r['mib_per_token']:.0f}",
                    f"{r['vs_lru']:+.2f}",
                    f"{r['vs_classlru']:+.2f}",
                    "" if np.isnan(r["gap_closed"]) else f"{100 * r['gap_closed']:.0f} %",
                ]
                for r in rows
            ],
            headers=["policy", "cap", "hit %", "MiB/token", "vs LRU", "vs ClassLRU", "gap closed"],
        )
    )


def default_table(workers):
    """The default policy against LRU, OppClassLRU and Belady on every trace, capacity and
    partition; prints Markdown and returns the rows."""
    default = _lib.DEFAULT_POLICY
    policies = ("lru", "oppclass", default, "belady")
    specs = (
        [("real", i.name) for i in list_traces() if i.kind == "decode"]
        + [("syn", n) for n, _ in DEFAULT_SYNTHETIC]
        + [("shift", n) for n, _ in SHIFTING]
    )
    jobs = [(s, p, f, part) for s in specs for p in policies for f in DEFAULT_FRACTIONS for part in PARTITIONS]
    jobs.sort(key=lambda j: -_trace(j[0]).num_requests)
    res = _map(_run_partitioned, jobs, workers)
    rows = []
    for s in specs:
        for part in PARTITIONS:
            for f in DEFAULT_FRACTIONS:
                h = {p: res[(s, p, f, part)] for p in policies}
                rows.append(
                    {
                        "trace": s[1],
                        "kind": s[0],
                        "partition": part,
                        "fraction": f,
                        **h,
                        "default_minus_lru": h[default] - h["lru"],
                    }
                )
    print(f"| trace | partition | cap | LRU | OppClassLRU | **{default}** | Belady | {default} − LRU |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['trace']} | {r['partition']} | {r['fraction']:.0%} | {r['lru']:.2f} | {r['oppclass']:.2f} | "
            f"**{r[default]:.2f}** | {r['belady']:.2f} | {r['default_minus_lru']:+.2f} |"
        )
    worst = min(rows, key=lambda r: r["default_minus_lru"])
    print(
        f"\nworst {default} − LRU: {worst['default_minus_lru']:+.2f} points ({worst['trace']}, {worst['partition']}, "
        f"{worst['fraction']:.0%}); OppClassLRU − LRU worst: "
        f"{min(r['oppclass'] - r['lru'] for r in rows):+.2f}"
    )
    print(f"\nDeepSeek decode traces, mean gain over LRU (points), {default} / OppClassLRU:\n")
    print("| partition | cap | " + f"{default} − LRU | OppClassLRU − LRU | share kept |")
    print("|---|---|---|---|---|")
    for part in PARTITIONS:
        for f in DEFAULT_FRACTIONS:
            sel = [r for r in rows if r["kind"] == "real" and r["partition"] == part and r["fraction"] == f]
            d = np.mean([r[default] - r["lru"] for r in sel])
            o = np.mean([r["oppclass"] - r["lru"] for r in sel])
            kept = f"{100 * d / o:.0f} %" if o > 0.05 else "(no gain to keep)"
            print(f"| {part} | {f:.0%} | {d:+.2f} | {o:+.2f} | {kept} |")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--default",
        action="store_true",
        help="only the default policy's table: every trace x 10/25/50 %% x global/layer, Markdown",
    )
    ap.add_argument("--quick", action="store_true", help="held-out traces at 10 %% only, reduced mixed check (<20 s)")
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    tmp = tempfile.gettempdir()
    ap.add_argument("--json", default=os.path.join(tmp, "policy_eval.json"), help="output JSON path ('' to skip)")
    ap.add_argument("--png", default=os.path.join(tmp, "policy_eval.png"), help="output PNG path ('' to skip)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    if args.default:
        rows = default_table(args.workers)
        print(f"\nwall time {time.perf_counter() - t_start:.1f} s")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"default_policy": _lib.DEFAULT_POLICY, "rows": rows}, fh, indent=1, default=float)
        return rows

    decode = [i.name for i in list_traces() if i.kind == "decode"]
    held = [n for n in decode if n not in TUNING]
    policies = QUICK_POLICIES if args.quick else POLICIES
    fractions = (0.10,) if args.quick else FRACTIONS
    real_specs = [("real", n) for n in (held if args.quick else decode)]
    syn_specs = [("syn", SYNTHETIC[0][0])] if args.quick else [("syn", s[0]) for s in SYNTHETIC]
    print(
        f"# Eviction policies on DeepSeek V4 Flash routing ({'quick' if args.quick else 'full'} run, "
        f"{args.workers} worker(s))"
    )
    print(f"tuning traces: {', '.join(TUNING)}; held-out: {', '.join(held)}")

    jobs = [(s, p, f) for s in real_specs + syn_specs for p in policies for f in fractions]
    # Longest first so the pool stays busy.
    jobs.sort(key=lambda j: -(_trace(j[0]).num_tokens if j[0][0] == "real" else 150))
    res = _map(_run_uniform, jobs, args.workers)

    held_specs = [("real", n) for n in held]
    print("\n## Per held-out trace: hit % (MiB moved per token, q2 experts)\n")
    rows = []
    for s in held_specs:
        for f in fractions:
            rows.append([s[1], f"{f:.0%}"] + [f"{_hit(res, s, p, f):.2f} ({_mib(res, s, p, f):.0f})" for p in policies])
    print(tabulate(rows, headers=["trace", "cap"] + list(policies)))

    held_rows = _summary(res, held_specs, policies, fractions)
    _summary_table(held_rows, "Mean over the held-out traces")
    tune_rows = []
    if not args.quick:
        tune_rows = _summary(res, [("real", n) for n in TUNING], policies, fractions)
        _summary_table(tune_rows, "Mean over the tuning traces (parameters were chosen here)")
    syn_rows = {}
    print("\n## Synthetic traces (expcache_bench.traces.synthetic_trace, 150 tokens): hit %\n")
    rows = []
    for s in syn_specs:
        syn_rows[s[1]] = _summary(res, [s], policies, fractions)
        for f in fractions:
            rows.append([s[1], f"{f:.0%}"] + [f"{_hit(res, s, p, f):.2f}" for p in policies])
    print(tabulate(rows, headers=["trace", "cap"] + list(policies)))

    # ---------------------------------------------------------------- mixed layout
    if args.quick:
        mixed_specs = [("real", "podA_c_python_full"), ("real", "smoke_count64")]
        shares = (0.225, 0.25, 0.275, 0.3)
    else:
        mixed_specs = [("real", n) for n in decode]
        shares = SHARES
    sweep_specs = list(dict.fromkeys([("real", n) for n in TUNING] + mixed_specs))
    mjobs = [(s, "fixed", WINNER, sh) for s in sweep_specs for sh in shares]
    mjobs += [(s, "proportional", p, None) for s in mixed_specs for p in ("lru", WINNER)]
    mjobs += [(s, "global", p, None) for s in mixed_specs for p in ("lru", WINNER)]
    mjobs.sort(key=lambda j: -_trace(j[0]).num_tokens)
    mres = _map(_run_mixed, mjobs, args.workers)
    # The one fixed split a deployment would pick: the best share on the tuning traces.
    tuned_share = min(
        shares, key=lambda sh: np.mean([mres[(("real", n), "fixed", WINNER, sh)]["mib_per_token"] for n in TUNING])
    )
    print(f"\n## Mixed q2-q4 layout, {BUDGET >> 30} GiB budget: MiB moved per token (lower is better)\n")
    print(
        f"fixed splits use {WINNER} in each class; the q4 share of the budget is swept over "
        f"{shares[0]:.3f}..{shares[-1]:.3f}; the share best on the tuning traces is {tuned_share:.3f}; "
        f"proportional = {_mixed()[2][1] / sum(_mixed()[2]):.3f} (each class's share of all expert bytes)"
    )
    mrows = []
    mixed_out = {}
    for s in mixed_specs:
        sweep = {sh: mres[(s, "fixed", WINNER, sh)]["mib_per_token"] for sh in shares}
        hind_share = min(sweep, key=sweep.get)
        d = {
            "lru_proportional": mres[(s, "proportional", "lru", None)]["mib_per_token"],
            "proportional": mres[(s, "proportional", WINNER, None)]["mib_per_token"],
            "tuned_fixed": sweep[tuned_share],
            "hindsight_fixed": sweep[hind_share],
            "hindsight_share": hind_share,
            "lru_global": mres[(s, "global", "lru", None)]["mib_per_token"],
            "global": mres[(s, "global", WINNER, None)]["mib_per_token"],
            "global_slots": mres[(s, "global", WINNER, None)]["slots"],
            "sweep": sweep,
        }
        mixed_out[s[1]] = d
        mrows.append(
            [
                s[1] + (" (tuning)" if s[1] in TUNING else ""),
                f"{d['lru_proportional']:.1f}",
                f"{d['proportional']:.1f}",
                f"{d['tuned_fixed']:.1f}",
                f"{d['hindsight_fixed']:.1f} @{hind_share:.3f}",
                f"{d['lru_global']:.1f}",
                f"{d['global']:.1f}",
                f"{d['global'] - d['hindsight_fixed']:+.1f}",
            ]
        )
    print(
        tabulate(
            mrows,
            headers=[
                "trace",
                "LRU prop.",
                f"{WINNER} prop.",
                "best fixed (tuned)",
                "best fixed (hindsight)",
                "LRU global",
                f"{WINNER} global",
                "global - hindsight",
            ],
        )
    )

    # ---------------------------------------------------------------- targets
    def pick(rows, p, f):
        return next(r for r in rows if r["policy"] == p and r["fraction"] == f)

    print("\n## Targets (held-out traces unless said)\n")
    targets = []
    if 0.10 in fractions:
        w = pick(held_rows, WINNER, 0.10)
        targets.append(("10 %: >= 2 points above ClassLRU", f"{w['vs_classlru']:+.2f}", w["vs_classlru"] >= 2.0))
        targets.append(
            ("10 %: >= 40 % of the LRU->Belady gap closed", f"{100 * w['gap_closed']:.0f} %", w["gap_closed"] >= 0.40)
        )
    all_specs = real_specs + syn_specs
    worst = min((_hit(res, s, WINNER, f) - _hit(res, s, "lru", f), s[1], f) for s in all_specs for f in fractions)
    targets.append(
        (
            "never > 1 point below LRU (worst of every trace, synthetic too, x capacity)",
            f"{worst[0]:+.2f} ({worst[1]}, {worst[2]:.0%})",
            worst[0] >= -1.0,
        )
    )
    held_mixed = [n for n in mixed_out if n not in TUNING]
    g = np.mean([mixed_out[n]["global"] for n in held_mixed])
    for key, label in (
        ("tuned_fixed", f"best fixed split on the tuning traces (q4 share {tuned_share:.3f})"),
        ("proportional", "proportional split"),
        ("hindsight_fixed", "per-trace hindsight best fixed split"),
    ):
        ref = np.mean([mixed_out[n][key] for n in held_mixed])
        targets.append(
            (
                f"mixed 12 GiB: global <= {label}, mean",
                f"{g:.1f} vs {ref:.1f} MiB/token ({100 * (g / ref - 1):+.2f} %)",
                g <= ref,
            )
        )
    print(tabulate([[t, v, "met" if ok else "NOT met"] for t, v, ok in targets], headers=["target", "value", ""]))

    elapsed = time.perf_counter() - t_start
    print(f"\nwall time {elapsed:.1f} s")

    out = {
        "tuning": list(TUNING),
        "held_out": held,
        "fractions": list(fractions),
        "policies": list(policies),
        "winner": WINNER,
        "quick": args.quick,
        "runs": [{"trace": s[1], "kind": s[0], "policy": p, "fraction": f, **r} for (s, p, f), r in res.items()],
        "held_out_mean": held_rows,
        "tuning_mean": tune_rows,
        "synthetic": syn_rows,
        "mixed": {"budget_bytes": BUDGET, "tuned_share": tuned_share, "traces": mixed_out},
        "targets": [{"target": t, "value": v, "met": bool(ok)} for t, v, ok in targets],
        "wall_seconds": elapsed,
    }
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1, default=float)
        print(f"wrote {args.json}")
    if args.png:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed: no plot (pip install matplotlib)")
        else:
            fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
            for p in policies:
                a1.plot([100 * f for f in fractions], [pick(held_rows, p, f)["hit"] for f in fractions], "o-", label=p)
            a1.set_xlabel("experts cached (%)")
            a1.set_ylabel("hit rate (%), held-out mean")
            a1.legend(fontsize=7)
            for n, d in mixed_out.items():
                a2.plot(list(d["sweep"]), list(d["sweep"].values()), "-", label=n)
                a2.axhline(d["global"], ls=":", lw=0.8, color=a2.lines[-1].get_color())
            a2.set_xlabel("q4 share of the 12 GiB budget (fixed split)")
            a2.set_ylabel("MiB per token (dotted: global)")
            a2.legend(fontsize=6)
            fig.tight_layout()
            fig.savefig(args.png, dpi=120)
            print(f"wrote {args.png}")
    return out


if __name__ == "__main__":
    main()
