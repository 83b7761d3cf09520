"""References that keep a cache's device memory allocated (``expcache_memory_retain``).

Every zero-copy view holds one (:class:`MemoryPin`), and every array or tensor made from a view
holds the view, so the memory a tensor reads stays allocated, after the cache's next call, its
``release_all`` or ``close`` too; it is freed when the last reference goes. What the bytes are is
another matter: the views' validity rule says when the cache may put another expert there.
"""

from __future__ import annotations

import ctypes

from . import _lib, _lifetime


class MemoryPin:
    """One reference to the device allocation holding an address (a slab of slots). Released
    when collected; in a child made by fork() it is left alone (the memory is the parent's)."""

    __slots__ = ("_ref", "_release", "__weakref__")

    def __init__(self, handle: int, address: int):
        ref = _lib.MemoryRefPtr()
        _lib.lib.expcache_memory_retain(handle, address, ctypes.byref(ref))
        self._ref = ref.value
        self._release = _lib.lib.expcache_memory_release  # kept: module globals may be gone at exit

    def __del__(self):
        ref, self._ref = getattr(self, "_ref", None), None
        try:
            if ref and not _lifetime.in_forked_child:
                self._release(ref)
        except Exception:  # interpreter shutdown: the process's memory goes with it
            pass
