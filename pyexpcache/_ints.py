"""Range checks of the integers the wrapper hands to C: ctypes silently wraps a
Python int that does not fit its C type (2**32 + 5 becomes 5), so every value is
checked here first and a bad one raises, naming the parameter."""

from __future__ import annotations

import operator

from ._errors import ArgumentRangeError

U32_MAX = (1 << 32) - 1
U64_MAX = (1 << 64) - 1
I32_MIN, I32_MAX = -(1 << 31), (1 << 31) - 1


def checked_int(value, name: str, lo: int, hi: int) -> int:
    """``value`` as an int in ``[lo, hi]``: TypeError for a non-integer (a bool or a float
    included), :class:`~pyexpcache.ArgumentRangeError` (a ValueError and an OverflowError)
    outside the range."""
    if type(value) is not int:
        if isinstance(value, bool):
            raise TypeError(f"{name} must be an integer, got a bool ({value})")
        try:
            value = operator.index(value)
        except TypeError:
            raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None
    if not lo <= value <= hi:
        raise ArgumentRangeError(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def u32(value, name: str) -> int:
    """A uint32_t argument."""
    if type(value) is int and 0 <= value <= U32_MAX:  # the hot path: one type test, one compare
        return value
    return checked_int(value, name, 0, U32_MAX)


def u64(value, name: str) -> int:
    """A uint64_t argument (also sizes, addresses and stream handles)."""
    if type(value) is int and 0 <= value <= U64_MAX:
        return value
    return checked_int(value, name, 0, U64_MAX)
