"""The cache's counters as Python objects: per (class, path), the host pool's, the staging
ring's and prefetch's (see the expcache_*_stats_t structs of expcache.h)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class PathStats:
    """Counters of one (class, path); see expcache_stats_t. Experts are counted once per call."""

    calls: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    appends: int = 0
    direct_loads: int = 0
    bytes_h2d: int = 0
    bytes_d2d: int = 0
    releases: int = 0
    alloc_retries: int = 0
    cap_notices: int = 0
    class_reuses: int = 0

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses); 0.0 when nothing was asked."""
        asked = self.hits + self.misses
        return self.hits / asked if asked else 0.0

    def __add__(self, other: PathStats) -> PathStats:
        return PathStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


@dataclass
class ClassInfo:
    """One size class: its key, budget, cap and occupancy (see expcache_class_info_t)."""

    index: int
    gate_bytes: int
    up_bytes: int
    down_bytes: int
    slot_bytes: int
    target_experts: int
    cap_experts: int
    allocated_experts: int
    resident_experts: int
    held_experts: int
    num_layers: int
    staging_bytes: int = 0  # mapped for the bank's staging rows (misses that got no slot)
    part_bytes: tuple[int, ...] = ()  # every part's size, in order (gate, up, down for three parts)

    @property
    def key(self) -> tuple[int, ...]:
        """The class key: every part's size (``part_bytes``; the gate, up and down sizes for a
        ClassInfo made without them)."""
        return self.part_bytes or (self.gate_bytes, self.up_bytes, self.down_bytes)


@dataclass
class ClassStats:
    """A class and its counters per path, by the library's path names (``_lib.PATH_NAMES``: "decode",
    "compact", "batch", "control", "device")."""

    info: ClassInfo
    paths: dict[str, PathStats] = field(default_factory=dict)

    @property
    def total(self) -> PathStats:
        out = PathStats()
        for p in self.paths.values():
            out = out + p
        return out

    @property
    def hit_rate(self) -> float:
        return self.total.hit_rate


@dataclass
class PoolStats:
    """Counters of the host pool (``host_budget_bytes``; see expcache_pool_stats_t): the tiers a
    miss of the device cache of a pageable or file source goes through. Each such miss is a
    pool hit (``hits``: copied from RAM) or a source read (``source_reads``: a disk read, for a
    file; every such miss when there is no pool); each source read through a pool is entered
    (``inserts``), failed (``failed``: not entered) or read past it (``bypassed``). ``budget_bytes``,
    ``slot_bytes``, ``slots`` and ``resident`` are the pool as it is now."""

    budget_bytes: int = 0
    slot_bytes: int = 0
    slots: int = 0
    resident: int = 0
    hits: int = 0
    bytes_hit: int = 0
    source_reads: int = 0
    bytes_source: int = 0
    inserts: int = 0
    evictions: int = 0
    failed: int = 0
    bypassed: int = 0

    @property
    def lookups(self) -> int:
        """The device's misses of such sources: ``hits + source_reads``."""
        return self.hits + self.source_reads

    @property
    def hit_rate(self) -> float:
        """hits / lookups: the share of the device's misses the pool served; 0.0 with none."""
        return self.hits / self.lookups if self.lookups else 0.0


@dataclass
class CacheStats:
    """Counters of every class in use (the device tier: each path's hits and misses), and the
    host pool's (``pool``: the tiers below it, :class:`PoolStats`)."""

    classes: list[ClassStats]
    pool: PoolStats = field(default_factory=PoolStats)

    def path(self, name: str) -> PathStats:
        """One path summed over classes."""
        out = PathStats()
        for c in self.classes:
            out = out + c.paths[name]
        return out

    @property
    def total(self) -> PathStats:
        out = PathStats()
        for c in self.classes:
            out = out + c.total
        return out

    @property
    def hit_rate(self) -> float:
        return self.total.hit_rate


@dataclass
class StagingStats:
    """Counters of the staging ring (pageable and file sources): see expcache_staging_stats_t.
    Times in nanoseconds; the per-call and per-piece figures are derived from them."""

    calls: int = 0
    pieces: int = 0
    bytes: int = 0
    caller_fills: int = 0
    fill_ns: int = 0
    chunk_waits: int = 0
    chunk_wait_ns: int = 0
    wait_ns: int = 0
    send_ns: int = 0
    sends: int = 0
    span_ns: int = 0
    first_fill_ns: int = 0

    @property
    def pieces_per_call(self) -> float:
        return self.pieces / self.calls if self.calls else 0.0

    @property
    def fill_us_per_piece(self) -> float:
        """Filling time of one piece (a copy or pread), on whichever thread filled it."""
        return self.fill_ns / self.pieces / 1e3 if self.pieces else 0.0

    @property
    def wait_us_per_call(self) -> float:
        """Time the calling thread waited for workers' pieces, per call."""
        return self.wait_ns / self.calls / 1e3 if self.calls else 0.0

    @property
    def span_us_per_call(self) -> float:
        """From a call's first piece queued to its last piece sent."""
        return self.span_ns / self.calls / 1e3 if self.calls else 0.0

    @property
    def first_fill_us_per_call(self) -> float:
        """From a call's first piece queued to that piece filled: how long the link waits to start."""
        return self.first_fill_ns / self.calls / 1e3 if self.calls else 0.0

    @property
    def threads_filling(self) -> float:
        """Threads filling on average during a call's span (fill time over span)."""
        return self.fill_ns / self.span_ns if self.span_ns else 0.0

    @property
    def pieces_per_send(self) -> float:
        """Pieces handed to the link together (those found filled at once go as one transfer)."""
        return self.pieces / self.sends if self.sends else 0.0

    @property
    def send_us_per_piece(self) -> float:
        """Time the calling thread spent handing one piece to the link."""
        return self.send_ns / self.pieces / 1e3 if self.pieces else 0.0

    COLUMNS = (
        "pieces/call",
        "pieces/send",
        "span µs",
        "first piece µs",
        "caller wait µs",
        "threads filling",
        "fill µs/piece",
        "send µs/piece",
        "caller fills",
    )

    def columns(self) -> list[str]:
        """The figures under :attr:`COLUMNS`, as text: how `expcache bench transfer --detail` and the
        staging sweep show where staged calls spend their time (µs are per call unless per piece)."""
        return [
            f"{self.pieces_per_call:.1f}",
            f"{self.pieces_per_send:.1f}",
            f"{self.span_us_per_call:.1f}",
            f"{self.first_fill_us_per_call:.1f}",
            f"{self.wait_us_per_call:.1f}",
            f"{self.threads_filling:.1f}",
            f"{self.fill_us_per_piece:.1f}",
            f"{self.send_us_per_piece:.2f}",
            f"{100 * self.caller_fills / self.pieces:.0f} %" if self.pieces else "—",
        ]


@dataclass
class PrefetchStats:
    """Counters of prefetches and hints over the whole cache (see expcache_prefetch_stats_t):
    experts queued (``issued``), all their bytes sent before a select listed them (``used``: the
    select's hits), evicted unused (``wasted``), cancelled before all their bytes were sent
    (``cancelled``), and their bytes; ids skipped (resident or on their way) or dropped (limit
    reached, no slot); hints and those refreshed. ``late``: listed by a select while bytes of
    theirs were still queued, so the select finished them in place as misses (never ``used``);
    ``bytes_late_sent`` the part of their bytes the prefetch had sent, the rest is the misses'."""

    calls: int = 0
    issued: int = 0
    used: int = 0
    wasted: int = 0
    cancelled: int = 0
    skipped: int = 0
    dropped: int = 0
    bytes_issued: int = 0
    bytes_used: int = 0
    bytes_wasted: int = 0
    bytes_cancelled: int = 0
    bytes_sent: int = 0
    pieces: int = 0
    hints: int = 0
    hint_refreshes: int = 0
    late: int = 0
    bytes_late_sent: int = 0

    @property
    def accuracy(self) -> float:
        """used / issued: the share of queued prefetches that landed before a select used them (late
        ones not counted); 0.0 when none was issued."""
        return self.used / self.issued if self.issued else 0.0

    def __add__(self, other: PrefetchStats) -> PrefetchStats:
        return PrefetchStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})
