"""The device select's table read (``docs/device_lookup.md``): a select whose ids in range are all
resident is served from the slot map alone (hits refreshed and counted, no victim search,
nothing to copy), with the results the lookup would give; a class whose bank holds every expert
of its layers is always served so. ``testing.table_reads`` counts the selects served so, so each
test sees which way every select went. On the CUDA backend the selects run as captured graphs
replayed with new ids, and a captured select is one kernel node whether it misses or not; on the
host backend the same steps run eagerly."""

from __future__ import annotations

import numpy as np
import pytest

from pyexpcache import LayerSpec, ModelLayout, _cuda, _lib, bank as _bank, testing

from support.cache import assert_served, bank_rows, device_ids, to_numpy

# Two layers of one size class, 8 experts each: a budget of 16 experts holds the whole class.
LAYOUT = ModelLayout((LayerSpec(8, 512, 512, 768), LayerSpec(8, 512, 512, 768)), name="two8")


@pytest.fixture
def policy() -> str:
    return "lru"  # a device-lookup cache evicts by LRU


def _cache(make_cache, experts):
    return make_cache(LAYOUT, lookup="device", budget_experts=experts, pinned=True)


class _Step:
    """One counted select_device of ``shape`` ids of ``layer``, at fixed addresses: on the CUDA
    backend captured once in a graph and replayed after the new ids are copied in, on the host
    backend called again with the ids rewritten in place."""

    def __init__(self, cache, layer, shape):
        self.cache, self.layer, self.shape = cache, layer, shape
        self.ids = device_ids(cache, np.zeros(shape, np.int64))
        self.slots = device_ids(cache, np.zeros(shape, np.int32), dtype="int32")
        self.counts = device_ids(cache, [0, 0], dtype="int32")
        self.graph = None
        if cache.backend == "cuda":
            torch = pytest.importorskip("torch", reason="the CUDA backend's graphs are captured with torch")
            cache.bind_class(layer)  # a capture cannot allocate the bank
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._select()

    def _select(self):
        if self.graph is not None or self.cache.backend == "cuda":
            self.cache.select_device(self.layer, self.ids, out=self.slots, counts=self.counts)
            return
        # The host backend through the C ABI, as ids in device memory go: no host code checks
        # their range (select_device checks ids in host memory before the call).
        src, dst, tally = (_bank.id_array(a, "ids") for a in (self.ids, self.slots, self.counts))
        n, k = (1, self.ids.size) if self.ids.ndim == 1 else self.ids.shape
        with self.cache.raw_handle() as h:
            _lib.lib.expcache_select_device_counted_async(
                h, self.layer, src.ptr, src.bits, n, k, dst.ptr, tally.ptr, None
            )

    def __call__(self, ids):
        ids = np.asarray(ids, np.int64).reshape(self.shape)
        if self.graph is None:
            self.ids[...] = ids
            self._select()
        else:
            import torch

            self.ids.copy_(torch.from_numpy(ids))
            self.graph.replay()
            torch.cuda.synchronize()
        return to_numpy(self.slots).copy(), [int(c) for c in to_numpy(self.counts)]


def _device(cache):
    return cache.stats().classes[0].paths["device"]


def _resident(cache, layer):
    return {e for e in range(cache.layout[layer].num_experts) if testing.read_expert(cache, layer, e) is not None}


def test_a_class_holding_every_expert_is_served_by_its_table(make_cache):
    """Once both layers' 16 experts are in the 16-slot bank, every select is a table read: its
    slots are the ones the experts got when they were copied, its counts have no miss, the
    counters add its distinct experts as hits and nothing else, and a host-side call in between
    (served by the same grid from the device's state, counted on its own path) changes none of
    that."""
    cache, source = _cache(make_cache, 16)
    fill = {layer: _Step(cache, layer, (8,)) for layer in LAYOUT.moe_layers}
    home = {}
    for layer, step in fill.items():
        slots, counts = step(range(8))
        assert counts == [8, 8]
        home[layer] = dict(enumerate(slots.tolist()))
    assert testing.table_reads(cache, 0) == 0  # both filling selects missed
    assert sorted(s for h in home.values() for s in h.values()) == list(range(16))
    rows = {layer: _Step(cache, layer, (2, 3)) for layer in LAYOUT.moe_layers}
    rng = np.random.default_rng(5)
    before = _device(cache)
    served = distinct = 0
    for i in range(24):
        layer = int(rng.integers(0, 2))
        ids = rng.integers(0, 8, size=(2, 3))
        slots, counts = rows[layer](ids)
        served += 1
        distinct += len(set(ids.ravel().tolist()))
        assert slots.tolist() == [[home[layer][e] for e in row] for row in ids.tolist()]
        assert counts == [len(set(ids.ravel().tolist())), 0]
        assert testing.table_reads(cache, layer) == served
        assert_served(cache, source, layer, ids.ravel(), bank_rows(cache.bank(layer), slots.ravel()))
        if i == 11:
            cache.select(layer, [1, 2])  # a host select: two hits, on the device's state
            distinct += 2
    after = _device(cache)
    assert after.calls - before.calls == served
    assert after.hits - before.hits + cache.stats().path("decode").hits == distinct
    assert (after.misses, after.evictions, after.bytes_h2d) == (before.misses, before.evictions, before.bytes_h2d)
    assert _resident(cache, 0) == _resident(cache, 1) == set(range(8))


def test_hits_and_misses_mixed_follow_the_lru_model(make_cache):
    """A 4-slot bank and steps of 3 ids, some all hits, some with misses, replayed four times
    over: each step's counts and the residency after it equal a Python LRU model's (hits
    refreshed in order of first occurrence, then each miss evicting the least recently used),
    exactly the all-hit steps are table reads, and every slot holds its expert's bytes. The
    model's victims depend on the refreshes the table reads made: after 1, 2, 3, 4 came in,
    [3, 1, 1] then [7] evicts 2, not 1."""
    cache, source = _cache(make_cache, 4)
    layer = LAYOUT.moe_layers[0]
    step = _Step(cache, layer, (3,))
    steps = [[1, 2, 3], [4, 4, 4], [3, 1, 1], [7, 7, 7], [1, 3, 7], [2, 4, 5], [5, 4, 2], [6, 0, 6], [0, 6, 0]]
    lru: dict[int, None] = {}  # the model: resident experts, least recently used first
    reads = 0
    for replay in range(4):
        for ids in steps:
            order = list(dict.fromkeys(ids))
            missed = [e for e in order if e not in lru]
            for e in order:
                if e in lru:
                    lru[e] = lru.pop(e)
            for e in missed:
                if len(lru) == 4:
                    del lru[next(iter(lru))]
                lru[e] = None
            slots, counts = step(ids)
            reads += not missed
            assert counts == [len(order), len(missed)], (replay, ids)
            assert testing.table_reads(cache, layer) == reads, (replay, ids)
            assert _resident(cache, layer) == set(lru), (replay, ids)
            assert_served(cache, source, layer, ids, bank_rows(cache.bank(layer), slots))
            if (replay, ids) == (0, [7, 7, 7]):
                assert 2 not in lru and 1 in lru  # the table read of [3, 1, 1] refreshed 3 and 1
    assert 0 < reads < 4 * len(steps)
    d = _device(cache)
    assert d.calls == 4 * len(steps) and d.misses == d.appends + d.evictions


@pytest.mark.filterwarnings("ignore::pyexpcache.ExpcacheWarning")  # the report of the id out of range
def test_an_id_out_of_range_does_not_stop_a_table_read(make_cache):
    """An id out of range is no expert: the others all resident, the select is a table read that
    gives it slot -1, counts only the others and reports it like the lookup does."""
    cache, _ = _cache(make_cache, 8)
    layer = LAYOUT.moe_layers[1]
    step = _Step(cache, layer, (4,))
    step([4, 5, 4, 6])
    slots, counts = step([5, 8, 4, 5])
    assert counts == [2, 0] and slots[1] == -1 and slots[0] == slots[3] >= 0
    assert testing.table_reads(cache, layer) == 1


def test_a_captured_select_is_one_kernel_node(make_cache, backend):
    """Under capture a select adds one kernel to the graph, all hits or not: the lookup, the table
    read and the misses' copy are one grid (lookup_kernels_cuda.cu says why)."""
    if backend != "cuda":
        pytest.skip("graphs are the CUDA backend's")
    torch = pytest.importorskip("torch", reason="torch is not installed")
    try:
        rt = _cuda.runtime()
    except ImportError as exc:
        pytest.skip(str(exc))
    cache, _ = _cache(make_cache, 6)
    layer = LAYOUT.moe_layers[0]
    cache.bind_class(layer)
    ids = torch.tensor([1, 2, 3], device="cuda")
    slots = torch.empty(3, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    handle = stream.cuda_stream
    _cuda.check(
        rt.cudaStreamBeginCapture(handle, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal),
        "cudaStreamBeginCapture",
    )
    try:
        cache.select_device(layer, ids, stream=handle, out=slots)
    finally:
        graph = _cuda.check(rt.cudaStreamEndCapture(handle), "cudaStreamEndCapture")
    try:
        nodes, count = _cuda.check(rt.cudaGraphGetNodes(graph, 0), "cudaGraphGetNodes")
        nodes, count = _cuda.check(rt.cudaGraphGetNodes(graph, count), "cudaGraphGetNodes")
        kinds = [_cuda.check(rt.cudaGraphNodeGetType(n), "cudaGraphNodeGetType") for n in nodes]
        assert kinds == [rt.cudaGraphNodeType.cudaGraphNodeTypeKernel]
    finally:
        rt.cudaGraphDestroy(graph)
