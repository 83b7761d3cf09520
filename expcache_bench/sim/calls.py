"""Requests and results of the offline simulators: calls, streams, keys, counters.

What every other module of :mod:`expcache_bench.sim` shares:

* :class:`Call` (``kind`` :data:`DECODE` or :data:`BATCH`, a cache layer, expert
  ids): one request to the cache; a *stream* is a sequence of them.
* :func:`decode_stream`, :func:`prompt_stream`, :func:`as_stream`: streams of
  traces; :func:`token_index`: the token of every call of a stream.
* :func:`check_classes`: the validated capacity per class and class per layer.
* keys: ``layer << KEY_SHIFT | expert``, one Python int per ``(layer, expert)``.
* :class:`SimResult`: the per-class counters, named by :data:`COUNTERS`; a
  simulator counts into rows indexed by :data:`HIT` .. :data:`EVICT` and
  builds the result with :meth:`SimResult.from_counters`.

Layer indices
-------------
``layer_class`` is indexed by the ``layer`` of the calls.  Passing a
:class:`~pyexpcache.routing.Trace` or a ``[tokens, layers, k]`` array uses the
array index (0 = the trace's first layer).  :func:`prompt_stream` uses model
layer numbers (0..42) so a prompt's prefill and decode share keys; use
``decode_stream(trace, first_layer=trace.first_layer)`` to put a decode trace
on the same numbering.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Union

import numpy as np

from pyexpcache.routing import MISSING, Trace

from ..traces.types import PrefillPrompt

__all__ = [
    "DECODE",
    "BATCH",
    "KEY_SHIFT",
    "COUNTERS",
    "HIT",
    "MISS",
    "INSERT",
    "APPEND",
    "DIRECT",
    "EVICT",
    "Call",
    "SimResult",
    "Requests",
    "decode_stream",
    "present_rows",
    "prompt_stream",
    "as_stream",
    "token_index",
    "check_classes",
]

DECODE = "decode"
BATCH = "batch"

# The key of (layer, expert) is layer << KEY_SHIFT | expert: one Python int hashes
# faster than a tuple, which matters at ~10^5 requests.
KEY_SHIFT = 32

# The counters of a SimResult, in the order of a simulator's counter row.
COUNTERS = ("hits", "misses", "inserts", "appends", "direct", "evictions")
HIT, MISS, INSERT, APPEND, DIRECT, EVICT = range(len(COUNTERS))  # columns of a counter row


@dataclass(frozen=True)
class Call:
    """One request to the cache.

    Attributes:
        kind: ``"decode"`` (one token) or ``"batch"`` (prefill of many tokens).
        layer: cache layer, an index into ``layer_class``.
        ids: expert ids in request order (a batch lists its tokens' ids
            token-major); duplicates are allowed and served once.
    """

    kind: str
    layer: int
    ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.kind not in (DECODE, BATCH):
            raise ValueError(f"Call.kind must be {DECODE!r} or {BATCH!r}, got {self.kind!r}")
        if self.layer < 0:
            raise ValueError(f"Call.layer must be >= 0, got {self.layer}")
        ids = tuple(int(e) for e in self.ids)
        if any(not 0 <= e < (1 << KEY_SHIFT) for e in ids):
            raise ValueError(f"expert ids must be in [0, 2**{KEY_SHIFT}), got {ids}")
        object.__setattr__(self, "ids", ids)


@dataclass
class SimResult:
    """Counters of one simulation, one entry per size class.

    All counter fields are int64 arrays of shape ``[num_classes]``.
    ``misses == inserts + appends + direct``.
    """

    policy: str
    capacity: tuple[int, ...]
    hits: np.ndarray
    misses: np.ndarray
    inserts: np.ndarray
    appends: np.ndarray
    direct: np.ndarray
    evictions: np.ndarray
    calls: int = 0

    @classmethod
    def from_counters(cls, policy: str, capacity: Sequence[int], counters, calls: int) -> SimResult:
        """The result of per-class counter rows (``counters[c][HIT]`` .. ``counters[c][EVICT]``)."""
        arr = np.asarray(counters, dtype=np.int64).reshape(len(capacity), len(COUNTERS)).T
        return cls(policy, capacity, *arr, calls=calls)

    @property
    def num_classes(self) -> int:
        return len(self.capacity)

    @property
    def requests(self) -> int:
        """Requests after per-call deduplication (hits + misses, all classes)."""
        return int(self.hits.sum() + self.misses.sum())

    @property
    def hit_rate(self) -> float:
        """Overall hits / requests (NaN when there were no requests)."""
        n = self.requests
        return float(self.hits.sum()) / n if n else float("nan")

    @property
    def class_hit_rates(self) -> np.ndarray:
        """float64 ``[num_classes]`` hit rate per class (NaN for unused classes)."""
        n = self.hits + self.misses
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(n > 0, self.hits / np.maximum(n, 1), np.nan)

    def as_dict(self) -> dict:
        """Plain-Python totals and per-class lists, e.g. for JSON reports."""
        out = {
            "policy": self.policy,
            "capacity": list(self.capacity),
            "calls": self.calls,
            "requests": self.requests,
            "hit_rate": self.hit_rate,
        }
        for name in COUNTERS:
            arr = getattr(self, name)
            out[name] = int(arr.sum())
            out[name + "_per_class"] = arr.tolist()
        return out

    def __repr__(self) -> str:
        return (
            f"SimResult({self.policy}, capacity={list(self.capacity)}, hit_rate={self.hit_rate:.4f}, "
            f"hits={int(self.hits.sum())}, misses={int(self.misses.sum())}, "
            f"evictions={int(self.evictions.sum())}, direct={int(self.direct.sum())})"
        )


# --------------------------------------------------------------------------- streams

Requests = Union[Trace, np.ndarray, Sequence[Call]]


def decode_stream(ids: Trace | np.ndarray, *, first_layer: int = 0) -> list[Call]:
    """Decode calls of a trace in replay order: for each token, for each layer.

    Args:
        ids: a :class:`Trace` or an integer array ``[tokens, layers, k]``.
        first_layer: cache layer of array index 0 (0: array index; pass
            ``trace.first_layer`` to use model layer numbers).

    Returns:
        A decode :class:`Call` per (token, layer) with a record: ``tokens * layers`` of them
        for a complete trace; a row of :data:`~pyexpcache.routing.MISSING` (-1) ids, a
        (token, layer) the trace has no record of, makes no call.
    """
    arr = ids.ids if isinstance(ids, Trace) else np.asarray(ids)
    if arr.ndim != 3:
        raise ValueError(f"decode ids must have shape [tokens, layers, k], got {arr.shape}")
    present = present_rows(arr)
    if arr.size and arr[present].min(initial=0) < 0:
        raise ValueError(f"expert ids must be >= 0 (a row of {MISSING} marks a missing record)")
    L = arr.shape[1]
    rows = arr.tolist()
    keep = present.tolist()
    return [
        Call(DECODE, first_layer + layer, tuple(tok[layer]))
        for t, tok in enumerate(rows)
        for layer in range(L)
        if keep[t][layer]
    ]


def present_rows(arr: np.ndarray) -> np.ndarray:
    """bool ``[tokens, layers]`` of a ``[tokens, layers, k]`` id array: the rows that are not all
    :data:`~pyexpcache.routing.MISSING` (the (token, layer) records present)."""
    return ~(arr == MISSING).all(axis=2) if arr.shape[2] else np.ones(arr.shape[:2], dtype=bool)


def prompt_stream(
    prompt: PrefillPrompt,
    *,
    decode: bool = True,
    layers: Iterable[int] | None = None,
) -> list[Call]:
    """Calls of one prompt: a prefill batch per layer, then its decode token(s).

    Cache layers are *model* layer numbers (prefill 0..42, decode 3..42), so
    the decode token finds what the prefill left in the cache.

    Args:
        prompt: a :class:`PrefillPrompt` from ``load_prefill_trace``.
        decode: append the prompt's decode tokens after the prefill.
        layers: model layers to include (default all); e.g. ``range(3, 43)``
            leaves out the hash-routed layers 0..2.
    """
    keep = None if layers is None else set(layers)
    calls = [
        Call(BATCH, layer, tuple(prompt.prefill[layer].ravel().tolist()))  # token-major within the layer
        for layer in range(prompt.num_layers)
        if keep is None or layer in keep
    ]
    if decode:
        d = prompt.decode
        calls += [c for c in decode_stream(d, first_layer=d.first_layer) if keep is None or c.layer in keep]
    return calls


def as_stream(requests: Requests) -> Sequence[Call]:
    """The calls of ``requests``: a Trace or ``[tokens, layers, k]`` array becomes its
    :func:`decode_stream` (cache layer = array index); a sequence of calls is returned as is."""
    if isinstance(requests, (Trace, np.ndarray)):
        return decode_stream(requests)
    return requests


def token_index(stream: Sequence[Call]) -> list[int]:
    """Token index of each call: a new token starts when a call's layer is not
    greater than the previous call's layer (decode traces are token-major,
    prefill batches layer-major and followed by their decode token)."""
    out = []
    tok = -1
    prev = None
    for call in stream:
        if prev is None or call.layer <= prev:
            tok += 1
        prev = call.layer
        out.append(tok)
    return out


def check_classes(stream: Sequence[Call], capacity, layer_class) -> tuple[tuple[int, ...], list[int]]:
    """Validate and return (capacity tuple, class-of-layer list)."""
    max_layer = max((c.layer for c in stream), default=-1)
    if layer_class is None:
        cls = [0] * (max_layer + 1)
    else:
        cls = [int(c) for c in np.asarray(layer_class).ravel().tolist()]
        if len(cls) <= max_layer:
            raise ValueError(f"layer_class has {len(cls)} entries but the stream uses layer {max_layer}")
        if any(c < 0 for c in cls):
            raise ValueError("layer_class entries must be >= 0")
    num_classes = max(cls, default=0) + 1
    if np.ndim(capacity) == 0:
        cap = (int(capacity),) * num_classes  # one capacity for every class
    else:
        cap = tuple(int(c) for c in capacity)
        if len(cap) < num_classes:
            raise ValueError(f"capacity lists {len(cap)} classes but layer_class uses {num_classes}")
    if any(c < 0 for c in cap):
        raise ValueError(f"capacities must be >= 0, got {cap}")
    return cap, cls
