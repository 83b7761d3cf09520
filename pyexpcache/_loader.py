"""Find and load the libexpcache shared library.

Search order: the ``EXPCACHE_LIBRARY`` environment variable (a path); then,
in this package's folder and in the source tree's ``build/``, the CUDA build
``libexpcache.so`` before the host-only ``libexpcache_host.so``. The CUDA
build also contains the host backend, so it is preferred wherever it loads.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

_NAMES = ("libexpcache.so", "libexpcache_host.so")


def candidate_paths() -> list[Path]:
    """Every path the loader tries, in order."""
    env = os.environ.get("EXPCACHE_LIBRARY")
    if env:
        return [Path(env)]
    here = Path(__file__).resolve().parent
    folders = [here, here.parent / "build"]
    return [folder / name for folder in folders for name in _NAMES]


#: The libraries that were found but did not load before the one that did, with the reason
#: (the CUDA build without the CUDA runtime it links, libcudart.so.13, for one).
skipped: list[str] = []


def load() -> tuple[ctypes.CDLL, Path]:
    """Load the first library that exists and loads; raise OSError naming every attempt."""
    tried = []
    for path in candidate_paths():
        if not path.exists():
            tried.append(f"{path}: not found")
            continue
        try:
            dll = ctypes.CDLL(str(path))  # RTLD_LOCAL: nothing else resolves against it
        except OSError as exc:
            tried.append(f"{path}: {exc}")
            skipped.append(f"{path}: {exc}")
            continue
        return dll, path
    raise OSError(
        "libexpcache not found; build it with `make lib` in the source tree or set "
        "EXPCACHE_LIBRARY. Tried:\n  " + "\n  ".join(tried)
    )
