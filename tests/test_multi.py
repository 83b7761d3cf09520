"""Several devices: placement (pyexpcache/placement.py) and MultiDeviceCache (pyexpcache/multi.py).

The contract tests run on every backend × policy × device count (1, 2, 3; the host backend
emulates the devices, CUDA repeats the GPUs there are)."""

from __future__ import annotations

import numpy as np
import pytest

from expcache_bench.traces import load_decode_trace
from expcache_bench.workload import decode_workload
from pyexpcache import (
    CacheClosedError,
    ExpcacheError,
    HostSource,
    InvalidStateError,
    LayerSpec,
    ModelLayout,
    MultiDeviceCache,
    Placement,
    loads_from_calls,
    testing,
)

from support.cache import SCALE, assert_served
from support.child import close_while_threads_call


def _layout(n_layers=4, experts=12):
    q2 = ModelLayout.preset("q2", scale=SCALE)[3]
    return ModelLayout((None,) + tuple(LayerSpec(experts, *q2.class_key) for _ in range(n_layers)), name="multi")


# -- placement ---------------------------------------------------------------------------


def test_round_robin_gives_expert_e_to_device_e_mod_n():
    layout = _layout()
    p = Placement.round_robin(layout, 3)
    assert p.owners[0] is None
    assert p.owners[1].tolist() == [e % 3 for e in range(12)]
    assert p.experts_per_device().tolist() == [16, 16, 16]


def test_balanced_placement_evens_each_layers_load():
    layout = _layout(n_layers=2, experts=10)
    rng = np.random.default_rng(0)
    loads = [None] + [rng.integers(0, 1000, 10) for _ in range(2)]
    p = Placement.balanced(layout, 3, loads)
    for layer in (1, 2):
        per = np.bincount(p.owners[layer], weights=loads[layer], minlength=3)
        # Greedy in decreasing load: no device exceeds the lightest by more than one expert's load.
        assert per.max() - per.min() <= loads[layer].max(), per
    zero = Placement.balanced(layout, 2, [None, np.zeros(10), np.zeros(10)])
    assert zero.owners[1].tolist() == [e % 2 for e in range(10)]


def test_balanced_placement_of_a_real_trace_splits_its_requests_evenly():
    layout = ModelLayout.preset("mixed", scale=SCALE)
    calls = decode_workload([load_decode_trace("podA_a_coffee_full")], None).calls
    loads = loads_from_calls(layout, calls)
    assert sum(int(w.sum()) for w in loads if w is not None) == sum(len(c.ids) for c in calls)
    share = Placement.balanced(layout, 2, loads).load_share(loads)
    assert abs(share[0] - 0.5) < 0.005, share
    rr = Placement.round_robin(layout, 2).load_share(loads)
    assert abs(share[0] - 0.5) <= abs(rr[0] - 0.5)


def test_placement_rejects_what_it_cannot_place():
    layout = _layout()
    with pytest.raises(ValueError, match="num_devices must be 1..64"):
        Placement.round_robin(layout, 0)
    with pytest.raises(TypeError, match="must be an int"):
        Placement.round_robin(layout, 2.0)
    with pytest.raises(ValueError, match="loads has 2 layers"):
        Placement.balanced(layout, 2, [None, None])
    with pytest.raises(ValueError, match=r"loads\[1\] has shape"):
        Placement.balanced(layout, 2, [None, np.ones(3)] + [np.ones(12)] * 3)
    with pytest.raises(ValueError, match="finite and non-negative"):
        Placement.balanced(layout, 2, [None, -np.ones(12)] + [np.ones(12)] * 3)
    with pytest.raises(ValueError, match=r"owners\[2\] must be device indices 0..1"):
        Placement.explicit(layout, 2, [None, np.zeros(12, int), np.full(12, 2), np.zeros(12, int), np.zeros(12, int)])
    with pytest.raises(ValueError, match=r"owners\[1\] is None"):
        Placement.explicit(layout, 2, [None] * 5)


# -- serving -------------------------------------------------------------------------------


def _resident_on(multi, layer, e):
    return [d for d, c in enumerate(multi.caches) if testing.read_expert(c, layer, e) is not None]


@pytest.mark.parametrize("pinned", [None, False], ids=["default-source", "pageable"])
def test_select_serves_each_expert_from_its_owner_byte_exact(make_multi, num_devices, pinned):
    """On CUDA the default source is pinned (owners in order), pageable runs them on threads."""
    layout = _layout()
    multi, source = make_multi(layout, budget_experts=8, pinned=pinned)
    assert multi.parallel == (num_devices > 1 and not source.pinned)
    rng = np.random.default_rng(1)
    for _ in range(40):
        layer = int(rng.integers(1, 5))
        ids = rng.integers(0, 12, 6)
        sel = multi.select(layer, ids)
        want = multi.placement.owners[layer][ids]
        assert sel.owners.tolist() == want.tolist()
        assert sel.devices.tolist() == [multi.devices[d] for d in want]
        for d in range(num_devices):
            mine = sel.owners == d
            assert_served(multi.caches[d], source, layer, ids[mine], sel.pointers[mine])
        for e in set(ids.tolist()):
            assert _resident_on(multi, layer, e) == [multi.placement.owners[layer][e]]


def test_each_device_counts_its_own_share(make_multi, num_devices):
    layout = _layout()
    multi, _ = make_multi(layout, budget_experts=64)
    ids = np.arange(12)
    multi.select(1, ids)
    multi.select(1, ids)
    per = [st.total for st in multi.stats()]
    owned = np.bincount(multi.placement.owners[1], minlength=num_devices)
    assert [p.misses for p in per] == owned.tolist()
    assert [p.hits for p in per] == owned.tolist()
    total = multi.total_stats()
    assert (total.hits, total.misses) == (12, 12)


def test_the_budget_is_each_devices(make_multi, num_devices):
    layout = _layout(n_layers=1, experts=12)
    multi, _ = make_multi(layout, budget_experts=2, policy="lru")
    for e in range(12):
        multi.select(1, [e])
    held = [c.classes()[0].resident_experts for c in multi.caches]
    assert held == [2] * num_devices
    assert sum(len(_resident_on(multi, 1, e)) for e in range(12)) == 2 * num_devices


def test_budgets_and_layers_change_on_every_device(make_multi, num_devices):
    """set_budget shrinks each device's class to the new per-device budget and keeps what stays
    byte for byte; unregister_layer takes the layer out of every device, the others kept."""
    layout = _layout(n_layers=2, experts=12)
    multi, source = make_multi(layout, budget_experts=4, policy="lru")
    for e in range(12):
        multi.select(1, [e])
    multi.select(2, [0, 1])
    multi.set_budget(budget_experts=3)
    assert [c.classes()[0].cap_experts for c in multi.caches] == [3] * num_devices
    assert [c.classes()[0].resident_experts for c in multi.caches] == [3] * num_devices
    multi.unregister_layer(1)
    # Layer 2's two experts, the latest used, outlived the shrink; layer 1's left with it.
    owned = np.bincount(multi.placement.owners[2][:2], minlength=num_devices).tolist()
    assert [c.classes()[0].resident_experts for c in multi.caches] == owned
    sel = multi.select(2, [0, 1])
    for d in range(num_devices):
        assert_served(multi.caches[d], source, 2, np.array([0, 1])[sel.owners == d], sel.pointers[sel.owners == d])
    with pytest.raises(InvalidStateError):
        multi.select(1, [0])
    multi.set_reserve(0)
    with pytest.raises(ValueError):
        multi.set_budget(budget_experts=-1)


def test_prefetch_and_hints_go_to_the_owners(make_multi, num_devices):
    layout = _layout()
    multi, source = make_multi(layout, budget_experts=12)
    multi.select(2, [0])  # makes each device's class, so hints have something to refresh
    queued = multi.prefetch(1, np.arange(8))
    owned = np.bincount(multi.placement.owners[1][:8], minlength=num_devices)
    assert queued == 8
    assert [p.issued for p in multi.prefetch_stats()] == owned.tolist()
    multi.wait_prefetch()
    sel = multi.select(1, np.arange(8))
    for d in range(num_devices):
        assert_served(multi.caches[d], source, 1, np.arange(8)[sel.owners == d], sel.pointers[sel.owners == d])
    assert [p.used for p in multi.prefetch_stats()] == owned.tolist()
    multi.hint(1, [0, 1, 2])
    assert sum(p.hints for p in multi.prefetch_stats()) == 3
    total = multi.total_prefetch_stats()
    assert (total.issued, total.used, total.hints) == (8, 8, 3) and total.accuracy == 1.0


def test_batches_and_compact_loads_are_per_owner(make_multi, num_devices):
    layout = _layout()
    multi, source = make_multi(layout, budget_experts=12)
    ids = np.array([[0, 1, 2], [2, 3, 4], [5, 0, 7]])
    with multi.prepare_batch(3, ids) as batch:
        got = set()
        for d, b in enumerate(batch.batches):
            if b is None:
                continue
            assert set((multi.placement.owners[3][b.ids] == d).tolist()) == {True}
            assert_served(multi.caches[d], source, 3, b.ids, b.pointers)
            got |= set(b.ids.tolist())
        assert got == {0, 1, 2, 3, 4, 5, 7}
    assert all(b is None or b.finished for b in batch.batches)
    ids = np.array([4, 9, 4, 11])
    for d, part in enumerate(multi.load_compact(4, ids)):
        if part is None:
            assert not (multi.placement.owners[4][ids] == d).any()
            continue
        pos, buf = part
        assert_served(multi.caches[d], source, 4, ids[pos], buf.pointers())


def test_an_explicit_placement_is_followed(make_multi, num_devices):
    layout = _layout()
    owners = [None] + [np.full(12, num_devices - 1)] * 4
    multi, _ = make_multi(layout, placement=Placement.explicit(layout, num_devices, owners), budget_experts=4)
    assert set(multi.select(2, [1, 5, 9]).owners.tolist()) == {num_devices - 1}


def test_bad_input_is_refused_with_the_reason(make_multi, num_devices):
    layout = _layout()
    multi, source = make_multi(layout, budget_experts=4)
    with pytest.raises(ValueError, match="layer 0 has no routed experts"):
        multi.select(0, [1])
    with pytest.raises(ValueError, match="layer 9 has no routed experts"):
        multi.select(9, [1])
    with pytest.raises(ValueError, match=r"expert id 12 \(index 1\) out of range for layer 1 \(12 experts\)"):
        multi.select(1, [3, 12])
    with pytest.raises(ValueError, match="expert_ids is empty"):
        multi.select(1, [])
    with pytest.raises(ValueError, match="must be in"):
        multi.select(1, [-1])
    with pytest.raises(ValueError, match=f"one stream per device \\({num_devices}\\), got {num_devices + 1}"):
        multi.select(1, [1], streams=[None] * (num_devices + 1))
    with pytest.raises(OverflowError):
        multi.select(2**32, [1])
    assert multi.total_stats().misses == 0  # nothing was served by the refused calls
    with pytest.raises(ValueError, match="spreads over 5 devices"):
        MultiDeviceCache(
            layout,
            source,
            devices=list(range(num_devices)),
            placement=Placement.round_robin(layout, 5),
            budget_experts=1,
            backend="host",
        )
    with pytest.raises(ValueError, match="devices must list 1..64"):
        MultiDeviceCache(layout, source, devices=[], budget_experts=1, backend="host")
    with pytest.raises(ValueError, match=r"devices\[0\] must be in"):
        MultiDeviceCache(layout, source, devices=[-1], budget_experts=1, backend="host")
    with pytest.raises(TypeError, match="devices="):
        MultiDeviceCache(layout, source, device=0, budget_experts=1, backend="host")
    with pytest.raises(ValueError, match="different layout"):
        MultiDeviceCache(
            layout,
            source,
            devices=[0],
            placement=Placement.round_robin(_layout(n_layers=2), 1),
            budget_experts=1,
            backend="host",
        )


MULTI_SINGLE_TOKEN_CALLS = [
    ("select", lambda m, ids: m.select(1, ids)),
    ("select_views", lambda m, ids: m.select_views(1, ids)),
    ("prefetch", lambda m, ids: m.prefetch(1, ids)),
    ("hint", lambda m, ids: m.hint(1, ids)),
    ("load_compact", lambda m, ids: m.load_compact(1, ids)),
    ("owners_of", lambda m, ids: m.owners_of(1, ids)),
]


@pytest.mark.parametrize(
    "ids", [np.array([[1, 2], [3, 4]], dtype=np.uint32), [[1, 2]], 3], ids=["2d-uint32", "nested-list", "scalar"]
)
@pytest.mark.parametrize("name, call", MULTI_SINGLE_TOKEN_CALLS, ids=[c[0] for c in MULTI_SINGLE_TOKEN_CALLS])
def test_single_token_calls_refuse_ids_that_are_not_1d(make_multi, num_devices, name, call, ids):
    multi, _ = make_multi(_layout(), budget_experts=4)
    with pytest.raises(
        ValueError,
        match=r"expert_ids must be 1-D \(one token's expert ids\).*"
        r"prepare_batch takes 2-D \(tokens x k\) ids",
    ):
        call(multi, ids)
    assert multi.total_stats().calls == 0 and multi.total_prefetch_stats().calls == 0
    with multi.prepare_batch(1, [[1, 2], [2, 3]]) as batch:  # tokens x k is the batch's shape
        assert sum(len(b) for b in batch.batches if b is not None) == 3


def test_calls_after_close_raise_the_closed_error(make_multi):
    multi, source = make_multi(_layout(), budget_experts=4)
    multi.select(1, [1, 2])
    multi.close()
    multi.close()
    assert multi.closed
    with pytest.raises(CacheClosedError):
        multi.select(1, [1, 2])
    assert source.users == 0


def test_a_failed_creation_closes_the_caches_it_made():
    layout = _layout()
    with HostSource(layout) as source:
        with pytest.raises(ValueError, match="backend must be one of"):
            MultiDeviceCache(layout, source, devices=[0, 1], budget_experts=1, backend="nope")
        assert source.users == 0


def test_close_while_threads_select_in_a_child():
    out = close_while_threads_call(
        'MultiDeviceCache(lay, src, devices=[0, 1, 2], budget_experts=8, backend="host", log_level=0)',
        """
        cache.select(int(rng.integers(3, 43)), rng.choice(256, 6, replace=False))
        cache.prefetch(int(rng.integers(3, 43)), rng.choice(256, 4, replace=False))
        """,
    )
    assert out.returncode == 0, f"rc {out.returncode}: {out.stderr[-2000:]}"
    assert out.stdout.strip() == "ok"


def test_owners_run_in_parallel_when_the_source_is_staged():
    layout = _layout()
    with HostSource(layout) as source:
        for parallel, want in ((None, True), (False, False), (True, True)):
            with MultiDeviceCache(
                layout, source, devices=[0, 1], budget_experts=2, backend="host", parallel=parallel, log_level=0
            ) as multi:
                assert multi.parallel is want
        with MultiDeviceCache(layout, source, devices=[0], budget_experts=2, backend="host", parallel=True) as one:
            assert one.parallel is False  # nothing to overlap


@pytest.mark.parametrize("parallel", [False, True])
def test_a_failing_owner_stops_the_call_in_order_or_is_raised_after_all_in_parallel(parallel):
    layout = _layout(n_layers=1, experts=12)
    with (
        HostSource(layout) as source,
        MultiDeviceCache(
            layout, source, devices=[0, 1, 2], budget_experts=4, backend="host", log_level=0, parallel=parallel
        ) as multi,
    ):
        testing.fail_copy_after(multi.caches[1], 0)
        with pytest.raises(ExpcacheError, match="injected copy failure"):
            multi.select(1, np.arange(12))
        misses = [st.total.misses for st in multi.stats()]
        assert misses[0] == 4 and misses[1] >= 1  # device 1 failed at its first copy
        assert misses[2] == (4 if parallel else 0)
        sel = multi.select(1, np.arange(12))  # a later call is whole on every device
        for d in range(3):
            mine = sel.owners == d
            assert_served(multi.caches[d], source, 1, np.arange(12)[mine], sel.pointers[mine])
