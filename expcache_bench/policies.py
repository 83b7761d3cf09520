"""The library's eviction policies by name, as the benchmark runs them: its default first
(:func:`policy_variants`). Read from the library, which this loads when called (not at import)."""

from __future__ import annotations

from pyexpcache import _lib


def policy_variants() -> tuple[str, ...]:
    """The library's policies by name: its default (the one expcache_config_init fills in) first,
    then the rest of its table in id order. Loads the library."""
    default = _lib.DEFAULT_POLICY
    return (default,) + tuple(name for name in _lib.POLICIES if name != default)
