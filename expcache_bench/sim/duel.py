"""The library's default: LRU and OppClassLRU side by side, the one followed chosen online from
two shadow caches (set dueling; docs/policy.md, "The default: duel").

Mirrored by ``libexpcache/src/policy/duel.cpp`` (same decisions, count for count).
"""

from __future__ import annotations

from .lru import LRU
from .oppclass import OppClassLRU
from .policy import Policy

__all__ = ["DuelPolicy"]


def _always(key) -> bool:
    return True


class DuelPolicy(Policy):
    """LRU and :class:`OppClassLRU` both order the resident entries; a saturating counter, fed by
    two shadow caches, picks whose victim goes.

    The shadows hold keys only: one runs LRU, one OppClassLRU, each as large as the most entries
    the real cache has held at once so far, and both see every request the real cache's policy
    sees (a decode hit or a demand insert; batch appends and prefetches are not requests). A
    request one shadow hits and the other misses moves the counter ``psel`` one step toward the
    shadow that hit, within ``[-limit, limit - 1]``; the real cache evicts OppClassLRU's victim
    while ``psel >= 0`` (from the start) and LRU's below. As the leader sets of a CPU cache's set
    dueling, the shadows measure each policy alone on the same requests; the real cache follows
    the better one. A shadow evicts any of its keys (it knows no call protection or partition).

    Costs: three times OppClassLRU's bookkeeping at most (the real orders and two shadows), O(1)
    per request plus a shadow victim per shadow miss.

    Args:
        capacity: unused (as every policy here).
        limit: the counter's bound: how many more requests the better shadow must win, from the
            middle, before the real cache switches.
    """

    name = "duel"

    def __init__(self, capacity, limit: int = 64):
        super().__init__(capacity)
        self.lru = LRU(capacity)
        self.opp = OppClassLRU(capacity)
        self.shadows = (LRU(capacity), OppClassLRU(capacity))
        self.limit = int(limit)
        self.psel = 0
        self.resident = 0
        self.room = 0  # the shadows' size: the most entries resident at once

    def __len__(self):
        return len(self.lru)

    @property
    def follows(self) -> str:
        """The policy whose victims go now."""
        return "oppclass" if self.psel >= 0 else "lru"

    def begin(self, ctx):
        self.lru.begin(ctx)
        self.opp.begin(ctx)
        for s in self.shadows:
            s.begin(ctx)

    def _request(self, key, ctx):
        hit = [False, False]
        for i, s in enumerate(self.shadows):
            if key in s.where if i else key in s.od:
                hit[i] = True
                s.on_hit(key, ctx)
                continue
            if len(s) >= self.room:
                s.on_remove(s.victim(_always))
            s.on_insert(key, False, ctx)
        if hit[1] and not hit[0]:
            if self.psel < self.limit - 1:
                self.psel += 1
        elif hit[0] and not hit[1]:
            if self.psel > -self.limit:
                self.psel -= 1

    def _grew(self):
        self.resident += 1
        if self.resident > self.room:
            self.room = self.resident

    def on_hit(self, key, ctx):
        self._request(key, ctx)
        self.lru.on_hit(key, ctx)
        self.opp.on_hit(key, ctx)

    def on_hint(self, key, ctx):
        self.lru.on_hint(key, ctx)
        self.opp.on_hint(key, ctx)

    def on_prefetch(self, key, ctx):
        self._grew()
        self.lru.on_prefetch(key, ctx)
        self.opp.on_prefetch(key, ctx)

    def on_insert(self, key, cold, ctx):
        self._grew()
        if not cold:
            self._request(key, ctx)
        self.lru.on_insert(key, cold, ctx)
        self.opp.on_insert(key, cold, ctx)

    def on_remove(self, key):
        self.resident -= 1
        self.lru.on_remove(key)
        self.opp.on_remove(key)

    def victim(self, evictable):
        return (self.opp if self.psel >= 0 else self.lru).victim(evictable)
