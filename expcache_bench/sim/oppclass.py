"""Ours: ClassLRU's lists with age counted in missed opportunities of the key's layer.

* :func:`missed_opportunities`: how many times a key's layer ran since its last use.
* :class:`OppClassLRU`: the winner (``"oppclass"``; docs/policy.md), mirrored by
  ``libexpcache/src/policy/oppclass.hpp`` and ``oppclass.cpp``.
* :class:`HazardClassLRU`: candidate 2 (``"hazard"``), the same lists ranked by a
  reuse hazard learned online.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np

from .policy import Policy

__all__ = ["missed_opportunities", "OppClassLRU", "HazardClassLRU"]


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

    def __init__(
        self,
        capacity,
        half_life: float = 64.0,
        base: float = 1.3,
        weight: float = 1.6,
        offset: float = 1.0,
        max_class: int = 15,
        remember: bool = True,
        size_exp: float = 0.0,
    ):
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

    def on_hint(self, key, ctx):
        # Recency only, as the library: a hint is not a use.
        k = self.where[key]
        self.lists[k].move_to_end(key)
        self.when[key] = (ctx.token, ctx.pos)

    def on_prefetch(self, key, ctx):
        # Class 0, the cold end, with no use counted, as the library.
        if self.size_exp:
            self.cls_of[key] = ctx.cls
        self.lists[0][key] = None
        self.lists[0].move_to_end(key, last=False)
        self.where[key] = 0
        self.when[key] = (-(1 << 30), 0)

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

    def __init__(
        self,
        capacity,
        half_life: float = 64.0,
        base: float = 1.3,
        weight: float = 1.6,
        offset: float = 1.0,
        max_class: int = 15,
        M: int = 64,
        prior_n: float = 100.0,
        prior_h: float = 0.3,
        forget: float = 0.0,
    ):
        super().__init__(capacity, half_life=half_life, base=base, weight=weight, offset=offset, max_class=max_class)
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
