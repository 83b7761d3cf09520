"""The offline expert-cache simulator: online policies and Belady/MIN with the C library's semantics.

These replay routing traces against a model of the cache and count hits and
misses.  They follow the decode and prefill-batch paths of libexpcache
exactly, so a simulator's counters can be compared one-for-one with the
library's.

Model
-----
* Keys are ``(layer, expert)``.  Every *cache layer* (an index chosen by the
  caller, see :mod:`expcache_bench.sim.calls`) belongs to one size class,
  ``layer_class[layer]``; class ``c`` holds at most ``capacity[c]`` experts.
  Classes never interact (except in :func:`simulate_global`'s shared budget).
* The input is a *request stream*: a sequence of :class:`Call`.  A call asks
  for some expert ids of one layer.  Duplicate ids within a call are served
  and counted once (first appearance order is kept).
* ``"decode"`` call (one token at one layer):

  1. every resident id is a hit and becomes most recently used (in call order);
  2. every missing id, in order, is a miss.  If the class has a free slot the
     id is inserted as most recently used.  Otherwise the least recently used
     resident entry *not requested by this call* is evicted and the id is
     inserted.  If every resident entry was requested by this call (capacity
     smaller than the call) the id is served directly, without caching.
     Capacity 0 serves everything directly.

* ``partition="layer"`` (:func:`simulate_policy`): each layer its own share of its class's
  capacity; a decode miss of a layer holding its share evicts one of that layer's entries, a
  batch appends only below it (:class:`~expcache_bench.sim.driver.LayerSlots`).
* ``"batch"`` call (prefill: one layer, the ids of many tokens): the union
  of the ids is served.  A resident id is a hit and its recency does *not*
  change.  A missing id is a miss; it is appended at the *least* recently used
  end if the class has a free slot (so it is the first to go later), otherwise
  served directly.  Batches never evict.

That is LRU (:func:`simulate_lru`); :func:`simulate_policy` keeps the call
structure and lets a policy object choose victims (and refuse replacements);
:func:`simulate_belady` is the clairvoyant reference for decode-only streams.

Counters (per class): ``hits``, ``misses``, ``inserts`` (decode misses cached),
``appends`` (batch misses cached), ``direct`` (misses served without caching)
and ``evictions``.  ``misses == inserts + appends + direct`` always holds.

Policies (``POLICIES`` maps names to factories):

=================  ==========================================================
``lru``            least recently used (identical counters to simulate_lru)
``classlru``       llama.cpp's frequency/recency hybrid: decayed use count
                   (128-token half-life), one LRU list per log2 class of the
                   count, victim = list head with the largest age / 2^class
``lrfu``           Lee et al. LRFU: combined recency-frequency value
                   sum 2^(-lambda * age) over past uses, victim = smallest
                   (lambda = 0.03 per token, tuned on the tuning traces)
``arc``            ARC (Megiddo & Modha), ghost lists B1/B2, adaptive p
``s3fifo``         S3-FIFO (Yang et al., SOSP'23): 10 % small FIFO, main
                   FIFO with 2-bit counters, ghost FIFO
``wtinylfu``       W-TinyLFU (Caffeine): window LRU (10 %, tuned on the
                   tuning traces; Caffeine starts at 1 % and hill-climbs),
                   segmented main LRU, frequency duel for admission
``oppclass``       ours, the winner: :class:`OppClassLRU` (docs/policy.md)
``hazard``         ours, candidate 2: :class:`HazardClassLRU`, the same lists
                   ranked by a reuse hazard learned online
``duel``           the library's default: :class:`DuelPolicy`, LRU and
                   OppClassLRU, the one followed chosen by two shadow caches
=================  ==========================================================

Nothing here needs more than numpy; every policy keeps O(1) or O(log n)
bookkeeping per access (``victim`` may look at a bounded number of list
heads), except the peers' ghost-list trimming, which is amortised O(1).

Modules
-------
``calls``      calls, streams, keys, :class:`SimResult`
``policy``     the policy interface (:class:`Policy`, :class:`Ctx`)
``driver``     the one replay loop; per-class slots or one shared byte budget
``lru``        :class:`LRU`
``frequency``  :class:`ClassLRU`, :class:`LRFU`
``segmented``  :class:`ARC`, :class:`S3FIFO`, :class:`WTinyLFU`
``oppclass``   :func:`missed_opportunities`, :class:`OppClassLRU`, :class:`HazardClassLRU`
``duel``       :class:`DuelPolicy`
``belady``     :func:`simulate_belady`
``registry``   :data:`POLICIES`, :func:`make_policy`, the ``simulate_*`` entry points
"""

from .belady import simulate_belady
from .calls import (
    BATCH,
    DECODE,
    KEY_SHIFT,
    Call,
    Requests,
    SimResult,
    as_stream,
    decode_stream,
    prompt_stream,
    token_index,
)
from .duel import DuelPolicy
from .frequency import LRFU, ClassLRU
from .lru import LRU
from .oppclass import HazardClassLRU, OppClassLRU, missed_opportunities
from .policy import Ctx, Policy
from .registry import POLICIES, make_policy, simulate, simulate_global, simulate_lru, simulate_policy
from .segmented import ARC, S3FIFO, WTinyLFU

__all__ = [
    # calls and results
    "DECODE",
    "BATCH",
    "KEY_SHIFT",
    "Call",
    "Requests",
    "SimResult",
    "decode_stream",
    "prompt_stream",
    "as_stream",
    "token_index",
    # the policy interface and the policies
    "Ctx",
    "Policy",
    "LRU",
    "ClassLRU",
    "LRFU",
    "ARC",
    "S3FIFO",
    "WTinyLFU",
    "OppClassLRU",
    "HazardClassLRU",
    "DuelPolicy",
    "missed_opportunities",
    # registry and simulators
    "POLICIES",
    "make_policy",
    "simulate_policy",
    "simulate_global",
    "simulate_lru",
    "simulate_belady",
    "simulate",
]
