"""Lazy access to cuda-python (``cuda.bindings.runtime``), so the host path
needs only numpy, and stream conversion for every stream type we accept."""

from __future__ import annotations

import functools

from ._ints import u64


@functools.cache
def runtime():
    """``cuda.bindings.runtime`` (or the older ``cuda.cudart``); ImportError if absent."""
    try:
        from cuda.bindings import runtime as rt
    except ImportError:
        try:
            from cuda import cudart as rt  # cuda-python < 12.6
        except ImportError as exc:
            raise ImportError("this needs cuda-python: pip install cuda-python") from exc
    return rt


def check(result, what: str):
    """Unpack a cuda-python ``(err, *values)`` tuple, raising RuntimeError on failure."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        rt = runtime()
        _, name = rt.cudaGetErrorName(err)
        raise RuntimeError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def stream_handle(stream) -> int:
    """A ``cudaStream_t`` as an int from: None (the legacy default stream, 0), an int,
    an object with ``__cuda_stream__`` (cuda.core, PyTorch, CuPy), or a cuda-python
    stream handle."""
    if stream is None:
        return 0
    if isinstance(stream, bool):
        raise TypeError("a stream cannot be a bool")
    if isinstance(stream, int):
        return u64(stream, "stream")
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        value = protocol() if callable(protocol) else protocol
        return u64(int(value[1]), "stream")
    for attr in ("getPtr", "handle"):
        if hasattr(stream, attr):
            v = getattr(stream, attr)
            return u64(int(v() if callable(v) else v), "stream")
    try:
        return u64(int(stream), "stream")
    except (TypeError, ValueError):
        raise TypeError(
            f"cannot use {type(stream).__name__} as a CUDA stream: pass None, an int handle, "
            "an object with __cuda_stream__, or a cuda-python stream"
        ) from None


def device_count() -> int:
    """CUDA devices visible through cuda-python, 0 when cuda-python or a driver is missing."""
    try:
        rt = runtime()
        err, n = rt.cudaGetDeviceCount()
        return int(n) if int(err) == 0 else 0
    except Exception:
        return 0
