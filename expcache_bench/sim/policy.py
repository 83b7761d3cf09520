"""The policy interface: :class:`Policy`, the base class every eviction policy
implements, and :class:`Ctx`, the per-call context the driver hands its hooks.

The interface mirrors ``libexpcache/src/policy/policy.hpp`` (one policy object
per size class; ``on_insert(slot, cold)``, ``on_hit(slot)``,
``on_remove(slot)``, ``victim(evictable)``), with the per-call context
:class:`Ctx` added (token index, layer, gate weights) and three optional
hooks (``begin`` at the start of every call, ``on_miss`` for every miss,
``admit`` for bypass).  Keys are ``layer << KEY_SHIFT | expert``
(:data:`~expcache_bench.sim.calls.KEY_SHIFT`).  :mod:`expcache_bench.sim.driver` says
when each hook is called.
"""

from __future__ import annotations

from typing import Callable, Optional

from .calls import DECODE

__all__ = ["Ctx", "Policy"]


class Ctx:
    """Per-call context handed to the policy hooks (one object, updated in place).

    Attributes:
        tick: index of the call in the stream (0, 1, ...).
        token: token index of the call (see :func:`token_index`).
        layer: the call's cache layer.
        pos: position of the layer within the token, 0 .. ``layers - 1``
            (cache layers sorted; the rank of ``layer`` among the layers used).
        layers: number of distinct cache layers in the stream.
        kind: ``"decode"`` or ``"batch"``.
        want: ``dict`` key -> gate weight (``None`` without weights) of the
            call's deduplicated requests, in first-appearance order.  For a
            batch the weight is the largest over the batch's tokens.
        size: bytes of one expert of the call's class (global mode), else 1.
        cls: the call's size class.
    """

    __slots__ = ("tick", "token", "layer", "pos", "layers", "kind", "want", "size", "cls")

    def __init__(self) -> None:
        self.tick = self.token = self.layer = self.pos = 0
        self.layers = 1
        self.kind = DECODE
        self.want: dict = {}
        self.size = 1
        self.cls = 0

    @property
    def time(self) -> float:
        """Fractional token time: ``token + pos / layers``."""
        return self.token + self.pos / self.layers


class Policy:
    """Base class: the interface of ``policy.hpp`` plus the simulator's hooks.

    A policy orders the resident keys of one class (or of all classes in
    global mode).  ``victim`` must return a resident key for which
    ``evictable(key)`` is true, or ``None`` when there is none; the simulator
    then calls ``on_remove(victim)`` before ``on_insert(new)``.
    """

    name = "policy"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    def begin(self, ctx: Ctx) -> None:
        """Start of every call (decode or batch), before any hit or miss."""

    def on_hit(self, key: int, ctx: Ctx) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def on_miss(self, key: int, ctx: Ctx) -> None:
        """Every miss (decode and batch), before it is placed or served directly."""

    def on_hint(self, key: int, ctx: Ctx) -> None:
        """A hint that the resident ``key`` is expected soon: a hit unless a policy says otherwise."""
        self.on_hit(key, ctx)

    def on_prefetch(self, key: int, ctx: Ctx) -> None:
        """A prefetch placed ``key``: a cold insert unless a policy says otherwise."""
        self.on_insert(key, True, ctx)

    def on_insert(self, key: int, cold: bool, ctx: Ctx) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def on_remove(self, key: int) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def victim(self, evictable: Callable[[int], bool]) -> Optional[int]:  # pragma: no cover - abstract
        raise NotImplementedError

    def admit(self, key: int, victim: int, ctx: Ctx) -> bool:
        """Replace ``victim`` by the missing ``key``?  ``False``: serve ``key`` directly."""
        return True

    def __len__(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError
