"""Recency-frequency hybrids: a decayed use count per key, kept for keys not resident too.

* :class:`ClassLRU`: llama.cpp's policy: one LRU list per log2 class of the
  count (128-token half-life), the victim the list head with the largest
  ``age / 2**class``.
* :class:`LRFU`: Lee et al.'s combined recency-frequency value, the victim the
  smallest (lambda = 0.03 per token, tuned on the tuning traces).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict

from .policy import Policy

__all__ = ["ClassLRU", "LRFU"]


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
