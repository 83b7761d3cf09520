"""Segmented-queue policies of the literature: recent and frequent entries in separate
queues, with ghost lists of evicted keys or a frequency duel for admission.

* :class:`ARC`: Megiddo & Modha's adaptive replacement cache (T1/T2, ghosts B1/B2, adaptive p).
* :class:`S3FIFO`: Yang et al.'s small, main and ghost FIFOs (10 % small, 2-bit counters).
* :class:`WTinyLFU`: Caffeine's window LRU (10 %), segmented main LRU and frequency duel.

Every one keeps O(1) bookkeeping per access, the ghost-list trimming amortised O(1).
"""

from __future__ import annotations

from collections import OrderedDict

from .policy import Policy

__all__ = ["ARC", "S3FIFO", "WTinyLFU"]


def first_evictable(od, evictable):
    """The first key of the ordered dict ``od`` that ``evictable`` accepts, or None."""
    for key in od:
        if evictable(key):
            return key
    return None


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

    def victim(self, evictable):
        if self.c is None:
            self.c = max(len(self), 1)
        n1 = len(self.t1)
        if n1 and (n1 > self.p or (self.pending_b2 and n1 == int(self.p))):
            order = (self.t1, self.t2)
        else:
            order = (self.t2, self.t1)
        for od in order:
            v = first_evictable(od, evictable)
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

    def victim(self, evictable):
        wsize = max(int(self._cap() * self.window_frac), 1)
        # Window overflow moves into probation while main is below its share.
        while len(self.win) > wsize and len(self.prob) + len(self.prot) < self._cap() - wsize:
            k, _ = self.win.popitem(last=False)
            self.prob[k] = None
        main = first_evictable(self.prob, evictable)
        if main is None:
            main = first_evictable(self.prot, evictable)
        if len(self.win) > wsize or main is None:
            cand = first_evictable(self.win, evictable)
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
