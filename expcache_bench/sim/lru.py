"""Least recently used: the library's default policy, as a :class:`~expcache_bench.sim.policy.Policy`."""

from __future__ import annotations

from collections import OrderedDict

from .policy import Policy

__all__ = ["LRU"]


class LRU(Policy):
    """Least recently used; cold inserts go to the LRU end.  Same counters as
    the library's LRU classes (:func:`expcache_bench.sim.simulate_lru` runs it)."""

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
