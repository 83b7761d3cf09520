"""The hit-rate curve (``expcache bench curve``; the variants table draws it with ``--plot``): each
of the library's eviction policies (:func:`~expcache_bench.policies.policy_variants`: its
default first) and Belady's MIN at fractions of each size class's experts, from the offline
simulator (each policy's twin of the same name; no cache, no device), over the decode traces. The
policies' names are read from the library, which must be built; nothing is run on it."""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Optional

from tabulate import tabulate

from pyexpcache import _lib
from pyexpcache.layout import ModelLayout

from .. import options
from ..options import LAYERS, LAYOUT, OUTPUT, PLOT, TOP_K, TRACES, UsageError
from ..policies import policy_variants
from ..report import Report, made_by
from ..sim import simulate_belady, simulate_policy
from ..workload import Workload, build_workload, trace_label

NAME = "curve"
TITLE = "hit-rate curve"
HELP = "hit rate against budget for each of the library's policies and Belady, from the simulator (no device)"
DESCRIPTION = (
    "Hit rate against budget for each of the library's eviction policies (its default first) and "
    "Belady's MIN over the decode traces, from the offline simulator: no cache and no device; --plot "
    "draws it."
)
RUNS = "simulates the decode traces"
USES_BENCH = False
OPTIONS = (LAYOUT, LAYERS, TRACES, TOP_K, PLOT) + OUTPUT
SELECTED_BY = ()  # named only: expcache bench curve

FRACTIONS = (0.02, 0.05, 0.1, 0.15, 0.25, 0.35, 0.5)  # of each class's experts


@dataclass
class CurvePoint:
    fraction: float  # of each class's experts cached
    hit_rates: dict[str, float] = field(default_factory=dict)  # per policy, by name: the library's default first
    belady: float = float("nan")  # nan where the workload has prefill batches


def hit_rate_curve(
    workload: Workload, layout: ModelLayout, fractions: Sequence[float], policies: Optional[Sequence[str]] = None
) -> dict:
    """Hit rates at fractions of each class's experts: ``{"fraction": [...], "policies": {name:
    [...]}, "belady": [...], "default": name}``, a list per policy of ``policies`` (default: the
    library's, :func:`~expcache_bench.policies.policy_variants`), each by its simulator twin,
    and Belady's. ``default``: the library's default policy when it is one of them, else None."""
    if policies is None:
        policies = policy_variants()
    keys = list(layout.classes())
    layer_class = [keys.index(s.class_key) if s else 0 for s in layout.layers]
    sizes = [sum(layout[i].num_experts for i in layers) for layers in layout.classes().values()]
    out = {
        "fraction": list(fractions),
        "policies": {name: [] for name in policies},
        "belady": [],
        "default": _lib.DEFAULT_POLICY if _lib.DEFAULT_POLICY in policies else None,
    }
    for f in fractions:
        caps = [int(f * n) for n in sizes]
        for name, rates in out["policies"].items():
            rates.append(
                simulate_policy(workload.calls, caps, layer_class, policy=name, layers=layout.moe_layers).hit_rate
            )
        out["belady"].append(
            simulate_belady(workload.calls, caps, layer_class).hit_rate if not workload.has_batches else float("nan")
        )
    return out


def policy_label(name: str, default: Optional[str]) -> str:
    """A policy's name, marked when it is the library's default."""
    return f"{name} (the default)" if name == default else name


def plot_curve(curve: dict, out, title: str, image_format: Optional[str] = None) -> None:
    """Draw ``curve`` into ``out``, a file name or a binary file; ``image_format`` (png, svg,
    pdf, ...) defaults to the name's extension, png for a file."""
    try:  # matplotlib is optional (the [plot] extra): imported only to draw
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("--plot needs matplotlib (pip install matplotlib)") from exc
    x = [100 * f for f in curve["fraction"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    markers = "^ovD<>phx*"
    for i, (name, rates) in enumerate(curve["policies"].items()):
        ax.plot(
            x, [100 * v for v in rates], f"{markers[i % len(markers)]}-", label=policy_label(name, curve["default"])
        )
    ax.plot(x, [100 * v for v in curve["belady"]], "s--", label="Belady (optimum)")
    ax.set_xlabel("experts cached (% of each class)")
    ax.set_ylabel("hit rate (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120, format=image_format)
    plt.close(fig)


def image_format(path: str) -> str:
    """--plot's image format: the file name's extension, png without one."""
    return os.path.splitext(path)[1][1:].lower() or "png"


def check_plot(args) -> None:
    """--plot, when given: matplotlib installed and able to write the file's type."""
    path = getattr(args, "plot", None)
    if not path:
        return
    options.need(options.has_module("matplotlib"), "--plot needs matplotlib", "plot")
    from matplotlib.figure import Figure  # optional (the [plot] extra): imported only for --plot

    if image_format(path) not in Figure().canvas.get_supported_filetypes():
        raise UsageError(
            f"--plot {path}: matplotlib writes no .{image_format(path)} files; name a .png, .svg or .pdf file"
        )


def _draw(curve: dict, layout: ModelLayout, workload: Workload, out) -> None:
    image = io.BytesIO()
    plot_curve(
        curve, image, f"{layout.name}: {workload.decode_tokens} decode tokens", image_format=image_format(out.path)
    )
    out.write(image.getvalue())
    print(f"wrote {out.path}", file=sys.stderr)


def write_plot(layout: ModelLayout, traces: Sequence[str], out) -> None:
    """The curve of ``traces`` on ``layout`` at :data:`FRACTIONS`, drawn into ``out`` (an output
    file of the command line: ``write(bytes)`` and ``path``)."""
    workload = build_workload("decode", traces, layout.moe_layers, layout)
    _draw(hit_rate_curve(workload, layout, FRACTIONS), layout, workload, out)


# -- the mode ---------------------------------------------------------------------------------


def check(args) -> None:
    check_plot(args)
    options.synthetic_traces(args)


def run(bench, args) -> Iterator[Report]:
    """The curve at :data:`FRACTIONS` as a report (``bench``: unused, None), and drawn into --plot."""
    layout = options.generated_layout(args, 1)  # hit rates depend on the experts' counts, not their sizes
    workload = build_workload("decode", args.traces, layout.moe_layers, layout)
    curve = hit_rate_curve(workload, layout, FRACTIONS)
    names = list(curve["policies"])
    yield Report(
        NAME,
        "hit rate against budget, offline simulator",
        layout=layout.name,
        traces=[trace_label(t) for t in args.traces],
        settings=dict(decode_tokens=workload.decode_tokens, policies=names, default_policy=curve["default"]),
        results=[
            CurvePoint(f, {n: curve["policies"][n][i] for n in names}, curve["belady"][i])
            for i, f in enumerate(curve["fraction"])
        ],
        **made_by(),
    )
    if args.outputs.get("plot"):
        _draw(curve, layout, workload, args.outputs["plot"])


def describe(report: Report) -> list[str]:
    return [
        f"{report.settings['decode_tokens']} decode tokens; capacity per size class, every policy at the same "
        "capacities"
    ]


def table(report: Report) -> str:
    names = report.settings["policies"]
    rows = [
        [f"{100 * p.fraction:g} %"]
        + [f"{100 * p.hit_rates[n]:.1f} %" for n in names]
        + [f"{100 * p.belady:.1f} %" if p.belady == p.belady else "—"]
        for p in report.results
    ]
    headers = (
        ["experts cached (of each class)"]
        + [policy_label(n, report.settings["default_policy"]) for n in names]
        + ["Belady"]
    )
    return tabulate(rows, headers=headers, disable_numparse=True)
