"""Experts of 1 to 8 parts through the C ABI (expcache_layer_desc_t.num_parts and parts[]), by raw
ctypes calls: every part served byte for byte from its slot in the bank, on each backend, lookup
and policy; classes keyed by every part's size; the calls that hand out three-part pointers refuse
other layers and name the calls that serve them."""

from __future__ import annotations

import ctypes
from ctypes import byref, c_int32, c_uint32, c_uint64

import numpy as np
import pytest

from pyexpcache import _lib
from pyexpcache._errors import ExpcacheError
from pyexpcache.source import checksum_bytes

from support.cache import BACKENDS

lib = _lib.lib
INVALID_STATE = 4  # EXPCACHE_ERR_INVALID_STATE
NUM_EXPERTS = 8
BUDGET = 3  # experts per class: selects of 2 over 8 experts evict


def _sizes(nparts: int) -> list[int]:
    """Part sizes that differ from each other and are not multiples of 16 (so the copies' tails
    and the bank's alignment are exercised): 300, 533, 766, ..."""
    return [300 + 233 * p for p in range(nparts)]


class RawCache:
    """A cache made and driven through the C ABI alone, its layers' parts in pageable host
    memory: [experts][stride] arrays of random bytes, stride past each part's size."""

    def __init__(self, backend: str, lookup: str, policy: str, num_layers: int = 4):
        cfg = _lib.Config()
        lib.expcache_config_init(byref(cfg))
        cfg.num_layers = num_layers
        cfg.budget_experts = BUDGET
        cfg.backend = _lib.BACKEND_CUDA if backend == "cuda" else _lib.BACKEND_HOST
        cfg.lookup = _lib.LOOKUPS[lookup]
        cfg.policy = list(_lib.POLICIES).index(policy)
        cfg.log_level = 0
        self.handle = _lib.CachePtr()
        lib.expcache_create(byref(cfg), byref(self.handle))
        self.backend = backend
        self.parts: dict[int, list[np.ndarray]] = {}
        self.rng = np.random.default_rng(7)
        self._registered: list[int] = []  # host addresses cudaHostRegister'ed by register(pinned=True)

    def close(self):
        lib.expcache_destroy(self.handle.value)
        if self._registered:
            from pyexpcache import _cuda

            for address in self._registered:
                _cuda.runtime().cudaHostUnregister(address)

    def register(
        self, layer: int, sizes: list[int], shorthand: bool = False, align: int = 1, pad: int = 40, pinned: bool = False
    ) -> None:
        """Layer ``layer``'s parts of ``sizes`` bytes, each expert's part at a stride of its size
        rounded up to ``align``, plus ``pad``; ``pinned``: declared pinned (on CUDA registered with
        cudaHostRegister, unregistered at close)."""
        arrays = [
            self.rng.integers(0, 256, (NUM_EXPERTS, (n + align - 1) // align * align + pad), dtype=np.uint8)
            for n in sizes
        ]
        self.parts[layer] = [a[:, :n] for a, n in zip(arrays, sizes)]
        self._arrays = getattr(self, "_arrays", []) + arrays  # alive while the cache may read them
        if pinned and self.backend == "cuda":
            from pyexpcache import _cuda

            rt = _cuda.runtime()
            for a in arrays:
                _cuda.check(rt.cudaHostRegister(a.ctypes.data, a.nbytes, rt.cudaHostRegisterMapped), "cudaHostRegister")
                self._registered.append(a.ctypes.data)
        d = _lib.LayerDesc()
        lib.expcache_layer_desc_init(byref(d))
        d.num_experts = NUM_EXPERTS
        if pinned:
            d.source_kind = _lib.SOURCE_PINNED
        if shorthand:
            assert len(sizes) == 3
            for name, n, a in zip(("gate", "up", "down"), sizes, arrays):
                setattr(d, f"{name}_bytes", n)
                setattr(d, f"{name}_stride", a.strides[0])
                setattr(d, f"{name}_base", a.ctypes.data)
        else:
            d.num_parts = len(sizes)
            for p, (n, a) in enumerate(zip(sizes, arrays)):
                d.parts[p].bytes, d.parts[p].stride, d.parts[p].base = n, a.strides[0], a.ctypes.data
        lib.expcache_layer_register(self.handle.value, layer, byref(d))

    def select_slots(self, layer: int, ids: list[int]) -> list[int]:
        ids_arr = (c_int32 * len(ids))(*ids)
        out = (c_int32 * len(ids))()
        lib.expcache_select_slots_async(self.handle.value, layer, ids_arr, 32, len(ids), out, None)
        lib.expcache_synchronize(self.handle.value, None)
        return list(out)

    def select_device_and_check(self, layer: int, ids: list[int]) -> None:
        """expcache_select_device_async of ``ids`` (one row), synchronized; every part of every
        slot it gives checked against the source."""
        d_ids, d_slots, read, free = _device_ids(self, ids)
        try:
            lib.expcache_select_device_async(self.handle.value, layer, d_ids, 32, 1, len(ids), d_slots, None)
            lib.expcache_synchronize(self.handle.value, None)
            for e, slot in zip(ids, read()):
                self.assert_slot_holds(layer, int(slot), e)
        finally:
            free()

    def bank(self, layer: int) -> _lib.Bank:
        c = c_uint32()
        lib.expcache_layer_bind_class(self.handle.value, layer, byref(c))
        b = _lib.Bank()
        b.struct_size = ctypes.sizeof(_lib.Bank)
        lib.expcache_class_bank_get(self.handle.value, c.value, byref(b))
        return b

    def read(self, address: int, n: int) -> np.ndarray:
        out = np.empty(n, np.uint8)
        lib.expcache_testing_read_device(self.handle.value, address, out.ctypes.data, n)
        return out

    def assert_slot_holds(self, layer: int, slot: int, expert: int) -> None:
        b = self.bank(layer)
        assert 0 <= slot < b.rows
        for p, src in enumerate(self.parts[layer]):
            got = self.read(b.base + slot * b.slot_stride + b.part_offset[p], b.part_bytes[p])
            assert (got == src[expert]).all(), f"layer {layer} expert {expert} part {p} differs"


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture(params=["host", "device"])
def lookup(request):
    return request.param


@pytest.fixture
def raw(backend, lookup, policy):
    cache = RawCache(backend, lookup, policy)
    yield cache
    cache.close()


@pytest.mark.parametrize("nparts", [1, 2, 5, 8])
def test_every_part_is_served_byte_exact_from_the_bank(raw, nparts):
    raw.register(0, _sizes(nparts))
    rng = np.random.default_rng(nparts)
    for _ in range(12):
        ids = [int(i) for i in rng.choice(NUM_EXPERTS, 2, replace=False)]
        for e, slot in zip(ids, raw.select_slots(0, ids)):
            raw.assert_slot_holds(0, slot, e)


def test_the_bank_lays_out_each_part_aligned(raw):
    sizes = _sizes(5)
    raw.register(0, sizes)
    raw.select_slots(0, [1])
    b = raw.bank(0)
    assert b.num_parts == 5
    assert list(b.part_bytes) == sizes + [0, 0, 0]
    offsets = list(b.part_offset[:5])
    assert offsets[0] == 0 and all(o % 256 == 0 for o in offsets)
    assert all(offsets[p + 1] >= offsets[p] + sizes[p] for p in range(4))
    assert b.slot_stride >= offsets[4] + sizes[4]
    assert (b.gate_bytes, b.up_bytes, b.down_bytes, b.gate_offset) == (0, 0, 0, 0)


@pytest.mark.parametrize("policy", ["lru"])  # the classes, not the victims, are under test
def test_part_counts_and_sizes_key_the_classes(raw):
    three = _sizes(3)
    raw.register(0, three, shorthand=True)
    raw.register(1, _sizes(5))
    raw.register(2, three)  # the same sizes through parts[]: layer 0's class
    raw.register(3, three[:2])  # a prefix of layer 0's sizes: a class of its own
    classes = []
    for layer in range(4):
        raw.select_slots(layer, [0, 1])
        c = c_uint32()
        lib.expcache_layer_bind_class(raw.handle.value, layer, byref(c))
        classes.append(c.value)
    assert classes[0] == classes[2] and len({classes[0], classes[1], classes[3]}) == 3
    for layer in range(4):
        sizes = [a.shape[1] for a in raw.parts[layer]]
        found = c_uint32()
        lib.expcache_class_find_parts(raw.handle.value, len(sizes), (c_uint64 * len(sizes))(*sizes), byref(found))
        assert found.value == classes[layer]
        info = _lib.ClassInfo()
        info.struct_size = ctypes.sizeof(_lib.ClassInfo)
        lib.expcache_class_info_get(raw.handle.value, found.value, byref(info))
        assert info.num_parts == len(sizes) and list(info.part_bytes[: len(sizes)]) == sizes
        three_fields = (info.gate_bytes, info.up_bytes, info.down_bytes)
        assert three_fields == (tuple(sizes) if len(sizes) == 3 else (0, 0, 0))
    found = c_uint32()
    lib.expcache_class_find(raw.handle.value, *three, byref(found))
    assert found.value == classes[0]
    for layer in range(4):  # every layer's residents are its own bytes
        for e, slot in zip([0, 1], raw.select_slots(layer, [0, 1])):
            raw.assert_slot_holds(layer, slot, e)


@pytest.mark.parametrize("policy", ["lru"])
def test_calls_handing_out_three_part_pointers_refuse_other_layers(raw):
    raw.register(0, _sizes(5))
    raw.register(1, _sizes(3))  # three parts through parts[]: the pointer calls serve it
    ptrs = (_lib.ExpertPtrs * 2)()
    ids = (c_uint32 * 2)(1, 2)
    with pytest.raises(ExpcacheError) as info:
        lib.expcache_select_async(raw.handle.value, 0, ids, 2, None, ptrs)
    assert info.value.status == INVALID_STATE
    assert "layer 0's experts have 5 parts" in info.value.message
    assert "expcache_select_slots_async" in info.value.message
    count, batch = c_uint32(), c_uint64()
    with pytest.raises(ExpcacheError) as info:
        lib.expcache_batch_prepare_async(raw.handle.value, 0, ids, 2, None, ids, ptrs, byref(count), byref(batch))
    assert "expcache_batch_prepare_slots_async" in info.value.message
    lib.expcache_select_async(raw.handle.value, 1, ids, 2, None, ptrs)
    lib.expcache_synchronize(raw.handle.value, None)
    for e, row in zip([1, 2], ptrs):
        for p, addr in enumerate((row.gate, row.up, row.down)):
            assert (raw.read(addr, raw.parts[1][p].shape[1]) == raw.parts[1][p][e]).all()
    # The refused layer is still served by slot id.
    for e, slot in zip([1, 2], raw.select_slots(0, [1, 2])):
        raw.assert_slot_holds(0, slot, e)


def test_a_compact_buffer_has_a_region_per_part(raw):
    sizes = _sizes(4)
    raw.register(0, sizes)
    raw.select_slots(0, [3])  # one hit, lent from its slot
    ids = [3, 5, 3, 6]
    out = _lib.Compact()
    out.struct_size = ctypes.sizeof(_lib.Compact)
    lib.expcache_compact_load_async(raw.handle.value, 0, (c_uint32 * 4)(*ids), 4, None, byref(out))
    lib.expcache_synchronize(raw.handle.value, None)
    assert out.num_parts == 4 and list(out.part_bytes[:4]) == sizes
    for p, n in enumerate(sizes):
        assert out.part_offset[p] % 256 == 0
        for i, e in enumerate(ids):
            assert (raw.read(out.base + out.part_offset[p] + i * n, n) == raw.parts[0][p][e]).all()


def test_a_batch_by_slot_id_serves_every_part(raw):
    raw.register(0, _sizes(6))
    ids = [0, 4, 7, 4, 2, 5, 1]  # more distinct experts than the budget: some staged in batch rows
    out_ids = (c_uint32 * len(ids))()
    out_slots = (c_int32 * len(ids))()
    count, batch = c_uint32(), c_uint64()
    lib.expcache_batch_prepare_slots_async(
        raw.handle.value,
        0,
        (c_int32 * len(ids))(*ids),
        32,
        len(ids),
        None,
        out_ids,
        out_slots,
        byref(count),
        byref(batch),
    )
    lib.expcache_synchronize(raw.handle.value, None)
    assert sorted(out_ids[: count.value]) == sorted(set(ids))
    for i in range(count.value):
        raw.assert_slot_holds(0, out_slots[i], out_ids[i])
    lib.expcache_batch_finish(raw.handle.value, batch.value, None)


def _device_ids(raw, ids):
    """ids where select_device reads them: host memory on the host backend, device memory on CUDA;
    and the slots' buffer beside them. Returns (ids address, slots address, read back, free)."""
    n = len(ids)
    if raw.backend == "host":
        ids_arr = np.asarray(ids, np.int32)
        slots = np.empty(n, np.int32)
        return ids_arr.ctypes.data, slots.ctypes.data, lambda: slots.copy(), lambda: (ids_arr, slots)
    from pyexpcache import _cuda

    rt = _cuda.runtime()
    host = np.asarray(ids, np.int32)
    d_ids = _cuda.check(rt.cudaMalloc(4 * n), "cudaMalloc")
    d_slots = _cuda.check(rt.cudaMalloc(4 * n), "cudaMalloc")
    _cuda.check(rt.cudaMemcpy(d_ids, host.ctypes.data, 4 * n, rt.cudaMemcpyKind.cudaMemcpyHostToDevice), "copy")

    def read():
        out = np.empty(n, np.int32)
        kind = rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        _cuda.check(rt.cudaMemcpy(out.ctypes.data, d_slots, 4 * n, kind), "copy")
        return out

    def free():
        rt.cudaFree(d_ids)
        rt.cudaFree(d_slots)

    return int(d_ids), int(d_slots), read, free


@pytest.mark.parametrize("lookup", ["device"])
@pytest.mark.parametrize("nparts", [1, 7])
def test_a_device_select_copies_every_part(raw, nparts):
    """select_device over a pageable source (fed: each part read in pieces into the feed's rows,
    then into the slot)."""
    raw.register(0, _sizes(nparts))
    rng = np.random.default_rng(nparts)
    for _ in range(6):
        raw.select_device_and_check(0, [int(i) for i in rng.choice(NUM_EXPERTS, 2, replace=False)])


@pytest.mark.parametrize(
    "sizes",
    [_sizes(5), [2**20 + 4, 70_012, 3 * 2**20 + 8]],  # parts within one round of the grid, and over many
    ids=["small", "large"],
)
@pytest.mark.parametrize("pad", [16, 8], ids=["aligned", "unaligned"])  # each stride: a multiple of 16, or not
def test_a_device_select_copies_every_part_from_pinned_memory(backend, sizes, pad):
    """select_device over pinned memory the GPU maps, its misses copied by the select's grid (the
    blocks polling for them apart): up to three misses a select, every part (none a multiple of
    16 bytes) copied 16 bytes at a time where each part's address and stride allow it, then its
    tail, and byte by byte where they do not."""
    rng = np.random.default_rng(len(sizes) + pad)
    cache = RawCache(backend, "device", "lru")
    try:
        cache.register(0, sizes, align=16, pad=pad, pinned=True)
        for _ in range(8):
            cache.select_device_and_check(0, [int(i) for i in rng.choice(NUM_EXPERTS, BUDGET, replace=False)])
    finally:
        cache.close()


def _shuffled_parts(raw, sizes, rng):
    """Each part's experts in one buffer, in a shuffled order with gaps: (buffer, offsets per part),
    the expected bytes set in raw.parts."""
    arrays, tables = [], []
    for n in sizes:
        order = rng.permutation(NUM_EXPERTS)
        pitch = n + 24
        buf = rng.integers(0, 256, NUM_EXPERTS * pitch + 8, dtype=np.uint8)
        offsets = np.array([8 + int(order[e]) * pitch for e in range(NUM_EXPERTS)], np.uint64)
        arrays.append(np.stack([buf[o : o + n] for o in offsets]))
        tables.append((buf, offsets))
    return arrays, tables


@pytest.mark.parametrize("policy", ["lru"])
@pytest.mark.parametrize("kind", [0, 1])  # pageable, pinned (declared: the tables make a device select feed it)
def test_parts_at_offsets_of_their_own_are_served(raw, kind):
    """A checkpoint that keeps each expert's tensor apart: expcache_part_t.offsets, one per expert."""
    sizes = _sizes(3)
    arrays, tables = _shuffled_parts(raw, sizes, np.random.default_rng(3))
    raw.parts[0] = arrays
    d = _lib.LayerDesc()
    lib.expcache_layer_desc_init(byref(d))
    d.num_experts, d.num_parts, d.source_kind = NUM_EXPERTS, 3, kind
    for p, (n, (buf, offsets)) in enumerate(zip(sizes, tables)):
        d.parts[p].bytes, d.parts[p].base = n, buf.ctypes.data
        d.parts[p].offsets = offsets.ctypes.data_as(ctypes.POINTER(c_uint64))
    lib.expcache_layer_register(raw.handle.value, 0, byref(d))
    del offsets  # copied at registration
    raw._arrays = tables
    for ids in ([1, 6], [0, 7], [3, 1], [5, 2], [4, 6]):
        for e, slot in zip(ids, raw.select_slots(0, ids)):
            raw.assert_slot_holds(0, slot, e)


@pytest.mark.parametrize("policy", ["lru"])
@pytest.mark.parametrize("reads", [0, 1])  # buffered, O_DIRECT
def test_a_layer_spread_over_files_is_served(raw, tmp_path, reads):
    """A checkpoint of shards: expcache_part_t.files, each expert's part in a file of its own choice,
    at its own offset."""
    sizes = _sizes(2)
    rng = np.random.default_rng(5)
    arrays = [rng.integers(0, 256, (NUM_EXPERTS, n), dtype=np.uint8) for n in sizes]
    raw.parts[0] = arrays
    shards = [bytearray(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()) for _ in range(2)]
    files = np.empty((2, NUM_EXPERTS), np.uint32)
    offsets = np.empty((2, NUM_EXPERTS), np.uint64)
    for e in range(NUM_EXPERTS):
        for p in range(2):
            f = (e + p) % 2
            files[p, e], offsets[p, e] = f, len(shards[f])
            shards[f] += arrays[p][e].tobytes() + b"\0" * 100
    ids = []
    for i, data in enumerate(shards):
        path = tmp_path / f"shard{i}.bin"
        path.write_bytes(bytes(data))
        fid = c_uint32()
        lib.expcache_file_open(raw.handle.value, str(path).encode(), byref(fid))
        ids.append(fid.value)
    files = np.vectorize(lambda f: ids[f])(files).astype(np.uint32)
    d = _lib.LayerDesc()
    lib.expcache_layer_desc_init(byref(d))
    d.num_experts, d.num_parts, d.source_kind, d.file = NUM_EXPERTS, 2, 2, ids[0]
    for p, n in enumerate(sizes):
        d.parts[p].bytes = n
        d.parts[p].offsets = offsets[p].ctypes.data_as(ctypes.POINTER(c_uint64))
        d.parts[p].files = files[p].ctypes.data_as(ctypes.POINTER(c_uint32))
    lib.expcache_layer_register(raw.handle.value, 0, byref(d))
    for sel in ([1, 6], [0, 7], [3, 1], [5, 2], [4, 6]):
        for e, slot in zip(sel, raw.select_slots(0, sel)):
            raw.assert_slot_holds(0, slot, e)


@pytest.mark.parametrize("policy", ["lru"])
@pytest.mark.parametrize("lookup", ["host"])
def test_bad_file_tables_are_refused_naming_the_expert(raw, tmp_path):
    path = tmp_path / "shard.bin"
    path.write_bytes(b"\1" * 4096)
    fid = c_uint32()
    lib.expcache_file_open(raw.handle.value, str(path).encode(), byref(fid))
    offsets = (c_uint64 * NUM_EXPERTS)(*[512 * e for e in range(NUM_EXPERTS)])
    for files, fragment in (
        ([fid.value] * 5 + [7] + [fid.value] * 2, "parts[0].files[5] is 7, not a file expcache_file_open gave"),
        ([fid.value] * NUM_EXPERTS, "parts[0] part of expert 7 ends at byte 4608, past the end of"),
    ):
        d = _lib.LayerDesc()
        lib.expcache_layer_desc_init(byref(d))
        d.num_experts, d.num_parts, d.source_kind, d.file = NUM_EXPERTS, 1, 2, fid.value
        d.parts[0].bytes, d.parts[0].base, d.parts[0].offsets = 1024, 0, offsets
        d.parts[0].files = (c_uint32 * NUM_EXPERTS)(*files)
        with pytest.raises(ExpcacheError) as info:
            lib.expcache_layer_register(raw.handle.value, 0, byref(d))
        assert fragment in info.value.message, info.value.message


@pytest.mark.parametrize("policy", ["lru"])
@pytest.mark.parametrize("lookup", ["host"])
def test_a_prefetch_sends_every_part_at_its_offset(raw):
    sizes = _sizes(4)
    arrays, tables = _shuffled_parts(raw, sizes, np.random.default_rng(9))
    raw.parts[0], raw._arrays = arrays, tables
    d = _lib.LayerDesc()
    lib.expcache_layer_desc_init(byref(d))
    d.num_experts, d.num_parts = NUM_EXPERTS, 4
    for p, (n, (buf, offsets)) in enumerate(zip(sizes, tables)):
        d.parts[p].bytes, d.parts[p].base = n, buf.ctypes.data
        d.parts[p].offsets = offsets.ctypes.data_as(ctypes.POINTER(c_uint64))
    lib.expcache_layer_register(raw.handle.value, 0, byref(d))
    queued = c_uint32()
    lib.expcache_prefetch_async(raw.handle.value, 0, (c_uint32 * 2)(2, 5), 2, None, byref(queued))
    lib.expcache_prefetch_wait(raw.handle.value)
    assert queued.value == 2
    for e, slot in zip([2, 5], raw.select_slots(0, [2, 5])):
        raw.assert_slot_holds(0, slot, e)


def _sum_of_parts(raw, layer: int, expert: int) -> int:
    """The checksum kernel's rule over every part of an expert's source bytes."""
    return sum(checksum_bytes(part[expert]) for part in raw.parts[layer]) & ((1 << 64) - 1)


def _host_slots_checksum(raw, layer: int, slots, first: int) -> list[int]:
    arr = np.asarray(slots, np.int32)
    lib.expcache_testing_bank_checksum_host_slots_async(raw.handle.value, layer, arr.ctypes.data, len(arr), None, first)
    arr[:] = -1  # the call has taken the slots: the array may be reused at once
    lib.expcache_synchronize(raw.handle.value, None)
    out = np.empty(len(slots), np.uint64)
    lib.expcache_testing_checksum_results(raw.handle.value, first, len(slots), out.ctypes.data)
    return out.tolist()


@pytest.mark.parametrize("nparts", [1, 4, 8])
def test_the_bank_checksum_of_host_slots_sums_every_part(raw, nparts):
    """expcache_testing_bank_checksum_host_slots_async over the slots a select by slot id writes
    to host memory (staged rows among them: more ids than the budget) and a batch's: each sum is
    every part's, as the checksum rule says; a slot outside the bank sums to 0."""
    raw.register(0, _sizes(nparts))
    ids = [0, 5, 2, 7]  # over BUDGET: one staged
    slots = raw.select_slots(0, ids)
    assert _host_slots_checksum(raw, 0, slots, 3) == [_sum_of_parts(raw, 0, e) for e in ids]
    assert _host_slots_checksum(raw, 0, [raw.bank(0).rows + 5, -1], 0) == [0, 0]
    out_ids, out_slots = (c_uint32 * 6)(), (c_int32 * 6)()
    count, batch = c_uint32(), c_uint64()
    batch_ids = [1, 3, 1, 6, 4, 0]
    lib.expcache_batch_prepare_slots_async(
        raw.handle.value, 0, (c_int32 * 6)(*batch_ids), 32, 6, None, out_ids, out_slots, byref(count), byref(batch)
    )
    n = count.value
    got = _host_slots_checksum(raw, 0, list(out_slots[:n]), 100)
    assert got == [_sum_of_parts(raw, 0, e) for e in out_ids[:n]]
    lib.expcache_batch_finish(raw.handle.value, batch.value, None)
