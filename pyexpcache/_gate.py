"""The call gate of an :class:`~pyexpcache.ExpertCache`: calls run while the cache is open, and
:meth:`~pyexpcache.ExpertCache.close` waits for them."""

from __future__ import annotations

import threading

from . import _lifetime
from ._errors import CacheClosedError, ForkedError


class Gate:
    """Lets calls into one cache run while it is open and :meth:`ExpertCache.close` wait for
    them: a call enters (counted) or raises CacheClosedError; close marks the gate shut, waits
    until no call is in flight, and destroys the handle under the gate's lock, so a call that
    starts meanwhile blocks, then raises. Nested entries on one thread are counted alike.
    In a forked child the gate is a new one, shut, raising ForkedError.

    ``after``, when given, runs on a thread when that thread's outermost entry ends with lines
    queued on it (``queue``), the gate already left: the cache's log lines are delivered there,
    so a logging handler may call the cache (close included), and a warning raised as an error
    surfaces at the call."""

    __slots__ = ("lock", "idle", "active", "shut", "forked", "depth", "after")

    def __init__(self, after=None):
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.active = 0
        self.shut = False
        self.forked = False
        self.depth = threading.local()
        self.after = after

    def inside(self) -> bool:
        """True on a thread inside a call through this gate."""
        return getattr(self.depth, "n", 0) > 0

    def queue(self, item) -> None:
        """Keep ``item`` for this thread's ``after``."""
        items = getattr(self.depth, "items", None)
        if items is None:
            items = self.depth.items = []
        items.append(item)

    def take(self) -> list:
        """This thread's queued items, emptied."""
        items = getattr(self.depth, "items", None) or []
        self.depth.items = None
        return items

    def __enter__(self):
        with self.lock:
            if not self.shut:
                self.active += 1
                self.depth.n = getattr(self.depth, "n", 0) + 1
                return
        if self.forked:
            raise ForkedError(
                "this cache was created before the process forked: a cache cannot be used in a "
                "forked child (its threads, locks and device state stayed in the parent); create a "
                "new cache (and source) in the child"
            )
        _lifetime.park_if_exiting()
        raise CacheClosedError("the cache is closed")

    def __exit__(self, exc_type, exc, tb):
        with self.lock:
            self.active -= 1
            self.depth.n -= 1
            outermost = self.depth.n == 0
            if self.shut and self.active == 0:
                self.idle.notify_all()
        if outermost and self.after is not None and getattr(self.depth, "items", None):
            self.after(exc_type is None)
