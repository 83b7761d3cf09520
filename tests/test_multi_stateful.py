"""Stateful fuzzing with a devices axis: random call sequences through a MultiDeviceCache of 1-3
emulated devices (host backend) and one reference model per device (``tests/support/
reference_model.py``), each model given exactly its device's share of every call.

Each example draws a layout, budgets and limits as ``tests/test_stateful.py`` does (each device
gets the same per-device budget), a device count and a placement (round-robin, balanced by random
loads, or explicit random owners). It then runs select / prepare_batch / batch finish /
load_compact / prefetch (drained at once) / hint / release_all / fail_device_alloc_after /
reset_stats calls and after every step compares, per device: residency and resident bytes (an
expert is only ever resident on its owner), every counter of every class and path, the prefetch
counters, the class infos and device bytes in use; and after every serving call, that each id was
served by its owner with the source's bytes. Half the examples run the owners in parallel. A
device's failure stops the call there, on both sides (the devices before it keep what they did),
or in parallel every owner's share runs and the first failure in device order is the call's, as
the multi-device cache documents.

Runs 3/10 of the sequences of hypothesis' profile, each 3/5 of its steps: with the long profile
(``make test-long``) 120 sequences of up to 30 steps (a few seconds), with the quick one (``make
test``) 30 of up to 18; ``EXPCACHE_FUZZ_EXAMPLES`` and ``EXPCACHE_FUZZ_STEPS`` set the counts as for
test_stateful.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule  # noqa: E402
from test_stateful import LAYOUTS, _status, assert_cache_matches_model, configs, fuzz_settings, source_for  # noqa: E402

from pyexpcache import ExpcacheError, MultiDeviceCache, Placement, testing  # noqa: E402

from support.cache import assert_served  # noqa: E402
from support.reference_model import ModelError, ReferenceCache  # noqa: E402

EXAMPLES = int(os.environ.get("EXPCACHE_FUZZ_EXAMPLES", hypothesis.settings.default.max_examples * 3 // 10))
STEPS = int(os.environ.get("EXPCACHE_FUZZ_STEPS", hypothesis.settings.default.stateful_step_count * 3 // 5))


@st.composite
def placements(draw, layout, n):
    kind = draw(st.sampled_from(["round-robin", "balanced", "explicit"]))
    if kind == "round-robin":
        return Placement.round_robin(layout, n)
    per_layer = [
        None
        if s is None
        else draw(
            st.lists(st.integers(0, 9 if kind == "balanced" else n - 1), min_size=s.num_experts, max_size=s.num_experts)
        )
        for s in layout.layers
    ]
    if kind == "balanced":
        return Placement.balanced(layout, n, per_layer)
    return Placement.explicit(layout, n, per_layer)


class MultiMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.multi = None

    @initialize(cfg=configs(), n=st.integers(1, 3), parallel=st.booleans(), data=st.data())
    def setup(self, cfg, n, parallel, data):
        name, kw = cfg
        self.layout = LAYOUTS[name]
        self.source = source_for(name)
        self.n = n
        self.placement = data.draw(placements(self.layout, n))
        self.multi = MultiDeviceCache(
            self.layout,
            self.source,
            devices=list(range(n)),
            placement=self.placement,
            backend="host",
            log_level=0,
            parallel=parallel,
            **kw,
        )
        self.models = [ReferenceCache(self.layout, **kw) for _ in range(n)]
        self.batches = []  # (DeviceBatch, model handles per device)
        self.moe_layers = self.layout.moe_layers

    def teardown(self):
        if self.multi is not None:
            self.multi.close()

    # -- helpers ---------------------------------------------------------------
    def shares(self, layer, ids):
        own = self.placement.owners[layer][np.asarray(ids, dtype=np.int64)]
        return [[e for e, o in zip(ids, own.tolist()) if o == d] for d in range(self.n)]

    def both(self, layer, ids, model_call, multi_call):
        """Each device's model gets its share, in device order, until one fails (in parallel: every
        share, the first failure counting); the multi-device cache gets the whole call. The
        outcome must agree; returns (ok, model outputs, output)."""
        m_exc, m_out = None, [None] * self.n
        for d, share in enumerate(self.shares(layer, ids)):
            if share:
                try:
                    m_out[d] = model_call(self.models[d], share)
                except ModelError as exc:
                    m_exc = m_exc or exc
                    if not self.multi.parallel:
                        break
        l_exc = out = None
        try:
            out = multi_call()
        except ExpcacheError as exc:
            l_exc = exc
        m_s = None if m_exc is None else _status(m_exc)
        l_s = None if l_exc is None else _status(l_exc)
        assert m_s == l_s, f"models: {m_exc!r}, multi-device cache: {l_exc!r}"
        return m_exc is None, m_out, out

    def draw_call(self, data, max_len):
        layer = data.draw(st.sampled_from(self.moe_layers))
        n = self.layout[layer].num_experts
        return layer, data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=max_len))

    # -- rules -----------------------------------------------------------------
    @rule(data=st.data())
    def select(self, data):
        layer, ids = self.draw_call(data, 7)
        ok, _, sel = self.both(
            layer, ids, lambda m, share: m.select(layer, share), lambda: self.multi.select(layer, np.array(ids))
        )
        if ok:
            want = self.placement.owners[layer][ids]
            assert sel.owners.tolist() == want.tolist()
            for d in range(self.n):
                mine = sel.owners == d
                assert_served(self.multi.caches[d], self.source, layer, np.array(ids)[mine], sel.pointers[mine])

    @rule(data=st.data())
    def load_compact(self, data):
        layer, ids = self.draw_call(data, 7)
        ok, _, parts = self.both(
            layer,
            ids,
            lambda m, share: m.load_compact(layer, share),
            lambda: self.multi.load_compact(layer, np.array(ids)),
        )
        if ok:
            for d, part in enumerate(parts):
                if part is not None:
                    pos, buf = part
                    assert_served(self.multi.caches[d], self.source, layer, np.array(ids)[pos], buf.pointers())

    @rule(data=st.data())
    def prepare_batch(self, data):
        layer, ids = self.draw_call(data, 9)
        handles = [None] * self.n

        def model_call(m, share):
            d = self.models.index(m)
            handle, unique, _ = m.prepare_batch(layer, share)
            handles[d] = handle
            return unique

        ok, uniques, batch = self.both(layer, ids, model_call, lambda: self.multi.prepare_batch(layer, np.array(ids)))
        if not ok:
            # The multi-device cache finished the batches of the devices before the failing one.
            for d, h in enumerate(handles):
                if h is not None:
                    self.models[d].finish_batch(h)
            return
        for d, b in enumerate(batch.batches):
            assert (b is None) == (uniques[d] is None)
            if b is not None:
                assert b.ids.tolist() == uniques[d] and b.handle == handles[d]
                assert_served(self.multi.caches[d], self.source, layer, b.ids, b.pointers)
        self.batches.append((batch, handles))

    @precondition(lambda self: self.batches)
    @rule(data=st.data())
    def finish_batch(self, data):
        batch, handles = self.batches.pop(data.draw(st.integers(0, len(self.batches) - 1)))
        for d, h in enumerate(handles):
            if h is not None:
                self.models[d].finish_batch(h)
        batch.finish()

    @rule(data=st.data())
    def prefetch(self, data):
        layer, ids = self.draw_call(data, 7)

        def multi_call():
            # Drained even when a device fails: the devices before it keep their queued
            # prefetches, which land in the background (the models' land at once).
            try:
                return self.multi.prefetch(layer, np.array(ids))
            finally:
                self.multi.wait_prefetch()

        ok, m_queued, l_queued = self.both(
            layer, ids, lambda m, share: m.prefetch(layer, share, lands=True), multi_call
        )
        if ok:
            assert l_queued == sum(q for q in m_queued if q is not None)

    @rule(data=st.data())
    def hint(self, data):
        layer, ids = self.draw_call(data, 7)
        self.both(layer, ids, lambda m, share: m.hint(layer, share), lambda: self.multi.hint(layer, np.array(ids)))

    @rule()
    def release_all(self):
        for m in self.models:
            m.release_all()
        self.multi.release_all()

    @rule(d=st.integers(0, 2), n=st.integers(0, 4), count=st.integers(0, 3))
    def inject(self, d, n, count):
        d %= self.n
        self.models[d].fail_device_alloc_after(n, count)
        testing.fail_device_alloc_after(self.multi.caches[d], n, count)

    @rule()
    def reset_stats(self):
        for m in self.models:
            m.reset_stats()
        self.multi.reset_stats()

    # -- invariants ------------------------------------------------------------
    @invariant()
    def same_state(self):
        if self.multi is None:
            return
        for d, (cache, model) in enumerate(zip(self.multi.caches, self.models)):
            for layer, e in assert_cache_matches_model(cache, model, self.source, f"device {d}: "):
                assert self.placement.owners[layer][e] == d, f"({layer}, {e}) resident off its owner"
        for batch, _ in self.batches:
            for d, b in enumerate(batch.batches):
                if b is not None:
                    assert_served(self.multi.caches[d], self.source, b.layer, b.ids, b.pointers)


MultiMachine.TestCase.settings = fuzz_settings(EXAMPLES, STEPS)
TestMultiMatchesModels = pytest.mark.fuzz(MultiMachine.TestCase)
