"""The bundled traces' types: a bundled file's :class:`TraceInfo`, a prefill file's
:class:`PrefillPrompt`, and the DeepSeek-V4-Flash geometry they are shaped by. A decode trace is
the library's :class:`~pyexpcache.routing.Trace`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from pyexpcache.layout import FIRST_ROUTED_LAYER, NUM_EXPERTS, NUM_LAYERS, TOP_K
from pyexpcache.routing import Trace

__all__ = [
    "NUM_EXPERTS",
    "TOP_K",
    "DECODE_FIRST_LAYER",
    "DECODE_NUM_LAYERS",
    "PREFILL_NUM_LAYERS",
    "TraceInfo",
    "PrefillPrompt",
]

#: Model layer stored at array index 0 of a decode trace (layers before it route by hash).
DECODE_FIRST_LAYER = FIRST_ROUTED_LAYER
#: Layers in a decode trace (model layers 3..42).
DECODE_NUM_LAYERS = NUM_LAYERS - FIRST_ROUTED_LAYER
#: Layers in a prefill block (model layers 0..42, hash-routed ones included).
PREFILL_NUM_LAYERS = NUM_LAYERS


class TraceInfo(NamedTuple):
    """One bundled trace file: its short ``name``, ``kind`` and file ``path``."""

    name: str
    kind: str  # "decode" or "prefill"
    path: Path


@dataclass(frozen=True, eq=False)
class PrefillPrompt:
    """One prompt of a prefill file: its layer-major prefill and the decode token(s) after it.

    Attributes:
        name: label ``"<file>#<index>"``.
        index: 0-based prompt number within the file.
        prefill: int32 array ``[layers, prompt_tokens, k]``; ``prefill[layer]`` holds
            the ids of every prompt token at *model* layer ``layer`` (all 43 layers,
            0..42, so array index == model layer).
        prefill_weights: float32 array of the same shape, or ``None``.
        positions: int64 array ``[prompt_tokens]`` (0..prompt_tokens-1 in the files).
        decode: :class:`Trace` of the decode token(s) logged after the prefill
            (one token, model layers 3..42, in the bundled files).
    """

    name: str
    index: int
    prefill: np.ndarray
    prefill_weights: np.ndarray | None
    positions: np.ndarray
    decode: Trace

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt length in tokens (second axis of ``prefill``)."""
        return int(self.prefill.shape[1])

    @property
    def num_layers(self) -> int:
        """Prefill layers stored (first axis of ``prefill``; model layers 0..num_layers-1)."""
        return int(self.prefill.shape[0])

    @property
    def k(self) -> int:
        """Experts per token and layer."""
        return int(self.prefill.shape[2])

    def layer_ids(self, layer: int) -> np.ndarray:
        """Prefill expert ids at model layer ``layer``: int32 ``[prompt_tokens, k]``."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"prompt {self.name!r} has prefill layers 0..{self.num_layers - 1}, not {layer}")
        return self.prefill[layer]

    def __repr__(self) -> str:
        return (
            f"PrefillPrompt(name={self.name!r}, prefill_tokens={self.num_prefill_tokens}, "
            f"layers={self.num_layers}, decode_tokens={self.decode.num_tokens})"
        )
