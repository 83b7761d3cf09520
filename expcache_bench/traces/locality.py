"""Locality statistics of a decode trace: reuse of the previous token's experts and the
share of the most used experts."""

from __future__ import annotations

import numpy as np

from pyexpcache.routing import Trace


def _top_count(num_experts: int, top_fraction: float) -> int:
    # 10 % of 256 experts -> 26 (rounded), never fewer than one expert.
    return max(1, int(round(top_fraction * num_experts)))


def locality_stats(trace: Trace, *, top_fraction: float = 0.1) -> dict:
    """Measure the two kinds of locality an expert cache exploits.

    Returns a dict with:
        ``reuse_previous``: fraction of requests (token t >= 1, layer, slot) whose
            expert was also chosen by token t-1 at the same layer (recency), over the
            (token, layer) records present at t and t-1.
        ``top10_share``: per layer, the share of that layer's requests taken by its
            ``round(top_fraction * num_experts)`` most requested experts (26 of 256
            for 10 %), averaged over layers (popularity skew; the uniform value is
            ``top_fraction``).  Measured on the trace itself, so it includes
            sampling noise: short traces read higher.
        ``chance_reuse``: ``k / num_experts``, the ``reuse_previous`` of
            independent uniform routing, for comparison.
        ``distinct_share``: fraction of a layer's experts requested at least once,
            averaged over layers.
        ``num_tokens``, ``num_layers``, ``k``, ``num_experts``.
    """
    ids = trace.ids
    T, L, k = ids.shape
    E = trace.num_experts
    present = trace.present  # a missing (token, layer) record counts nowhere
    both = present[1:] & present[:-1]
    if T >= 2 and both.any():
        # [T-1, L, k, k]: does slot j of token t match any slot of token t-1?
        hit = (ids[1:, :, :, None] == ids[:-1, :, None, :]).any(axis=-1)
        reuse = float(hit[both].mean())
    else:
        reuse = float("nan")
    # Per-layer expert histograms in one bincount: offset ids by layer * E.
    flat = (ids + (np.arange(L, dtype=np.int64) * E)[None, :, None])[present].ravel()
    counts = np.bincount(flat, minlength=L * E).reshape(L, E)
    ntop = _top_count(E, top_fraction)
    top = -np.sort(-counts, axis=1)[:, :ntop].sum(axis=1)
    share = float(np.mean(top / np.maximum(counts.sum(axis=1), 1))) if T else float("nan")
    return {
        "reuse_previous": reuse,
        "top10_share": share,
        "chance_reuse": k / E,
        "distinct_share": float(np.mean((counts > 0).mean(axis=1))),
        "num_tokens": T,
        "num_layers": L,
        "k": k,
        "num_experts": E,
    }
