"""Request streams for the offline simulator's tests (expcache_bench/sim/): decode and batch calls
by hand, random streams, and a simulator result's counters as one tuple."""

from __future__ import annotations

from expcache_bench.sim import BATCH, DECODE, Call

#: A SimResult's per-class counters, in the order counters() returns them.
FIELDS = ("hits", "misses", "inserts", "appends", "direct", "evictions")


def D(layer, *ids) -> Call:
    """A decode call of ``ids`` at ``layer``."""
    return Call(DECODE, layer, ids)


def B(layer, *ids) -> Call:
    """A prefill batch of ``ids`` at ``layer``."""
    return Call(BATCH, layer, ids)


def counters(r, c=None) -> tuple:
    """(hits, misses, inserts, appends, direct, evictions) of class ``c``, or summed over every
    class when ``c`` is None (a one-class result: that class's)."""
    if c is None:
        return tuple(int(getattr(r, n).sum()) for n in FIELDS)
    return tuple(int(getattr(r, n)[c]) for n in FIELDS)


def random_stream(rng, *, batches=True, layers=None, experts=None, calls=None):
    """(calls, number of layers): random decode calls of 1-4 ids and, unless ``batches`` is
    False, batches of 1-10 ids (15 %)."""
    layers = layers or rng.randint(1, 4)
    experts = experts or rng.randint(3, 12)
    out = []
    for _ in range(calls or rng.randint(5, 80)):
        layer = rng.randrange(layers)
        if batches and rng.random() < 0.15:
            out.append(B(layer, *(rng.randrange(experts) for _ in range(rng.randint(1, 10)))))
        else:
            out.append(D(layer, *(rng.randrange(experts) for _ in range(rng.randint(1, 4)))))
    return out, layers
