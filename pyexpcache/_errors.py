"""Exceptions: one base class carrying the library status and message, one
subclass per status, raised from exactly one place (:func:`check`).

The status codes themselves are defined here, once, mirroring expcache.h's
``EXPCACHE_OK`` and ``EXPCACHE_ERR_*``; ``_lib`` imports them from this module
(which must not import ``_lib``: ``_lib`` imports it)."""

from __future__ import annotations

import sys

# Status codes (expcache.h: EXPCACHE_OK, EXPCACHE_ERR_*).
OK = 0
ERR_INVALID_ARGUMENT = 1
ERR_OUT_OF_DEVICE_MEMORY = 2
ERR_OUT_OF_HOST_MEMORY = 3
ERR_INVALID_STATE = 4
ERR_UNSUPPORTED = 5
ERR_CUDA = 6
ERR_POISONED = 7
ERR_INTERNAL = 8
ERR_IO = 9


class ExpcacheError(Exception):
    """A libexpcache call failed.

    Attributes:
        status: the library's status code (``EXPCACHE_ERR_*`` value).
        status_name: its name, e.g. ``"EXPCACHE_ERR_INVALID_ARGUMENT"``.
        message: the library's detail (function, reason, CUDA error name).
    """

    def __init__(self, status: int, status_name: str, message: str):
        self.status = status
        self.status_name = status_name
        self.message = message
        super().__init__(f"{message} [{status_name}]")


class InvalidArgumentError(ExpcacheError, ValueError):
    """An argument was NULL, out of range or inconsistent."""


class OutOfDeviceMemoryError(ExpcacheError, MemoryError):
    """Device memory (or the host backend's emulated capacity) is exhausted."""


class OutOfHostMemoryError(ExpcacheError, MemoryError):
    """A host allocation failed."""


class InvalidStateError(ExpcacheError, RuntimeError):
    """The call is not valid in the cache's current state."""


class UnsupportedError(ExpcacheError, NotImplementedError):
    """The requested backend is not available."""


class CudaError(ExpcacheError, RuntimeError):
    """A CUDA call failed."""


class PoisonedError(CudaError):
    """A sticky CUDA error poisoned the cache; close it."""


class InternalError(ExpcacheError, RuntimeError):
    """A bug in libexpcache."""


class SourceIOError(ExpcacheError, OSError):
    """Reading a source file failed or came up short."""


class ArgumentRangeError(OverflowError, ValueError):
    """An integer argument does not fit the C type it is passed as (raised by the wrapper
    before the library sees it, naming the parameter). Both a ValueError and an OverflowError."""


class CacheClosedError(ValueError):
    """The cache (or what the call needs of it) is closed: a call that starts after
    :meth:`~pyexpcache.ExpertCache.close` began. A ValueError, like I/O on a closed file."""


class ForkedError(CacheClosedError):
    """A cache or source used in a child process made by fork() after it was created: its
    library threads, locks and device state stayed in the parent. Create it in the child
    (or start children with the ``spawn`` or ``forkserver`` method)."""


class ExpcacheWarning(RuntimeWarning):
    """Trouble the library reports without failing a call, e.g. a size class left with
    cap 0 (nothing of it is cached: a budget too small for one of its experts, or no device
    memory after the reserve), with the smallest budget or largest reserve that holds one."""


def stacklevel_outside(*modules: str) -> int:
    """``stacklevel`` for a warning issued by the caller of this function that names the first
    frame outside ``modules`` (the caller's ``__name__``, and those of the modules whose functions
    call it): the user's line, however many of their own functions lie between."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") in modules:
        level += 1
        frame = frame.f_back
    return level


_BY_STATUS = {
    ERR_INVALID_ARGUMENT: InvalidArgumentError,
    ERR_OUT_OF_DEVICE_MEMORY: OutOfDeviceMemoryError,
    ERR_OUT_OF_HOST_MEMORY: OutOfHostMemoryError,
    ERR_INVALID_STATE: InvalidStateError,
    ERR_UNSUPPORTED: UnsupportedError,
    ERR_CUDA: CudaError,
    ERR_POISONED: PoisonedError,
    ERR_INTERNAL: InternalError,
    ERR_IO: SourceIOError,
}


def error_for(status: int, status_name: str, message: str) -> ExpcacheError:
    """The exception instance for a failed status."""
    return _BY_STATUS.get(status, ExpcacheError)(status, status_name, message)
