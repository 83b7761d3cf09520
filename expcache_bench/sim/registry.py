"""The name -> policy registry and the simulators' entry points.

* :data:`POLICIES` maps names to factories ``capacity -> Policy``;
  :func:`make_policy` resolves a name, class or factory. Every policy of the
  library (``pyexpcache._lib.POLICIES``, from the table in
  ``libexpcache/src/policy/registry.cpp``) has its twin here under the same
  name, which replays count for count what the library does
  (``tests/test_policy.py`` checks both); the other entries are candidates
  evaluated offline (``benchmarks/policy_eval.py``).
* :func:`simulate_policy` (one policy object per size class; ``partition="layer"``: each
  layer its own share of its class, as the library's ``partition="layer"``) and
  :func:`simulate_global` (one policy object, one byte budget for every class)
  replay a stream through :func:`expcache_bench.sim.driver.replay`;
  :func:`simulate_lru` is ``simulate_policy`` with :class:`~expcache_bench.sim.lru.LRU`.
* :func:`simulate` picks LRU or Belady (:mod:`expcache_bench.sim.belady`) by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Callable

from pyexpcache.routing import Trace

from .belady import simulate_belady
from .calls import COUNTERS, Requests, SimResult, as_stream, check_classes
from .driver import ClassSlots, LayerSlots, SharedBudget, layer_shares, prepare, replay
from .duel import DuelPolicy
from .frequency import LRFU, ClassLRU
from .lru import LRU
from .oppclass import HazardClassLRU, OppClassLRU
from .policy import Policy
from .segmented import ARC, S3FIFO, WTinyLFU

__all__ = [
    "POLICIES",
    "PARTITIONS",
    "make_policy",
    "simulate_policy",
    "simulate_global",
    "simulate_lru",
    "simulate",
    "simulate_belady_partitioned",
    "layer_experts_of",
]

#: How a class's slots are shared among its layers: "global" (any miss may evict any entry of
#: its class) or "layer" (each layer its own share, :func:`~expcache_bench.sim.driver.layer_shares`).
PARTITIONS = ("global", "layer")

POLICIES: dict[str, Callable[[int], Policy]] = {
    "lru": LRU,
    "classlru": ClassLRU,
    "lrfu": LRFU,
    "arc": ARC,
    "s3fifo": S3FIFO,
    "wtinylfu": WTinyLFU,
    "oppclass": OppClassLRU,
    "hazard": HazardClassLRU,
    "duel": DuelPolicy,
}


def make_policy(policy) -> Callable[[int], Policy]:
    """A factory ``capacity -> Policy`` from a name in :data:`POLICIES`, a
    :class:`Policy` subclass, a ``functools.partial`` of one, or any callable."""
    if isinstance(policy, str):
        try:
            return POLICIES[policy]
        except KeyError:
            raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}") from None
    if callable(policy):
        return policy
    raise TypeError(f"policy must be a name or a callable capacity -> Policy, got {policy!r}")


def _policy_name(factory) -> str:
    if isinstance(factory, partial):
        inner = _policy_name(factory.func)
        args = ",".join(f"{k}={v}" for k, v in factory.keywords.items())
        return f"{inner}({args})" if args else inner
    return getattr(factory, "name", getattr(factory, "__name__", "policy"))


def simulate_policy(
    requests,
    capacity: int | Sequence[int],
    layer_class: Sequence[int] | None = None,
    policy="lru",
    *,
    weights=None,
    tokens: Sequence[int] | None = None,
    layers: Sequence[int] | None = None,
    partition: str = "global",
    layer_experts: Sequence[int] | None = None,
    check: bool = False,
    misses: list | None = None,
) -> SimResult:
    """Replay ``requests`` through one ``policy`` object per size class.

    Args:
        requests: as :func:`simulate_lru` (a sequence of
            :class:`~expcache_bench.sim.calls.Call`, a :class:`Trace` or an int array).
        capacity, layer_class: as in ``simulate_lru``.
        policy: name in :data:`POLICIES` or a factory ``capacity -> Policy``.
        weights: gate weights, ``[tokens, layers, k]`` array or per-call tuples
            parallel to ``call.ids`` (default: a Trace's own weights, if any).
        tokens: token index of every call (default :func:`token_index`).
        layers: the layers whose ranks are the clock's layer positions, as the library's
            registered MoE layers are (default: the layers the stream uses).
        partition: ``"global"`` (default) or ``"layer"``: each layer its own share of its
            class's capacity (:func:`~expcache_bench.sim.driver.layer_shares`); a miss of a layer
            holding its share evicts one of that layer's entries.
        layer_experts: with ``partition="layer"``, the experts of each layer (indexed as
            ``layer_class``; 0 for a layer in no class, e.g. a dense one): what the shares are
            in proportion to. Default: a Trace's ``num_experts`` for each of its layers
            (:func:`layer_experts_of`); required for a stream of calls.
        check: assert the invariants after every call (slow; for tests).
        misses: a list that gets every miss's key (``layer << KEY_SHIFT | expert``), in the
            order the library reads them.

    Returns:
        :class:`SimResult` whose ``policy`` is the policy's name.
    """
    prepared = prepare(requests, weights, tokens, layers)
    cap, cls = check_classes(prepared.stream, capacity, layer_class)
    factory = make_policy(policy)
    policies = [factory(c) for c in cap]
    if _check_partition(partition) == "layer":
        space = LayerSlots(cap, cls, policies, layer_experts_of(requests, cls, layer_experts))
    else:
        space = ClassSlots(cap, cls, policies)
    counters = replay(prepared, space, check=check, misses=misses)
    return SimResult.from_counters(_policy_name(factory), cap, counters, len(prepared.stream))


def _check_partition(partition: str) -> str:
    if partition not in PARTITIONS:
        raise ValueError(f"partition must be one of {', '.join(PARTITIONS)}, got {partition!r}")
    return partition


def layer_experts_of(requests, layer_class: Sequence[int], layer_experts: Sequence[int] | None = None) -> list[int]:
    """The experts of each layer (indexed as ``layer_class``) that ``partition="layer"`` splits a
    class in proportion to: ``layer_experts`` when given, else a Trace's ``num_experts`` for
    each layer (a stream of calls does not say: pass ``layer_experts``)."""
    if layer_experts is not None:
        out = [int(n) for n in layer_experts]
        if len(out) < len(layer_class):
            raise ValueError(f"layer_experts has {len(out)} entries, layer_class {len(layer_class)}")
        if any(n < 0 for n in out):
            raise ValueError("layer_experts entries must be >= 0")
        return out
    if isinstance(requests, Trace):
        return [requests.num_experts] * len(layer_class)
    raise ValueError('partition="layer" needs layer_experts (the experts of each layer) for a stream of calls')


def simulate_belady_partitioned(
    requests,
    capacity: int | Sequence[int],
    layer_class: Sequence[int] | None = None,
    *,
    partition: str = "global",
    layer_experts: Sequence[int] | None = None,
    bypass: bool = True,
) -> SimResult:
    """Belady's MIN (:func:`~expcache_bench.sim.belady.simulate_belady`) under ``partition``:
    ``"global"`` is ``simulate_belady``; ``"layer"`` runs it within each layer's share (every
    layer a class of its own, capacity its share), counters summed back per class."""
    if _check_partition(partition) == "global":
        return simulate_belady(requests, capacity, layer_class, bypass=bypass)
    stream = as_stream(requests)
    cap, cls = check_classes(stream, capacity, layer_class)
    shares = layer_shares(cap, cls, layer_experts_of(requests, cls, layer_experts))
    per_layer = simulate_belady(stream, shares, list(range(len(cls))), bypass=bypass)
    rows = [[0] * len(COUNTERS) for _ in cap]
    for layer, c in enumerate(cls):
        for j, name in enumerate(COUNTERS):
            rows[c][j] += int(getattr(per_layer, name)[layer])
    return SimResult.from_counters("belady", cap, rows, per_layer.calls)


def simulate_global(
    requests,
    budget_bytes: int,
    class_bytes: Sequence[int],
    layer_class: Sequence[int],
    policy="lru",
    *,
    weights=None,
    tokens: Sequence[int] | None = None,
    check: bool = False,
) -> SimResult:
    """Replay ``requests`` with every class competing for one byte budget.

    One policy object orders all resident entries.  A miss of class ``c``
    needs ``class_bytes[c]`` bytes: if they are free it is inserted, otherwise
    victims (``policy.victim``, any class, never an entry of the current call)
    are evicted one by one until the bytes fit; if the policy runs out of
    victims first, or refuses the first replacement (``admit``), the miss is
    served directly (victims already evicted stay evicted).  Batch calls
    append into free bytes only.  Counters are per class; ``capacity`` in the
    result is each class's largest resident count reached.

    The victim is the policy's choice across classes, so class budgets
    follow demand.  :class:`OppClassLRU` ranks entries of every size by the
    same score, an increasing function of the chance of reuse: when a miss
    costs its bytes, keeping an entry of ``s`` bytes hit with probability
    ``p`` saves ``p * s`` bytes for ``s`` bytes of room, a value per byte of
    ``p`` whatever the size (its ``size_exp`` option weights the score by
    ``size ** size_exp`` to test other trade-offs).

    Args:
        requests: as :func:`simulate_policy`.
        budget_bytes: the one budget shared by all classes.
        class_bytes: bytes of one expert of each class.
        layer_class: class of each cache layer (required).
        policy: name in :data:`POLICIES` or factory; built with capacity ``None``.
        weights, tokens, check: as :func:`simulate_policy` (``check`` also
            asserts the budget).
    """
    prepared = prepare(requests, weights, tokens)
    cls = [int(c) for c in layer_class]
    factory = make_policy(policy)
    space = SharedBudget(budget_bytes, class_bytes, cls, factory(None))
    counters = replay(prepared, space, check=check)
    return SimResult.from_counters("global:" + _policy_name(factory), tuple(space.peak), counters, len(prepared.stream))


def simulate_lru(
    requests: Requests, capacity: int | Sequence[int], layer_class: Sequence[int] | None = None
) -> SimResult:
    """Replay ``requests`` through an LRU cache with the library's decode/batch semantics.

    Args:
        requests: a request stream (sequence of :class:`Call`, decode and batch
            calls mixed), or a :class:`Trace` / int array ``[tokens, layers, k]``
            replayed as decode calls with cache layer = array index.
        capacity: experts per class; an int gives every class the same capacity.
        layer_class: class of each cache layer (default: one class for all).

    Returns:
        :class:`SimResult` with per-class counters.

    Runs at roughly 10^6 requests per second (one ``OrderedDict`` per class),
    through the replay loop of :func:`simulate_policy` with the
    :class:`~expcache_bench.sim.lru.LRU` policy.
    """
    # The stream, not the Trace: LRU reads no gate weights, so none are gathered.
    return simulate_policy(as_stream(requests), capacity, layer_class, LRU)


def simulate(
    requests: Requests,
    capacity: int | Sequence[int],
    layer_class: Sequence[int] | None = None,
    *,
    policy: str = "lru",
) -> SimResult:
    """Dispatch to :func:`simulate_lru` (``policy="lru"``) or :func:`simulate_belady` (``"belady"``)."""
    if policy == "lru":
        return simulate_lru(requests, capacity, layer_class)
    if policy == "belady":
        return simulate_belady(requests, capacity, layer_class)
    raise ValueError(f"unknown policy {policy!r}; expected 'lru' or 'belady'")
