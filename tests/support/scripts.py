"""Scripts of benchmarks/ (not an importable package: asv's package is benchmarks/benchmarks/),
loaded by path for the tests that check them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def load_benchmark_script(name: str) -> ModuleType:
    """benchmarks/<name>.py as a module named ``name``."""
    path = REPO / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass of the script looks its module up there
    spec.loader.exec_module(module)
    return module
