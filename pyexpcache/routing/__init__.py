"""Routing traces of any MoE model: which ``k`` routed experts the router picked for every
(token, MoE layer), the input an expert cache is replayed against.

The format (:mod:`~pyexpcache.routing.format`, ``docs/traces.md`` is the contract): one record per
(token, layer) as JSON lines, CSV or .npz, each optionally gzip-compressed, read into a
:class:`Trace` by :func:`read_trace` (the geometry from the records; missing records are skipped
with one :class:`TraceWarning`) and written by :func:`write_trace` or, record by record, by a
:class:`TraceWriter` (what :func:`pyexpcache.hf.record_routing` uses).

Layer numbering: a :class:`Trace` stores its layers densely (array index 0 is model layer
``first_layer``); methods that take a ``layer`` argument take the *model* layer number.

Only numpy and the standard library are used. The benchmark suite's bundled, synthetic and
prefill traces are :mod:`expcache_bench.traces`.
"""

from .format import FORMATS, TraceWriter, is_generic_path, read_trace, trace_format, write_trace
from .trace import MISSING, PathLike, Trace, TraceWarning

__all__ = [
    "FORMATS",
    "MISSING",
    "PathLike",
    "Trace",
    "TraceWarning",
    "TraceWriter",
    "is_generic_path",
    "read_trace",
    "trace_format",
    "write_trace",
]
