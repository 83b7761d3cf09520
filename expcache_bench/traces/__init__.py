"""MoE routing traces: the generic format of any model, the bundled DeepSeek-V4-Flash traces and a
synthetic generator.

A routing trace says which ``k`` routed experts the router picked for every
(token, MoE layer).  It is what an expert cache is replayed against.

The generic format (:mod:`~pyexpcache.traces.generic`, ``docs/traces.md``): one record per
(token, layer) as JSON lines, CSV or .npz, each optionally gzip-compressed, read by
:func:`read_trace` (the geometry from the records; missing records are skipped with one
:class:`TraceWarning`) and written by :func:`write_trace` or, record by record, a
:class:`TraceWriter`. :func:`check_layout` checks a trace against a model layout.

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

Layer numbering: a :class:`Trace` stores its layers densely (array index 0 is
model layer ``first_layer``); methods that take a ``layer`` argument take the
*model* layer number, so callers never do the offset arithmetic by hand.

Only numpy and the standard library are used.
"""

from .bundled import TRACE_DIR, list_traces, load_decode_trace, load_prefill_trace, load_trace
from .generic import FORMATS, TraceWriter, read_trace, trace_format, write_trace
from .geometry import check_layout
from .locality import locality_stats
from .synthetic import DEFAULT_REUSE, DEFAULT_ZIPF, SYNTHETIC_MAX_BYTES, fit_synthetic_params, synthetic_trace
from .types import (
    DECODE_FIRST_LAYER,
    DECODE_NUM_LAYERS,
    MISSING,
    NUM_EXPERTS,
    PREFILL_NUM_LAYERS,
    TOP_K,
    PrefillPrompt,
    Trace,
    TraceInfo,
    TraceWarning,
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
