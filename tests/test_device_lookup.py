"""The device-side lookup (``ExpertCache(lookup="device")``): slot banks, ``select_device``, and
every other call on the same cache in any order, on each backend: the residency has one copy, on
the device, and the host-side calls run on it. These tests pin the policy to LRU (every policy in
the device lookup: tests/test_device_policy.py). Ids live where the backend's device does: numpy arrays on the host
backend, CUDA tensors on the CUDA backend (support.cache.device_ids)."""

from __future__ import annotations

import ctypes
import warnings

import numpy as np
import pytest

from pyexpcache import (
    CudaError,
    ExpcacheWarning,
    ExpertCache,
    HostSource,
    InvalidArgumentError,
    InvalidStateError,
    LayerSpec,
    ModelLayout,
    OutOfDeviceMemoryError,
    UnsupportedError,
    _lib,
    bank as _bank,
    testing,
)

from support.cache import SCALE, assert_served, bank_rows, device_ids, to_numpy
from support.child import run_child

#: Every test here that makes its caches through make_cache runs against both bank arrangements.
pytestmark = pytest.mark.arrangements


@pytest.fixture
def policy() -> str:
    return "lru"  # make_cache passes it


def _layout():
    return ModelLayout.preset("q2", scale=SCALE)


def _cache(make_cache, experts=6, **kw):
    if experts is not None:
        kw.setdefault("budget_experts", experts)
    kw.setdefault("pinned", True)  # what a device select reads (emulated on the host backend)
    return make_cache(_layout(), lookup="device", **kw)


def _select(cache, layer, ids, **kw):
    return to_numpy(cache.select_device(layer, device_ids(cache, ids), **kw))


def _device(cache):
    return cache.stats().classes[0].paths["device"]


def test_bank_is_the_class_whole_and_fixed(make_cache):
    cache, _ = _cache(make_cache, experts=6)
    layer = cache.layout.moe_layers[0]
    bank = cache.bank(layer)
    assert bank.cap == 6
    assert bank.gate.shape[0] == bank.up.shape[0] == bank.down.shape[0] == bank.rows > 6  # slots, then staging rows
    info = cache.classes()[0]
    assert info.allocated_experts == info.cap_experts == 6  # reserved whole when bound
    spec = cache.layout[layer]
    assert bank.gate.shape[1:] == (spec.gate_bytes,)
    assert bank.slot_stride == (info.slot_bytes if bank.arrangement == "slots" else 0)
    base = bank.gate.ptr
    _select(cache, layer, [1, 2, 3])
    cache.release_all()
    assert cache.bank(layer).gate.ptr == base  # emptied, never moved
    assert cache.classes()[0].resident_experts == 0


def test_slots_hold_the_source_bytes(make_cache):
    cache, source = _cache(make_cache, experts=8)
    layer = cache.layout.moe_layers[1]
    ids = [4, 9, 4, 0, 17, 9]
    slots = _select(cache, layer, ids)
    assert slots.dtype == np.int32 and slots.shape == (6,)
    assert slots[0] == slots[2] and slots[1] == slots[5]
    assert len({int(s) for s in slots}) == 4 and all(0 <= s < 8 for s in slots)
    assert_served(cache, source, layer, ids, bank_rows(cache.bank(layer), slots))
    d = _device(cache)
    assert (d.calls, d.hits, d.misses, d.appends, d.evictions) == (1, 0, 4, 4, 0)
    assert d.bytes_h2d == 4 * cache.layout[layer].expert_bytes
    slots2 = _select(cache, layer, [9, 4])
    assert list(slots2) == [slots[1], slots[0]]
    assert _device(cache).hits == 2


def test_rows_are_one_step(make_cache):
    """[n, k] ids: the distinct experts of all rows copied once and protected together (the bank
    must have n*k slots it may fill: the host cannot count the distinct ids it never sees)."""
    cache, source = _cache(make_cache, experts=6)
    layer = cache.layout.moe_layers[0]
    ids = np.array([[1, 2], [2, 3], [4, 1]])
    slots = _select(cache, layer, ids)
    assert slots.shape == (3, 2)
    assert len(set(slots.ravel().tolist())) == 4
    assert _device(cache).misses == 4
    assert_served(cache, source, layer, ids.ravel(), bank_rows(cache.bank(layer), slots.ravel()))


def test_lru_victims_and_int32_ids(make_cache):
    cache, source = _cache(make_cache, experts=3)
    layer = cache.layout.moe_layers[0]
    _select(cache, layer, [1, 2, 3])
    _select(cache, layer, [1])  # 2 is now the least recently used
    _select(cache, layer, np.array([7], dtype=np.int32))
    assert testing.read_expert(cache, layer, 2) is None
    for e in (1, 3, 7):
        assert testing.read_expert(cache, layer, e) is not None
    assert _device(cache).evictions == 1


def test_host_and_device_selects_share_one_lru(make_cache):
    """A host select sees the device selects' residency and recency, and the other way round:
    both evict the least recently used expert over the calls of both kinds."""
    cache, source = _cache(make_cache, experts=3)
    layer = cache.layout.moe_layers[0]
    _select(cache, layer, [1, 2])
    cache.select(layer, [3, 1])  # 1 hit; 3 a miss; LRU order now 2, 3, 1
    assert cache.stats().classes[0].paths["decode"].hits == 1
    slots = _select(cache, layer, [5])  # evicts 2
    assert testing.read_expert(cache, layer, 2) is None
    ptrs = cache.select(layer, [5, 3])  # both hits, served from the device select's slot
    assert cache.stats().classes[0].paths["decode"].hits == 3
    assert int(ptrs[0][0]) == bank_rows(cache.bank(layer), slots)[0][0]
    assert_served(cache, source, layer, [5, 3], ptrs)
    cache.select(layer, [8])  # evicts 1 (2 is gone; order was 1, 5, 3)
    assert testing.read_expert(cache, layer, 1) is None
    assert _select(cache, layer, [3]).shape == (1,)
    assert _device(cache).hits == 1


def test_batches_pin_their_slots(make_cache):
    cache, source = _cache(make_cache, experts=4)
    layer = cache.layout.moe_layers[0]
    with cache.prepare_batch(layer, np.array([[1, 2], [2, 3]])) as batch:
        assert cache.classes()[0].held_experts == 3
        slots = _select(cache, layer, [6])  # the one free slot
        with pytest.raises(InvalidArgumentError, match="held by batches"):
            _select(cache, layer, [7, 8])  # 2 ids, 1 slot it may fill
        _select(cache, layer, [9])  # evicts 6, never a held slot
        for e in (1, 2, 3):
            assert testing.read_expert(cache, layer, e) is not None
        assert testing.read_expert(cache, layer, 6) is None
        assert_served(cache, source, layer, [1, 2, 3], batch.pointers)
    _select(cache, layer, [10, 11])
    assert cache.classes()[0].held_experts == 0
    assert slots.shape == (1,)


def test_compact_and_views_after_device_selects(make_cache):
    cache, source = _cache(make_cache, experts=4)
    layer = cache.layout.moe_layers[2]
    _select(cache, layer, [3, 4])
    buf = cache.load_compact(layer, [4, 5, 3])
    assert_served(cache, source, layer, [4, 5, 3], buf.pointers())
    assert cache.stats().classes[0].paths["compact"].hits == 2
    views = cache.select_views(layer, [3])
    assert views[0].gate.ptr == bank_rows(cache.bank(layer), _select(cache, layer, [3]))[0][0]


def test_release_all_then_misses_again(make_cache):
    cache, source = _cache(make_cache, experts=4)
    layer = cache.layout.moe_layers[0]
    _select(cache, layer, [1, 2])
    cache.release_all()
    slots = _select(cache, layer, [1, 2])
    assert _device(cache).misses == 4
    assert_served(cache, source, layer, [1, 2], bank_rows(cache.bank(layer), slots))


def test_stats_read_the_device_once(make_cache):
    """The residency and the counters have one copy, on the device: stats() (every class, every
    path) synchronizes the device once and copies once, and a host-side serving call neither
    (it synchronizes its own stream); the counts it reads are the selects' own."""
    cache, _ = make_cache(ModelLayout.preset("mixed", scale=SCALE), budget_experts=6, lookup="device", pinned=True)
    layers = cache.layout.moe_layers
    for layer in layers:
        _select(cache, layer, [1, 2])
    before = testing.device_reads(cache)
    st = cache.stats()
    after = testing.device_reads(cache)
    assert len(st.classes) >= 2
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)
    assert sum(c.paths["device"].misses for c in st.classes) == 2 * len(layers)
    cache.select(layers[-1], [1, 3])  # 1 is the class's most recent
    assert testing.device_reads(cache) == after
    assert cache.stats().path("decode").hits == 1


def test_reset_stats_zeroes_the_device_counters(make_cache):
    cache, _ = _cache(make_cache)
    layer = cache.layout.moe_layers[0]
    _select(cache, layer, [1, 2])
    cache.reset_stats()
    assert _device(cache).calls == 0
    _select(cache, layer, [1])
    d = _device(cache)
    assert (d.calls, d.hits, d.misses) == (1, 1, 0)


def _raw_select_device(cache, layer, ids, counts=None):
    """select_device through the C ABI with ids the library reads on its own device (numpy on
    the host backend): the path of device-memory ids, whose range no host code checks. With
    ``counts`` (2 int32 on the device), the counted call writes them."""
    ids = device_ids(cache, ids)
    out = device_ids(cache, [0] * len(ids), dtype="int32")
    src, dst = _bank.id_array(ids, "ids"), _bank.id_array(out, "out")
    with cache.raw_handle() as h:
        if counts is None:
            _lib.lib.expcache_select_device_async(h, layer, src.ptr, src.bits, 1, len(ids), dst.ptr, None)
        else:
            tally = _bank.id_array(counts, "counts").ptr
            _lib.lib.expcache_select_device_counted_async(
                h, layer, src.ptr, src.bits, 1, len(ids), dst.ptr, tally, None
            )
    return to_numpy(out)


def test_an_id_out_of_range_is_logged_by_the_next_read_of_the_device_state(make_cache):
    """The report lives on the device with the counters: the next call that reads them (stats,
    classes) logs it, once; serving calls in between do their work."""
    cache, src = _cache(make_cache)
    layer = cache.layout.moe_layers[0]
    n = cache.layout[layer].num_experts
    slots = _raw_select_device(cache, layer, [1, n + 3, 2])
    assert slots[1] == -1 and slots[0] >= 0 and slots[2] >= 0
    ptrs = cache.select(layer, [1, 4])
    assert_served(cache, src, layer, [1, 4], ptrs)
    assert testing.read_expert(cache, layer, 4) is not None
    with pytest.warns(ExpcacheWarning, match=f"expert id {n + 3} \\(index 1\\) out of range"):
        cache.stats()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache.stats()  # reported once
        cache.release_all()
    assert all(testing.read_expert(cache, layer, e) is None for e in (1, 2, 4))  # release_all released


def test_a_report_no_call_read_back_is_logged_at_close(make_cache):
    cache, _ = _cache(make_cache)
    layer = cache.layout.moe_layers[0]
    _raw_select_device(cache, layer, [-1])
    with pytest.warns(ExpcacheWarning, match="expert id -1 \\(index 0\\) out of range"):
        cache.close()


def test_host_memory_ids_out_of_range_raise_at_once(make_cache, backend):
    if backend != "host":
        pytest.skip("ids in host memory are the host backend's")
    cache, _ = _cache(make_cache)
    layer = cache.layout.moe_layers[0]
    n = cache.layout[layer].num_experts
    with pytest.raises(InvalidArgumentError, match=f"expert id {n + 3} \\(index 1\\) out of range"):
        cache.select_device(layer, np.array([1, n + 3, 2], dtype=np.int32))
    assert cache.stats().path("device").calls == 0  # nothing was selected
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache.stats()  # and nothing is left to report


def test_argument_errors(make_cache):
    cache, _ = _cache(make_cache, experts=4)
    layer = cache.layout.moe_layers[0]
    ids = device_ids(cache, [1, 2])
    with pytest.raises(TypeError, match="int32 or int64"):
        cache.select_device(layer, device_ids(cache, [1.0, 2.0], dtype="float32"))
    with pytest.raises(ValueError, match="1-D \\[k\\] or 2-D"):
        cache.select_device(layer, device_ids(cache, np.zeros((1, 1, 2))))
    with pytest.raises(ValueError, match="out must be int32"):
        cache.select_device(layer, ids, out=device_ids(cache, [0, 0], dtype="int64"))
    with pytest.raises(ValueError, match="C-contiguous"):
        cache.select_device(layer, device_ids(cache, np.zeros((2, 4)))[:, ::2])
    with pytest.raises(InvalidArgumentError, match="needs as many slots"):
        cache.select_device(layer, device_ids(cache, [1, 2, 3, 4, 5]))
    with pytest.raises(InvalidArgumentError, match="n\\*k must be 1..1024"):
        cache.select_device(layer, device_ids(cache, np.zeros((2, 600))))
    for empty in (np.zeros(0), np.zeros((0, 6)), np.zeros((2, 0))):
        with pytest.raises(InvalidArgumentError, match="n\\*k must be 1..1024 ids, got an empty array"):
            cache.select_device(layer, device_ids(cache, empty))
    dense = next((i for i, s in enumerate(cache.layout.layers) if s is None), None)
    if dense is not None:
        with pytest.raises(ValueError, match="no routed experts"):
            cache.select_device(dense, ids)
    with pytest.raises(UnsupportedError, match="prefetch is not available on a device-lookup cache"):
        cache.prefetch(layer, [1])
    with pytest.raises(UnsupportedError, match="hint is not available"):
        cache.hint(layer, [1])


def test_an_empty_torch_tensor_is_refused_by_its_size(make_cache, backend):
    torch = pytest.importorskip("torch")
    cache, _ = _cache(make_cache)
    layer = cache.layout.moe_layers[0]
    empty = torch.zeros(0, dtype=torch.int64, device="cuda" if backend == "cuda" else "cpu")
    assert empty.data_ptr() == 0 or backend == "cuda"  # the address C would have read as NULL
    with pytest.raises(InvalidArgumentError, match="n\\*k must be 1..1024 ids, got an empty array of shape \\(0,\\)"):
        cache.select_device(layer, empty)


def test_a_read_only_out_is_refused(make_cache, backend):
    if backend != "host":
        pytest.skip("numpy arrays are the host backend's out arrays")
    cache, _ = _cache(make_cache)
    layer = cache.layout.moe_layers[0]
    ids = np.array([1, 2], dtype=np.int32)
    frozen = np.zeros(2, dtype=np.int32)
    frozen.flags.writeable = False
    over_bytes = np.frombuffer(bytes(8), dtype=np.int32)  # immutable memory
    for out in (frozen, over_bytes):
        with pytest.raises(ValueError, match="out is read-only"):
            cache.select_device(layer, ids, out=out)
        assert not out.any()  # nothing written
    assert cache.stats().path("device").calls == 0


def test_out_is_filled(make_cache):
    cache, _ = _cache(make_cache)
    layer = cache.layout.moe_layers[0]
    out = device_ids(cache, [[-5, -5], [-5, -5]], dtype="int32")
    got = cache.select_device(layer, device_ids(cache, [[1, 2], [3, 1]]), out=out)
    assert got is out
    s = to_numpy(out)
    assert s[0, 0] == s[1, 1] and (s >= 0).all()


# The counts of a step (select_device(..., counts=)): the distinct experts of its rows and their misses.


def _counts(cache):
    return device_ids(cache, [-7, -7], dtype="int32")  # where the select writes, filled so a miss shows


def _resident(cache, layer):
    return {e for e in range(cache.layout[layer].num_experts) if testing.read_expert(cache, layer, e) is not None}


def test_counts_price_a_verification_step(make_cache):
    """A [3, 6] verification step with overlapping rows: counts[0] is the size of the rows' union,
    counts[1] the experts of it not resident before (read back expert by expert), equal to the
    device path's misses, and the hits are the rest; the same step again misses nothing."""
    cache, source = _cache(make_cache, experts=24)
    layer = cache.layout.moe_layers[0]
    _select(cache, layer, [1, 2, 3, 4, 20])
    ids = np.array([[1, 2, 5, 6, 7, 2], [2, 5, 9, 10, 1, 11], [5, 12, 1, 2, 13, 3]])
    union = set(ids.ravel().tolist())
    before, stats = _resident(cache, layer), _device(cache)
    counts = _counts(cache)
    slots = _select(cache, layer, ids, counts=counts)
    distinct, misses = (int(c) for c in to_numpy(counts))
    assert (distinct, misses) == (len(union), len(union - before)) == (11, 8)
    after = _device(cache)
    assert after.misses - stats.misses == misses and after.hits - stats.hits == distinct - misses
    assert_served(cache, source, layer, ids.ravel(), bank_rows(cache.bank(layer), slots.ravel()))
    again = _counts(cache)
    assert list(_select(cache, layer, ids, counts=again).ravel()) == list(slots.ravel())
    assert [int(c) for c in to_numpy(again)] == [11, 0]
    assert _device(cache).hits - after.hits == 11


def test_counts_follow_an_lru_model(make_cache):
    """Random steps of 1 to 3 rows over a small bank: each step's counts equal those of a Python
    model of the device LRU (hits refreshed in order of first occurrence, then each miss evicting
    the least recently used), and so does the residency after it."""
    cache, _ = _cache(make_cache, experts=7)
    layer = cache.layout.moe_layers[1]
    rng = np.random.default_rng(37)
    lru: dict[int, None] = {}  # the model: resident experts, least recently used first
    for _ in range(40):
        n = int(rng.integers(1, 4))
        k = int(rng.integers(1, 7 // n + 1))
        ids = rng.integers(0, 12, size=(n, k))
        order = list(dict.fromkeys(ids.ravel().tolist()))  # the distinct experts, by first occurrence
        missed = [e for e in order if e not in lru]
        for e in order:
            if e in lru:
                lru[e] = lru.pop(e)  # refreshed
        for e in missed:
            if len(lru) == 7:
                del lru[next(iter(lru))]
            lru[e] = None
        counts = _counts(cache)
        _select(cache, layer, ids, counts=counts)
        assert [int(c) for c in to_numpy(counts)] == [len(order), len(missed)], ids.tolist()
        assert _resident(cache, layer) == set(lru)


@pytest.mark.filterwarnings("ignore::pyexpcache.ExpcacheWarning")  # the report of the ids out of range
def test_counts_leave_out_ids_out_of_range(make_cache):
    """An id out of range (slot -1) is no expert: neither distinct nor a miss."""
    cache, _ = _cache(make_cache, experts=8)
    layer = cache.layout.moe_layers[0]
    n = cache.layout[layer].num_experts
    _select(cache, layer, [4])
    counts = _counts(cache)
    slots = _raw_select_device(cache, layer, [4, n, 6, -1, 6, n + 9, 4, 7], counts=counts)
    assert [s < 0 for s in slots] == [False, True, False, True, False, True, False, False]
    assert [int(c) for c in to_numpy(counts)] == [3, 2]  # 4 (a hit), 6 and 7
    counts = _counts(cache)
    _raw_select_device(cache, layer, [n, -3], counts=counts)
    assert [int(c) for c in to_numpy(counts)] == [0, 0]


def test_counts_arguments(make_cache, backend):
    """counts: 2 int32 or uint32, writable, where the ids live; anything else is refused before
    anything is selected."""
    cache, _ = _cache(make_cache, experts=4)
    layer = cache.layout.moe_layers[0]
    ids = device_ids(cache, [1, 2])
    with pytest.raises(TypeError, match="counts must hold int32, int64 or uint32 integers"):
        cache.select_device(layer, ids, counts=device_ids(cache, [0, 0], dtype="float32"))
    for bad in (device_ids(cache, [0, 0], dtype="int64"), device_ids(cache, [0, 0, 0], dtype="int32")):
        with pytest.raises(ValueError, match="counts must be 2 int32 or uint32"):
            cache.select_device(layer, ids, counts=bad)
    with pytest.raises(ValueError, match="counts must be 2 int32 or uint32 .* shape \\(1, 2\\)"):
        cache.select_device(layer, ids, counts=device_ids(cache, [[0, 0]], dtype="int32"))
    with pytest.raises(TypeError, match="counts must be an array"):
        cache.select_device(layer, ids, counts=[0, 0])
    if backend == "host":
        frozen = np.zeros(2, dtype=np.int32)
        frozen.flags.writeable = False
        with pytest.raises(ValueError, match="counts is read-only"):
            cache.select_device(layer, ids, counts=frozen)
        unsigned = np.full(2, 99, dtype=np.uint32)
        cache.select_device(layer, ids, counts=unsigned)
        assert list(unsigned) == [2, 2]
        assert cache.stats().path("device").calls == 1  # the refused calls selected nothing
    else:
        with pytest.raises(ValueError, match="counts must be in device memory"):
            cache.select_device(layer, ids, counts=np.zeros(2, dtype=np.int32))
        assert cache.stats().path("device").calls == 0


def test_counts_are_written_by_each_graph_replay(make_cache, backend):
    """A counted select captured in a CUDA graph: each replay writes the step's counts."""
    if backend != "cuda":
        pytest.skip("CUDA graphs are the CUDA backend's")
    torch = pytest.importorskip("torch", reason="torch is not installed")
    cache, source = _cache(make_cache, experts=8)
    layer = cache.layout.moe_layers[0]
    cache.bank(layer)  # binds the class: a capture cannot allocate its bank
    ids = torch.tensor([[1, 2, 3], [3, 4, 1]], device="cuda")
    slots = torch.empty((2, 3), dtype=torch.int32, device="cuda")
    counts = torch.full((2,), -7, dtype=torch.int32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cache.select_device(layer, ids, out=slots, counts=counts)
    seen = []
    for step in ([[1, 2, 3], [3, 4, 1]], [[1, 2, 3], [3, 4, 1]], [[5, 6, 1], [1, 1, 7]]):
        ids.copy_(torch.tensor(step))
        graph.replay()
        torch.cuda.synchronize()
        seen.append(counts.tolist())
        assert_served(cache, source, layer, np.ravel(step), bank_rows(cache.bank(layer), slots.cpu().ravel().tolist()))
    assert seen == [[4, 4], [4, 0], [4, 3]]


def test_host_lookup_cache_refuses(make_cache):
    cache, _ = make_cache(_layout(), budget_experts=4)
    layer = cache.layout.moe_layers[0]
    with pytest.raises(InvalidStateError, match="needs a device-lookup cache"):
        cache.select_device(layer, device_ids(cache, [1]))


def test_lookup_argument_checked(backend):
    layout = _layout()
    with HostSource(layout) as source:
        with pytest.raises(ValueError, match="lookup must be one of"):
            ExpertCache(layout, source, budget_experts=4, backend=backend, lookup="gpu")
        with pytest.raises(InvalidArgumentError, match="set partition to global"):
            ExpertCache(layout, source, budget_experts=4, backend=backend, lookup="device", partition="layer")
        for policy in [None, *_lib.POLICIES]:  # every policy runs in the device lookup
            with ExpertCache(
                layout, source, budget_experts=4, backend=backend, lookup="device", log_level=0, policy=policy
            ) as cache:
                assert cache.policy == (policy or _lib.DEFAULT_POLICY) and cache.lookup == "device"


def test_c_config_takes_every_policy_for_a_device_lookup():
    lib = _lib.lib
    cfg = _lib.Config()
    lib.expcache_config_init(ctypes.byref(cfg))
    cfg.num_layers, cfg.budget_experts, cfg.backend = 4, 4, _lib.BACKEND_HOST
    cfg.lookup = _lib.LOOKUP_DEVICE
    handle = _lib.CachePtr()
    for policy in _lib.POLICIES.values():
        cfg.policy = policy
        lib.expcache_create(ctypes.byref(cfg), ctypes.byref(handle))
        lib.expcache_destroy(handle)
    cfg.lookup = 2
    with pytest.raises(InvalidArgumentError, match="unknown lookup 2"):
        lib.expcache_create(ctypes.byref(cfg), ctypes.byref(handle))


def test_no_class_reuse_on_a_device_lookup_cache(make_cache):
    layout = ModelLayout.preset("mixed", scale=SCALE)
    with pytest.warns(ExpcacheWarning, match="2 expert size classes and max_classes is 1"):
        cache, _ = make_cache(layout, budget_experts=4, lookup="device", max_classes=1, pinned=True)
    first, second = [next(i for i in layout.moe_layers if layout[i].class_key == key) for key in layout.classes()]
    _select(cache, first, [1])
    with pytest.raises(InvalidStateError, match="never reuses a class"):
        _select(cache, second, [1])
    assert _select(cache, first, [1])[0] >= 0  # the first class is intact


def test_bank_views_outlive_the_cache(make_cache):
    cache, source = _cache(make_cache, experts=4)
    layer = cache.layout.moe_layers[0]
    slot = int(_select(cache, layer, [5])[0])
    bank = cache.bank(layer, dtype=np.uint8)
    want = source.part(layer, 5, 0)
    if cache.backend == "host":
        gate = np.asarray(bank.gate)
        assert gate.strides == (bank.part_strides[0], 1)
        cache.close()
        assert (gate[slot] == want).all()  # the bank's memory lives while the array does
    else:
        import torch

        gate = torch.from_dlpack(bank.gate)
        assert gate.stride() == (bank.part_strides[0], 1)
        assert (gate[slot].cpu().numpy() == want).all()
        cache.close()
        torch.cuda.synchronize()
        assert (gate[slot].cpu().numpy() == want).all()


def test_bank_shapes_and_dtype(make_cache):
    cache, source = _cache(make_cache, experts=4)
    layer = cache.layout.moe_layers[0]
    spec = cache.layout[layer]
    shapes = [(2, spec.gate_bytes // 4), (spec.up_bytes // 2,), (1, spec.down_bytes // 2)]
    bank = cache.bank(layer, dtype="uint16", shapes=shapes)
    assert bank.gate.shape == (bank.rows, 2, spec.gate_bytes // 4)
    assert bank.gate.strides == (bank.part_strides[0], spec.gate_bytes // 2, 2)
    assert bank.down.shape == (bank.rows, 1, spec.down_bytes // 2)


def test_torch_ids_are_read_directly_and_checked(make_cache):
    """torch tensors are read by data_ptr (no interface dict); their errors say the same as numpy's."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    cache, source = _cache(make_cache, experts=4)
    layer = cache.layout.moe_layers[0]
    device = "cuda" if cache.backend == "cuda" else "cpu"
    slots = cache.select_device(layer, torch.tensor([[3, 7]], device=device, dtype=torch.int32))
    assert slots.dtype == torch.int32 and slots.shape == (1, 2)
    assert_served(cache, source, layer, [3, 7], bank_rows(cache.bank(layer), slots.cpu().reshape(-1).tolist()))
    with pytest.raises(TypeError, match="int32 or int64 ids, got torch.float32"):
        cache.select_device(layer, torch.tensor([1.0], device=device))
    with pytest.raises(ValueError, match="1-D \\[k\\] or 2-D"):
        cache.select_device(layer, torch.zeros((1, 1, 2), dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="C-contiguous"):
        cache.select_device(layer, torch.zeros((2, 4), dtype=torch.long, device=device)[:, ::2])
    with pytest.raises(ValueError, match="CUDA or host memory, got a tensor on meta"):
        cache.select_device(layer, torch.zeros(2, dtype=torch.long, device="meta"))


def test_bank_gate_up_is_both_parts_as_one_view(make_cache):
    """gate_up(): each slot's gate and up side by side (gate bytes a multiple of 256), as the fused
    weight engines keep; two equal-shaped parts double the first dimension."""
    layout = ModelLayout([LayerSpec(8, 1024, 1024, 512)])
    # A fused view needs a slots bank (tests/test_bank_arrangement.py: a parts bank refuses it).
    cache, source = make_cache(layout, lookup="device", budget_experts=4, pinned=True, bank_arrangement="slots")
    slots = _select(cache, 0, [6, 2])
    bank = cache.bank(0, dtype="uint16", shapes=[(4, 128), (4, 128), (256,)])
    joined = bank.gate_up()
    assert joined.shape == (bank.rows, 8, 128) and joined.strides == (bank.slot_stride, 256, 2)
    assert joined.ptr == bank.gate.ptr and joined.dtype == bank.gate.dtype
    rows = _bank_bytes(cache, bank.gate_up(dtype=np.uint8), bank.cap)
    for expert, slot in zip([6, 2], slots):
        want = np.concatenate([source.part(0, expert, 0), source.part(0, expert, 1)])
        assert (rows[slot] == want).all()
    assert bank.gate_up(shape=(1024,), dtype="uint16").shape == (bank.rows, 1024)


def test_bank_gate_up_refuses_parts_apart(make_cache):
    layout = ModelLayout([LayerSpec(8, 1000, 1000, 512)])  # up starts at 1024, not 1000
    cache, _ = make_cache(layout, lookup="device", budget_experts=4, pinned=True, bank_arrangement="slots")
    with pytest.raises(ValueError, match="24 B apart in a slot.*multiple of 256"):
        cache.bank(0).gate_up()


def _bank_bytes(cache, view, cap):
    """The view's first ``cap`` rows (the slots: the staging rows past them may have no memory) as
    a numpy array (copied from the device on CUDA)."""
    if cache.backend == "host":
        return np.asarray(view)[:cap]
    import torch

    return torch.from_dlpack(view)[:cap].cpu().numpy()


def test_bank_checksum_reads_the_slots(make_cache):
    """The benchmark's kernel over a bank: each slot's expert summed as the source's checksum."""
    cache, source = _cache(make_cache, experts=6)
    layer = cache.layout.moe_layers[0]
    ids = [3, 7, 3, 11]
    slots = cache.select_device(
        layer,
        device_ids(cache, ids),
    )
    testing.bank_checksum_async(cache, layer, slots, first=10)
    cache.synchronize()
    got = testing.checksum_results(cache, 10, 4)
    assert got.tolist() == [source.expected_checksum(layer, e) for e in ids]
    with pytest.raises(TypeError, match="int32"):
        testing.bank_checksum_async(cache, layer, device_ids(cache, ids), first=0)


def test_pinned_memory_is_emulated_where_no_cuda_device_is(monkeypatch, backend):
    """HostSource(pinned=True) without a usable CUDA device: ordinary memory a host-backend cache
    treats as pinned (so device selects read it, as on a GPU), which a CUDA cache refuses."""
    from pyexpcache import _cuda

    monkeypatch.setattr(_cuda, "device_count", lambda: 0)
    layout = _layout()
    with HostSource(layout, pinned=True) as source:
        assert source.pinned_emulated and "pinned (emulated)" in repr(source)
        if backend == "cuda":
            with pytest.raises(ValueError, match="pinned memory is emulated"):
                ExpertCache(layout, source, budget_experts=4, backend="cuda", lookup="device")
            return
        with ExpertCache(layout, source, budget_experts=4, backend="host", lookup="device") as cache:
            layer = layout.moe_layers[0]
            slots = _select(cache, layer, [3, 1])
            assert_served(cache, source, layer, [3, 1], bank_rows(cache.bank(layer), slots))


@pytest.mark.parametrize("policy", ["lru", "duel"])
def test_host_side_calls_serve_a_pageable_source(make_cache, policy):
    """From a source the GPU cannot read the device select chooses the slots and the call copies
    into them: every host-side serving call works (select_device has it fed: test_device_feed.py)."""
    cache, source = _cache(make_cache, pinned=False, experts=4, policy=policy)
    layer = cache.layout.moe_layers[0]
    ptrs = cache.select(layer, [1, 2, 1])
    assert_served(cache, source, layer, [1, 2, 1], ptrs)
    slots = cache.select_slots(layer, np.array([3, 1], dtype=np.int64))
    assert_served(cache, source, layer, [3, 1], bank_rows(cache.bank(layer), slots))
    buf = cache.load_compact(layer, [1, 9, 3])
    assert_served(cache, source, layer, [1, 9, 3], buf.pointers())
    for by_slots in (False, True):
        with cache.prepare_batch(layer, np.array([[1, 4, 10, 11]]), slots=by_slots) as batch:
            assert_served(cache, source, layer, batch.ids, batch.pointers)
    for e in (1, 2, 3, 4):
        got = testing.read_expert(cache, layer, e)
        assert got is None or (got == source.expert_bytes(layer, e)).all()


def test_a_failed_copy_from_the_host_frees_its_slot_on_the_device(make_cache):
    """A host-side call whose copy into a slot the device gave fails forgets that slot on the device
    (and the fills it had not copied yet): none of them is resident afterwards, the resident count
    agrees, and the next select copies them again."""
    cache, source = _cache(make_cache, pinned=False, experts=6)
    layer = cache.layout.moe_layers[0]
    cache.select(layer, [1])
    testing.fail_copy_after(cache, 1)  # the first fill's copy goes out, the second fails
    with pytest.raises(CudaError, match="injected copy failure"):
        cache.select(layer, [2, 3, 4])
    testing.fail_copy_after(cache, 0, 0)
    assert testing.read_expert(cache, layer, 1) is not None
    assert [testing.read_expert(cache, layer, e) is None for e in (3, 4)] == [True, True]
    resident = sum(testing.read_expert(cache, layer, e) is not None for e in range(cache.layout[layer].num_experts))
    assert cache.classes()[0].resident_experts == resident
    ptrs = cache.select(layer, [2, 3, 4])
    assert_served(cache, source, layer, [2, 3, 4], ptrs)


@pytest.mark.parametrize("by_slots", [False, True])
def test_a_failed_batch_leaves_no_slot_pinned(make_cache, by_slots):
    """A batch whose copy fails after the device pinned its hits and fills unpins every one of them:
    the next select may take every slot of the bank."""
    cache, source = _cache(make_cache, pinned=False, experts=4)
    layer = cache.layout.moe_layers[0]
    cache.select(layer, [1])
    testing.fail_copy_after(cache, 1)
    with pytest.raises(CudaError, match="injected copy failure"):
        cache.prepare_batch(layer, np.array([[1, 2, 3, 4]]), slots=by_slots)
    testing.fail_copy_after(cache, 0, 0)
    assert cache.classes()[0].held_experts == 0
    slots = cache.select_slots(layer, np.array([20, 21, 22, 23]))
    assert (slots < cache.bank(layer).cap).all()  # none stayed pinned: all four got a slot
    assert_served(cache, source, layer, [20, 21, 22, 23], bank_rows(cache.bank(layer), slots))


def test_a_class_of_cap_0_serves_the_host_side_calls_from_staging(make_cache):
    """A budget under one expert leaves the class no slot: select_device is refused with the reason,
    and every host-side call serves its experts from the bank's staging or batch rows, loaded
    directly, byte-exact."""
    cache, source = _cache(make_cache, experts=None, budget_bytes=1000)
    layer = cache.layout.moe_layers[0]
    with pytest.warns(ExpcacheWarning, match="cap 0 experts"):
        ptrs = cache.select(layer, [1, 2, 1])
    assert_served(cache, source, layer, [1, 2, 1], ptrs)
    slots = cache.select_slots(layer, np.array([3, 1], dtype=np.int32))
    assert_served(cache, source, layer, [3, 1], bank_rows(cache.bank(layer), slots))
    buf = cache.load_compact(layer, [4, 2])
    assert_served(cache, source, layer, [4, 2], buf.pointers())
    for by_slots in (False, True):
        with cache.prepare_batch(layer, np.array([[5, 6]]), slots=by_slots) as batch:
            assert_served(cache, source, layer, batch.ids, batch.pointers)
    d = cache.stats().path("decode")
    assert (d.hits, d.misses, d.direct_loads) == (0, 4, 4)
    with pytest.raises(OutOfDeviceMemoryError, match="cap is 0 experts"):
        cache.select_device(layer, device_ids(cache, [1]))


CAP_0_CHILD = """
    import numpy as np
    from pyexpcache import ExpertCache, HostSource, ModelLayout
    lay = ModelLayout.preset("q2", scale=4096)
    with HostSource(lay, pinned=True) as src:
        with ExpertCache(lay, src, budget_bytes=1000, backend="host", lookup="device", log_level=0) as cache:
            layer = lay.moe_layers[0]
            cache.select(layer, [1, 2])
            cache.select_slots(layer, np.array([3, 1], dtype=np.int32))
            cache.load_compact(layer, [4, 2])
            cache.prepare_batch(layer, np.array([[5, 6]]), slots=True).finish()
    print("done")
"""


def test_a_class_of_cap_0_never_crashes_a_host_side_call():
    """The calls that once crashed (a host select on a device-lookup class with no slot), in a
    child process with a timeout: it ends, and normally."""
    out = run_child(CAP_0_CHILD, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr
