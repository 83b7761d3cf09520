"""Stateful fuzzing: random call sequences through libexpcache (host backend) and
the pure-Python reference model (``tests/support/reference_model.py``) side by side.

Each hypothesis example builds one cache over a small layout (2-4 size classes,
including the DeepSeek q2/q4 "mixed" shape scaled down, 4-8 experts per layer,
sometimes a dense layer), with random budgets (experts, bytes or both), a
max_classes sometimes smaller than the number of classes, sometimes a tight
emulated device capacity and reserve, and sometimes small slabs. It then runs a
random sequence of select / prepare_batch / batch finish / load_compact /
prefetch / hint / release_all / fail_device_alloc_after / reset_stats calls (plus
the odd invalid call) on both, and after every step compares:

* prefetch made certain: in half the examples the prefetch thread is paused (every
  prefetch stays queued until the next serving call or release cancels it), in the
  others each prefetch is drained at once (every byte sent);
* the raised exception type (library status vs model status), or success; on
  failure of a select made through the raw ABI, that its out-pointers are untouched;
* that hits are served in place (at the address the expert was loaded to), newly
  cached experts in a slot no other resident expert has, direct loads outside
  the slots, duplicates at one address;
* the bytes behind every served pointer (select, batch, compact), and the
  pointers of every unfinished batch and of the live compact buffer again after
  each later step (held slots must never be overwritten);
* which (layer, expert) are resident (``testing.read_expert`` is not None) and that
  their bytes equal the source;
* every counter of every class and path (``cache.stats()``) and of prefetch and hints
  (``cache.prefetch_stats()``, all but the piece count), the class infos
  (key, target, cap, allocated, resident, held, layers), device bytes in use.

Runs, derandomized so CI is reproducible, take their counts from hypothesis'
profile (tests/conftest.py): ``make test`` (the quick profile) runs 100 sequences of
up to 30 steps, a few seconds; ``make test-long`` (``--hypothesis-profile=long``)
``max_examples=400`` sequences of up to ``stateful_step_count=50`` steps. Measured
for the long run: about 430 sequences and 16,000 steps (37 per sequence on average;
each step also runs the full comparison), about 15-30 s on 2 cores. Fuzzing with 4,000 fresh random sequences
of up to 80 steps (about 6 minutes) found no divergence either.
Run longer and with fresh randomness with e.g.::

    EXPCACHE_FUZZ_EXAMPLES=5000 EXPCACHE_FUZZ_STEPS=80 python -m pytest tests/test_stateful.py -q
"""

from __future__ import annotations

import os

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, settings, strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule  # noqa: E402

from pyexpcache import ExpcacheError, ExpertCache, HostSource, LayerSpec, ModelLayout, testing  # noqa: E402
from pyexpcache._lib import PREFETCH_FIELDS, lib  # noqa: E402

from support.cache import POLICIES, SCALE, assert_served, bank_rows  # noqa: E402
from support.reference_model import DENSE, INVALID_STATE, PATHS, STAT_FIELDS, ModelError, ReferenceCache, align_up  # noqa: E402

# The hypothesis profile's counts (quick or long), unless the environment asks for a longer run.
FUZZ_EXAMPLES = int(os.environ.get("EXPCACHE_FUZZ_EXAMPLES", settings.default.max_examples))
FUZZ_STEPS = int(os.environ.get("EXPCACHE_FUZZ_STEPS", settings.default.stateful_step_count))
FUZZ_RANDOM = "EXPCACHE_FUZZ_EXAMPLES" in os.environ  # fresh randomness when asked to run longer


def _mixed_small() -> ModelLayout:
    """DeepSeek V4 Flash "mixed" (q2 and q4) scaled by SCALE, 6 layers of 6 experts."""
    base = ModelLayout.preset("mixed", scale=SCALE)
    q2, q4 = base[0], base[40]
    specs = [q2, q2, q4, q2, q4, q2]
    return ModelLayout(tuple(LayerSpec(6, *s.class_key) for s in specs), name="mixed-small")


def _mixed_uneven() -> ModelLayout:
    """q2/q4 with different expert counts per class, and a dense layer (never registered)."""
    base = ModelLayout.preset("mixed", scale=SCALE)
    q2, q4 = base[0].class_key, base[40].class_key
    return ModelLayout(
        (None, LayerSpec(8, *q2), LayerSpec(4, *q4), LayerSpec(8, *q2), LayerSpec(4, *q4)), name="mixed-uneven"
    )


def _three() -> ModelLayout:
    return ModelLayout(
        (
            LayerSpec(6, 512, 512, 640),
            LayerSpec(6, 1024, 1024, 1024),
            LayerSpec(6, 264, 264, 336),
            LayerSpec(6, 512, 512, 640),
        ),
        name="three",
    )


def _four_odd() -> ModelLayout:
    """Four classes with unaligned part sizes (tails, 256-byte rounding)."""
    return ModelLayout(
        (
            LayerSpec(5, 520, 1000, 333),
            LayerSpec(5, 256, 256, 256),
            LayerSpec(5, 100, 200, 300),
            LayerSpec(5, 520, 1000, 333),
            LayerSpec(5, 264, 264, 336),
        ),
        name="four-odd",
    )


LAYOUTS = {f.__name__: f() for f in (_mixed_small, _mixed_uneven, _three, _four_odd)}
_SOURCES: dict = {}


def source_for(name: str) -> HostSource:
    """One read-only source per layout, shared by every example (sources outlive caches)."""
    if name not in _SOURCES:
        _SOURCES[name] = HostSource(LAYOUTS[name])
    return _SOURCES[name]


def total_slot_bytes(layout: ModelLayout) -> int:
    return sum(s.num_experts * sum(align_up(b) for b in s.class_key) for s in layout.layers if s)


def max_slot_bytes(layout: ModelLayout) -> int:
    return max(sum(align_up(b) for b in s.class_key) for s in layout.layers if s)


@st.composite
def configs(draw):
    name = draw(st.sampled_from(sorted(LAYOUTS)))
    layout = LAYOUTS[name]
    slot = max_slot_bytes(layout)
    kw = {}
    budget = draw(st.sampled_from(["experts", "bytes", "both"]))
    if budget in ("experts", "both"):
        kw["budget_experts"] = draw(st.integers(1, 7))
    if budget in ("bytes", "both"):
        frac = draw(st.sampled_from([0.05, 0.1, 0.2, 0.35, 0.6, 1.0]))
        kw["budget_bytes"] = max(1, int(total_slot_bytes(layout) * frac)) + draw(st.integers(0, 255))
    nclasses = len(layout.classes())
    kw["max_classes"] = draw(st.integers(1, nclasses + 1))
    if draw(st.booleans()):  # tight emulated device: a handful of slots, a small reserve
        kw["device_capacity_bytes"] = draw(st.integers(1, 14)) * slot + 256 * draw(st.integers(0, 7))
        kw["reserve_bytes"] = draw(st.sampled_from([0, 0, 256, slot, 2 * slot + 100]))
    else:
        kw["reserve_bytes"] = draw(st.sampled_from([None, 0]))
    if draw(st.booleans()):
        kw["slab_bytes"] = draw(st.integers(1, 3 * slot))
    kw["policy"] = draw(st.sampled_from(POLICIES))
    return name, {k: v for k, v in kw.items() if v is not None}


_SENTINEL = np.uint64(0xA5A5A5A5A5A5A5A5)


def raw_select(cache, layer, ids):
    """expcache_select_async through the raw ABI; on failure the out-pointers must be untouched."""
    k = len(ids)
    ids_buf = np.zeros(max(k, 1), dtype=np.uint32)
    ids_buf[:k] = ids
    out = np.full((max(k, 1), 3), _SENTINEL, dtype=np.uint64)
    try:
        lib.expcache_select_async(cache._handle, layer, ids_buf.ctypes.data, k, None, out.ctypes.data)
    except ExpcacheError:
        assert (out == _SENTINEL).all(), "a failed select wrote its out-pointers"
        raise
    return out[:k]


def _status(exc: BaseException) -> str:
    if isinstance(exc, ModelError):
        return exc.status
    if isinstance(exc, ExpcacheError):
        return exc.status_name.replace("EXPCACHE_ERR_", "")
    return type(exc).__name__


def assert_cache_matches_model(cache, model, source, where: str = "") -> set:
    """The library's cache and the reference model agree: the model's own invariants, which
    (layer, expert) are resident and their bytes, the class infos, every counter of every class and
    path, the prefetch and hint counters (all but the piece count) and device bytes in use.
    ``where`` prefixes the messages. Returns the resident (layer, expert) pairs."""
    model.check_invariants()
    layout = cache.layout
    resident = set()
    for layer in layout.moe_layers:
        for e in range(layout[layer].num_experts):
            got = testing.read_expert(cache, layer, e)
            want = model.is_resident(layer, e)
            assert (got is not None) == want, (
                f"{where}layer {layer} expert {e}: library resident={got is not None}, model resident={want}"
            )
            if got is not None:
                assert (got == source.expert_bytes(layer, e)).all(), f"{where}({layer}, {e}) corrupted"
                resident.add((layer, e))
    infos = {c.index: c for c in cache.classes()}
    m_infos = model.class_infos()
    assert sorted(infos) == sorted(m_infos), f"{where}classes in use: library {sorted(infos)}, model {sorted(m_infos)}"
    for i, info in infos.items():
        got = dict(
            key=info.key,
            slot_bytes=info.slot_bytes,
            target_experts=info.target_experts,
            cap_experts=info.cap_experts,
            allocated_experts=info.allocated_experts,
            resident_experts=info.resident_experts,
            held_experts=info.held_experts,
            num_layers=info.num_layers,
            staging_bytes=info.staging_bytes,
        )
        assert got == m_infos[i], f"{where}class {i}: library {got}, model {m_infos[i]}"
    m_stats = model.stats()
    for c in cache.stats().classes:
        for p in PATHS:
            got = {f: getattr(c.paths[p], f) for f in STAT_FIELDS}
            want = m_stats[c.info.index][p]
            assert got == want, f"{where}class {c.info.index} path {p}: library {got}, model {want}"
    got = {f: getattr(cache.prefetch_stats(), f) for f in PREFETCH_FIELDS if f != "pieces"}
    want = {f: v for f, v in model.pstats.items() if f != "pieces"}
    assert got == want, f"{where}prefetch: library {got}, model {want}"
    assert testing.device_bytes_in_use(cache) == model.device_bytes_in_use, f"{where}device bytes in use"
    return resident


class CacheMachine(RuleBasedStateMachine):
    """The library and the model driven by the same calls."""

    def __init__(self):
        super().__init__()
        self.cache = None
        self.model = None

    @initialize(cfg=configs(), paused=st.booleans(), limit=st.sampled_from([1, 3, 8]))
    def setup(self, cfg, paused, limit):
        name, kw = cfg
        self.layout = LAYOUTS[name]
        self.source = source_for(name)
        self.kw = kw
        self.paused = paused
        self.cache = ExpertCache(
            self.layout, self.source, backend="host", log_level=0, prefetch_max_per_layer=limit, **kw
        )
        if paused:
            testing.pause_prefetch(self.cache)
        self.model = ReferenceCache(self.layout, prefetch_max_per_layer=limit, **kw)
        self.batches = []  # (Batch, model handle)
        self.compact = None  # (layer, ids, CompactBuffer) while valid
        self.moe_layers = self.layout.moe_layers
        self.addr = {}  # (layer, expert) -> slot addresses, while resident (as far as seen)

    def teardown(self):
        if self.cache is not None:
            self.cache.close()

    # -- helpers ---------------------------------------------------------------
    def both(self, model_call, lib_call):
        """Run the call on both; the outcome (success or status) must agree."""
        m_exc = l_exc = None
        m_out = l_out = None
        try:
            m_out = model_call()
        except ModelError as e:
            m_exc = e
        try:
            l_out = lib_call()
        except (ExpcacheError, ValueError) as e:  # ValueError: the wrapper's own refusals (a dense layer)
            l_exc = e
        m_s = None if m_exc is None else _status(m_exc)
        l_s = None if l_exc is None else _status(l_exc)
        assert m_s == l_s, f"model: {m_exc!r}, library: {l_exc!r}"
        if m_exc is not None:
            self.addr.clear()  # a failed call may have moved experts without telling where
        return m_exc is None, m_out, l_out

    def draw_layer(self, data):
        if data.draw(st.integers(0, 30)) == 0:  # now and then a dense or out-of-range layer
            return data.draw(
                st.sampled_from(
                    [self.layout.num_layers, self.layout.num_layers + 5]
                    + [i for i, s in enumerate(self.layout.layers) if s is None]
                )
            )
        return data.draw(st.sampled_from(self.moe_layers))

    def draw_ids(self, data, layer, max_len):
        spec = self.layout[layer] if 0 <= layer < self.layout.num_layers else None
        n = spec.num_experts if spec else 4
        roll = data.draw(st.integers(0, 40))
        if roll == 0:
            return []
        ids = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=max_len))
        if roll == 1:
            ids = ids + [n + data.draw(st.integers(0, 3))]  # out of range
        return ids

    # -- rules -----------------------------------------------------------------
    def check_addresses(self, layer, where, rows):
        """Hits are served in place (the address the expert got when it was loaded), a newly
        cached expert gets a slot no other resident expert has, direct loads are not slots."""
        resident = self.model.resident_set()
        loaded = {(layer, e) for e, kind in where.items() if kind == "slot"}  # old addresses are stale
        self.addr = {k: v for k, v in self.addr.items() if k in resident and k not in loaded}
        for e, kind in where.items():
            row = tuple(rows[e])
            k = (layer, e)
            if kind == "hit":
                if k in self.addr:
                    assert self.addr[k] == row, f"hit ({layer}, {e}) served from {row}, loaded at {self.addr[k]}"
            else:
                others = {v: o for o, v in self.addr.items() if o != k}
                assert row not in others, f"({layer}, {e}) {kind} served from the slot of {others.get(row)}"
            if kind in ("hit", "slot"):
                self.addr[k] = row
            else:
                self.addr.pop(k, None)

    @rule(data=st.data(), how=st.sampled_from(["python", "raw", "slots"]))
    def select(self, data, how):
        """select, through the wrapper or the raw ABI, or select_slots (the rows' addresses in the
        class's bank are its pointers): the model's select either way."""
        layer = self.draw_layer(data)
        ids = self.draw_ids(data, layer, 7)
        raw = how == "raw"

        def by_slots():
            slots = self.cache.select_slots(layer, np.array(ids, dtype=np.int64))
            return np.array(bank_rows(self.cache.bank(layer), slots), dtype=np.uint64).reshape(len(ids), 3)

        call = {
            "raw": lambda: raw_select(self.cache, layer, ids),
            "python": lambda: self.cache.select(layer, np.array(ids, dtype=np.int64)),
            "slots": by_slots,
        }[how]

        def model_call():
            try:
                return self.model.select(layer, ids)
            except ModelError as e:  # the raw ABI has no wrapper: a dense layer is one never registered
                if raw and e.status == DENSE:
                    raise ModelError(INVALID_STATE, str(e)) from None
                raise

        ok, where, ptrs = self.both(model_call, call)
        if ok:
            assert ptrs.shape == (len(ids), 3)
            assert_served(self.cache, self.source, layer, ids, ptrs)
            # Duplicates share addresses; distinct experts never do.
            first = {}
            for e, row in zip(ids, ptrs.tolist()):
                assert first.setdefault(e, row) == row
            assert len({tuple(r) for r in first.values()}) == len(first)
            self.check_addresses(layer, where, first)

    @rule(data=st.data())
    def load_compact(self, data):
        layer = self.draw_layer(data)
        ids = self.draw_ids(data, layer, 7)
        # Any load_compact call (even a failing one) may free the previous buffer.
        self.compact = None
        ok, _, buf = self.both(
            lambda: self.model.load_compact(layer, ids),
            lambda: self.cache.load_compact(layer, np.array(ids, dtype=np.int64)),
        )
        if ok:
            spec = self.layout[layer]
            assert buf.num_experts == len(ids)
            assert (buf.gate_bytes, buf.up_bytes, buf.down_bytes) == spec.class_key
            assert buf.up_offset >= len(ids) * spec.gate_bytes
            assert buf.down_offset >= buf.up_offset + len(ids) * spec.up_bytes
            assert buf.nbytes == buf.down_offset + len(ids) * spec.down_bytes
            assert_served(self.cache, self.source, layer, ids, buf.pointers())
            self.compact = (layer, ids, buf)

    @rule(data=st.data())
    def prepare_batch(self, data):
        """A batch by address, or by slot id (its staged experts in the class's batch rows, every
        row below the bank's rows and each staged one at or past its cap)."""
        layer = self.draw_layer(data)
        tokens = data.draw(st.integers(1, 4))
        rows = [self.draw_ids(data, layer, 3) for _ in range(tokens)]
        flat = [e for r in rows for e in r]
        slots = data.draw(st.booleans())
        ok, m_out, batch = self.both(
            lambda: self.model.prepare_batch(layer, flat, slots=slots),
            lambda: self.cache.prepare_batch(layer, np.array(flat, dtype=np.int64), slots=slots),
        )
        if ok:
            handle, unique, where = m_out
            assert batch.ids.tolist() == unique
            assert batch.handle == handle
            if slots:
                bank = self.cache.bank(layer)
                for e, row in zip(unique, batch.slots.tolist()):
                    assert 0 <= row < bank.rows and (where[e] == "direct") == (row >= bank.cap), (e, row)
            assert_served(self.cache, self.source, layer, batch.ids, batch.pointers)
            assert len({tuple(r) for r in batch.pointers.tolist()}) == len(unique)
            self.check_addresses(layer, where, dict(zip(unique, batch.pointers.tolist())))
            self.batches.append((batch, handle))

    @precondition(lambda self: self.batches)
    @rule(data=st.data())
    def finish_batch(self, data):
        i = data.draw(st.integers(0, len(self.batches) - 1))
        batch, handle = self.batches.pop(i)
        self.both(lambda: self.model.finish_batch(handle), lambda: batch.finish())
        assert batch.finished

    @rule(handle=st.integers(0, 3))
    def finish_unknown_batch(self, handle):
        live = {h for _, h in self.batches}
        h = self.model.next_batch + handle if handle else 0
        if h in live:
            return
        self.both(lambda: self.model.finish_batch(h), lambda: lib.expcache_batch_finish(self.cache._handle, h, None))

    @rule(data=st.data())
    def prefetch(self, data):
        layer = self.draw_layer(data)
        ids = self.draw_ids(data, layer, 7)

        def lib_call():
            queued = self.cache.prefetch(layer, np.array(ids, dtype=np.int64))
            if not self.paused:
                self.cache.wait_prefetch()
            return queued

        ok, m_queued, l_queued = self.both(lambda: self.model.prefetch(layer, ids, lands=not self.paused), lib_call)
        if ok:
            assert l_queued == m_queued, (
                f"prefetch({layer}, {ids}) queued: library {l_queued}, model {m_queued}; "
                f"library {self.cache.prefetch_stats()}, model {self.model.pstats}; "
                f"model resident {sorted(self.model.resident_set())}"
            )

    @rule(data=st.data())
    def hint(self, data):
        layer = self.draw_layer(data)
        ids = self.draw_ids(data, layer, 7)
        self.both(lambda: self.model.hint(layer, ids), lambda: self.cache.hint(layer, np.array(ids, dtype=np.int64)))

    @rule()
    def release_all(self):
        self.compact = None
        self.addr.clear()
        self.both(self.model.release_all, self.cache.release_all)

    @rule(n=st.integers(0, 4), count=st.integers(0, 3))
    def inject(self, n, count):
        self.both(
            lambda: self.model.fail_device_alloc_after(n, count),
            lambda: testing.fail_device_alloc_after(self.cache, n, count),
        )

    @rule()
    def reset_stats(self):
        self.both(self.model.reset_stats, self.cache.reset_stats)

    # -- invariants ------------------------------------------------------------
    @invariant()
    def same_state(self):
        if self.cache is None:
            return
        assert_cache_matches_model(self.cache, self.model, self.source)
        # Unfinished batches still hold their bytes; so does the live compact buffer.
        for batch, _ in self.batches:
            assert_served(self.cache, self.source, batch.layer, batch.ids, batch.pointers)
        if self.compact is not None:
            layer, ids, buf = self.compact
            assert_served(self.cache, self.source, layer, ids, buf.pointers())


def fuzz_settings(examples: int, steps: int):
    """The machines' hypothesis settings: derandomized unless asked to run longer, no deadline."""
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        derandomize=not FUZZ_RANDOM,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    )


CacheMachine.TestCase.settings = fuzz_settings(FUZZ_EXAMPLES, FUZZ_STEPS)
TestCacheMatchesModel = pytest.mark.fuzz(CacheMachine.TestCase)


# ---------------------------------------------------------------------------
# Directed checks of the model itself (fast; they pin the documented semantics
# the machine relies on, independently of the library).


def test_model_lru_and_batch_semantics():
    # LRU's victim order and recency list: the model pinned to policy="lru", whatever its default.
    layout = ModelLayout((LayerSpec(16, 512, 512, 640),))
    m = ReferenceCache(layout, budget_experts=3, policy="lru")
    m.select(0, [0, 1, 2])
    m.select(0, [0])
    m.select(0, [3])  # evicts 1
    assert m.resident_set() == {(0, 0), (0, 2), (0, 3)}
    assert m.lru_order(0) == [(0, 2), (0, 0), (0, 3)]
    m2 = ReferenceCache(layout, budget_experts=4, policy="lru")
    m2.select(0, [0, 1])
    h, unique, where = m2.prepare_batch(0, [0, 2, 3, 4, 5, 2])
    assert unique == [0, 2, 3, 4, 5]
    assert where == {0: "hit", 2: "slot", 3: "slot", 4: "direct", 5: "direct"}
    assert m2.lru_order(0) == [(0, 3), (0, 2), (0, 0), (0, 1)]  # appends coldest, hits keep recency
    st_ = m2.stats()[0]["batch"]
    assert (st_["hits"], st_["misses"], st_["appends"], st_["direct_loads"]) == (1, 4, 2, 2)
    # Held entries and entries of the same call are never evicted.
    where = m2.select(0, [6, 7, 8])
    assert where == {6: "slot", 7: "direct", 8: "direct"}  # only 1 was evictable
    m2.finish_batch(h)
    assert m2.select(0, [9]) == {9: "slot"}


def test_model_compact_retry_and_budget_share():
    layout = ModelLayout.preset("mixed", scale=SCALE)
    m = ReferenceCache(layout, budget_bytes=layout.total_bytes // 10)
    m.select(0, [1])
    m.select(40, [1])
    t = {c: m.class_target(c) for c in m.stats()}
    assert t[0] / (37 * 256) == pytest.approx(t[1] / (6 * 256), abs=2 / (6 * 256))
    m.fail_device_alloc_after(0, 1)
    assert m.load_compact(0, [1, 2]) == {1: "direct", 2: "direct"}  # released, then retried
    st_ = m.stats()[0]["compact"]
    assert st_["alloc_retries"] == 1 and st_["releases"] == 1 and m.stats()[1]["compact"]["releases"] == 1
    m.select(0, [1])
    m.fail_device_alloc_after(0, 2)
    with pytest.raises(ModelError, match="OUT_OF_DEVICE_MEMORY"):
        m.load_compact(0, [3] * 100)
