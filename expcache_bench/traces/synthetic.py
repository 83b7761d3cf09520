"""A synthetic decode trace with the locality of real MoE routing, and the fit of its
parameters to a real trace."""

from __future__ import annotations

import numbers

import numpy as np

from pyexpcache.layout import NUM_LAYERS
from pyexpcache.routing import MISSING, Trace

from .locality import locality_stats
from .types import DECODE_FIRST_LAYER, DECODE_NUM_LAYERS, NUM_EXPERTS, TOP_K

#: Zipf exponent of the synthetic per-layer popularity.  Fitted with
#: :func:`fit_synthetic_params` to the bundled coffee trace (299 tokens), whose
#: measured ``top10_share`` is 0.685: the 26 most used experts of a layer take
#: about two thirds of its requests.  The exponent is a model parameter, not a
#: share: fresh draws skip the previous token's experts, which flattens the
#: realised popularity below the raw Zipf weights (0.81 for the top 26 at 1.3).
DEFAULT_ZIPF = 1.3
#: Probability that each expert of the previous token (same layer) is chosen
#: again; equals the expected ``reuse_previous`` of a synthetic trace.  0.35 is
#: the token-weighted ``reuse_previous`` of the seven bundled decode traces
#: (0.26..0.41 each; coffee 0.387).
DEFAULT_REUSE = 0.35

#: Largest array :func:`synthetic_trace` allocates: the int32 ids
#: (``num_tokens * num_layers * k * 4`` bytes) and its per-layer working tables
#: must each fit in 4 GiB, so at most 4,473,924 tokens of the default shape.
SYNTHETIC_MAX_BYTES = 4 * 2**30

# Expert ids are stored as int32.
_MAX_EXPERTS = 2**31


def synthetic_trace(
    num_tokens: int,
    num_layers: int = DECODE_NUM_LAYERS,
    num_experts: int = NUM_EXPERTS,
    k: int = TOP_K,
    *,
    seed: int = 0,
    zipf: float = DEFAULT_ZIPF,
    reuse: float = DEFAULT_REUSE,
    first_layer: int = DECODE_FIRST_LAYER,
    name: str | None = None,
) -> Trace:
    """Random decode trace with the locality of real MoE routing.

    Model (per layer, independently):

    * popularity: expert of rank ``r`` (0-based) has weight ``(r + 1) ** -zipf``;
      each layer gets its own random permutation of ranks to experts, so layers do
      not share hot experts (as in the real traces);
    * recency: each of the previous token's ``k`` experts at that layer is kept
      with probability ``reuse``; the remaining slots are drawn without
      replacement from the popularity, *excluding* the previous token's experts.
      The exclusion makes the measured ``reuse_previous`` equal ``reuse`` in
      expectation instead of ``reuse`` plus an accidental overlap.

    Args:
        num_tokens: tokens to generate, at least 1.
        num_layers, num_experts, k: shape; ``ids`` is int32 ``[num_tokens, num_layers, k]``
            with ``k`` distinct ids per (token, layer).  ``num_layers >= 1``,
            ``2 <= num_experts <= 2**31`` and ``1 <= k <= num_experts // 2``.
        seed: random seed; same arguments, same trace, and the first ``n`` tokens
            do not depend on ``num_tokens``.
        zipf: popularity exponent (0 = uniform).
        reuse: keep probability of each previous expert, in ``[0, 1]``.
        first_layer: model layer of array index 0 (metadata only).
        name: label; a descriptive default is built from the parameters.

    Returns:
        A :class:`Trace` without weights, positions ``0..num_tokens-1``.

    Raises:
        TypeError: ``num_tokens``, ``num_layers``, ``num_experts`` or ``k`` is not an
            integer (a bool, a float or a str is refused, numpy integers are accepted).
        ValueError: a size out of range, or a trace too large to allocate: the ids
            (``num_tokens * num_layers * k * 4`` bytes) or the per-layer working
            tables (about ``56 * num_layers * num_experts`` bytes) would exceed
            :data:`SYNTHETIC_MAX_BYTES` (4 GiB); ``zipf`` negative or not finite;
            ``reuse`` outside ``[0, 1]``.  The message names the parameter.
    """
    sizes = {"num_tokens": num_tokens, "num_layers": num_layers, "num_experts": num_experts, "k": k}
    for pname, value in sizes.items():
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{pname} must be an int, got {type(value).__name__} {value!r}")
    T, L, E, k = (int(v) for v in sizes.values())
    if T < 1:
        raise ValueError(f"num_tokens must be >= 1, got {T}")
    if L < 1:
        raise ValueError(f"num_layers must be >= 1, got {L}")
    if not 2 <= E <= _MAX_EXPERTS:
        raise ValueError(f"num_experts must be in [2, {_MAX_EXPERTS}] (ids are int32), got {E}")
    if not 0 < k <= E // 2:
        # Fresh draws exclude the previous token's k experts, so 2k must fit.
        raise ValueError(f"need 0 < k <= num_experts // 2, got k={k}, num_experts={E}")
    limit = f"more than SYNTHETIC_MAX_BYTES = {SYNTHETIC_MAX_BYTES / 2**30:g} GiB"
    # Float64 tables of L * E entries: 3 per layer (ranks, permutation, log
    # weights) and about 4 per token of a block (keys, noise, partition).
    table_bytes = 8 * L * E
    if 7 * table_bytes > SYNTHETIC_MAX_BYTES:
        raise ValueError(
            f"num_layers={L} and num_experts={E} are too large: generating needs about "
            f"{7 * table_bytes / 2**30:.3g} GiB of working memory (56 * num_layers * num_experts bytes), {limit}"
        )
    if T * L * k * 4 > SYNTHETIC_MAX_BYTES:
        raise ValueError(
            f"num_tokens={T} is too large: the ids would take {T * L * k * 4 / 2**30:.3g} GiB "
            f"(num_tokens * num_layers * k * 4 bytes), {limit}; at most "
            f"{SYNTHETIC_MAX_BYTES // (L * k * 4)} tokens for num_layers={L}, k={k}"
        )
    if not 0.0 <= reuse <= 1.0:
        raise ValueError(f"reuse must be in [0, 1], got {reuse}")
    if not np.isfinite(zipf) or zipf < 0:
        raise ValueError(f"zipf must be a finite number >= 0, got {zipf}")
    # Independent streams for the layer permutations, the Gumbel keys and the
    # keep decisions: each is consumed token by token, so the first n tokens of
    # a trace do not depend on num_tokens (traces of different lengths nest).
    perm_rng, key_rng, keep_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))
    rank_logw = -zipf * np.log(np.arange(1, E + 1, dtype=np.float64))
    # perm[l, r] = expert holding rank r at layer l  ->  logw[l, perm[l, r]] = rank_logw[r]
    perm = np.argsort(perm_rng.random((L, E)), axis=1)
    logw = np.empty((L, E))
    np.put_along_axis(logw, perm, np.broadcast_to(rank_logw, (L, E)), axis=1)

    ids = np.empty((T, L, k), dtype=np.int32)
    prev = None
    # Tokens per block of random keys: bounds memory to about 256 MiB (the
    # streams are consumed token by token, so the block size does not change the trace).
    chunk = max(1, min(256, 2**28 // (4 * table_bytes)))
    for t0 in range(0, T, chunk):
        n = min(chunk, T - t0)
        # Gumbel-top-k: sorting log w + Gumbel noise gives a sample without
        # replacement with probabilities proportional to w.  Excluding the
        # previous token's k experts removes at most k of the candidates, so the
        # 2k best keys always contain the k best admissible ones; computing them
        # for a whole block at once keeps the per-token loop tiny.
        keys = logw[None] + key_rng.gumbel(size=(n, L, E))
        cand = np.argpartition(-keys, 2 * k - 1, axis=2)[:, :, : 2 * k]
        cand = np.take_along_axis(cand, np.argsort(-np.take_along_axis(keys, cand, axis=2), axis=2), axis=2)
        keep_all = keep_rng.random((n, L, k)) < reuse
        for i in range(n):
            c = cand[i]
            if prev is None:
                ids[t0 + i] = c[:, :k]
            else:
                banned = (c[:, :, None] == prev[:, None, :]).any(axis=2)
                # First k admissible candidates in key order (stable sort keeps it).
                fresh = np.take_along_axis(c, np.argsort(banned, axis=1, kind="stable")[:, :k], axis=1)
                keep = keep_all[i]
                # Kept experts stay in their slot; other slots take fresh draws in order.
                slot = np.maximum(np.cumsum(~keep, axis=1) - 1, 0)
                ids[t0 + i] = np.where(keep, prev, np.take_along_axis(fresh, slot, axis=1))
            prev = ids[t0 + i]
    if name is None:
        name = f"synthetic(T={T},L={L},E={E},k={k},zipf={zipf:g},reuse={reuse:g},seed={seed})"
    return Trace(name, ids, None, first_layer, np.arange(T, dtype=np.int64), E)


def is_deepseek_v4_flash_shaped(layout) -> bool:
    """Whether ``layout`` (a :class:`~pyexpcache.ModelLayout`) has DeepSeek V4 Flash's geometry:
    its 43 layers, each of 256 routed experts (the first three routed by hash, which no trace has)."""
    return layout.num_layers == NUM_LAYERS and all(
        s is not None and s.num_experts == NUM_EXPERTS for s in layout.layers
    )


def synthetic_trace_for(
    layout,
    num_tokens: int,
    k: int | None = None,
    *,
    seed: int = 0,
    zipf: float = DEFAULT_ZIPF,
    reuse: float = DEFAULT_REUSE,
    name: str | None = None,
) -> Trace:
    """:func:`synthetic_trace` shaped by ``layout`` (a :class:`~pyexpcache.ModelLayout`): its MoE
    layers, from the first to the last (a dense layer between them has no records), the fewest
    experts of any of them, and ``k`` experts per token (default :data:`TOP_K`, DeepSeek V4
    Flash's 6). A DeepSeek V4 Flash-shaped layout (:func:`is_deepseek_v4_flash_shaped`) gets the
    trace of layers 3-42 that :func:`synthetic_trace` makes by default. ValueError when ``k`` is
    more than half the experts (fresh draws skip the previous token's), naming both."""
    k = TOP_K if k is None else k
    if is_deepseek_v4_flash_shaped(layout):
        return synthetic_trace(num_tokens, k=k, seed=seed, zipf=zipf, reuse=reuse, name=name)
    moe = layout.moe_layers
    experts = min(layout[i].num_experts for i in moe)
    if isinstance(k, numbers.Integral) and not isinstance(k, bool) and not 0 < k <= experts // 2:
        raise ValueError(
            f"a synthetic trace of k={k} experts per token needs more experts than layout {layout.name} "
            f"has ({experts} experts per layer): k at most {experts // 2}"
        )
    first = moe[0]
    trace = synthetic_trace(
        num_tokens, moe[-1] - first + 1, experts, k, seed=seed, zipf=zipf, reuse=reuse, first_layer=first, name=name
    )
    ids = trace.ids
    dense = [i - first for i in range(first, moe[-1] + 1) if layout[i] is None]
    if dense:
        ids = ids.copy()
        ids[:, dense] = MISSING
    return Trace(trace.name, ids, None, first, trace.positions, experts)


def fit_synthetic_params(trace: Trace, *, seed: int = 0) -> dict:
    """Synthetic-generator parameters that reproduce ``trace``'s locality.

    ``reuse`` is the measured ``reuse_previous`` (the generator reproduces it in
    expectation).  ``zipf`` is found by bisection so that a synthetic trace of
    the *same shape* (and ``seed``) measures the same ``top10_share``; matching
    the measured statistic at equal length also matches its sampling-noise
    bias, which is large for traces of a few dozen tokens.

    Returns:
        ``{"zipf": float, "reuse": float, "stats": locality_stats(trace)}``; pass
        ``zipf`` and ``reuse`` to :func:`synthetic_trace`.  Takes two or three seconds
        for a 300-token trace (about 17 synthetic traces are generated).
    """
    stats = locality_stats(trace)
    reuse = float(min(max(stats["reuse_previous"], 0.0), 1.0))
    target = stats["top10_share"]
    T, L, k, E = trace.num_tokens, trace.num_layers, trace.k, trace.num_experts

    def measured(s: float) -> float:
        syn = synthetic_trace(T, L, E, k, seed=seed, zipf=s, reuse=reuse)
        return locality_stats(syn)["top10_share"]

    lo, hi = 0.0, 4.0
    if measured(lo) >= target:
        zipf = lo  # no more skewed than the sampling noise of uniform routing
    elif measured(hi) <= target:
        zipf = hi
    else:
        # The share grows with the exponent (with a fixed seed the noise is
        # shared between evaluations, so the curve is close to monotone).
        for _ in range(14):  # bracket width 4 / 2**14 ~ 2.4e-4
            mid = 0.5 * (lo + hi)
            if measured(mid) < target:
                lo = mid
            else:
                hi = mid
        zipf = 0.5 * (lo + hi)
    return {"zipf": float(zipf), "reuse": reuse, "stats": stats}
