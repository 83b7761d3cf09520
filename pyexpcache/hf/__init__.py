"""Hugging Face transformers: a MoE model's experts served by expcache (``pip install expcache[hf]``).

- :func:`offload`: every experts-interface MoE layer of a transformers >= 5 model served from an
  expcache slot bank through a registered experts implementation (``"expcache"``).
- :func:`record_routing`: a context manager writing the model's routing as a generic trace and
  its layout file, for ``expcache bench --layout L --traces T``.

``docs/hf.md`` says how to use them, with real checkpoints.
"""

from ._experts import ExpertsLayer, find_experts
from ._offload import Offloaded, offload
from ._record import RoutingRecorder, record_routing
from ._serve import IMPLEMENTATION
from ._source import ParameterSource

__all__ = ["IMPLEMENTATION", "ExpertsLayer", "Offloaded", "ParameterSource", "RoutingRecorder", "find_experts",
           "offload", "record_routing"]
