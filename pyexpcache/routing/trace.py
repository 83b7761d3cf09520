"""A decode routing trace (:class:`Trace`): which experts the router picked for every (token,
MoE layer) of a model, with :data:`MISSING` where a trace has no record, and the notice a reader
gives for what it dropped (:class:`TraceWarning`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Union

import numpy as np

from ..layout import NUM_EXPERTS

__all__ = ["PathLike", "TraceWarning", "Trace", "MISSING"]

PathLike = Union[str, "os.PathLike[str]"]


class TraceWarning(UserWarning):
    """A trace file loaded with something dropped or missing: it ends inside a token (an interrupted
    logger), or some (token, layer) records are missing (the tokens are kept with the layers they
    have)."""


#: The id that fills ``Trace.ids[t, i]`` when token ``t`` has no record at layer index ``i``.
MISSING = -1


@dataclass(frozen=True, eq=False)
class Trace:
    """Decode routing of ``num_tokens`` tokens over ``num_layers`` consecutive MoE layers.

    Attributes:
        name: a label (file name stem for bundled traces).
        ids: int32 array ``[tokens, layers, k]``; ``ids[t, i]`` are the expert ids
            (router selection order) of token ``t`` at model layer ``first_layer + i``,
            or ``k`` times :data:`MISSING` (-1) where the trace has no record of that
            (token, layer): a partly logged token, or a layer between ``first_layer``
            and the last layer that no token routes (a dense layer). A row is either
            all -1 or all ids; :attr:`present` is the mask of the rows with ids, and
            every replay (the simulator, the benchmark) skips the others.
        weights: float32 array of the same shape with the gate weights (NaN in the
            missing rows), or ``None`` when the source has no weights.
        first_layer: model layer number of array index 0 (3 for decode traces).
        positions: int64 array ``[tokens]``, absolute context position of each token.
        num_experts: routed experts per layer; every id is in ``[0, num_experts)``.
        sequences: int64 array ``[tokens]``, the sequence (request) each token belongs to, or
            ``None`` (one sequence, or not recorded); a generic trace's ``seq`` field.
    """

    name: str
    ids: np.ndarray
    weights: np.ndarray | None
    first_layer: int
    positions: np.ndarray
    num_experts: int = NUM_EXPERTS
    sequences: np.ndarray | None = None

    def __post_init__(self) -> None:
        ids = np.asarray(self.ids)
        if ids.ndim != 3:
            raise ValueError(f"Trace {self.name!r}: ids must have shape [tokens, layers, k], got {ids.shape}")
        if ids.size and (ids.min() < MISSING or ids.max() >= self.num_experts):
            raise ValueError(f"Trace {self.name!r}: expert ids must lie in [0, {self.num_experts})")
        if ids.size and ids.min() < 0 and not ((ids < 0).all(axis=2) | (ids >= 0).all(axis=2)).all():
            raise ValueError(
                f"Trace {self.name!r}: a (token, layer) row of ids is either all {MISSING} (no record) "
                "or all expert ids"
            )
        positions = np.asarray(self.positions, dtype=np.int64)
        if positions.shape != ids.shape[:1]:
            raise ValueError(f"Trace {self.name!r}: positions must have shape [{ids.shape[0]}], got {positions.shape}")
        weights = self.weights
        if weights is not None:
            weights = np.asarray(weights, dtype=np.float32)
            if weights.shape != ids.shape:
                raise ValueError(f"Trace {self.name!r}: weights shape {weights.shape} != ids shape {ids.shape}")
        sequences = self.sequences
        if sequences is not None:
            sequences = np.asarray(sequences, dtype=np.int64)
            if sequences.shape != ids.shape[:1]:
                raise ValueError(
                    f"Trace {self.name!r}: sequences must have shape [{ids.shape[0]}], got {sequences.shape}"
                )
        object.__setattr__(self, "sequences", sequences)
        # Frozen dataclass: normalise dtypes through object.__setattr__.
        object.__setattr__(self, "ids", ids.astype(np.int32, copy=False))
        object.__setattr__(self, "positions", positions)
        object.__setattr__(self, "weights", weights)

    @property
    def num_tokens(self) -> int:
        """Number of tokens (first axis of ``ids``)."""
        return int(self.ids.shape[0])

    @property
    def num_layers(self) -> int:
        """Number of MoE layers stored (second axis of ``ids``)."""
        return int(self.ids.shape[1])

    @property
    def k(self) -> int:
        """Experts per token and layer (third axis of ``ids``)."""
        return int(self.ids.shape[2])

    @property
    def layers(self) -> range:
        """Model layer numbers covered, in array order."""
        return range(self.first_layer, self.first_layer + self.num_layers)

    @property
    def present(self) -> np.ndarray:
        """bool ``[tokens, layers]``: whether token ``t`` has a record at layer index ``i``."""
        return self.ids[:, :, 0] >= 0 if self.k else np.ones(self.ids.shape[:2], dtype=bool)

    @property
    def complete(self) -> bool:
        """Whether every token has a record at every layer (:attr:`present` all true)."""
        return bool(self.present.all())

    @property
    def routed_layers(self) -> list[int]:
        """Model layer numbers with at least one record (every layer of :attr:`layers` for a complete
        trace; a layer no token routes, e.g. a dense one inside the span, is left out)."""
        return [self.first_layer + i for i in np.flatnonzero(self.present.any(axis=0)).tolist()]

    @property
    def missing_records(self) -> int:
        """(token, layer) records missing among the :attr:`routed_layers`: a token without a record
        at a layer that other tokens have."""
        present = self.present
        return int((~present[:, present.any(axis=0)]).sum())

    @property
    def num_requests(self) -> int:
        """Total expert requests: ``k`` per (token, layer) record present."""
        return int(self.present.sum()) * self.k

    def layer_ids(self, layer: int) -> np.ndarray:
        """Expert ids at *model* layer ``layer``: int32 view of shape ``[tokens, k]`` (rows of
        :data:`MISSING` where a token has no record there)."""
        if layer not in self.layers:
            raise IndexError(
                f"Trace {self.name!r} holds model layers {self.first_layer}..{self.layers.stop - 1}, not {layer}"
            )
        return self.ids[:, layer - self.first_layer, :]

    def __repr__(self) -> str:
        return (
            f"Trace(name={self.name!r}, tokens={self.num_tokens}, layers={self.first_layer}.."
            f"{self.first_layer + self.num_layers - 1}, k={self.k}, weights={self.weights is not None}"
            + (f", missing_records={self.missing_records})" if not self.complete else ")")
        )
