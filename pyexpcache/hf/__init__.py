"""Hugging Face transformers: a MoE model's experts served by expcache (``pip install expcache[hf]``).

- :func:`offload`: every experts-interface MoE layer of a transformers >= 5 model served from an
  expcache slot bank through a registered experts implementation (``"expcache"``); with
  ``budget="auto"`` the bank is sized from the device's free memory (:class:`AutoBudget`).
- :func:`offload_pretrained`: a safetensors checkpoint loaded with its experts never in host
  memory, served from the checkpoint's own files (:class:`~pyexpcache.FileSource`).
- :class:`GraphDecoder`: greedy decoding with a static KV cache, each decode step one CUDA graph
  replay (offloaded or not).
- :func:`record_routing`: a context manager writing the model's routing as a generic trace and
  its layout file, for ``expcache bench --layout L --traces T``.

``docs/hf.md`` says how to use them, with real checkpoints.
"""

try:
    import torch  # noqa: F401
    import transformers
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(f"pyexpcache.hf needs torch and transformers >= 5 (pip install expcache[hf]): {exc}") from exc
if int(transformers.__version__.split(".")[0]) < 5:  # pragma: no cover
    raise ImportError(
        f"pyexpcache.hf needs transformers >= 5 (its experts interface), found {transformers.__version__}"
    )

from ._auto_budget import AutoBudget
from ._experts import ExpertsLayer, find_experts
from ._graph import GraphDecoder
from ._offload import Offloaded, offload
from ._pretrained import offload_pretrained
from ._record import RoutingRecorder, record_routing
from ._serve import IMPLEMENTATION
from ._source import ParameterSource

__all__ = [
    "IMPLEMENTATION",
    "AutoBudget",
    "ExpertsLayer",
    "GraphDecoder",
    "Offloaded",
    "ParameterSource",
    "RoutingRecorder",
    "find_experts",
    "offload",
    "offload_pretrained",
    "record_routing",
]
