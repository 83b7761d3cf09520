"""The benchmark's routing traces: the bundled DeepSeek-V4-Flash traces, a synthetic generator,
locality statistics and the check of a trace against a model layout.

A routing trace says which ``k`` routed experts the router picked for every (token, MoE layer).
Its type (:class:`~pyexpcache.routing.Trace`) and the generic format of any model (read by
:func:`~pyexpcache.routing.read_trace`, written by :func:`~pyexpcache.routing.write_trace` or a
:class:`~pyexpcache.routing.TraceWriter`; ``docs/traces.md``) are the library's
(:mod:`pyexpcache.routing`), re-exported here for convenience. :func:`check_layout` checks a trace
against a model layout.

Bundled traces live in :data:`TRACE_DIR` (copied from ``imanu86/reap-loop``,
MIT licence; see ``README.md`` and ``ATTRIBUTION.md`` there).  Two kinds exist:

* ``"decode"`` files: generated tokens only, token-major, model layers 3..42
  (layers 0..2 are hash-routed and not logged).  Loaded as one :class:`Trace`.
* ``"prefill"`` files: several prompts, each a layer-major prefill over model
  layers 0..42 followed by one decode token.  Loaded as a list of
  :class:`PrefillPrompt`.

Files may be gzip-compressed (a name ending in ``.gz``, or gzip content under
any name).  A file that ends inside a token (an interrupted logger) loads
without that token and with a :class:`TraceWarning` saying what was dropped;
every other defect is a one-line ``ValueError`` naming the file.

Only numpy and the standard library are used.
"""

from pyexpcache.routing import FORMATS, MISSING, Trace, TraceWarning, TraceWriter, read_trace, trace_format, write_trace

from .bundled import TRACE_DIR, list_traces, load_decode_trace, load_prefill_trace, load_trace
from .geometry import check_layout
from .locality import locality_stats
from .synthetic import DEFAULT_REUSE, DEFAULT_ZIPF, SYNTHETIC_MAX_BYTES, fit_synthetic_params, synthetic_trace
from .types import (
    DECODE_FIRST_LAYER,
    DECODE_NUM_LAYERS,
    NUM_EXPERTS,
    PREFILL_NUM_LAYERS,
    TOP_K,
    PrefillPrompt,
    TraceInfo,
)

__all__ = [
    "TRACE_DIR",
    "FORMATS",
    "MISSING",
    "NUM_EXPERTS",
    "TOP_K",
    "DECODE_FIRST_LAYER",
    "DECODE_NUM_LAYERS",
    "PREFILL_NUM_LAYERS",
    "DEFAULT_ZIPF",
    "DEFAULT_REUSE",
    "SYNTHETIC_MAX_BYTES",
    "TraceWarning",
    "TraceInfo",
    "Trace",
    "PrefillPrompt",
    "list_traces",
    "load_decode_trace",
    "load_prefill_trace",
    "load_trace",
    "read_trace",
    "write_trace",
    "TraceWriter",
    "trace_format",
    "check_layout",
    "locality_stats",
    "synthetic_trace",
    "fit_synthetic_params",
]
