"""The benchmark's modes, one module each: ``variants`` (the variants table), ``engine`` (the
engine model), ``torch_loop`` (the torch decode loop, mode ``torch``), ``devices`` (several
devices), ``curve`` (hit rate against budget) and ``transfer`` (miss throughput next to the raw
link)."""

from __future__ import annotations

import importlib

# Mode name -> its module, in the order the help lists them.
_MODULES = {"variants": "variants", "engine": "engine", "torch": "torch_loop", "devices": "devices"}
NAMES = tuple(_MODULES)


def by_name(name: str):
    """The module of the mode ``name``."""
    try:
        module = _MODULES[name]
    except KeyError:
        raise ValueError(f"unknown mode {name!r}: expected one of {', '.join(NAMES)}") from None
    return importlib.import_module(f"{__name__}.{module}")
