"""Hit rate against budget for LRU, OppClassLRU and Belady (``expcache bench --plot``)."""

from __future__ import annotations

from typing import Optional, Sequence

from ...layout import ModelLayout
from ...sim import simulate_belady, simulate_lru, simulate_policy
from ..workload import Workload


def hit_rate_curve(workload: Workload, layout: ModelLayout, fractions: Sequence[float]) -> dict:
    """LRU, OppClassLRU (the library's default) and Belady hit rates at fractions of each class's experts."""
    keys = list(layout.classes())
    layer_class = [keys.index(s.class_key) if s else 0 for s in layout.layers]
    sizes = [sum(layout[i].num_experts for i in layers) for layers in layout.classes().values()]
    out = {"fraction": list(fractions), "lru": [], "oppclass": [], "belady": []}
    for f in fractions:
        caps = [int(f * n) for n in sizes]
        out["lru"].append(simulate_lru(workload.calls, caps, layer_class).hit_rate)
        out["oppclass"].append(simulate_policy(workload.calls, caps, layer_class, policy="oppclass",
                                               layers=layout.moe_layers).hit_rate)
        out["belady"].append(simulate_belady(workload.calls, caps, layer_class).hit_rate
                             if not workload.has_batches else float("nan"))
    return out


def plot_curve(curve: dict, out, title: str, image_format: Optional[str] = None) -> None:
    """Draw ``curve`` into ``out``, a file name or a binary file; ``image_format`` (png, svg,
    pdf, ...) defaults to the name's extension, png for a file."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("--plot needs matplotlib (pip install matplotlib)") from exc
    x = [100 * f for f in curve["fraction"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(x, [100 * v for v in curve["lru"]], "o-", label="LRU (policy=\"lru\")")
    ax.plot(x, [100 * v for v in curve["oppclass"]], "^-", label="OppClassLRU (the default)")
    ax.plot(x, [100 * v for v in curve["belady"]], "s--", label="Belady (optimum)")
    ax.set_xlabel("experts cached (% of each class)")
    ax.set_ylabel("hit rate (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120, format=image_format)
    plt.close(fig)
