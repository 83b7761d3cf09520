"""The one replay loop of the online simulators, and the two cache spaces it runs on.

:func:`replay` serves every call of a prepared stream (:func:`prepare`) and
lets policy objects (:class:`~expcache_bench.sim.policy.Policy`) decide the order
of eviction, with the library's call semantics (see :mod:`expcache_bench.sim`):

* ``"decode"`` call: deduplicated ids, hits first in call order
  (``on_hit``), then each miss in order (``on_miss``): into free room if the
  class has some (``on_insert(key, cold=False)``); otherwise
  ``victim(evictable)`` names a resident entry *not requested by this call*
  (``None``: every resident entry is protected, the miss is served directly).
  A policy with admission may refuse the replacement (``admit`` returns
  ``False``): the miss is then served directly and counted in ``direct``.
* ``"batch"`` call: hits are counted and do **not** reach the policy (the
  library leaves recency untouched on a batch hit); misses are appended into
  free capacity as the coldest entries (``on_insert(key, cold=True)``), never
  evicting, else served directly.  ``on_miss`` is still called for every batch
  miss so that history-keeping policies can count it.

Where entries live and what "room" means is the *space*:

* :class:`ClassSlots`: class ``c`` holds at most ``capacity[c]`` entries and
  has a policy object of its own; a full class evicts one of its own entries
  (capacity 0 serves everything directly without asking the policy).
* :class:`LayerSlots`: the *per-layer partition* (``partition="layer"``): class ``c``'s
  ``capacity[c]`` split into a share per layer (:func:`layer_shares`); a miss of layer ``L``
  takes free room while ``L`` holds fewer entries than its share, else evicts one of ``L``'s own
  entries (the policy's victim among them), else is served directly.
* :class:`SharedBudget`: the *global budget* mode for multi-class layouts: one
  policy object orders the entries of every class and the classes compete for
  one byte budget (a miss evicts victims, of any class, until its bytes fit; a
  refused first replacement or no victim left serves it directly, victims
  already evicted stay evicted).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np

from pyexpcache.routing import Trace

from .calls import (
    APPEND,
    COUNTERS,
    DECODE,
    DIRECT,
    EVICT,
    HIT,
    INSERT,
    KEY_SHIFT,
    MISS,
    Call,
    as_stream,
    present_rows,
    token_index,
)
from .policy import Ctx, Policy

__all__ = ["PreparedStream", "prepare", "ClassSlots", "LayerSlots", "SharedBudget", "replay", "layer_shares"]


# --------------------------------------------------------------------------- the stream


@dataclass
class PreparedStream:
    """A stream with what the policy context needs of each call.

    Attributes:
        stream: the calls.
        weights: per call, a tuple of gate weights parallel to ``call.ids`` (or
            None), or None for a stream without weights.
        tokens: token index of every call.
        pos_of: cache layer -> its position within a token (its rank).
        layers: number of layer positions (at least 1).
    """

    stream: Sequence[Call]
    weights: Optional[list]
    tokens: list
    pos_of: dict
    layers: int


def _weights_for(requests, stream, weights):
    """Per call, a tuple of gate weights parallel to ``call.ids``, or None."""
    if weights is None and isinstance(requests, Trace):
        weights = requests.weights
    if weights is None:
        return None
    if isinstance(weights, np.ndarray):
        if weights.ndim != 3:
            raise ValueError(f"weights must have shape [tokens, layers, k], got {weights.shape}")
        L = weights.shape[1]
        rows = weights.tolist()
        # The rows of the calls decode_stream makes: a missing (token, layer) record makes none.
        ids = requests.ids if isinstance(requests, Trace) else requests
        if isinstance(ids, np.ndarray) and ids.ndim == 3 and ids.shape[:2] == weights.shape[:2]:
            keep = present_rows(ids).tolist()
        else:
            keep = [[True] * L for _ in rows]
        out = [tuple(tok[layer]) for t, tok in enumerate(rows) for layer in range(L) if keep[t][layer]]
    else:
        out = [None if w is None else tuple(w) for w in weights]
    if len(out) != len(stream):
        raise ValueError(f"weights cover {len(out)} calls, the stream has {len(stream)}")
    return out


def prepare(requests, weights=None, tokens=None, layers=None) -> PreparedStream:
    """The stream of ``requests`` (:func:`~expcache_bench.sim.calls.as_stream`) with its weights
    (default: a Trace's own), token indices (default :func:`token_index`) and layer positions:
    ranks among ``layers`` (the library: its registered MoE layers), else among the layers the
    stream uses."""
    stream = as_stream(requests)
    wts = _weights_for(requests, stream, weights)
    toks = list(tokens) if tokens is not None else token_index(stream)
    if len(toks) != len(stream):
        raise ValueError(f"tokens cover {len(toks)} calls, the stream has {len(stream)}")
    layers = sorted(set(layers) if layers is not None else {c.layer for c in stream})
    pos_of = {layer: i for i, layer in enumerate(layers)}
    return PreparedStream(stream, wts, toks, pos_of, max(len(layers), 1))


# --------------------------------------------------------------------------- the spaces


class ClassSlots:
    """Per-class capacities: class ``c`` holds at most ``capacity[c]`` entries, ordered by
    ``policies[c]``.

    The interface :func:`replay` uses (shared with :class:`SharedBudget`):
    ``layer_class``, ``policies`` and ``resident`` (per class: the policy object and a
    container of the resident keys), ``sizes`` (per class: :attr:`Ctx.size`), ``fits(c, layer)``,
    ``may_evict(c, layer)``, ``evictable(want, layer)`` (the predicate handed to ``victim``),
    ``holds(key, c)``, ``add(key, c)``, ``remove(key, c)`` (returns the removed entry's class)
    and ``check(c)``.
    """

    def __init__(self, capacity: Sequence[int], layer_class: Sequence[int], policies: Sequence[Policy]) -> None:
        self.capacity = capacity
        self.layer_class = layer_class
        self.policies = list(policies)
        self.resident = [set() for _ in capacity]
        self.sizes = [1] * len(capacity)

    def fits(self, c: int, layer: int) -> bool:
        """Is there room for one more entry of class ``c``?"""
        return len(self.resident[c]) < self.capacity[c]

    def may_evict(self, c: int, layer: int) -> bool:
        """May a miss of class ``c`` ask its policy for a victim?  (Capacity 0: no.)"""
        return self.capacity[c] > 0

    def evictable(self, want, layer: int):
        """What a decode miss may evict: any entry the call does not request."""
        return lambda k: k not in want

    def holds(self, key: int, c: int) -> bool:
        return key in self.resident[c]

    def add(self, key: int, c: int) -> None:
        self.resident[c].add(key)

    def remove(self, key: int, c: int) -> int:
        self.resident[c].discard(key)
        return c

    def check(self, c: int) -> None:
        res = self.resident[c]
        assert len(res) <= self.capacity[c]
        assert len(self.policies[c]) == len(res), (len(self.policies[c]), len(res))


def layer_shares(capacity: Sequence[int], layer_class: Sequence[int], layer_experts: Sequence[int]) -> list[int]:
    """Each layer's share of its class's capacity under ``partition="layer"``, as the library
    computes it (``libexpcache/src/class_table.cpp``): ``capacity[c]`` split over the class's
    layers in proportion to their experts (``layer_experts[l]``; 0 for a layer outside every
    class), rounded down, the slots left over handed one each to the layers of the largest
    remainders (ties: the lower layer), so the shares add up to the capacity."""
    shares = [0] * len(layer_class)
    for c, cap in enumerate(capacity):
        members = [
            layer
            for layer, k in enumerate(layer_class)
            if k == c and layer < len(layer_experts) and layer_experts[layer] > 0
        ]
        total = sum(layer_experts[layer] for layer in members)
        if not total:
            continue
        rem = []
        for layer in members:
            q, r = divmod(cap * layer_experts[layer], total)
            shares[layer] = q
            rem.append((-r, layer))
        left = cap - sum(shares[layer] for layer in members)
        for _, layer in sorted(rem)[:left]:
            shares[layer] += 1
    return shares


class LayerSlots(ClassSlots):
    """The per-layer partition: as :class:`ClassSlots`, but layer ``l`` holds at most
    ``share[l]`` entries (:func:`layer_shares`) and a miss evicts only an entry of its own
    layer.  Keys are ``layer << KEY_SHIFT | expert``, so an entry's layer is ``key >> KEY_SHIFT``."""

    def __init__(
        self,
        capacity: Sequence[int],
        layer_class: Sequence[int],
        policies: Sequence[Policy],
        layer_experts: Sequence[int],
    ) -> None:
        super().__init__(capacity, layer_class, policies)
        self.share = layer_shares(capacity, layer_class, layer_experts)
        self.count = [0] * len(self.share)

    def fits(self, c: int, layer: int) -> bool:
        return self.count[layer] < self.share[layer]

    def may_evict(self, c: int, layer: int) -> bool:
        return self.share[layer] > 0

    def evictable(self, want, layer: int):
        return lambda k: k >> KEY_SHIFT == layer and k not in want

    def add(self, key: int, c: int) -> None:
        super().add(key, c)
        self.count[key >> KEY_SHIFT] += 1

    def remove(self, key: int, c: int) -> int:
        self.count[key >> KEY_SHIFT] -= 1
        return super().remove(key, c)

    def check(self, c: int) -> None:
        super().check(c)
        assert all(n <= s for n, s in zip(self.count, self.share))


class SharedBudget:
    """One byte budget for every class: an entry of class ``c`` takes ``class_bytes[c]``
    bytes and one ``policy`` orders the entries of all classes.  ``peak[c]``: the
    largest number of class-``c`` entries resident at once.  Interface as :class:`ClassSlots`.
    """

    def __init__(
        self, budget_bytes: int, class_bytes: Sequence[int], layer_class: Sequence[int], policy: Policy
    ) -> None:
        n = len(class_bytes)
        self.budget = budget_bytes
        self.class_bytes = class_bytes
        self.layer_class = layer_class
        self.policy = policy
        self.policies = [policy] * n
        self.entries: dict[int, int] = {}  # resident key -> its class
        self.resident = [self.entries] * n
        self.sizes = [int(b) for b in class_bytes]
        self.used = 0
        self.count = [0] * n
        self.peak = [0] * n

    def fits(self, c: int, layer: int) -> bool:
        """Are ``class_bytes[c]`` bytes free?"""
        return self.used + self.sizes[c] <= self.budget

    def may_evict(self, c: int, layer: int) -> bool:
        return True

    def evictable(self, want, layer: int):
        return lambda k: k not in want

    def holds(self, key: int, c: int) -> bool:
        return key in self.entries

    def add(self, key: int, c: int) -> None:
        self.entries[key] = c
        self.count[c] += 1
        self.peak[c] = max(self.peak[c], self.count[c])
        self.used += self.sizes[c]

    def remove(self, key: int, c: int) -> int:
        vc = self.entries.pop(key)
        self.used -= self.class_bytes[vc]
        self.count[vc] -= 1
        return vc

    def check(self, c: int) -> None:
        assert self.used <= self.budget and len(self.policy) == len(self.entries)


# --------------------------------------------------------------------------- the loop


def _begin_call(ctx: Ctx, i: int, call: Call, c: int, toks, pos_of, wts) -> dict:
    """Fill ``ctx`` for call ``i`` and return its unique keys in first-appearance order, each
    with its largest gate weight when the stream has weights (else None)."""
    base = call.layer << KEY_SHIFT
    w = wts[i] if wts is not None else None
    if w is None:
        want = dict.fromkeys(base | e for e in call.ids)
    else:
        want = {}
        for e, g in zip(call.ids, w):
            key = base | e
            old = want.get(key)
            if old is None or g > old:
                want[key] = g
    ctx.tick = i
    ctx.token = toks[i]
    ctx.layer = call.layer
    ctx.pos = pos_of[call.layer]
    ctx.kind = call.kind
    ctx.want = want
    ctx.cls = c
    return want


def _serve_hits(want, resident, pol, ctx, counters) -> list:
    """A decode call's first pass: count and report its resident keys as hits, in call order;
    returns the missing keys."""
    missing = []
    for key in want:
        if key in resident:
            counters[HIT] += 1
            pol.on_hit(key, ctx)
        else:
            missing.append(key)
    return missing


def _make_room(space, c, key, pol, evictable, want, ctx, counters, check) -> bool:
    """Evict the policy's victims until an entry of class ``c`` fits; False: serve ``key``
    directly (no victim left, or the first replacement refused by ``admit``)."""
    layer = ctx.layer
    if not space.may_evict(c, layer):
        return False
    first = True
    while not space.fits(c, layer):
        v = pol.victim(evictable)
        if v is None or (first and not pol.admit(key, v, ctx)):
            return False
        first = False
        if check:
            assert space.holds(v, c) and v not in want, (v, key)
        vc = space.remove(v, c)
        pol.on_remove(v)
        counters[vc][EVICT] += 1
    return True


def replay(prepared: PreparedStream, space, *, check: bool = False, misses: list | None = None) -> list[list[int]]:
    """Serve every call of ``prepared`` in ``space`` (:class:`ClassSlots` or
    :class:`SharedBudget`); returns a counter row per class (columns
    :data:`~expcache_bench.sim.calls.COUNTERS`).  ``check``: assert the invariants after
    every call (slow; for tests). ``misses``: a list each miss's key is appended to, in the
    order the library reads them (calls in order, each call's in first-appearance order)."""
    toks, pos_of, wts = prepared.tokens, prepared.pos_of, prepared.weights
    cls, pols, resident, sizes = space.layer_class, space.policies, space.resident, space.sizes
    cnt = [[0] * len(COUNTERS) for _ in pols]
    ctx = Ctx()
    ctx.layers = prepared.layers
    for i, call in enumerate(prepared.stream):
        c = cls[call.layer]
        pol = pols[c]
        res = resident[c]
        ct = cnt[c]
        want = _begin_call(ctx, i, call, c, toks, pos_of, wts)
        ctx.size = sizes[c]
        pol.begin(ctx)
        if call.kind == DECODE:
            missing = _serve_hits(want, res, pol, ctx, ct)
            if missing:
                evictable = space.evictable(want, call.layer)
                for key in missing:
                    ct[MISS] += 1
                    if misses is not None:
                        misses.append(key)
                    pol.on_miss(key, ctx)
                    if not space.fits(c, call.layer) and not _make_room(
                        space, c, key, pol, evictable, want, ctx, cnt, check
                    ):
                        ct[DIRECT] += 1
                        continue
                    space.add(key, c)
                    pol.on_insert(key, False, ctx)
                    ct[INSERT] += 1
        else:
            for key in want:
                if key in res:
                    ct[HIT] += 1
                else:
                    ct[MISS] += 1
                    if misses is not None:
                        misses.append(key)
                    pol.on_miss(key, ctx)
                    if space.fits(c, call.layer):
                        space.add(key, c)
                        pol.on_insert(key, True, ctx)
                        ct[APPEND] += 1
                    else:
                        ct[DIRECT] += 1
        if check:
            space.check(c)
    return cnt
