"""The contract suite's axes and checks, shared by tests/conftest.py's fixtures and the test
modules: every cache test runs against each available backend (host always; CUDA when a device
is present) and each eviction policy."""

from __future__ import annotations

import pytest

from pyexpcache import _cuda, testing
from pyexpcache._lib import POLICIES as _LIBRARY_POLICIES, library_path

#: The bank arrangements (ExpertCache's bank_arrangement): the suites marked ``arrangements`` run
#: against each (tests/conftest.py's bank_arrangement fixture).
ARRANGEMENTS = ["slots", "parts"]

SCALE = 4096  # DeepSeek V4 Flash sizes / 4096: q2 experts 1,728 B, q4 3,456 B

#: The library's eviction policies, by name in id order (its table: pyexpcache._lib.POLICIES). Every
#: contract test runs against each; a test whose assertions depend on one policy's victim order
#: pins it with ``@pytest.mark.parametrize("policy", ["lru"])`` and says why.
POLICIES = list(_LIBRARY_POLICIES)


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


def assert_served(cache, source, layer, ids, ptrs):
    """Every served pointer holds exactly the source bytes (read back from the device)."""
    spec = cache.layout[layer]
    for e, row in zip(ids, ptrs):
        for part, (addr, nbytes) in enumerate(zip(row, spec.class_key)):
            got = testing.read_device(cache, int(addr), nbytes)
            want = source.part(layer, int(e), part)
            assert (got == want).all(), f"layer {layer} expert {e} part {part} differs from the source"


def device_ids(cache, ids, dtype="int64"):
    """``ids`` where a device select reads them: a numpy array on the host backend, a CUDA tensor
    (torch, else cupy) on the CUDA backend."""
    import numpy as np

    host = np.asarray(ids, dtype=dtype)
    if cache.backend == "host":
        return host
    try:
        import torch
    except ImportError:
        import cupy

        return cupy.asarray(host)
    return torch.from_numpy(host).to("cuda")


def to_numpy(array):
    """A device select's ids or slots, back on the host."""
    import numpy as np

    if hasattr(array, "get"):  # cupy
        return array.get()
    if hasattr(array, "cpu"):  # torch
        return array.cpu().numpy()
    return np.asarray(array)


def bank_rows(bank, slots):
    """[n, 3] addresses (gate, up, down) of ``slots`` in ``bank``, as select returns for experts
    (part p of slot s at the part's view + s * its stride, in either arrangement)."""
    return [[part.ptr + int(s) * stride for part, stride in zip(bank.parts, bank.part_strides)] for s in slots]
