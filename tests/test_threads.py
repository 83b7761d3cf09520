"""The thread-safety contract of expcache.h, on the host backend:

  "one cache may be used from several threads; calls on one cache are
   serialized by an internal mutex. Separate caches are independent. Device
   pointers returned to one thread can be invalidated by another thread's next
   call on the same cache, so an engine that shares a cache between threads
   orders its own calls."

* Several threads on one cache, each on its own layers (two size classes shared
  between threads, so they compete for slots and evict each other's experts):
  select / prepare_batch / load_compact, many iterations. No crash; a batch's
  pointers are re-read without any test-level lock (valid: its slots are held and
  its staging is its own) and must hold the source bytes until finish; select and
  compact results are checked only inside an "ordered" section (a test-level lock
  around the call and the check, as the header asks of an engine). The counters
  must sum to the totals the threads issued.
* The same with release_all / reset_stats / fault injection / inspection calls
  from a control thread: no crash, held batch bytes stay intact, the cache stays
  consistent.
* Several threads, each with its own cache, replaying one seeded sequence: every
  cache ends with exactly the counters, residency and device bytes of a serial run.
* The Python wrapper: ExpertCache.select called from several threads on one cache.

ctypes releases the GIL around library calls, so the C calls do run concurrently.
Selects in the first two tests go through the C ABI with per-thread buffers (see
test_python_select_is_thread_safe for why). Every test runs once per eviction policy; about
10 s per policy.
"""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict
from contextlib import contextmanager

import numpy as np

from pyexpcache import (
    ExpcacheError,
    ExpertCache,
    HostSource,
    LayerSpec,
    ModelLayout,
    OutOfDeviceMemoryError,
    testing,
)
from pyexpcache._lib import lib

from support.cache import SCALE, assert_served

NUM_THREADS = 4
ITERATIONS = 3000


def mixed_layout(num_layers=8, num_experts=16) -> ModelLayout:
    """q2 and q4 (DeepSeek V4 Flash sizes / SCALE); the last quarter of the layers is q4."""
    base = ModelLayout.preset("mixed", scale=SCALE)
    q2, q4 = base[0].class_key, base[40].class_key
    return ModelLayout(
        tuple(LayerSpec(num_experts, *(q4 if i >= num_layers * 3 // 4 else q2)) for i in range(num_layers)),
        name="mixed-threads",
    )


class RawSelect:
    """expcache_select_async with this thread's own id and pointer buffers."""

    def __init__(self, cache: ExpertCache):
        self.cache = cache
        self.ids = np.empty(1024, dtype=np.uint32)
        self.ptrs = np.empty((1024, 3), dtype=np.uint64)

    def __call__(self, layer, ids):
        k = len(ids)
        self.ids[:k] = ids
        lib.expcache_select_async(self.cache._handle, layer, self.ids.ctypes.data, k, None, self.ptrs.ctypes.data)
        return self.ptrs[:k].copy()


class OrderLock:
    """The engine's own ordering of calls on a shared cache: ordinary calls take it shared
    (they run concurrently), a call whose results are checked afterwards takes it
    exclusively, so no other thread's call can invalidate them before the check."""

    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._waiting = 0

    @contextmanager
    def shared(self):
        with self._cond:
            while self._writer or self._waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self):
        with self._cond:
            self._waiting += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


def run_threads(target, n):
    errors = []

    def wrap(i):
        try:
            target(i)
        except BaseException as e:  # reported below
            errors.append((i, e))

    threads = [threading.Thread(target=wrap, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung (deadlock?)"
    if errors:
        raise errors[0][1]


def assert_residents_intact(cache, source):
    for layer in cache.layout.moe_layers:
        for e in range(cache.layout[layer].num_experts):
            got = testing.read_expert(cache, layer, e)
            if got is not None:
                assert (got == source.expert_bytes(layer, e)).all(), f"resident ({layer}, {e}) corrupted"


def test_shared_cache_disjoint_layers_counters_and_bytes(policy):
    layout = mixed_layout()
    source = HostSource(layout)
    cache = ExpertCache(layout, source, backend="host", budget_experts=12, max_classes=2, log_level=0, policy=policy)
    order = OrderLock()
    # expected[key][path] = [calls, unique ids, all ids]
    expected = [defaultdict(lambda: defaultdict(lambda: [0, 0, 0])) for _ in range(NUM_THREADS)]

    def worker(t):
        rng = random.Random(1000 + t)
        layers = [t, t + NUM_THREADS]
        select = RawSelect(cache)
        exp = expected[t]
        for _ in range(ITERATIONS):
            layer = rng.choice(layers)
            n = layout[layer].num_experts
            key = layout[layer].class_key
            op = rng.random()
            checked = rng.random() < 0.2
            if op < 0.5:
                ids = [rng.randrange(n) for _ in range(rng.randint(1, 6))]
                if checked:
                    with order.exclusive():
                        ptrs = select(layer, ids)
                        assert_served(cache, source, layer, ids, ptrs)
                else:
                    with order.shared():
                        ptrs = select(layer, ids)
                assert ptrs.shape == (len(ids), 3) and (ptrs != 0).all()
                c = exp[key]["decode"]
            elif op < 0.8:
                ids = np.array([[rng.randrange(n) for _ in range(3)] for _ in range(rng.randint(1, 8))])
                with order.shared():
                    batch = cache.prepare_batch(layer, ids)
                assert sorted(batch.ids.tolist()) == sorted(set(ids.ravel().tolist()))
                if rng.random() < 0.5:
                    with order.shared():
                        select(layer, [rng.randrange(n)])  # contention while the batch is held
                    d = exp[key]["decode"]
                    d[0], d[1], d[2] = d[0] + 1, d[1] + 1, d[2] + 1
                time.sleep(0)  # let other threads run while the batch is held
                # Lock-free re-read: the batch's slots are held and its staging is its own,
                # whatever the other threads do meanwhile.
                assert_served(cache, source, layer, batch.ids, batch.pointers)
                batch.finish()
                c = exp[key]["batch"]
                ids = ids.ravel().tolist()
            else:
                ids = [rng.randrange(n) for _ in range(rng.randint(1, 6))]
                if checked:
                    with order.exclusive():
                        buf = cache.load_compact(layer, ids)
                        assert_served(cache, source, layer, ids, buf.pointers())
                else:
                    with order.shared():
                        buf = cache.load_compact(layer, ids)
                assert buf.num_experts == len(ids)
                c = exp[key]["compact"]
            c[0] += 1
            c[1] += len(set(ids))
            c[2] += len(ids)

    run_threads(worker, NUM_THREADS)

    totals = defaultdict(lambda: defaultdict(lambda: [0, 0, 0]))
    for exp in expected:
        for key, paths in exp.items():
            for path, (calls, unique, every) in paths.items():
                t = totals[key][path]
                t[0] += calls
                t[1] += unique
                t[2] += every
    stats = cache.stats()
    assert len(stats.classes) == 2
    for cs in stats.classes:
        key = cs.info.key
        eb = sum(key)
        for path in ("decode", "batch", "compact"):
            p = cs.paths[path]
            calls, unique, every = totals[key][path]
            assert p.calls == calls, (key, path)
            assert p.hits + p.misses == unique, (key, path)
            assert p.releases == p.alloc_retries == p.class_reuses == 0
        d, b, c = cs.paths["decode"], cs.paths["batch"], cs.paths["compact"]
        assert d.bytes_h2d == d.misses * eb and d.bytes_d2d == 0
        assert d.evictions == d.misses - d.direct_loads - d.appends >= 0
        assert b.misses == b.appends + b.direct_loads and b.evictions == 0 and b.bytes_h2d == b.misses * eb
        assert c.misses == c.direct_loads and c.evictions == c.appends == 0
        assert c.bytes_h2d + c.bytes_d2d == totals[key]["compact"][2] * eb
        assert cs.total.cap_notices == 1
        assert cs.paths["control"] == type(cs.paths["control"])()
        info = cs.info
        assert info.held_experts == 0 and info.resident_experts <= info.cap_experts == 12
    assert_residents_intact(cache, source)
    cache.close()


def test_shared_cache_with_concurrent_control_calls(policy):
    layout = mixed_layout()
    source = HostSource(layout)
    slot = 3840
    cache = ExpertCache(
        layout,
        source,
        backend="host",
        budget_experts=10,
        max_classes=2,
        log_level=0,
        policy=policy,
        device_capacity_bytes=40 * slot,
        reserve_bytes=2 * slot,
        slab_bytes=3 * slot,
    )
    stop = threading.Event()
    allowed = (OutOfDeviceMemoryError,)

    def worker(t):
        if t == NUM_THREADS:  # the control thread
            rng = random.Random(7)
            while not stop.is_set():
                op = rng.random()
                if op < 0.3:
                    cache.release_all()
                elif op < 0.45:
                    cache.reset_stats()
                elif op < 0.6:
                    testing.fail_device_alloc_after(cache, rng.randrange(4), rng.randrange(3))
                else:
                    cache.stats()
                    assert testing.device_bytes_in_use(cache) <= 40 * slot
                time.sleep(0.0005)
            return
        rng = random.Random(2000 + t)
        layers = [t, t + NUM_THREADS]
        select = RawSelect(cache)
        for _ in range(ITERATIONS):
            layer = rng.choice(layers)
            n = layout[layer].num_experts
            op = rng.random()
            try:
                if op < 0.5:
                    ids = [rng.randrange(n) for _ in range(rng.randint(1, 6))]
                    ptrs = select(layer, ids)
                    assert ptrs.shape == (len(ids), 3)
                elif op < 0.8:
                    ids = [rng.randrange(n) for _ in range(rng.randint(1, 12))]
                    with cache.prepare_batch(layer, ids) as batch:
                        time.sleep(0)
                        assert_served(cache, source, layer, batch.ids, batch.pointers)  # held: valid
                else:
                    ids = [rng.randrange(n) for _ in range(rng.randint(1, 6))]
                    cache.load_compact(layer, ids)
            except allowed:
                pass

    ctl_errors = []

    def control():
        try:
            worker(NUM_THREADS)
        except BaseException as e:
            ctl_errors.append(e)

    ctl = threading.Thread(target=control)
    ctl.start()
    try:
        run_threads(worker, NUM_THREADS)
    finally:
        stop.set()
        ctl.join(timeout=60)
    assert not ctl_errors, ctl_errors
    testing.fail_device_alloc_after(cache, 0, 0)
    assert_residents_intact(cache, source)
    for info in cache.classes():
        assert info.held_experts == 0
        assert info.resident_experts <= info.allocated_experts
    cache.release_all()
    assert testing.device_bytes_in_use(cache) == 0
    # Still fully usable.
    ptrs = cache.select(0, [1, 2, 3])
    assert_served(cache, source, 0, [1, 2, 3], ptrs)
    cache.close()


def seeded_ops(seed, layout, count):
    rng = random.Random(seed)
    ops = []
    for _ in range(count):
        layer = rng.choice(layout.moe_layers)
        n = layout[layer].num_experts
        r = rng.random()
        if r < 0.45:
            ops.append(("select", layer, [rng.randrange(n) for _ in range(rng.randint(1, 6))]))
        elif r < 0.6:
            ops.append(("batch", layer, [rng.randrange(n) for _ in range(rng.randint(1, 16))]))
        elif r < 0.75:
            ops.append(("finish", rng.randrange(4)))
        elif r < 0.88:
            ops.append(("compact", layer, [rng.randrange(n) for _ in range(rng.randint(1, 8))]))
        elif r < 0.93:
            ops.append(("inject", rng.randrange(4), rng.randrange(3)))
        elif r < 0.97:
            ops.append(("release_all",))
        else:
            ops.append(("reset_stats",))
    return ops


def replay(layout, source, ops, policy, barrier=None):
    """Run ops on a fresh cache; return (counters, residency, device bytes, outcome per op)."""
    slot = 3840
    cache = ExpertCache(
        layout,
        source,
        backend="host",
        budget_experts=9,
        max_classes=2,
        log_level=0,
        policy=policy,
        device_capacity_bytes=30 * slot,
        reserve_bytes=slot,
        slab_bytes=2 * slot,
    )
    if barrier is not None:
        barrier.wait()
    batches = []
    outcomes = []
    for op in ops:
        try:
            if op[0] == "select":
                ptrs = cache.select(op[1], op[2])
                assert_served(cache, source, op[1], op[2], ptrs)
            elif op[0] == "batch":
                b = cache.prepare_batch(op[1], op[2])
                assert_served(cache, source, op[1], b.ids, b.pointers)
                batches.append(b)
            elif op[0] == "finish":
                if batches:
                    batches.pop(op[1] % len(batches)).finish()
            elif op[0] == "compact":
                buf = cache.load_compact(op[1], op[2])
                assert_served(cache, source, op[1], op[2], buf.pointers())
            elif op[0] == "inject":
                testing.fail_device_alloc_after(cache, op[1], op[2])
            elif op[0] == "release_all":
                cache.release_all()
            else:
                cache.reset_stats()
            outcomes.append("ok")
        except ExpcacheError as e:
            outcomes.append(e.status_name)
    for b in batches:
        assert_served(cache, source, b.layer, b.ids, b.pointers)
    counters = {
        (c.info.index, c.info.key, p): vars(s).copy() for c in cache.stats().classes for p, s in c.paths.items()
    }
    resident = {
        (layer, e)
        for layer in layout.moe_layers
        for e in range(layout[layer].num_experts)
        if testing.read_expert(cache, layer, e) is not None
    }
    snapshot = (counters, resident, testing.device_bytes_in_use(cache), outcomes)
    for b in batches:
        b.finish()
    cache.close()
    return snapshot


def test_separate_caches_are_independent(policy):
    q2, q4 = mixed_layout()[0].class_key, mixed_layout()[7].class_key
    keys = [q2, q2, q4, q2, q4, (264, 264, 336)]  # three classes, max_classes=2: class reuse too
    layout = ModelLayout(tuple(LayerSpec(12, *k) for k in keys), name="three-threads")
    source = HostSource(layout)
    ops = seeded_ops(42, layout, 1200)
    ops = ops[:900] + [op for op in ops[900:] if op[0] != "reset_stats"]
    serial = replay(layout, source, ops, policy)
    assert "EXPCACHE_ERR_OUT_OF_DEVICE_MEMORY" in serial[3]  # the memory-pressure paths ran
    assert sum(v["class_reuses"] for v in serial[0].values()) > 0  # ... and class reuse
    results = [None] * NUM_THREADS
    barrier = threading.Barrier(NUM_THREADS)

    def worker(t):
        results[t] = replay(layout, source, ops, policy, barrier)

    run_threads(worker, NUM_THREADS)
    for t, r in enumerate(results):
        assert r[3] == serial[3], f"thread {t}: outcomes diverged from the serial run"
        assert r[0] == serial[0], f"thread {t}: counters diverged from the serial run"
        assert r[1] == serial[1] and r[2] == serial[2], f"thread {t}: residency diverged"


def test_python_select_is_thread_safe(policy):
    layout = mixed_layout(num_layers=4, num_experts=8)
    source = HostSource(layout)
    cache = ExpertCache(layout, source, backend="host", budget_experts=32, log_level=0, policy=policy)
    # Every thread's experts are resident and never evicted: their addresses are fixed.
    want = {layer: cache.select(layer, [layer, (layer + 1) % 8]).tolist() for layer in range(4)}
    bad = []
    deadline = time.monotonic() + 5.0

    def worker(layer):
        while time.monotonic() < deadline and not bad:
            got = cache.select(layer, [layer, (layer + 1) % 8]).tolist()
            if got != want[layer]:
                bad.append((layer, got))

    run_threads(worker, 4)
    cache.close()
    assert not bad, f"select returned another thread's pointers: layer {bad[0][0]} got {bad[0][1]}"
