"""A package imported from a local directory: the hub kernels the FP8 and MXFP4 benchmarks carry
to a machine without the Hugging Face hub (``_fp8_experts``, ``_mxfp4_experts``)."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType


def import_from(where: str, name: str) -> ModuleType:
    """Package ``name`` from directory ``where``, which is on ``sys.path`` for the import only.
    ImportError if it is not there."""
    sys.path.insert(0, where)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(where)
