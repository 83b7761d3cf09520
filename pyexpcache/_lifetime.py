"""What happens to caches and sources when the process forks or the interpreter exits.

**fork().** A cache or source belongs to the process that made it: its library threads do not
exist in a child, and its locks and CUDA state are the parent's. In a forked child every object
registered here is marked unusable (:meth:`_after_fork_in_child`): any call raises
:class:`~pyexpcache.CacheForkedError`, and closing it, or the child exiting, touches no thread,
lock or device state (what it held is the parent's; the child's copy is left to the OS).

**Exit.** At interpreter exit (an :mod:`atexit` handler, so after the program's non-daemon threads
ended and before daemon threads are frozen) every cache still open is closed as
:meth:`~pyexpcache.ExpertCache.close` would: calls in flight on daemon threads finish first, and a
daemon thread's later call waits for the process to end instead of raising (so a daemon loop
left running prints nothing); a call from any other thread raises CacheClosedError.
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref

_live: weakref.WeakSet = weakref.WeakSet()
_lock = threading.Lock()
in_forked_child = False  # True in a child made by fork() after this module was imported
exiting = False  # True once the exit handler began


def register(obj) -> None:
    """Track ``obj`` (with ``_after_fork_in_child()`` and ``_close_at_exit()``) until it is collected."""
    with _lock:
        _live.add(obj)


def _tracked() -> list:
    with _lock:
        return list(_live)


def _after_fork_in_child() -> None:
    global _lock, in_forked_child
    _lock = threading.Lock()  # the parent's may have been held by a thread that is not here
    in_forked_child = True
    for obj in list(_live):
        obj._after_fork_in_child()


def _at_exit() -> None:
    global exiting
    exiting = True
    for obj in _tracked():
        try:
            obj._close_at_exit()
        except Exception:
            pass


def park_if_exiting() -> None:
    """A daemon thread calling into a cache that exit closed: wait for the process to end."""
    if exiting and threading.current_thread().daemon:
        threading.Event().wait()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_at_exit)
