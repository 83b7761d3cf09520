"""Fixtures shared by the contract suites: every cache test runs against each
available backend (host always; CUDA when a device is present)."""

from __future__ import annotations

import pytest

from pyexpcache import ExpertCache, HostSource, ModelLayout
from pyexpcache import _cuda
from pyexpcache._lib import library_path

SCALE = 4096  # DeepSeek V4 Flash sizes / 4096: q2 experts 1,728 B, q4 3,456 B


def cuda_available() -> tuple[bool, str]:
    if library_path.name == "libexpcache_host.so":
        return False, f"{library_path} is the host-only build"
    if _cuda.device_count() == 0:
        return False, "no CUDA device (or cuda-python missing)"
    return True, ""


CUDA_OK, CUDA_REASON = cuda_available()
BACKENDS = [
    "host",
    pytest.param("cuda", marks=pytest.mark.skipif(not CUDA_OK, reason=CUDA_REASON)),
]


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def make_cache(backend):
    """make_cache(layout=None, *, pinned=None, arrangement="tensor", **cache_kwargs) -> (cache, source).
    Everything made is closed at teardown, caches before sources."""
    made = []

    def make(layout=None, *, pinned=None, arrangement="tensor", **kwargs):
        layout = layout or ModelLayout.preset("q2", scale=SCALE)
        if pinned is None:
            pinned = backend == "cuda"
        source = HostSource(layout, pinned=pinned, arrangement=arrangement)
        kwargs.setdefault("log_level", 2)
        cache = ExpertCache(layout, source, backend=backend, **kwargs)
        made.append((cache, source))
        return cache, source

    yield make
    for cache, source in reversed(made):
        cache.close()
        source.close()


def assert_served(cache, source, layer, ids, ptrs):
    """Every served pointer holds exactly the source bytes (read back from the device)."""
    spec = cache.layout[layer]
    for e, row in zip(ids, ptrs):
        for part, (addr, nbytes) in enumerate(zip(row, spec.class_key)):
            got = cache.read_device(int(addr), nbytes)
            want = source.part(layer, int(e), part)
            assert (got == want).all(), f"layer {layer} expert {e} part {part} differs from the source"
