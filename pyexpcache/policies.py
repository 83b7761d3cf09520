"""Pluggable eviction policies for the offline expert-cache simulator.

:func:`simulate_policy` replays a request stream with *exactly* the call
semantics of :func:`pyexpcache.simulate.simulate_lru` (read that module's
docstring), but lets a policy object decide the order of eviction:

* ``"decode"`` call: deduplicated ids, hits first in call order
  (``on_hit``), then each miss in order (``on_miss``): into a free slot if the
  class has one (``on_insert(key, cold=False)``); otherwise
  ``victim(evictable)`` names a resident entry *not requested by this call*
  (``None``: every resident entry is protected, the miss is served directly).
  A policy with admission may refuse the replacement (``admit`` returns
  ``False``): the miss is then served directly and counted in ``direct``.
* ``"batch"`` call: hits are counted and do **not** reach the policy (the
  library leaves recency untouched on a batch hit); misses are appended into
  free capacity as the coldest entries (``on_insert(key, cold=True)``), never
  evicting, else served directly.  ``on_miss`` is still called for every batch
  miss so that history-keeping policies can count it.

The policy interface mirrors ``libexpcache/src/policy/policy.hpp`` (one policy
object per size class; ``on_insert(slot, cold)``, ``on_hit(slot)``,
``on_remove(slot)``, ``victim(evictable)``), with a per-call context
:class:`Ctx` added (token index, layer, gate weights) and two optional hooks
(``begin`` at the start of every call, ``on_miss`` for every miss, ``admit``
for bypass).  Keys are ``layer << 32 | expert``, the same Python ints as in
:mod:`pyexpcache.simulate`.

:func:`simulate_global` is the *global budget* mode for multi-class layouts:
one policy object orders the entries of every class and the classes compete for
one byte budget (a miss evicts victims until its bytes fit).

Policies (``POLICIES`` maps names to factories):

=================  ==========================================================
``lru``            least recently used (identical counters to simulate_lru)
``classlru``       llama.cpp's frequency/recency hybrid: decayed use count
                   (128-token half-life), one LRU list per log2 class of the
                   count, victim = list head with the largest age / 2^class
``lrfu``           Lee et al. LRFU: combined recency-frequency value
                   sum 2^(-lambda * age) over past uses, victim = smallest
                   (lambda = 0.03 per token, tuned on the tuning traces)
``arc``            ARC (Megiddo & Modha), ghost lists B1/B2, adaptive p
``s3fifo``         S3-FIFO (Yang et al., SOSP'23): 10 % small FIFO, main
                   FIFO with 2-bit counters, ghost FIFO
``wtinylfu``       W-TinyLFU (Caffeine): window LRU (10 %, tuned on the
                   tuning traces; Caffeine starts at 1 % and hill-climbs),
                   segmented main LRU, frequency duel for admission
``oppclass``       ours, the winner: :class:`OppClassLRU` (docs/policy.md)
``hazard``         ours, candidate 2: :class:`HazardClassLRU`, the same lists
                   ranked by a reuse hazard learned online
=================  ==========================================================

Nothing here needs more than numpy; every policy keeps O(1) or O(log n)
bookkeeping per access (``victim`` may look at a bounded number of list
heads), except the peers' ghost-list trimming, which is amortised O(1).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from functools import partial
from typing import Callable, Optional, Sequence

import numpy as np

from .simulate import DECODE, Call, SimResult, _SHIFT, _as_stream, _result, _setup
from .traces import Trace

__all__ = [
    "Ctx",
    "Policy",
    "LRU",
    "ClassLRU",
    "LRFU",
    "ARC",
    "S3FIFO",
    "WTinyLFU",
    "OppClassLRU",
    "HazardClassLRU",
    "missed_opportunities",
    "POLICIES",
    "make_policy",
    "simulate_policy",
    "simulate_global",
    "token_index",
]

_H, _M, _I, _A, _D, _E = range(6)


# --------------------------------------------------------------------------- context


class Ctx:
    """Per-call context handed to the policy hooks (one object, updated in place).

    Attributes:
        tick: index of the call in the stream (0, 1, ...).
        token: token index of the call (see :func:`token_index`).
        layer: the call's cache layer.
        pos: position of the layer within the token, 0 .. ``layers - 1``
            (cache layers sorted; the rank of ``layer`` among the layers used).
        layers: number of distinct cache layers in the stream.
        kind: ``"decode"`` or ``"batch"``.
        want: ``dict`` key -> gate weight (``None`` without weights) of the
            call's deduplicated requests, in first-appearance order.  For a
            batch the weight is the largest over the batch's tokens.
        size: bytes of one expert of the call's class (global mode), else 1.
        cls: the call's size class.
    """

    __slots__ = ("tick", "token", "layer", "pos", "layers", "kind", "want", "size", "cls")

    def __init__(self) -> None:
        self.tick = self.token = self.layer = self.pos = 0
        self.layers = 1
        self.kind = DECODE
        self.want: dict = {}
        self.size = 1
        self.cls = 0

    @property
    def time(self) -> float:
        """Fractional token time: ``token + pos / layers``."""
        return self.token + self.pos / self.layers


class Policy:
    """Base class: the interface of ``policy.hpp`` plus the simulator's hooks.

    A policy orders the resident keys of one class (or of all classes in
    global mode).  ``victim`` must return a resident key for which
    ``evictable(key)`` is true, or ``None`` when there is none; the simulator
    then calls ``on_remove(victim)`` before ``on_insert(new)``.
    """

    name = "policy"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    def begin(self, ctx: Ctx) -> None:
        """Start of every call (decode or batch), before any hit or miss."""

    def on_hit(self, key: int, ctx: Ctx) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def on_miss(self, key: int, ctx: Ctx) -> None:
        """Every miss (decode and batch), before it is placed or served directly."""

    def on_insert(self, key: int, cold: bool, ctx: Ctx) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def on_remove(self, key: int) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def victim(self, evictable: Callable[[int], bool]) -> Optional[int]:  # pragma: no cover - abstract
        raise NotImplementedError

    def admit(self, key: int, victim: int, ctx: Ctx) -> bool:
        """Replace ``victim`` by the missing ``key``?  ``False``: serve ``key`` directly."""
        return True

    def __len__(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError


# --------------------------------------------------------------------------- simulator


def token_index(stream: Sequence[Call]) -> list[int]:
    """Token index of each call: a new token starts when a call's layer is not
    greater than the previous call's layer (decode traces are token-major,
    prefill batches layer-major and followed by their decode token)."""
    out = []
    tok = -1
    prev = None
    for call in stream:
        if prev is None or call.layer <= prev:
            tok += 1
        prev = call.layer
        out.append(tok)
    return out


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
        out = [tuple(tok[l]) for tok in rows for l in range(L)]
    else:
        out = [None if w is None else tuple(w) for w in weights]
    if len(out) != len(stream):
        raise ValueError(f"weights cover {len(out)} calls, the stream has {len(stream)}")
    return out


def make_policy(policy) -> Callable[[int], Policy]:
    """A factory ``capacity -> Policy`` from a name in :data:`POLICIES`, a
    :class:`Policy` subclass, a ``functools.partial`` of one, or any callable."""
    if isinstance(policy, str):
        try:
            return POLICIES[policy]
        except KeyError:
            raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}") from None
    if callable(policy):
        return policy
    raise TypeError(f"policy must be a name or a callable capacity -> Policy, got {policy!r}")


def _policy_name(factory) -> str:
    if isinstance(factory, partial):
        inner = _policy_name(factory.func)
        args = ",".join(f"{k}={v}" for k, v in factory.keywords.items())
        return f"{inner}({args})" if args else inner
    return getattr(factory, "name", getattr(factory, "__name__", "policy"))


def _prepare(requests, weights, tokens, layers=None):
    stream = _as_stream(requests)
    wts = _weights_for(requests, stream, weights)
    toks = list(tokens) if tokens is not None else token_index(stream)
    if len(toks) != len(stream):
        raise ValueError(f"tokens cover {len(toks)} calls, the stream has {len(stream)}")
    # Layer positions: ranks among `layers` (the library: its registered MoE layers), else
    # among the layers the stream uses.
    layers = sorted(set(layers) if layers is not None else {c.layer for c in stream})
    pos_of = {l: i for i, l in enumerate(layers)}
    return stream, wts, toks, pos_of, max(len(layers), 1)


def _begin_call(ctx: "Ctx", i: int, call: Call, c: int, toks, pos_of, wts) -> dict:
    """Fill ``ctx`` for call ``i`` and return its unique keys in first-appearance order, each
    with its largest gate weight when the stream has weights (else None)."""
    base = call.layer << _SHIFT
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
            counters[_H] += 1
            pol.on_hit(key, ctx)
        else:
            missing.append(key)
    return missing


def simulate_policy(
    requests,
    capacity: int | Sequence[int],
    layer_class: Sequence[int] | None = None,
    policy="lru",
    *,
    weights=None,
    tokens: Sequence[int] | None = None,
    layers: Sequence[int] | None = None,
    check: bool = False,
) -> SimResult:
    """Replay ``requests`` through one ``policy`` object per size class.

    Args:
        requests: as :func:`pyexpcache.simulate.simulate_lru` (a sequence of
            :class:`~pyexpcache.simulate.Call`, a :class:`Trace` or an int array).
        capacity, layer_class: as in ``simulate_lru``.
        policy: name in :data:`POLICIES` or a factory ``capacity -> Policy``.
        weights: gate weights, ``[tokens, layers, k]`` array or per-call tuples
            parallel to ``call.ids`` (default: a Trace's own weights, if any).
        tokens: token index of every call (default :func:`token_index`).
        layers: the layers whose ranks are the clock's layer positions, as the library's
            registered MoE layers are (default: the layers the stream uses).
        check: assert the invariants after every call (slow; for tests).

    Returns:
        :class:`SimResult` whose ``policy`` is the policy's name.
    """
    stream, wts, toks, pos_of, nlayers = _prepare(requests, weights, tokens, layers)
    cap, cls = _setup(stream, capacity, layer_class)
    factory = make_policy(policy)
    pols = [factory(c) for c in cap]
    resident = [set() for _ in cap]
    cnt = [[0] * 6 for _ in cap]
    ctx = Ctx()
    ctx.layers = nlayers
    for i, call in enumerate(stream):
        c = cls[call.layer]
        pol = pols[c]
        res = resident[c]
        ct = cnt[c]
        limit = cap[c]
        want = _begin_call(ctx, i, call, c, toks, pos_of, wts)
        pol.begin(ctx)
        if call.kind == DECODE:
            missing = _serve_hits(want, res, pol, ctx, ct)
            if missing:
                evictable = lambda k: k not in want  # noqa: E731
                for key in missing:
                    ct[_M] += 1
                    pol.on_miss(key, ctx)
                    if len(res) < limit:
                        res.add(key)
                        pol.on_insert(key, False, ctx)
                        ct[_I] += 1
                        continue
                    v = pol.victim(evictable) if limit else None
                    if v is None or not pol.admit(key, v, ctx):
                        ct[_D] += 1
                        continue
                    if check:
                        assert v in res and v not in want, (v, key)
                    res.discard(v)
                    pol.on_remove(v)
                    res.add(key)
                    pol.on_insert(key, False, ctx)
                    ct[_E] += 1
                    ct[_I] += 1
        else:
            for key in want:
                if key in res:
                    ct[_H] += 1
                else:
                    ct[_M] += 1
                    pol.on_miss(key, ctx)
                    if len(res) < limit:
                        res.add(key)
                        pol.on_insert(key, True, ctx)
                        ct[_A] += 1
                    else:
                        ct[_D] += 1
        if check:
            assert len(res) <= limit
            assert len(pol) == len(res), (len(pol), len(res))
    name = _policy_name(factory)
    return _result(name, cap, cnt, len(stream))


def simulate_global(
    requests,
    budget_bytes: int,
    class_bytes: Sequence[int],
    layer_class: Sequence[int],
    policy="lru",
    *,
    weights=None,
    tokens: Sequence[int] | None = None,
    check: bool = False,
) -> SimResult:
    """Replay ``requests`` with every class competing for one byte budget.

    One policy object orders all resident entries.  A miss of class ``c``
    needs ``class_bytes[c]`` bytes: if they are free it is inserted, otherwise
    victims (``policy.victim``, any class, never an entry of the current call)
    are evicted one by one until the bytes fit; if the policy runs out of
    victims first, or refuses the first replacement (``admit``), the miss is
    served directly (victims already evicted stay evicted).  Batch calls
    append into free bytes only.  Counters are per class; ``capacity`` in the
    result is each class's largest resident count reached.

    The victim is the policy's choice across classes, so class budgets
    follow demand.  :class:`OppClassLRU` ranks entries of every size by the
    same score, an increasing function of the chance of reuse: when a miss
    costs its bytes, keeping an entry of ``s`` bytes hit with probability
    ``p`` saves ``p * s`` bytes for ``s`` bytes of room, a value per byte of
    ``p`` whatever the size (its ``size_exp`` option weights the score by
    ``size ** size_exp`` to test other trade-offs).

    Args:
        requests: as :func:`simulate_policy`.
        budget_bytes: the one budget shared by all classes.
        class_bytes: bytes of one expert of each class.
        layer_class: class of each cache layer (required).
        policy: name in :data:`POLICIES` or factory; built with capacity ``None``.
        weights, tokens, check: as :func:`simulate_policy` (``check`` also
            asserts the budget).
    """
    stream, wts, toks, pos_of, nlayers = _prepare(requests, weights, tokens)
    cls = [int(c) for c in layer_class]
    ncls = len(class_bytes)
    size_of = {}
    factory = make_policy(policy)
    pol = factory(None)
    resident: dict[int, int] = {}
    used = 0
    peak = [0] * ncls
    count = [0] * ncls
    cnt = [[0] * 6 for _ in range(ncls)]
    ctx = Ctx()
    ctx.layers = nlayers

    def add(key, c, used, cold):
        """Make `key` of class `c` resident; returns the bytes now used."""
        resident[key] = c
        count[c] += 1
        peak[c] = max(peak[c], count[c])
        pol.on_insert(key, cold, ctx)
        return used + int(class_bytes[c])

    for i, call in enumerate(stream):
        c = cls[call.layer]
        size = int(class_bytes[c])
        ct = cnt[c]
        want = _begin_call(ctx, i, call, c, toks, pos_of, wts)
        ctx.size = size
        pol.begin(ctx)
        if call.kind == DECODE:
            missing = _serve_hits(want, resident, pol, ctx, ct)
            evictable = lambda k: k not in want  # noqa: E731
            for key in missing:
                ct[_M] += 1
                pol.on_miss(key, ctx)
                if used + size > budget_bytes:
                    first = True
                    while used + size > budget_bytes:
                        v = pol.victim(evictable)
                        if v is None or (first and not pol.admit(key, v, ctx)):
                            break
                        first = False
                        if check:
                            assert v in resident and v not in want
                        vc = resident.pop(v)
                        used -= class_bytes[vc]
                        count[vc] -= 1
                        pol.on_remove(v)
                        cnt[vc][_E] += 1
                    if used + size > budget_bytes:
                        ct[_D] += 1
                        continue
                used = add(key, c, used, cold=False)
                ct[_I] += 1
        else:
            for key in want:
                if key in resident:
                    ct[_H] += 1
                else:
                    ct[_M] += 1
                    pol.on_miss(key, ctx)
                    if used + size <= budget_bytes:
                        used = add(key, c, used, cold=True)
                        ct[_A] += 1
                    else:
                        ct[_D] += 1
        if check:
            assert used <= budget_bytes and len(pol) == len(resident)
    name = "global:" + _policy_name(factory)
    return _result(name, tuple(peak), cnt, len(stream))


# --------------------------------------------------------------------------- baselines


class LRU(Policy):
    """Least recently used; cold inserts go to the LRU end.  Same counters as
    :func:`pyexpcache.simulate.simulate_lru`."""

    name = "lru"

    def __init__(self, capacity):
        super().__init__(capacity)
        self.od: OrderedDict = OrderedDict()

    def __len__(self):
        return len(self.od)

    def on_hit(self, key, ctx):
        self.od.move_to_end(key)

    def on_insert(self, key, cold, ctx):
        self.od[key] = None
        if cold:
            self.od.move_to_end(key, last=False)

    def on_remove(self, key):
        del self.od[key]

    def victim(self, evictable):
        for key in self.od:
            if evictable(key):
                return key
        return None


class ClassLRU(Policy):
    """llama.cpp's frequency/recency hybrid ("ClassLRU").

    Every key (resident or not) has a decayed use count: on each use
    ``count = count * 2 ** (-(now - last_use) / half_life) + 1`` with time in
    tokens.  A resident entry sits in the LRU list of its class
    ``min(floor(log2(count)), max_class)``, fixed at its last use (insert or
    hit).  The victim is, among the heads (least recently used evictable entry)
    of the non-empty lists, the one with the largest ``age / 2**class`` where
    age is measured in calls since its last use.  A cold insert (prefill
    append) enters class 0 at the head of its list with age counted from
    "never" (it goes first).
    """

    name = "classlru"

    def __init__(self, capacity, half_life: float = 128.0, max_class: int = 15, remember: bool = True):
        super().__init__(capacity)
        self.half_life = float(half_life)
        self.max_class = max_class
        self.remember = remember  # keep counts of non-resident keys
        self.lists = [OrderedDict() for _ in range(max_class + 1)]
        self.where: dict[int, int] = {}  # resident key -> class
        self.count: dict[int, tuple[float, float]] = {}  # key -> (count, time of last use)
        self.last: dict[int, int] = {}  # resident key -> tick of last use
        self.now = 0

    def __len__(self):
        return len(self.where)

    def begin(self, ctx):
        self.now = ctx.tick

    def _use(self, key, ctx):
        t = ctx.time
        c, t0 = self.count.get(key, (0.0, t))
        c = c * 2.0 ** (-(t - t0) / self.half_life) + 1.0
        self.count[key] = (c, t)
        return min(int(math.log2(c) + 1e-9), self.max_class)

    def on_hit(self, key, ctx):
        k = self._use(key, ctx)
        old = self.where[key]
        del self.lists[old][key]
        self.lists[k][key] = None
        self.where[key] = k
        self.last[key] = ctx.tick

    def on_insert(self, key, cold, ctx):
        if cold:
            # A prefill append: the first to go; its use is still counted.
            self._use(key, ctx)
            self.lists[0][key] = None
            self.lists[0].move_to_end(key, last=False)
            self.where[key] = 0
            self.last[key] = -(1 << 40)
            return
        k = self._use(key, ctx)
        self.lists[k][key] = None
        self.where[key] = k
        self.last[key] = ctx.tick

    def on_remove(self, key):
        k = self.where.pop(key)
        del self.lists[k][key]
        del self.last[key]
        if not self.remember:
            del self.count[key]

    def victim(self, evictable):
        best = None
        best_score = -1.0
        now = self.now
        for k, od in enumerate(self.lists):
            for key in od:
                if evictable(key):
                    score = (now - self.last[key] + 1) / (1 << k)
                    if score > best_score:
                        best, best_score = key, score
                    break
        return best


class LRFU(Policy):
    """LRFU (Lee et al., 2001): each key's combined recency and frequency
    ``CRF = sum over past uses of 2 ** (-lam * (now - t_use))`` (time in tokens);
    the victim is the resident entry with the smallest CRF.  Since every CRF
    decays at the same rate, the order is kept in a heap of
    ``log2(CRF) + lam * t_last`` (lazy deletion), O(log n) per access."""

    name = "lrfu"

    def __init__(self, capacity, lam: float = 0.03):
        super().__init__(capacity)
        self.lam = float(lam)
        self.crf: dict[int, tuple[float, float]] = {}  # key -> (crf at t_last, t_last), all keys seen
        self.res: dict[int, float] = {}  # resident key -> heap priority
        self.heap: list = []

    def __len__(self):
        return len(self.res)

    def _use(self, key, ctx):
        t = ctx.time
        c, t0 = self.crf.get(key, (0.0, t))
        c = c * 2.0 ** (-self.lam * (t - t0)) + 1.0
        self.crf[key] = (c, t)
        return math.log2(c) + self.lam * t

    def _push(self, key, prio):
        import heapq

        self.res[key] = prio
        heapq.heappush(self.heap, (prio, key))

    def on_hit(self, key, ctx):
        self._push(key, self._use(key, ctx))

    def on_insert(self, key, cold, ctx):
        prio = self._use(key, ctx)
        self._push(key, -1e300 if cold else prio)

    def on_remove(self, key):
        del self.res[key]

    def victim(self, evictable):
        import heapq

        heap = self.heap
        held = []
        out = None
        while heap:
            prio, key = heap[0]
            if self.res.get(key) != prio:
                heapq.heappop(heap)
            elif not evictable(key):
                held.append(heapq.heappop(heap))
            else:
                out = key
                break
        for item in held:
            heapq.heappush(heap, item)
        return out


class ARC(Policy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST'03).

    T1 (seen once recently) and T2 (seen at least twice) are LRU lists of
    resident keys; B1 and B2 their ghost lists (keys only).  A miss found in
    B1 grows the target size ``p`` of T1 by ``max(|B2| / |B1|, 1)``, one found
    in B2 shrinks it by ``max(|B1| / |B2|, 1)``; ghost hits enter T2, new keys
    T1.  REPLACE evicts T1's LRU into B1 when ``|T1| > p`` (or ``|T1| == p``
    and the miss is in B2), else T2's LRU into B2; with the current call's
    entries protected the first evictable entry of the chosen list is taken,
    falling back to the other list.  Ghost lists are trimmed to
    ``|T1| + |B1| <= c`` and ``|T1| + |T2| + |B1| + |B2| <= 2c``.
    Cold inserts (prefill appends) go to T1's LRU end.  In global mode
    ``c`` is the resident count at the first eviction.
    """

    name = "arc"

    def __init__(self, capacity):
        super().__init__(capacity)
        self.c = capacity
        self.p = 0.0
        self.t1, self.t2, self.b1, self.b2 = OrderedDict(), OrderedDict(), OrderedDict(), OrderedDict()
        self.pending_b2 = False
        self.pending_ghost = False

    def __len__(self):
        return len(self.t1) + len(self.t2)

    def on_hit(self, key, ctx):
        if key in self.t1:
            del self.t1[key]
        else:
            del self.t2[key]
        self.t2[key] = None

    def on_miss(self, key, ctx):
        c = self.c if self.c is not None else max(len(self), 1)
        self.pending_b2 = key in self.b2
        self.pending_ghost = False
        if key in self.b1:
            self.p = min(float(c), self.p + max(len(self.b2) / len(self.b1), 1.0))
            del self.b1[key]
            self.pending_ghost = True
        elif key in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            del self.b2[key]
            self.pending_ghost = True

    def on_insert(self, key, cold, ctx):
        if cold:
            self.t1[key] = None
            self.t1.move_to_end(key, last=False)
        elif self.pending_ghost:
            self.t2[key] = None
        else:
            self.t1[key] = None
        self.pending_ghost = False
        self._trim()

    def _trim(self):
        c = self.c if self.c is not None else max(len(self), 1)
        while self.b1 and len(self.t1) + len(self.b1) > c:
            self.b1.popitem(last=False)
        while len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c:
            if self.b2:
                self.b2.popitem(last=False)
            elif self.b1:
                self.b1.popitem(last=False)
            else:
                break

    def on_remove(self, key):
        if key in self.t1:
            del self.t1[key]
            self.b1[key] = None
        else:
            del self.t2[key]
            self.b2[key] = None

    @staticmethod
    def _first(od, evictable):
        for key in od:
            if evictable(key):
                return key
        return None

    def victim(self, evictable):
        if self.c is None:
            self.c = max(len(self), 1)
        n1 = len(self.t1)
        if n1 and (n1 > self.p or (self.pending_b2 and n1 == int(self.p))):
            order = (self.t1, self.t2)
        else:
            order = (self.t2, self.t1)
        for od in order:
            v = self._first(od, evictable)
            if v is not None:
                return v
        return None


class S3FIFO(Policy):
    """S3-FIFO (Yang et al., SOSP'23).

    A small FIFO S (``small`` = 10 % of the entries), a main FIFO M and a
    ghost FIFO G of keys evicted from S (as many keys as M's target size).
    Each resident entry has a 2-bit use counter (hits add 1, at most 3).  A
    new key goes to S, or to M when it is in G.  Eviction: while S holds at
    least its share, take S's oldest: if its counter is above ``promote``
    (default 0: any hit) it moves to M with counter 0 and the scan goes on,
    else it is the victim (and its key enters G).  Otherwise take M's oldest:
    a counter above 0 is decremented and the entry re-queued, else it is the
    victim.  Protected entries (current call) are re-queued without change;
    the scan gives up after two passes over the queues.  ``victim`` therefore
    reorders the queues (the lazy promotion of the paper).
    """

    name = "s3fifo"

    def __init__(self, capacity, small: float = 0.1, promote: int = 0):
        super().__init__(capacity)
        self.small_frac = small
        self.promote = promote
        self.s, self.m, self.g = OrderedDict(), OrderedDict(), OrderedDict()
        self.freq: dict[int, int] = {}
        self.pending = None

    def __len__(self):
        return len(self.s) + len(self.m)

    def _cap(self):
        return self.capacity if self.capacity is not None else max(len(self), 1)

    def on_hit(self, key, ctx):
        self.freq[key] = min(self.freq[key] + 1, 3)

    def on_insert(self, key, cold, ctx):
        self.freq[key] = 0
        if key in self.g:
            del self.g[key]
            self.m[key] = None
            if cold:
                self.m.move_to_end(key, last=False)
        else:
            self.s[key] = None
            if cold:
                self.s.move_to_end(key, last=False)

    def on_remove(self, key):
        del self.freq[key]
        if key in self.s:
            del self.s[key]
            self.g[key] = None
            limit = max(int(self._cap() * (1 - self.small_frac)), 1)
            while len(self.g) > limit:
                self.g.popitem(last=False)
        else:
            del self.m[key]

    def victim(self, evictable):
        small_target = max(int(self._cap() * self.small_frac), 1)
        budget = 2 * (len(self.s) + len(self.m)) + 2
        while budget > 0:
            budget -= 1
            if self.s and (len(self.s) >= small_target or not self.m):
                key = next(iter(self.s))
                if not evictable(key):
                    self.s.move_to_end(key)
                    continue
                if self.freq[key] > self.promote:
                    del self.s[key]
                    self.m[key] = None
                    self.freq[key] = 0
                    continue
                return key
            if self.m:
                key = next(iter(self.m))
                if not evictable(key):
                    self.m.move_to_end(key)
                    continue
                if self.freq[key] > 0:
                    self.freq[key] -= 1
                    self.m.move_to_end(key)
                    continue
                return key
            return None
        # Everything left is protected or kept re-queuing: first evictable anywhere.
        for od in (self.s, self.m):
            for key in od:
                if evictable(key):
                    return key
        return None


class WTinyLFU(Policy):
    """W-TinyLFU (Einziger et al.; the Caffeine design).

    A window LRU (``window`` = 1 % of the entries, at least 1) takes every new
    key; the main part is a segmented LRU (probation, and protected = 80 % of
    main; a hit in probation promotes to protected, whose overflow demotes its
    LRU to probation).  The frequency of every key is counted exactly (the key
    space is small; Caffeine uses a count-min sketch) and all counts are halved
    after ``10 * capacity`` requests.  Victim: when the window is over its
    size, its LRU entry (the candidate) duels the main victim (probation's LRU,
    else protected's): the candidate with the higher count enters probation and
    the other is evicted; ties evict the candidate.  Otherwise the main victim
    goes.  Protected entries of the current call are skipped.
    """

    name = "wtinylfu"

    def __init__(self, capacity, window: float = 0.10, protected: float = 0.8):
        super().__init__(capacity)
        self.window_frac = window
        self.protected_frac = protected
        self.win, self.prob, self.prot = OrderedDict(), OrderedDict(), OrderedDict()
        self.freq: dict[int, int] = {}
        self.samples = 0

    def __len__(self):
        return len(self.win) + len(self.prob) + len(self.prot)

    def _cap(self):
        return self.capacity if self.capacity is not None else max(len(self), 1)

    def begin(self, ctx):
        f = self.freq
        for key in ctx.want:
            f[key] = f.get(key, 0) + 1
        self.samples += len(ctx.want)
        if self.samples >= 10 * max(self._cap(), 1):
            self.samples //= 2
            self.freq = {k: v >> 1 for k, v in f.items() if v > 1}

    def on_hit(self, key, ctx):
        if key in self.win:
            self.win.move_to_end(key)
        elif key in self.prob:
            del self.prob[key]
            self.prot[key] = None
            limit = max(int((self._cap() - max(int(self._cap() * self.window_frac), 1)) * self.protected_frac), 1)
            while len(self.prot) > limit:
                k, _ = self.prot.popitem(last=False)
                self.prob[k] = None
        else:
            self.prot.move_to_end(key)

    def on_insert(self, key, cold, ctx):
        if cold:
            self.prob[key] = None
            self.prob.move_to_end(key, last=False)
        else:
            self.win[key] = None

    def on_remove(self, key):
        for od in (self.win, self.prob, self.prot):
            if key in od:
                del od[key]
                return

    @staticmethod
    def _first(od, evictable):
        for key in od:
            if evictable(key):
                return key
        return None

    def victim(self, evictable):
        wsize = max(int(self._cap() * self.window_frac), 1)
        # Window overflow moves into probation while main is below its share.
        while len(self.win) > wsize and len(self.prob) + len(self.prot) < self._cap() - wsize:
            k, _ = self.win.popitem(last=False)
            self.prob[k] = None
        main = self._first(self.prob, evictable)
        if main is None:
            main = self._first(self.prot, evictable)
        if len(self.win) > wsize or main is None:
            cand = self._first(self.win, evictable)
            if cand is None:
                return main
            if main is None:
                return cand
            if self.freq.get(cand, 0) > self.freq.get(main, 0):
                del self.win[cand]
                self.prob[cand] = None
                return main
            return cand
        return main



# --------------------------------------------------------------------------- ours


def missed_opportunities(token_last: int, pos_last: int, token_now: int, pos_now: int) -> int:
    """How many times the key's layer has run since the key was last requested.

    A key of layer position ``pos_last`` last used at token ``token_last`` had a
    chance to be requested once per token, when its layer ran.  At token
    ``token_now``, position ``pos_now``, the chances already passed are the
    tokens strictly between, plus the current token if its layer has already
    run (``pos_last <= pos_now``).  A key used by the previous token in a layer
    still ahead of the current one has missed nothing yet (0); the same key in
    a layer behind the current one has missed one chance.
    """
    return token_now - token_last - 1 + (pos_last <= pos_now)


class OppClassLRU(Policy):
    """Ours: ClassLRU with age counted in *missed opportunities* of the key's layer.

    State of every key ever requested (resident or not): a decayed use count
    ``d`` (half-life ``half_life`` tokens, +1 per use) and the time of its last
    use.  A resident entry lives in the LRU list of class
    ``k = min(floor(log_base(d)), max_class)``, fixed at its last use (insert
    or decode hit), with its last-use (token, layer position).  The victim is,
    among the heads (first evictable entry from the LRU end) of the non-empty
    lists, the one with the largest ``(m + offset) / weight ** k`` where ``m``
    is :func:`missed_opportunities` of the entry now; ties go to the lower
    class.  Cold inserts (prefill appends) enter class 0 at the LRU end with
    ``m`` counted as if never used (they go first).

    Why: the age of an expert that matters is how many times its layer asked
    and did not pick it, not the number of calls since (layers run in a fixed
    order, so a call count mixes up experts of layers ahead of and behind the
    current one by up to one whole token).  The defaults were tuned on the
    tuning traces only; see docs/policy.md.

    Per access O(1) (one exp2, one log or a threshold search, a list move);
    ``victim`` O(max_class + 1) list heads.
    """

    name = "oppclass"

    def __init__(self, capacity, half_life: float = 64.0, base: float = 1.3, weight: float = 1.6,
                 offset: float = 1.0, max_class: int = 15, remember: bool = True, size_exp: float = 0.0):
        super().__init__(capacity)
        self.size_exp = float(size_exp)
        self.size_factor: dict[int, float] = {}  # global mode: class -> size ** size_exp
        self.cls_of: dict[int, int] = {}  # resident key -> class (only with size_exp)
        self.half_life = float(half_life)
        self.log_base = math.log(base)
        self.max_class = int(max_class)
        self.scale = [float(weight) ** k for k in range(self.max_class + 1)]
        self.offset = float(offset)
        self.remember = remember
        self.lists = [OrderedDict() for _ in range(self.max_class + 1)]
        self.where: dict[int, int] = {}  # resident key -> class
        self.when: dict[int, tuple[int, int]] = {}  # resident key -> (token, layer position) of last use
        self.count: dict[int, tuple[float, float]] = {}  # key -> (decayed count, time of last use)
        self.token = 0
        self.pos = 0

    def __len__(self):
        return len(self.where)

    def begin(self, ctx):
        self.token = ctx.token
        self.pos = ctx.pos
        if self.size_exp and ctx.cls not in self.size_factor:
            self.size_factor[ctx.cls] = float(ctx.size) ** self.size_exp

    def _use(self, key, ctx) -> int:
        t = ctx.time
        prev = self.count.get(key)
        d = 1.0 if prev is None else prev[0] * 2.0 ** (-(t - prev[1]) / self.half_life) + 1.0
        self.count[key] = (d, t)
        k = int(math.log(d) / self.log_base + 1e-9)
        return k if k < self.max_class else self.max_class

    def on_hit(self, key, ctx):
        k = self._use(key, ctx)
        del self.lists[self.where[key]][key]
        self.lists[k][key] = None
        self.where[key] = k
        self.when[key] = (ctx.token, ctx.pos)

    def on_insert(self, key, cold, ctx):
        k = self._use(key, ctx)
        if self.size_exp:
            self.cls_of[key] = ctx.cls
        if cold:
            self.lists[0][key] = None
            self.lists[0].move_to_end(key, last=False)
            self.where[key] = 0
            self.when[key] = (-(1 << 30), 0)
            return
        self.lists[k][key] = None
        self.where[key] = k
        self.when[key] = (ctx.token, ctx.pos)

    def on_remove(self, key):
        del self.lists[self.where.pop(key)][key]
        del self.when[key]
        if self.size_exp:
            del self.cls_of[key]
        if not self.remember:
            del self.count[key]

    def victim(self, evictable):
        best = None
        best_score = -1.0
        token, pos, off, scale = self.token, self.pos, self.offset, self.scale
        for k, od in enumerate(self.lists):
            for key in od:
                if evictable(key):
                    t_last, p_last = self.when[key]
                    m = token - t_last - 1 + (p_last <= pos)
                    score = (m + off) / scale[k]
                    if self.size_exp:
                        score *= self.size_factor[self.cls_of[key]]
                    if score > best_score:
                        best, best_score = key, score
                    break
        return best



class HazardClassLRU(OppClassLRU):
    """Candidate 2: the classes and lists of :class:`OppClassLRU`, but the
    eviction score is a *hazard learned online* (an EVA/LHD-style estimate).

    For every class ``k`` and missed-opportunity count ``j`` (capped at ``M``)
    it counts ``ret[k][j]``, how many times a key of class ``k`` that had missed
    ``j`` chances was requested at the next one, and ``exp[k][j]``, how many
    such chances there were (every key ever requested, resident or not,
    contributes one chance per token; the keys of a class are tallied by
    last-use token, so a token's update is O(classes * M)).  The table
    ``h = ret / exp`` (made non-increasing in ``j``) is refreshed once per
    token and the victim is the list head with the smallest ``h[k][m]``.  A
    prior of ``prior_n`` pseudo-chances with hazard
    ``min(0.9, prior_h * weight ** k / (j + offset))`` keeps the early tokens
    sane.  Costs O(1) per access, O(classes * M) per token, O(classes) per
    victim.  It does no better than the fixed rule (docs/policy.md).
    """

    name = "hazard"

    def __init__(self, capacity, half_life: float = 64.0, base: float = 1.3, weight: float = 1.6,
                 offset: float = 1.0, max_class: int = 15, M: int = 64, prior_n: float = 100.0,
                 prior_h: float = 0.3, forget: float = 0.0):
        super().__init__(capacity, half_life=half_life, base=base, weight=weight, offset=offset,
                         max_class=max_class)
        K = self.max_class + 1
        self.M = int(M)
        self.forget = float(forget)
        j = np.arange(self.M + 1)[None, :]
        w = np.asarray(self.scale)[:, None]
        h0 = np.minimum(0.9, prior_h * w / (j + self.offset))
        self.exp = np.full((K, self.M + 1), float(prior_n))
        self.ret = prior_n * h0
        self.open = [dict() for _ in range(K)]  # class -> {last-use token: keys}
        self.kcls: dict[int, tuple[int, int]] = {}  # every key -> (class, last-use token)
        self.cur = -1
        self.table = None
        self._refresh()

    def _refresh(self):
        h = np.clip(self.ret / np.maximum(self.exp, 1e-9), 0.0, 1.0)
        self.table = np.minimum.accumulate(h, axis=1).tolist()

    def begin(self, ctx):
        while self.cur < ctx.token:
            if self.cur >= 0:
                self._end_token(self.cur)
            self.cur += 1
        super().begin(ctx)

    def _end_token(self, T):
        M = self.M
        for k, od in enumerate(self.open):
            row = self.exp[k]
            for t_last, n in od.items():
                if t_last < T:
                    j = T - t_last - 1
                    row[j if j < M else M] += n
        if self.forget > 0:
            f = 2.0 ** (-1.0 / self.forget)
            self.exp *= f
            self.ret *= f
        self._refresh()

    def _use(self, key, ctx) -> int:
        t = ctx.token
        prev = self.kcls.get(key)
        if prev is not None:
            k0, t0 = prev
            j = t - t0 - 1
            if j >= 0:
                j = j if j < self.M else self.M
                self.ret[k0][j] += 1.0
                self.exp[k0][j] += 1.0
            od = self.open[k0]
            od[t0] -= 1
            if not od[t0]:
                del od[t0]
        k = super()._use(key, ctx)
        self.kcls[key] = (k, t)
        od = self.open[k]
        od[t] = od.get(t, 0) + 1
        return k

    def victim(self, evictable):
        best = None
        best_h = 2.0
        token, pos, M, table = self.token, self.pos, self.M, self.table
        for k, od in enumerate(self.lists):
            for key in od:
                if evictable(key):
                    t_last, p_last = self.when[key]
                    m = token - t_last - 1 + (p_last <= pos)
                    h = table[k][m if m < M else M] if m >= 0 else 1.0
                    if h < best_h:
                        best, best_h = key, h
                    break
        return best


POLICIES: dict[str, Callable[[int], Policy]] = {
    "lru": LRU,
    "classlru": ClassLRU,
    "lrfu": LRFU,
    "arc": ARC,
    "s3fifo": S3FIFO,
    "wtinylfu": WTinyLFU,
    "oppclass": OppClassLRU,
    "hazard": HazardClassLRU,
}
