"""The text report of a GGUF file's (or a layout's) routed experts: one row per MoE layer, one
per size class, and the total (:func:`inspect_table`, the ``expcache inspect`` command)."""

from __future__ import annotations

import os

from .gguf import GGUFSource, _layout, describe_gguf
from .layout import ModelLayout


def _ranges(items: list[int]) -> str:
    """[3, 4, 5, 7] -> "3-5, 7"."""
    out, start, prev = [], None, None
    for i in items:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = i
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ", ".join(out)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.4f}"


def _gib(n: int) -> str:
    return f"{n / 2**30:,.4f}"


def inspect_table(path_or_layout) -> str:
    """A text report of a GGUF file (path), a :class:`GGUFSource` or a
    :class:`~pyexpcache.ModelLayout`: one row per MoE layer (class, quant types, per-expert
    MiB, bytes per layer), one row per size class (its layers, experts, GiB), and the total
    bytes of all experts. Quant types are known only from a file."""
    try:
        from tabulate import tabulate
    except ImportError as exc:
        raise ImportError("inspect_table needs the 'tabulate' package: pip install tabulate") from exc

    if isinstance(path_or_layout, ModelLayout):
        layout, records, title = path_or_layout, None, path_or_layout.name
    elif isinstance(path_or_layout, GGUFSource):
        layout, records, title = path_or_layout.layout, path_or_layout.records, path_or_layout.path
    else:
        records = describe_gguf(path_or_layout)
        layout, title = _layout(records, path_or_layout), os.fspath(path_or_layout)

    classes = layout.classes()
    keys = list(classes)
    rows = []
    # Parts past the first three (a GGUF file's expert biases, a layout's quantized parts): a column.
    extra = any(layout[i].num_parts > 3 for i in layout.moe_layers)
    for i in layout.moe_layers:
        s = layout[i]
        r = records[i] if records is not None else None
        types = "/".join(r.types) + (" (fused gate_up)" if r.fused else "") if r else "-"
        sizes = [f"{b:,}" for b in s.class_key[:3]] + [""] * (3 - min(s.num_parts, 3))
        more = ", ".join(f"{p.name} {p.nbytes:,}" for p in s.parts[3:])
        rows.append(
            [i, keys.index(s.class_key), s.num_experts, types, *sizes]
            + ([more] if extra else [])
            + [_mib(s.expert_bytes), f"{s.num_experts * s.expert_bytes:,}"]
        )
    layer_table = tabulate(
        rows,
        headers=["layer", "class", "experts", "types (gate/up/down)", "gate B", "up B", "down B"]
        + (["more parts B"] if extra else [])
        + ["expert MiB", "layer bytes"],
        disable_numparse=True,
        colalign=("right",) * 3 + ("left",) + ("right",) * 3 + (("left",) if extra else ()) + ("right",) * 2,
    )

    crows = []
    for c, (key, layers) in enumerate(classes.items()):
        experts = sum(layout[i].num_experts for i in layers)
        total = sum(layout[i].num_experts * layout[i].expert_bytes for i in layers)
        crows.append(
            [
                c,
                " / ".join(f"{b:,}" for b in key),
                _mib(sum(key)),
                _ranges(layers),
                len(layers),
                f"{experts:,}",
                f"{total:,}",
                _gib(total),
            ]
        )
    class_table = tabulate(
        crows,
        headers=[
            "class",
            "part B (gate / up / down ...)",
            "expert MiB",
            "layers",
            "n layers",
            "experts",
            "bytes",
            "GiB",
        ],
        disable_numparse=True,
        colalign=("right", "left", "right", "left") + ("right",) * 4,
    )

    dense = [i for i, s in enumerate(layout.layers) if s is None]
    total = layout.total_bytes
    lines = [
        f"{title}: {layout.num_layers} layers, {len(layout.moe_layers)} with routed experts"
        + (f", dense: {_ranges(dense)}" if dense else ""),
        "",
        layer_table,
        "",
        class_table,
        "",
        f"total: {total:,} bytes ({_gib(total)} GiB) of routed experts in {len(classes)} size class"
        + ("es" if len(classes) != 1 else ""),
    ]
    return "\n".join(lines)
