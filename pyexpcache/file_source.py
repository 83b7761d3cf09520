"""A source whose expert bytes stay in files: the library reads each miss itself (pread, or
O_DIRECT with ``ExpertCache(..., file_reads="direct")``), from whichever file and offset the
placement names for that expert, so a model larger than RAM is served from its checkpoint."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping, Sequence
from typing import Optional

import numpy as np

from ._ints import U64_MAX, checked_int
from ._layer_desc import expert_table
from .layout import ModelLayout
from .source import LayerPlacement

#: Files one cache can open (the library's limit).
MAX_FILES = 1024


class FileSource:
    """Expert bytes read from files by the library, each part of each expert at a (file, offset).

    Args:
        paths: the files (a checkpoint's shards), at most :data:`MAX_FILES`; they must not shrink
            or change while a cache reads them.
        layout: the experts' layout.
        placements: every MoE layer of ``layout`` -> its :class:`~pyexpcache.LayerPlacement`,
            in file offsets: ``bases`` and ``strides`` for a part whose experts lie at a fixed
            stride in one file (a fused 3-D tensor), or ``offsets`` (with base 0 and stride 0) and
            ``files`` (indices into ``paths``) for a part whose experts each lie where their own
            tensor is. A part without ``files`` is read from ``paths[0]``.

    Raises:
        ValueError: no path or too many, a path that is not a regular file, a layer without a
            placement, a placement whose sizes are not the layout's; a table of the wrong length,
            TypeError or :class:`~pyexpcache.ArgumentRangeError` for an entry that is not an
            index or offset (naming the layer, the part and the expert).

    The library opens the files when a cache is made over the source and closes them with the
    cache; the source itself holds no descriptor and no memory, so it needs no closing. It is
    never pinned: a device-lookup cache reads its misses into the pinned staging ring.
    """

    pinned = False
    file_path = None  # several files: file_paths

    def __init__(self, paths: Sequence, layout: ModelLayout, placements: Mapping[int, LayerPlacement]):
        self.file_paths = tuple(os.fspath(p) for p in paths)
        if not 1 <= len(self.file_paths) <= MAX_FILES:
            raise ValueError(f"a file source reads 1..{MAX_FILES} files, got {len(self.file_paths)}")
        for path in self.file_paths:
            if not os.path.isfile(path):
                raise ValueError(f"{path}: not a regular file")
        self.layout = layout
        self._placements: dict[int, LayerPlacement] = {}
        for layer in layout.moe_layers:
            spec, place = layout[layer], placements.get(layer)
            if place is None:
                raise ValueError(f"layer {layer} has {spec.num_experts} experts but no placement")
            if tuple(place.sizes) != spec.class_key:
                raise ValueError(f"layer {layer}: the placement's part sizes {place.sizes} are not {spec.class_key}")
            self._placements[layer] = self._checked(layer, spec, place)

    def _checked(self, layer: int, spec, place: LayerPlacement) -> LayerPlacement:
        """``place`` with its tables as read-only arrays, every entry range-checked."""
        n = spec.num_parts
        for what, tables in (("offsets", place.offsets), ("files", place.files)):
            if tables is not None and len(tables) != n:
                raise ValueError(f"layer {layer}: the placement's {what} has {len(tables)} tables for {n} parts")
        offsets, files = [], []
        for p, name in enumerate(spec.part_names):
            where = f"layer {layer} part {name!r}"
            table = None if place.offsets is None else place.offsets[p]
            if table is not None:
                table = expert_table(table, spec.num_experts, f"{where} offsets", U64_MAX, ctypes.c_uint64)
            offsets.append(None if table is None else _frozen(table, np.uint64))
            table = None if place.files is None else place.files[p]
            if table is not None:
                table = expert_table(
                    table, spec.num_experts, f"{where} files", len(self.file_paths) - 1, ctypes.c_uint32
                )
            files.append(None if table is None else _frozen(table, np.uint32))
            checked_int(place.bases[p], f"{where} base", 0, U64_MAX)
        return LayerPlacement(
            tuple(place.bases), tuple(place.strides), tuple(place.sizes), tuple(offsets), tuple(files)
        )

    def placement(self, layer: int) -> Optional[LayerPlacement]:
        """``layer``'s placement (file offsets and per-expert tables); None for a dense layer."""
        return self._placements.get(layer)

    def locate(self, layer: int, expert: int, part) -> tuple[str, int, int]:
        """Where one part of one expert is: (path, byte offset, bytes). ``part``: its index or name."""
        spec = self.layout[layer]
        p = spec.part_index(part)
        checked_int(expert, "expert", 0, spec.num_experts - 1)
        place = self._placements[layer]
        offsets, files = place.offsets[p], place.files[p]
        offset = place.bases[p] + (int(offsets[expert]) if offsets is not None else expert * place.strides[p])
        path = self.file_paths[int(files[expert]) if files is not None else 0]
        return path, offset, place.sizes[p]

    def part(self, layer: int, expert: int, part) -> np.ndarray:
        """One part's bytes, read from its file now (uint8; for verification)."""
        path, offset, nbytes = self.locate(layer, expert, part)
        fd = os.open(path, os.O_RDONLY)
        try:
            data = os.pread(fd, nbytes, offset)
        finally:
            os.close(fd)
        if len(data) != nbytes:
            raise OSError(f"{path}: {nbytes} bytes at {offset} run past the end of the file")
        return np.frombuffer(data, np.uint8)

    def expert_bytes(self, layer: int, expert: int) -> np.ndarray:
        """An expert's bytes: every part in order (as a slot holds them, without the alignment gaps)."""
        return np.concatenate([self.part(layer, expert, p) for p in range(self.layout[layer].num_parts)])

    def __repr__(self) -> str:
        return f"FileSource({self.layout.name}, {len(self.layout.moe_layers)} MoE layers, {len(self.file_paths)} files)"


def _frozen(table, dtype) -> np.ndarray:
    out = np.frombuffer(table, dtype=dtype).copy()
    out.flags.writeable = False
    return out
