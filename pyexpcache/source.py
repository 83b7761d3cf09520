"""Host sources: memory holding every expert's bytes, where the cache copies
misses from.

:class:`HostSource` fills its memory with a pattern that differs for every
(layer, expert, part) and every word in it, so a served expert can be checked
byte for byte (tests) or by checksum (the benchmark's kernel).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import numpy as np

from . import _cuda, _lifetime
from ._errors import ForkedError
from .layout import ModelLayout

_ALIGN = 256
_MASK64 = (1 << 64) - 1


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def pattern_seed(layer: int, expert: int, part: int) -> int:
    """The first word of a part; each later word adds one (splitmix64 of the coordinates: parts
    0..3 in bits 0-1, parts 4..7 also in bit 20, so three-part experts keep their bytes)."""
    z = ((layer << 32) | ((part >> 2) << 20) | (expert << 2) | (part & 3)) + 0x9E3779B97F4A7C15 & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def checksum_bytes(data: np.ndarray) -> int:
    """The checksum expcache_testing_checksum computes for one range: sum of 64-bit little-endian
    words (zero-padded tail) times (2j + 1), modulo 2^64."""
    raw = np.ascontiguousarray(data).view(np.uint8).ravel()
    pad = (-raw.size) % 8
    if pad:
        raw = np.concatenate([raw, np.zeros(pad, np.uint8)])
    words = raw.view("<u8")
    weights = np.arange(1, 2 * words.size, 2, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return int(np.sum(words * weights, dtype=np.uint64))


def _pattern_checksum(seed: int, nbytes: int) -> int:
    # Closed form of sum_j (seed + j)(2j + 1) for j < W words.
    w = nbytes // 8
    return (seed * w * w + (w - 1) * w * (2 * w - 1) // 3 + w * (w - 1) // 2) & _MASK64


class Source(Protocol):
    """What :class:`~pyexpcache.ExpertCache` needs of a source: the layout it holds,
    whether its memory is pinned, and where each layer's parts are. The memory must
    stay valid and unchanged while a cache uses it: sources derived from
    :class:`BufferSource` guarantee that themselves (see its lifetime rule); any other
    source must not free its memory before the caches using it are closed."""

    layout: ModelLayout
    pinned: bool
    #: When not None, misses are read from this file and placements hold file offsets. A source
    #: over several files has ``file_paths`` (a tuple of paths) instead, and its placements'
    #: ``files`` tables index it (:class:`~pyexpcache.FileSource`).
    file_path: Optional[str]

    def placement(self, layer: int) -> Optional[LayerPlacement]: ...


_users_lock = threading.Lock()


def _new_users_lock() -> None:
    global _users_lock
    _users_lock = threading.Lock()  # a forked child's: the parent's may be held by a thread not there


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_users_lock)


class BufferSource:
    """What the sources whose bytes sit in a host buffer (``self.buffer``) share: the
    lifetime rule, a context manager around ``close()``, and the buffer's size.

    Lifetime: **a cache keeps its source alive.** Each :class:`~pyexpcache.ExpertCache`
    registers itself as a user of its source; :meth:`close` (or leaving a ``with`` block)
    while caches still use the source marks it closed at once (no new cache may use it,
    :attr:`closed` is True) but its memory (pinned memory, a file mapping) is released
    only when the last of those caches closes. So the memory the library copies misses
    from is never freed under a live cache, whatever the order of the ``with`` blocks.
    """

    buffer: np.ndarray
    _users = 0
    _close_requested = False
    _forked = False

    def _track(self) -> None:
        """Called at the end of a subclass's __init__: fork makes the source unusable in the child."""
        _lifetime.register(self)

    def _check_usable(self) -> None:
        if self._forked:
            raise ForkedError(
                f"{type(self).__name__} was created before the process forked: its memory (pinned "
                "memory is not even mapped in a child) belongs to the parent; create the source and "
                "its caches in the child"
            )

    def _after_fork_in_child(self) -> None:
        self._forked = True
        self._close_requested = True
        self.buffer = np.empty(0, np.uint8)

    def _close_at_exit(self) -> None:
        pass  # the operating system frees the memory

    def add_user(self) -> None:
        """Called by a cache that will read this source's memory (raises ValueError when closed)."""
        self._check_usable()
        with _users_lock:
            if self._close_requested:
                raise ValueError(f"{self!r}: the source is closed")
            self._users += 1

    def remove_user(self) -> None:
        """Called by that cache once it is destroyed; the last user out releases a closed source."""
        if self._forked:
            return
        with _users_lock:
            self._users -= 1
            release = self._close_requested and self._users == 0
        if release:
            self._release()

    def close(self) -> None:
        """Close the source (idempotent): its memory is released now, or, while caches still
        use it, when the last of them closes."""
        if self._forked:
            return  # the parent's memory: left alone
        with _users_lock:
            if self._close_requested:
                return
            self._close_requested = True
            release = self._users == 0
        if release:
            self._release()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called (the memory may still be held by open caches)."""
        return self._close_requested

    @property
    def users(self) -> int:
        """Open caches reading this source."""
        return self._users

    def _release(self) -> None:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def _unmap(self) -> None:
        """For a source whose buffer views a file mapping (``self._mm``): drop the buffer and the
        placements, and close the mapping. Views handed out keep it alive until they are dropped."""
        mm, self._mm = self._mm, None
        self.buffer = np.empty(0, np.uint8)
        self._placements = []
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # views are still exported; the mapping goes when the last one does

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def nbytes(self) -> int:
        """Bytes of the source's host buffer (0 once released)."""
        return self.buffer.nbytes


@dataclass(frozen=True)
class LayerPlacement:
    """Where one layer's parts are: absolute addresses of expert 0's parts (or file offsets),
    their strides and sizes (bytes), one entry per part in the layer's part order.

    ``offsets`` and ``files`` (optional, one entry per part, each None or a sequence of one
    integer per expert): a part whose experts lie apart, as a checkpoint that keeps each expert's
    tensor on its own, in whatever order and shard its writer chose. With ``offsets[p]``, expert
    e's bytes of part p are at ``bases[p] + offsets[p][e]`` (``strides[p]`` must then be 0); with
    ``files[p]`` (a file source only), in file ``files[p][e]``: an index into the source's
    ``file_paths``. Each table is range-checked when a cache registers the layer."""

    bases: tuple[int, ...]
    strides: tuple[int, ...]
    sizes: tuple[int, ...]
    offsets: Optional[tuple[Optional[Sequence[int]], ...]] = None
    files: Optional[tuple[Optional[Sequence[int]], ...]] = None


def plan(layout: ModelLayout, arrangement: str) -> tuple[list, int]:
    """Where :class:`HostSource` puts each layer's parts in its buffer: per layer, the offsets of
    expert 0's parts and their strides (zeros for a dense layer), and the buffer's bytes. A layer's
    parts lie in one range that starts 256-byte aligned, after the previous layer's."""
    offsets, pos = [], 0
    for spec in layout.layers:
        if spec is None:
            offsets.append(((), ()))
            continue
        sizes = spec.class_key
        if arrangement == "tensor":
            offs = []
            for b in sizes:
                offs.append(pos)
                pos = _align(pos + b * spec.num_experts)
            offsets.append((tuple(offs), sizes))
        else:
            part_off = [0]
            for b in sizes[:-1]:
                part_off.append(part_off[-1] + _align(b))
            stride = part_off[-1] + _align(sizes[-1])
            offsets.append((tuple(pos + o for o in part_off), (stride,) * len(sizes)))
            pos += stride * spec.num_experts
    return offsets, max(pos, 1)


class HostSource(BufferSource):
    """Host memory with every expert of ``layout``.

    Args:
        layout: the model layout.
        pinned: allocate page-locked memory with ``cudaHostAlloc`` (portable: pinned for every
            device; misses then cross the link at full speed, and a device select can read it).
            Otherwise ordinary numpy (pageable) memory. Where no CUDA device can be used (no
            cuda-python, or no GPU) the pinning is emulated for the host backend: ordinary memory
            that a host-backend cache treats as pinned (:attr:`pinned_emulated`), which a CUDA
            cache refuses.
        arrangement: ``"tensor"`` places each part as a GGUF file does, one contiguous
            [experts][bytes] tensor per part; ``"expert"`` places each expert's parts
            together (256-byte aligned), so one copy moves a whole expert.
        progress: called as ``progress(done_bytes, total_bytes)`` while filling.
    """

    file_path = None  # bytes come from memory

    def __init__(
        self,
        layout: ModelLayout,
        *,
        pinned: bool = False,
        arrangement: str = "tensor",
        progress: Optional[Callable[[int, int], None]] = None,
    ):
        if arrangement not in ("tensor", "expert"):
            raise ValueError(f"arrangement must be 'tensor' or 'expert', got {arrangement!r}")
        self.layout = layout
        self.pinned = pinned
        self.arrangement = arrangement
        self._pinned_ptr = None
        offsets, total = plan(layout, arrangement)
        #: True where ``pinned=True`` could not use CUDA: page-locking emulated for the host backend.
        self.pinned_emulated = bool(pinned) and _cuda.device_count() == 0
        if pinned and not self.pinned_emulated:
            rt = _cuda.runtime()
            try:
                # Portable: pinned for every device, so caches on several GPUs read it at full speed.
                ptr = _cuda.check(rt.cudaHostAlloc(total, rt.cudaHostAllocPortable), f"cudaHostAlloc({total} bytes)")
            except RuntimeError as exc:
                raise MemoryError(
                    f"{total / 2**30:.1f} GiB of pinned host memory for {layout.name} could not be "
                    f"allocated ({exc}); replay fewer layers (bench --layers), use pageable memory "
                    "(--source pageable) or smaller experts (--scale)"
                ) from None
            self._pinned_ptr = int(ptr)
            self.buffer = np.ctypeslib.as_array((ctypes.c_uint8 * total).from_address(self._pinned_ptr))
        else:
            self.buffer = np.empty(total, dtype=np.uint8)
        self._base = self.buffer.ctypes.data
        self._placements = [
            LayerPlacement(tuple(self._base + o for o in offs), strides, spec.class_key) if spec else None
            for (offs, strides), spec in zip(offsets, layout.layers)
        ]
        self._fill(progress)
        self._track()

    def _fill(self, progress):
        total = self.layout.total_bytes
        done = 0
        ramps: dict[int, np.ndarray] = {}
        for layer, (spec, place) in enumerate(zip(self.layout.layers, self._placements)):
            if spec is None:
                continue
            for part in range(spec.num_parts):
                nbytes = place.sizes[part]
                words = -(-nbytes // 8)
                ramp = ramps.get(words)
                if ramp is None:
                    ramp = ramps[words] = np.arange(words, dtype=np.uint64)
                for expert in range(spec.num_experts):
                    view = self.part(layer, expert, part)
                    seed = np.uint64(pattern_seed(layer, expert, part))
                    if nbytes % 8 == 0 and view.ctypes.data % 8 == 0:
                        np.add(ramp, seed, out=view.view(np.uint64))
                    else:
                        view[:] = (ramp + seed).view(np.uint8)[:nbytes]
                done += nbytes * spec.num_experts
                if progress:
                    progress(done, total)

    # -- what the cache needs --------------------------------------------
    def placement(self, layer: int) -> Optional[LayerPlacement]:
        """Addresses and strides of ``layer``'s parts (for expcache_layer_register); None for
        a layer without routed experts."""
        self._check_usable()
        return self._placements[layer]

    # -- verification ------------------------------------------------------
    def part(self, layer: int, expert: int, part) -> np.ndarray:
        """A uint8 view of one part's source bytes (``part``: its index or name)."""
        self._check_usable()
        place = self._placements[layer]
        part = self.layout[layer].part_index(part)
        off = place.bases[part] - self._base + expert * place.strides[part]
        return self.buffer[off : off + place.sizes[part]]

    def expert_bytes(self, layer: int, expert: int) -> np.ndarray:
        """An expert's source bytes: every part, in order (a copy)."""
        return np.concatenate([self.part(layer, expert, p) for p in range(self.layout[layer].num_parts)])

    def expected_checksum(self, layer: int, expert: int) -> int:
        """What expcache_testing_checksum must give for this expert when its bytes are intact."""
        self._check_usable()
        total = 0
        for p, nbytes in enumerate(self._placements[layer].sizes):
            if nbytes % 8 == 0:
                total += _pattern_checksum(pattern_seed(layer, expert, p), nbytes)
            else:
                total += checksum_bytes(self.part(layer, expert, p))
        return total & _MASK64

    # -- lifetime ----------------------------------------------------------
    def _release(self) -> None:
        """Free the memory (pinned: cudaFreeHost); called once, when closed and unused."""
        self.buffer = np.empty(0, np.uint8)
        if self._pinned_ptr is not None:
            ptr, self._pinned_ptr = self._pinned_ptr, None
            _cuda.check(_cuda.runtime().cudaFreeHost(ptr), "cudaFreeHost")

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.buffer.nbytes} bytes"
        kind = "pinned (emulated)" if self.pinned_emulated else "pinned" if self.pinned else "pageable"
        return f"HostSource({self.layout.name}, {kind}, {self.arrangement} placement, {state})"
