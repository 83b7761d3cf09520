"""A pure-Python reference model of libexpcache's cache semantics.

Written from ``libexpcache/include/expcache.h`` (and, where the header is
silent, from the intent stated in the library's comments), not by
transliterating ``cache.cpp``. It models exactly what a test can observe
through :class:`pyexpcache.ExpertCache` on the host backend:

* which (layer, expert) are resident, and in which recency order;
* every counter of ``expcache_stats_t`` per class index and path;
* class infos (key, slot bytes, target, cap, allocated, resident, held, layers);
* device bytes in use (unrounded, as ``expcache_testing_device_bytes_in_use`` reports)
  and the host backend's emulated capacity (allocations rounded up to 256 B);
* which calls fail, and with which status.

Semantics modelled (header section in brackets):

Classes [expcache_layer_desc_t, expcache_config_t]
    A layer is bound to a size class lazily, on its first serving call; the
    class key is the exact (gate, up, down) byte sizes. Slot bytes are each
    part rounded up to 256. At most ``max_classes`` classes exist; when a new
    key arrives and every index is taken, the least recently used class (by
    its last counted serving call; ties to the lowest index) that holds no
    batch slot is released and reused (``class_reuses`` +1 and, when it had
    slots, ``releases`` +1, both on the calling path). When every class holds
    batch slots the call fails with INVALID_STATE.

Budgets and caps [expcache_config_t]
    target = min(experts of all registered layers of the key, budget_experts,
    budget_bytes * class slot bytes / all slot bytes // slot_bytes).
    The runtime cap = min(target, allocated + max(0, free - reserve - others)
    // slot_bytes) where free is the emulated free capacity and others the
    slots other classes (with a valid cap) may still grow into. The cap is
    computed when a class first needs to grow and again after it was released
    (never on every call); a notice (``cap_notices``) is counted when it is
    first computed for a key and whenever it changes. A failed slab allocation
    caps the class at what it has (and counts a notice). Slabs hold
    max(1, slab_bytes // slot_bytes) slots, fewer when the cap is closer.

Decode [expcache_select_async]
    Unique ids in first-appearance order; hits first (refresh recency, counted
    once), then each miss takes a free slot, grows the class within its cap, or
    evicts the least recently used entry that is neither part of this call nor
    held by a batch; misses inserted without an eviction are ``appends``. The
    misses that find no slot are staged in the class bank's staging rows
    (``direct_loads``), mapped as a call needs more of them than any before
    (a mapping of the rows it lacks; no release/retry on this path) and
    unmapped when the class is released.

Compact [expcache_compact_load_async]
    The staging buffer (reused while large enough) is allocated first; when
    that fails, every class holding no batch slot is released (``releases`` on
    the compact path), ``alloc_retries`` +1 on the layer's class, and the
    allocation is retried once; a second failure is OUT_OF_DEVICE_MEMORY.
    Then hits refresh recency (counted once, ``bytes_d2d`` per occurrence),
    misses are ``direct_loads`` (``bytes_h2d`` per occurrence). Residency does
    not change.

Batch [expcache_batch_prepare_async / _finish]
    Hits keep their recency and are held. Misses take only free capacity (a
    free slot or growth within the cap), never evict, and are inserted at the
    cold end (each later append colder than the earlier ones), held. The rest
    go to a staging buffer owned by the batch, allocated with the same
    release-and-retry-once rule as compact (``batch_staging_releases``; the
    header's batch section does not mention this release, and "a batch never
    evicts, so the decode working set survives a prompt of any length" does not
    hold when that staging does not fit: see the divergence report). A failed
    prepare drops the holds it took (entries it appended stay resident). Holds
    last until finish; at most 64 batches are outstanding.

Control [expcache_release_all, expcache_stats_reset, inject_alloc_failures]
    release_all frees the compact buffer and every class's slots and staging rows
    that hold no batch slot (``releases`` on the control path).
    Fault injection lets ``skip`` allocation attempts through and fails the
    next ``count`` as out of device memory.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Optional

from expcache_bench.sim import Ctx, make_policy
from pyexpcache._lib import (  # the ABI's
    MAX_BATCH_ROWS as BATCH_ROWS,
    MAX_BATCHES,
    MAX_SELECT,
    PATH_NAMES as PATHS,
    POLICIES,
    PREFETCH_FIELDS,
    STAT_FIELDS,
)

ALIGN = 256
MAX_COMPACT = 1 << 20
MAX_BATCH_IDS = 1 << 26
GIB = 1 << 30

# Default config values (expcache_config_init).
DEFAULT_RESERVE = 1 << 30
DEFAULT_CAPACITY = 64 << 30
DEFAULT_SLAB = 512 << 20


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class ModelError(Exception):
    """A call the model says must fail; ``status`` is the EXPCACHE_ERR_* name suffix."""

    def __init__(self, status: str, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


INVALID_ARGUMENT = "INVALID_ARGUMENT"
INVALID_STATE = "INVALID_STATE"
DENSE = "ValueError"  # ExpertCache's own refusal of a dense layer (a ValueError, not a status)
OUT_OF_DEVICE_MEMORY = "OUT_OF_DEVICE_MEMORY"

Key = tuple[int, int]  # (layer, expert)


def new_stats() -> dict[str, dict[str, int]]:
    return {p: {f: 0 for f in STAT_FIELDS} for p in PATHS}


@dataclass
class RefClass:
    index: int
    in_use: bool = False
    gen: int = 0
    key: tuple[int, int, int] = (0, 0, 0)
    slot_bytes: int = 0
    last_used: int = 0
    # Resident entries, coldest first.
    lru: OrderedDict[Key, None] = field(default_factory=OrderedDict)
    holds: dict[Key, int] = field(default_factory=dict)
    pol: object = None  # the policy's twin in expcache_bench.sim; None for LRU, whose order is `lru` itself
    allocated: int = 0
    slabs: list[int] = field(default_factory=list)  # allocation ids
    # The bank's staging rows mapped so far (decode's misses that got no slot), its batch rows mapped
    # so far (batches by slot id: their misses that got no slot), and both ranges' mappings.
    staging_rows: int = 0
    batch_rows: int = 0
    staging: list[int] = field(default_factory=list)
    batch_used: int = 0  # batch rows the open batches by slot id took
    batch_users: int = 0  # those batches
    target: int = 0
    cap: int = 0
    cap_valid: bool = False
    cap_announced: bool = False
    layers: int = 0
    stats: dict[str, dict[str, int]] = field(default_factory=new_stats)
    # Prefetched entries not used yet: "loading" (queued, never served) or "unused" (every byte sent).
    pf: dict[Key, str] = field(default_factory=dict)
    # The serving call that last used each entry (0: none), for what a prefetch may evict.
    last_use: dict[Key, int] = field(default_factory=dict)

    @property
    def resident(self) -> int:
        return len(self.lru)

    @property
    def free(self) -> int:
        return self.allocated - len(self.lru)

    @property
    def held(self) -> int:
        return sum(1 for n in self.holds.values() if n > 0)


@dataclass
class RefBatch:
    handle: int
    cls: int
    held: list[Key]
    staging: Optional[int]  # allocation id
    rows: bool = False  # a batch by slot id that took batch rows


@dataclass
class LayerShape:
    num_experts: int
    key: tuple[int, int, int]

    @property
    def expert_bytes(self) -> int:
        return sum(self.key)

    @property
    def slot_bytes(self) -> int:
        return sum(align_up(b) for b in self.key)


class ReferenceCache:
    """The model. ``layout`` is a sequence of None (dense layer, never registered) or
    objects with ``num_experts`` and ``class_key`` (e.g. :class:`pyexpcache.LayerSpec`),
    or a :class:`pyexpcache.ModelLayout`. Keyword arguments mirror ExpertCache's."""

    def __init__(
        self,
        layout,
        *,
        budget_experts: Optional[int] = None,
        budget_bytes: Optional[int] = None,
        reserve_bytes: Optional[int] = None,
        max_classes: int = 4,
        device_capacity_bytes: Optional[int] = None,
        slab_bytes: Optional[int] = None,
        batch_staging_releases: bool = False,
        policy: str = "lru",
        prefetch_max_per_layer: int = 8,
    ):
        self.batch_staging_releases = batch_staging_releases
        self.prefetch_max = int(prefetch_max_per_layer)
        self.pstats = {f: 0 for f in PREFETCH_FIELDS}
        self.pf_count: dict[int, int] = {}  # per layer: prefetched since its last serving call
        self.cur_call = self.prev_call = 0
        self.resumed: set = set()  # keys of queued prefetches the serving call under way finishes
        if policy not in POLICIES:
            raise ModelError(INVALID_ARGUMENT, f"unknown policy {policy}")
        self.policy = policy
        # The policy clock, as the library keeps it: a serving call whose layer is not after the
        # previous one's starts a token; positions are ranks among the registered layers.
        self.token = 0
        self.last_layer: Optional[int] = None
        specs = getattr(layout, "layers", layout)
        self.layers: list[Optional[LayerShape]] = [
            None if s is None else LayerShape(int(s.num_experts), tuple(int(b) for b in s.class_key)) for s in specs
        ]
        moe = [i for i, shape in enumerate(self.layers) if shape is not None]
        self.rank = {layer: r for r, layer in enumerate(moe)}
        self.positions = max(len(moe), 1)
        self.budget_experts = int(budget_experts or 0)
        self.budget_bytes = int(budget_bytes or 0)
        if not self.budget_experts and not self.budget_bytes:
            raise ModelError(INVALID_ARGUMENT, "set budget_experts or budget_bytes")
        if not 1 <= max_classes <= 64:
            raise ModelError(INVALID_ARGUMENT, "max_classes must be 1..64")
        self.reserve = DEFAULT_RESERVE if reserve_bytes is None else int(reserve_bytes)
        env = os.environ.get("EXPCACHE_RESERVE_GB")
        if env is not None:
            self.reserve = int(float(env) * float(GIB))  # the library converts the same way
        self.capacity = DEFAULT_CAPACITY if device_capacity_bytes is None else int(device_capacity_bytes)
        self.slab_bytes = DEFAULT_SLAB if slab_bytes is None else int(slab_bytes)
        self.classes = [RefClass(i) for i in range(max_classes)]
        self._ctx = Ctx()
        self.binding: dict[int, tuple[int, int]] = {}  # layer -> (class index, gen)
        self.call = 0
        # Device memory: allocation id -> (bytes, rounded bytes).
        self.allocs: dict[int, tuple[int, int]] = {}
        self._next_alloc = 1
        self.used = 0  # rounded, as the host backend counts its capacity
        self.device_bytes = 0  # as expcache_testing_device_bytes_in_use reports
        self.inject_skip = 0
        self.inject_count = 0
        self.compact: Optional[int] = None
        self.compact_bytes = 0
        self.batches: list[RefBatch] = []
        self.next_batch = 1

    # ------------------------------------------------------------------ memory
    def _alloc(self, nbytes: int) -> int:
        if self.inject_count > 0:
            if self.inject_skip > 0:
                self.inject_skip -= 1
            else:
                self.inject_count -= 1
                raise ModelError(OUT_OF_DEVICE_MEMORY, f"injected failure ({nbytes} bytes)")
        rounded = align_up(nbytes)
        if nbytes == 0 or rounded > self.capacity - self.used:
            raise ModelError(OUT_OF_DEVICE_MEMORY, f"emulated capacity exhausted ({nbytes} bytes)")
        aid = self._next_alloc
        self._next_alloc += 1
        self.allocs[aid] = (nbytes, rounded)
        self.used += rounded
        self.device_bytes += nbytes
        return aid

    def _free(self, aid: Optional[int]) -> None:
        if aid is None or aid not in self.allocs:
            return
        nbytes, rounded = self.allocs.pop(aid)
        self.used -= rounded
        self.device_bytes -= nbytes

    def _alloc_staging(self, nbytes: int, c: int, path: str) -> int:
        """Staging first; on out-of-memory release every class holding no batch slot, retry once."""
        try:
            return self._alloc(nbytes)
        except ModelError as e:
            if e.status != OUT_OF_DEVICE_MEMORY:
                raise
        self._release_unheld(path)
        self.classes[c].stats[path]["alloc_retries"] += 1
        return self._alloc(nbytes)

    # ------------------------------------------------------------------ classes
    def _validate_layer(self, layer: int) -> LayerShape:
        if not 0 <= layer < len(self.layers):
            raise ModelError(INVALID_ARGUMENT, f"layer {layer} out of range")
        shape = self.layers[layer]
        if shape is None:  # a dense layer: the wrapper refuses it before the library sees it
            raise ModelError(DENSE, f"layer {layer} has no routed experts")
        return shape

    def _validate_ids(self, shape: LayerShape, ids: Sequence[int]) -> None:
        for e in ids:
            if not 0 <= e < shape.num_experts:
                raise ModelError(INVALID_ARGUMENT, f"expert id {e} out of range")

    def class_of(self, layer: int) -> Optional[int]:
        """The class index ``layer`` is bound to now, or None (unbound or its class was reused)."""
        b = self.binding.get(layer)
        if b is None:
            return None
        c, gen = b
        cls = self.classes[c]
        return c if cls.in_use and cls.gen == gen else None

    def _activate(self, c: int, key: tuple[int, int, int]) -> None:
        cls = self.classes[c]
        assert cls.resident == 0 and cls.held == 0 and not cls.slabs
        cls.in_use = True
        cls.gen += 1
        cls.key = key
        cls.slot_bytes = sum(align_up(b) for b in key)
        cls.lru = OrderedDict()
        cls.pf, cls.last_use = {}, {}
        # A reused class starts afresh.
        cls.pol = None if self.policy == "lru" else make_policy(self.policy)(None)
        cls.holds = {}
        cls.allocated = 0
        cls.cap_valid = False
        cls.cap_announced = False
        cls.cap = cls.target = 0
        cls.layers = 0

    def _bind(self, layer: int, path: str) -> int:
        c = self.class_of(layer)
        if c is not None:
            return c
        key = self.layers[layer].key
        same = [cl.index for cl in self.classes if cl.in_use and cl.key == key]
        if same:
            c = same[0]
        else:
            empty = [cl.index for cl in self.classes if not cl.in_use]
            if empty:
                c = empty[0]
            else:
                candidates = [cl for cl in self.classes if cl.held == 0 and cl.batch_users == 0]
                if not candidates:
                    raise ModelError(INVALID_STATE, "every class holds batch slots")
                victim = min(candidates, key=lambda cl: (cl.last_used, cl.index))
                c = victim.index
                self._release_class(c, path)
                victim.stats[path]["class_reuses"] += 1
            self._activate(c, key)
        self.binding[layer] = (c, self.classes[c].gen)
        self.classes[c].layers += 1
        return c

    def _release_class(self, c: int, path: str) -> None:
        cls = self.classes[c]
        for aid in cls.staging:
            self._free(aid)
        assert cls.batch_users == 0
        cls.staging, cls.staging_rows, cls.batch_rows = [], 0, 0
        if not cls.slabs:
            return
        assert cls.held == 0
        self._cancel_prefetches()  # nothing is sent into the slabs after this
        for k in list(cls.pf):
            self._forget_prefetch(cls, k, "wasted")
        cls.last_use = {}
        for aid in cls.slabs:
            self._free(aid)
        cls.slabs = []
        cls.allocated = 0
        if cls.pol is not None:
            for k in cls.lru:
                cls.pol.on_remove(k)  # the policy forgets the slots, not the counts
        cls.lru = OrderedDict()
        cls.holds = {}
        cls.cap_valid = False
        cls.stats[path]["releases"] += 1

    def _release_unheld(self, path: str) -> None:
        for cls in self.classes:
            if cls.in_use and (cls.slabs or cls.staging) and cls.held == 0 and cls.batch_users == 0:
                self._release_class(cls.index, path)

    def class_target(self, c: int) -> int:
        cls = self.classes[c]
        experts = 0
        class_bytes = total_bytes = 0
        for shape in self.layers:
            if shape is None:
                continue
            total_bytes += shape.slot_bytes * shape.num_experts
            if shape.key == cls.key:
                experts += shape.num_experts
                class_bytes += shape.slot_bytes * shape.num_experts
        target = experts
        if self.budget_experts:
            target = min(target, self.budget_experts)
        if self.budget_bytes and total_bytes:
            target = min(target, self.budget_bytes * class_bytes // total_bytes // cls.slot_bytes)
        return target

    def _announce(self, cls: RefClass, path: str) -> None:
        cls.stats[path]["cap_notices"] += 1
        cls.cap_announced = True

    def _refresh_cap(self, c: int, path: str) -> None:
        cls = self.classes[c]
        others = 0
        for o in self.classes:
            if o.index == c or not o.in_use or not o.cap_valid:
                continue
            if o.cap > o.allocated:
                others += (o.cap - o.allocated) * o.slot_bytes
        free = self.capacity - self.used
        avail = max(0, free - (self.reserve + others))
        mem_cap = cls.allocated + avail // cls.slot_bytes
        old = cls.cap
        cls.target = self.class_target(c)
        cls.cap = min(cls.target, mem_cap)
        cls.cap_valid = True
        if not cls.cap_announced or cls.cap != old:
            self._announce(cls, path)

    def _grow(self, c: int, path: str) -> None:
        cls = self.classes[c]
        per_slab = max(1, self.slab_bytes // cls.slot_bytes)
        n = min(cls.cap - cls.allocated, per_slab)
        try:
            aid = self._alloc(n * cls.slot_bytes)
        except ModelError as e:
            if e.status != OUT_OF_DEVICE_MEMORY:
                raise
            cls.cap = cls.allocated  # memory is shorter than the cap assumed
            self._announce(cls, path)
            return
        cls.slabs.append(aid)
        cls.allocated += n

    def _acquire(self, c: int, *, allow_evict: bool, protected: set, path: str, prefetch: bool = False) -> bool:
        """Make room for one more resident entry. Returns True when there is a free slot
        (possibly after growing or evicting), False when the miss must go to staging. A
        prefetch may evict no entry of the current or previous serving call, nor one loading."""
        cls = self.classes[c]
        if cls.free == 0:
            if not cls.cap_valid:
                self._refresh_cap(c, path)
            if cls.allocated < cls.cap:
                self._grow(c, path)
        if cls.free > 0:
            return True
        if allow_evict:

            def evictable(k):
                if cls.holds.get(k, 0) != 0:
                    return False
                if prefetch:
                    return cls.pf.get(k) != "loading" and cls.last_use.get(k, 0) < self.prev_call
                return k not in protected

            if cls.pol is not None:
                victim = cls.pol.victim(evictable)
            else:
                victim = next((k for k in cls.lru if evictable(k)), None)
            if victim is not None:
                if victim in cls.pf:
                    self._forget_prefetch(cls, victim, "wasted")
                cls.last_use.pop(victim, None)
                del cls.lru[victim]
                if cls.pol is not None:
                    cls.pol.on_remove(victim)
                cls.stats[path]["evictions"] += 1
                return True
        return False

    def _start_call(self, layer: int, path: str, ids: Sequence[int] = ()):
        """Bind the layer's class and open a call on `path` (the library's start_call):
        returns (class index, class, the path's counters). Queued prefetches are cancelled
        first, but those of the layer this decode or batch call lists stay, to be finished in
        place by the call (``self.resumed``)."""
        keep = {(layer, int(e)) for e in ids} if path in ("decode", "batch") else set()
        self.resumed = self._cancel_prefetches(keep)
        c = self._bind(layer, path)
        cls = self.classes[c]
        self.call += 1
        self.prev_call, self.cur_call = self.cur_call, self.call
        self.pf_count[layer] = 0
        cls.last_used = self.call
        cls.stats[path]["calls"] += 1
        self._tick(cls, layer)
        return c, cls, cls.stats[path]

    # -------------------------------------------------------------- policy hooks
    def _tick(self, cls: RefClass, layer: int) -> None:
        """Advance the clock at the start of a serving call (the library's start_call)."""
        if self.last_layer is None or layer <= self.last_layer:
            self.token += 1
        self.last_layer = layer
        if cls.pol is not None:
            self._ctx.token, self._ctx.pos, self._ctx.layers = self.token, self.rank[layer], self.positions
            cls.pol.begin(self._ctx)

    def _hit(self, cls: RefClass, k: Key) -> None:
        """A serving call's hit: the policy's refresh (and a prefetched entry's first use)."""
        if k in cls.pf:
            self._forget_prefetch(cls, k, "used")
        self._refresh(cls, k)

    def _refresh(self, cls: RefClass, k: Key) -> None:
        cls.lru.move_to_end(k)
        if cls.pol is not None:
            cls.pol.on_hit(k, self._ctx)

    def _insert(self, cls: RefClass, k: Key, cold: bool) -> None:
        cls.lru[k] = None
        if cold:
            cls.lru.move_to_end(k, last=False)
        if cls.pol is not None:
            cls.pol.on_insert(k, cold, self._ctx)

    @staticmethod
    def _unique(ids: Iterable[int]) -> list[int]:
        return list(dict.fromkeys(int(e) for e in ids))

    # ------------------------------------------------------------------ serving
    def select(self, layer: int, ids: Sequence[int]) -> dict[int, str]:
        """Decode path. Returns, per unique id, "hit", "slot" (loaded into a slot) or "direct"."""
        ids = [int(e) for e in ids]
        shape = self._validate_layer(layer)
        if not 1 <= len(ids) <= MAX_SELECT:
            raise ModelError(INVALID_ARGUMENT, "k must be 1..1024")
        self._validate_ids(shape, ids)
        c, cls, st = self._start_call(layer, "decode", ids)
        unique = self._unique(ids)
        where: dict[int, str] = {}
        protected = set()
        misses = []
        for e in unique:
            k = (layer, e)
            if k in self.resumed:
                self._finish_in_place(cls, k, False, st)
                protected.add(k)
                where[e] = "slot"
            elif k in cls.lru:
                self._hit(cls, k)
                cls.last_use[k] = self.call
                protected.add(k)
                st["hits"] += 1
                where[e] = "hit"
            else:
                misses.append(e)
        direct = []
        for e in misses:
            k = (layer, e)
            st["misses"] += 1
            before = st["evictions"]
            if not self._acquire(c, allow_evict=True, protected=protected, path="decode"):
                direct.append(e)
                continue
            self._insert(cls, k, cold=False)  # hot end
            cls.last_use[k] = self.call
            protected.add(k)
            if st["evictions"] == before:
                st["appends"] += 1
            st["bytes_h2d"] += shape.expert_bytes
            where[e] = "slot"
        if len(direct) > cls.staging_rows:  # the bank's staging rows: mapped as calls need more
            cls.staging.append(self._alloc((len(direct) - cls.staging_rows) * cls.slot_bytes))
            cls.staging_rows = len(direct)
        if direct:
            for e in direct:
                st["direct_loads"] += 1
                st["bytes_h2d"] += shape.expert_bytes
                where[e] = "direct"
        return where

    def load_compact(self, layer: int, ids: Sequence[int]) -> dict[int, str]:
        """Compact path. Returns, per unique id, "hit" or "direct"."""
        ids = [int(e) for e in ids]
        shape = self._validate_layer(layer)
        n = len(ids)
        if not 1 <= n <= MAX_COMPACT:
            raise ModelError(INVALID_ARGUMENT, "n must be 1..2^20")
        self._validate_ids(shape, ids)
        # Counted once the call is under way, also when its staging then fails.
        c, cls, st = self._start_call(layer, "compact")
        g, u, d = shape.key
        up_off = align_up(g * n)
        down_off = align_up(up_off + u * n)
        total = down_off + d * n
        if self.compact_bytes < total:
            self._free(self.compact)
            self.compact, self.compact_bytes = None, 0
            self.compact = self._alloc_staging(total, c, "compact")
            self.compact_bytes = total
        where: dict[int, str] = {}
        for e in ids:
            k = (layer, e)
            first = e not in where
            if k in cls.lru:
                cls.last_use[k] = self.call
                if first:
                    self._hit(cls, k)
                    st["hits"] += 1
                    where[e] = "hit"
                st["bytes_d2d"] += shape.expert_bytes
            else:
                if first:
                    st["misses"] += 1
                    st["direct_loads"] += 1
                    where[e] = "direct"
                st["bytes_h2d"] += shape.expert_bytes
        return where

    def prepare_batch(
        self, layer: int, ids: Sequence[int], slots: bool = False
    ) -> tuple[int, list[int], dict[int, str]]:
        """Batch path (``slots``: by slot id, staging in the class's batch rows). Returns (handle,
        unique ids, per unique id "hit"/"slot"/"direct")."""
        ids = [int(e) for e in ids]
        shape = self._validate_layer(layer)
        if not 1 <= len(ids) <= MAX_BATCH_IDS:
            raise ModelError(INVALID_ARGUMENT, "n must be 1..2^26")
        self._validate_ids(shape, ids)
        if len(self.batches) >= MAX_BATCHES:
            raise ModelError(INVALID_STATE, "64 batches are unfinished")
        c, cls, st = self._start_call(layer, "batch", ids)
        unique = self._unique(ids)
        held: list[Key] = []

        def hold(k: Key) -> None:
            cls.holds[k] = cls.holds.get(k, 0) + 1
            held.append(k)

        def undo() -> None:
            for k in held:
                self._unhold(cls, k)

        where: dict[int, str] = {}
        misses = []
        for e in unique:
            k = (layer, e)
            if k in self.resumed:
                self._finish_in_place(cls, k, True, st)
                hold(k)
                where[e] = "slot"
            elif k in cls.lru:
                if k in cls.pf:
                    self._forget_prefetch(cls, k, "used")
                st["hits"] += 1
                hold(k)
                where[e] = "hit"
            else:
                misses.append(e)
        direct = []
        for e in misses:
            k = (layer, e)
            st["misses"] += 1
            if not self._acquire(c, allow_evict=False, protected=set(), path="batch"):
                direct.append(e)
                continue
            self._insert(cls, k, cold=True)  # the coldest entry
            cls.last_use[k] = self.call
            st["appends"] += 1
            st["bytes_h2d"] += shape.expert_bytes
            hold(k)
            where[e] = "slot"
        staging = None
        rows = False
        if direct and slots:
            need = cls.batch_used + len(direct)
            if need > BATCH_ROWS:
                undo()
                raise ModelError(INVALID_STATE, "the open batches have taken the batch rows")
            if need > cls.batch_rows:  # mapped as batches need more, kept until the class is released
                try:
                    cls.staging.append(self._alloc((need - cls.batch_rows) * cls.slot_bytes))
                except ModelError:
                    undo()
                    raise
                cls.batch_rows = need
            cls.batch_used, cls.batch_users, rows = need, cls.batch_users + 1, True
            for e in direct:
                st["direct_loads"] += 1
                st["bytes_h2d"] += shape.expert_bytes
                where[e] = "direct"
        elif direct:
            try:
                nbytes = len(direct) * cls.slot_bytes
                staging = (
                    self._alloc_staging(nbytes, c, "batch") if self.batch_staging_releases else self._alloc(nbytes)
                )
            except ModelError:
                undo()
                raise
            for e in direct:
                st["direct_loads"] += 1
                st["bytes_h2d"] += shape.expert_bytes
                where[e] = "direct"
        handle = self.next_batch
        self.next_batch += 1
        self.batches.append(RefBatch(handle, c, held, staging, rows))
        return handle, unique, where

    def finish_batch(self, handle: int) -> None:
        i = next((i for i, b in enumerate(self.batches) if b.handle == handle), None)
        if i is None:
            raise ModelError(INVALID_ARGUMENT, f"batch {handle} is unknown or already finished")
        b = self.batches[i]
        self._free(b.staging)
        cls = self.classes[b.cls]
        for k in b.held:
            self._unhold(cls, k)
        if b.rows:
            cls.batch_users -= 1
            if cls.batch_users == 0:
                cls.batch_used = 0
        del self.batches[i]

    def _unhold(self, cls: RefClass, k: Key) -> None:
        cls.holds[k] -= 1
        if cls.holds[k] == 0:
            del cls.holds[k]
        # Read by the batch's work so far: no prefetch may overwrite it before the next call.
        cls.last_use[k] = max(cls.last_use.get(k, 0), self.cur_call)

    # ------------------------------------------------------------------ prefetch and hints
    def _forget_prefetch(self, cls: RefClass, k: Key, outcome: str) -> None:
        """A prefetched entry's end: "used" by a serving call, "wasted" (evicted or released unused)."""
        del cls.pf[k]
        self.pstats[outcome] += 1
        self.pstats["bytes_" + outcome] += self.layers[k[0]].expert_bytes

    def _cancel_prefetches(self, keep: set = frozenset()) -> set:
        """Every queued (loading) prefetch leaves its slot (a serving call or a release pre-empts
        them), but those in ``keep``: returned, still resident, for the call to finish."""
        kept = set()
        for cls in self.classes:
            for k in [k for k, state in cls.pf.items() if state == "loading"]:
                if k in keep:
                    del cls.pf[k]
                    self.pstats["late"] += 1  # a miss of the call, never used; nothing of it sent (paused)
                    kept.add(k)
                    continue
                del cls.pf[k]
                cls.last_use.pop(k, None)
                del cls.lru[k]
                if cls.pol is not None:
                    cls.pol.on_remove(k)
                self.pstats["cancelled"] += 1
                self.pstats["bytes_cancelled"] += self.layers[k[0]].expert_bytes
                if self.pf_count.get(k[0], 0) > 0:
                    self.pf_count[k[0]] -= 1
        return kept

    def _finish_in_place(self, cls: RefClass, k: Key, cold: bool, st: dict[str, int]) -> None:
        """A miss whose queued prefetch the call finishes: its slot, re-entered in the policy as
        a fresh insert, no eviction (nothing of it was sent while paused: all its bytes move now)."""
        del cls.lru[k]
        if cls.pol is not None:
            cls.pol.on_remove(k)
        self._insert(cls, k, cold=cold)
        cls.last_use[k] = self.call
        st["misses"] += 1
        st["appends"] += 1
        st["bytes_h2d"] += self.layers[k[0]].expert_bytes

    def prefetch(self, layer: int, ids: Sequence[int], *, lands: bool) -> int:
        """expcache_prefetch_async. ``lands``: every queued byte is sent before anything else
        happens (the test drained the prefetch thread); otherwise the entries stay loading (the
        thread is paused) until a serving call or a release cancels them. Returns the count queued."""
        ids = [int(e) for e in ids]
        shape = self._validate_layer(layer)
        if not 1 <= len(ids) <= MAX_SELECT:
            raise ModelError(INVALID_ARGUMENT, "n must be 1..1024")
        self._validate_ids(shape, ids)
        self.pstats["calls"] += 1
        c = self._bind(layer, "control")
        cls = self.classes[c]
        if cls.pol is not None:
            cls.pol.begin(self._ctx)  # the class's clock is now's, as the library sets it
        queued = 0
        for e in self._unique(ids):
            k = (layer, e)
            if k in cls.lru:
                self.pstats["skipped"] += 1
                continue
            if self.pf_count.get(layer, 0) >= self.prefetch_max:
                self.pstats["dropped"] += 1
                continue
            if not self._acquire(c, allow_evict=True, protected=set(), path="control", prefetch=True):
                self.pstats["dropped"] += 1
                continue
            cls.lru[k] = None
            cls.lru.move_to_end(k, last=False)
            if cls.pol is not None:
                cls.pol.on_prefetch(k, self._ctx)
            cls.last_use[k] = 0
            cls.pf[k] = "loading"  # during the call, whatever comes after: no later id of it evicts this
            self.pf_count[layer] = self.pf_count.get(layer, 0) + 1
            self.pstats["issued"] += 1
            self.pstats["bytes_issued"] += shape.expert_bytes
            queued += 1
        if lands:
            for k, state in cls.pf.items():
                if state == "loading":
                    cls.pf[k] = "unused"
                    self.pstats["bytes_sent"] += self.layers[k[0]].expert_bytes
        return queued

    def hint(self, layer: int, ids: Sequence[int]) -> None:
        """expcache_hint: resident entries (not loading) refreshed as hits, no counters of a path."""
        ids = [int(e) for e in ids]
        shape = self._validate_layer(layer)
        if not 1 <= len(ids) <= MAX_SELECT:
            raise ModelError(INVALID_ARGUMENT, "n must be 1..1024")
        self._validate_ids(shape, ids)
        unique = self._unique(ids)
        self.pstats["hints"] += len(unique)
        c = self.class_of(layer)
        if c is None:
            return
        cls = self.classes[c]
        if cls.pol is not None:
            cls.pol.begin(self._ctx)
        for e in unique:
            k = (layer, e)
            if k in cls.lru and cls.pf.get(k) != "loading":
                cls.lru.move_to_end(k)
                if cls.pol is not None:
                    cls.pol.on_hint(k, self._ctx)
                self.pstats["hint_refreshes"] += 1

    # ------------------------------------------------------------------ control
    def release_all(self) -> None:
        self._free(self.compact)
        self.compact = None
        self.compact_bytes = 0
        self._release_unheld("control")

    def reset_stats(self) -> None:
        for cls in self.classes:
            cls.stats = new_stats()
        self.pstats = {f: 0 for f in PREFETCH_FIELDS}

    def fail_device_alloc_after(self, n: int, count: int = 1) -> None:
        self.inject_skip = n if count else 0
        self.inject_count = count

    # ------------------------------------------------------------------ inspection
    def is_resident(self, layer: int, expert: int) -> bool:
        c = self.class_of(layer)
        return (
            c is not None
            and (layer, expert) in self.classes[c].lru
            and self.classes[c].pf.get((layer, expert)) != "loading"
        )

    def resident_set(self) -> set:
        out = set()
        for layer in range(len(self.layers)):
            c = self.class_of(layer)
            if c is None:
                continue
            cls = self.classes[c]
            out.update(k for k in cls.lru if k[0] == layer and cls.pf.get(k) != "loading")
        return out

    def lru_order(self, c: int) -> list[Key]:
        """Class ``c``'s resident entries, coldest first."""
        return list(self.classes[c].lru)

    @property
    def device_bytes_in_use(self) -> int:
        return self.device_bytes

    def stats(self) -> dict[int, dict[str, dict[str, int]]]:
        """Class index (in use) -> path -> counter -> value."""
        return {cl.index: {p: dict(v) for p, v in cl.stats.items()} for cl in self.classes if cl.in_use}

    def class_infos(self) -> dict[int, dict[str, int]]:
        out = {}
        for cl in self.classes:
            if not cl.in_use:
                continue
            out[cl.index] = dict(
                key=cl.key,
                slot_bytes=cl.slot_bytes,
                target_experts=self.class_target(cl.index),
                cap_experts=cl.cap,
                allocated_experts=cl.allocated,
                resident_experts=cl.resident,
                held_experts=cl.held,
                num_layers=cl.layers,
                staging_bytes=(cl.staging_rows + cl.batch_rows) * cl.slot_bytes,
            )
        return out

    def check_invariants(self) -> None:
        """Internal consistency of the model itself."""
        for cl in self.classes:
            if not cl.in_use:
                continue
            assert 0 <= cl.resident <= cl.allocated, cl
            assert all(n > 0 for n in cl.holds.values())
            assert all(k in cl.lru for k in cl.holds), "a held entry is not resident"
            for layer, _e in cl.lru:
                assert self.class_of(layer) == cl.index
        assert self.used <= self.capacity
        assert self.device_bytes == sum(b for b, _ in self.allocs.values())
