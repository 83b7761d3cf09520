"""Stateful fuzzing of the device lookup (host backend): random sequences of device selects
interleaved with every other call, on a ``lookup="device"`` cache and, side by side, on a
host-lookup cache of the same policy (LRU, OppClassLRU or duel, drawn per sequence) given the
same calls, a device select becoming a host ``select`` of the same ids there.

The host-lookup cache is the one ``tests/test_stateful.py`` holds against the reference model;
the device lookup runs the policy's rules as the host's policy object does, every host-side call
of the device-lookup cache in its path's mode on the device's one copy of the residency
(``docs/device_lookup.md``), so after every step they must agree on which
(layer, expert) are resident, on every hit and miss (the device path's and the host paths'
counters together against the host cache's; each device select's counts, its distinct experts and
their misses, against the host select's; a device select served by its table read exactly when
nothing missed), and the bytes behind every slot a device select
gave, every batch's pointers and every compact buffer equal the source. Layouts have one or two
size classes; budgets leave room for a step's ids (a device select of n*k ids needs n*k slots it
may fill: the rule the library checks) and sometimes not (the call must fail and change nothing).

A quarter of test_stateful.py's sequences, at least 50, of as many steps: 100 of up to 50 with
hypothesis' long profile (``make test-long``), 50 of up to 30 with the quick one (``make test``).
``EXPCACHE_FUZZ_EXAMPLES`` and ``EXPCACHE_FUZZ_STEPS`` run it longer, as for test_stateful.py.
"""

from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule  # noqa: E402
from test_stateful import FUZZ_EXAMPLES, FUZZ_STEPS, fuzz_settings  # noqa: E402

from pyexpcache import ExpertCache, HostSource, InvalidArgumentError, LayerSpec, ModelLayout, testing  # noqa: E402

from support.cache import assert_served, bank_rows  # noqa: E402

LAYOUTS = {
    "one class": ModelLayout((LayerSpec(10, 512, 512, 768),) * 3, name="one"),
    "two classes": ModelLayout(
        (LayerSpec(8, 512, 512, 768), None, LayerSpec(12, 1024, 1024, 256), LayerSpec(8, 512, 512, 768)), name="two"
    ),
}
_SOURCES = {name: HostSource(layout, pinned=True) for name, layout in LAYOUTS.items()}  # read by device selects
COUNTED = ("hits", "misses", "evictions")
POLICIES = ("lru", "oppclass", "duel")


class DeviceLookupMachine(RuleBasedStateMachine):
    """A device-lookup cache and a host-lookup cache of the same policy driven by the same calls."""

    def __init__(self):
        super().__init__()
        self.dev = self.host = None

    @initialize(name=st.sampled_from(sorted(LAYOUTS)), experts=st.integers(3, 9), policy=st.sampled_from(POLICIES))
    def setup(self, name, experts, policy):
        self.layout = LAYOUTS[name]
        self.source = _SOURCES[name]
        kw = dict(budget_experts=experts, backend="host", log_level=0, policy=policy)
        self.dev = ExpertCache(self.layout, self.source, lookup="device", **kw)
        self.host = ExpertCache(self.layout, self.source, **kw)
        self.cap = experts
        self.batches = []  # (device cache's batch, host cache's batch)
        self.device_slots = []  # (layer, ids, slots) of the latest device select, re-checked each step

    def teardown(self):
        for cache in (self.dev, self.host):
            if cache is not None:
                cache.close()

    def ids(self, data, layer, most):
        n = self.layout[layer].num_experts
        return data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=most))

    def host_misses(self):
        return sum(c.paths["decode"].misses for c in self.host.stats().classes)

    def held(self, layer):
        index = self.dev.bind_class(layer)
        return next(c.held_experts for c in self.dev.classes() if c.index == index)

    @rule(data=st.data(), rows=st.integers(1, 3))
    def select_device(self, data, rows):
        layer = data.draw(st.sampled_from(self.layout.moe_layers))
        k = data.draw(st.integers(1, 4))
        n = self.layout[layer].num_experts
        ids = np.array(
            data.draw(st.lists(st.lists(st.integers(0, n - 1), min_size=k, max_size=k), min_size=rows, max_size=rows)),
            dtype=np.int64,
        )
        room = self.cap - self.held(layer)
        if ids.size > room:
            before = self.dev.classes()
            with pytest.raises(InvalidArgumentError, match="needs as many slots"):
                self.dev.select_device(layer, ids)
            assert self.dev.classes() == before
            return
        counts = np.full(2, -1, dtype=np.int32)
        missed = self.host_misses()
        reads = testing.table_reads(self.dev, layer)
        slots = self.dev.select_device(layer, ids, counts=counts)
        self.host.select(layer, ids.ravel())
        # The step's counts: its distinct experts, and those the host-lookup cache missed.
        assert list(counts) == [len(set(ids.ravel().tolist())), self.host_misses() - missed]
        # Served by its table read exactly when nothing missed (docs/device_lookup.md).
        assert testing.table_reads(self.dev, layer) - reads == (counts[1] == 0)
        self.device_slots = [(layer, ids.ravel().tolist(), slots.ravel().tolist())]

    @rule(data=st.data())
    def select(self, data):
        layer = data.draw(st.sampled_from(self.layout.moe_layers))
        ids = self.ids(data, layer, 5)
        if len(set(ids)) > self.cap - self.held(layer):
            return  # the host cache would serve the overflow from staging: not comparable
        ptrs = self.dev.select(layer, ids)
        self.host.select(layer, ids)
        assert_served(self.dev, self.source, layer, ids, ptrs)
        self.device_slots = []  # the next serving call may move them

    @rule(data=st.data())
    def prepare_batch(self, data):
        layer = data.draw(st.sampled_from(self.layout.moe_layers))
        ids = np.array([self.ids(data, layer, 3)[:1] * 2 for _ in range(2)], dtype=np.int64)
        if len(self.batches) >= 3:
            return
        pair = (self.dev.prepare_batch(layer, ids), self.host.prepare_batch(layer, ids))
        assert list(pair[0].ids) == list(pair[1].ids)
        self.batches.append((layer, pair))
        self.device_slots = []

    @rule(data=st.data())
    def finish_batch(self, data):
        if not self.batches:
            return
        i = data.draw(st.integers(0, len(self.batches) - 1))
        _, (a, b) = self.batches.pop(i)
        a.finish()
        b.finish()

    @rule(data=st.data())
    def load_compact(self, data):
        layer = data.draw(st.sampled_from(self.layout.moe_layers))
        ids = self.ids(data, layer, 4)
        buf = self.dev.load_compact(layer, ids)
        self.host.load_compact(layer, ids)
        assert_served(self.dev, self.source, layer, ids, buf.pointers())
        self.device_slots = []

    @rule()
    def release_all(self):
        self.dev.release_all()
        self.host.release_all()
        self.device_slots = []

    @rule()
    def reset_stats(self):
        self.dev.reset_stats()
        self.host.reset_stats()

    @invariant()
    def same_cache(self):
        if self.dev is None:
            return
        for layer, ids, slots in self.device_slots:  # still valid: no serving call since
            assert_served(self.dev, self.source, layer, ids, bank_rows(self.dev.bank(layer), slots))
        for layer, (a, _) in self.batches:
            assert_served(self.dev, self.source, layer, a.ids, a.pointers)
        for layer in self.layout.moe_layers:
            for e in range(self.layout[layer].num_experts):
                got = testing.read_expert(self.dev, layer, e)
                want = testing.read_expert(self.host, layer, e)
                assert (got is None) == (want is None), f"({layer}, {e}) resident in one cache only"
                if got is not None:
                    assert (got == self.source.expert_bytes(layer, e)).all()
        dev, host = self.dev.stats(), self.host.stats()
        for field in COUNTED:
            got = sum(
                getattr(p, field)
                for c in dev.classes
                for name, p in c.paths.items()
                if name in ("device", "decode", "compact", "batch")
            )
            want = sum(
                getattr(p, field)
                for c in host.classes
                for name, p in c.paths.items()
                if name in ("decode", "compact", "batch")
            )
            assert got == want, f"{field}: device-lookup cache {got}, host-lookup cache {want}"


DeviceLookupMachine.TestCase.settings = fuzz_settings(max(FUZZ_EXAMPLES // 4, 50), FUZZ_STEPS)
TestDeviceLookupMatchesHostLookup = pytest.mark.fuzz(DeviceLookupMachine.TestCase)
