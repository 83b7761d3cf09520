"""The C ABI's *_ids twins: every host call takes a router's int32 or int64 ids as they are (ds4's
are int32), with the uint32 call's results. Each twin is called through ctypes on one cache and
its uint32 original on a second cache of the same layout and policy, in the same order; the
served bytes are checked against the source and the two caches' counters must agree."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from pyexpcache import _lib

from support.cache import assert_served

lib = _lib.lib


def _ids(values, bits):
    return np.ascontiguousarray(values, dtype=np.int32 if bits == 32 else np.int64)


def _ptr(a):
    return a.ctypes.data_as(ctypes.c_void_p)


@pytest.mark.parametrize("bits", [32, 64])
def test_twins_serve_as_the_uint32_calls(make_cache, bits):
    twin, source = make_cache(budget_experts=6)
    plain, _ = make_cache(budget_experts=6)
    layer = twin.layout.moe_layers[0]
    h, p = twin._handle, plain._handle
    queued = ctypes.c_uint32()

    # hint, prefetch (then wait), select_split, compact load, a prefill batch: one after the other.
    ids = [3, 1, 3]
    lib.expcache_hint_ids(h, layer, _ptr(_ids(ids, bits)), bits, len(ids))
    lib.expcache_hint(p, layer, _ptr(_ids(ids, 32).view(np.uint32)), len(ids))
    lib.expcache_prefetch_ids_async(h, layer, _ptr(_ids([5, 6], bits)), bits, 2, None, ctypes.byref(queued))
    lib.expcache_prefetch_async(p, layer, _ptr(np.array([5, 6], np.uint32)), 2, None, ctypes.byref(queued))
    lib.expcache_prefetch_wait(h)
    lib.expcache_prefetch_wait(p)

    ptrs = (_lib.ExpertPtrs * 3)()
    resident = (ctypes.c_uint8 * 3)()
    ready = ctypes.c_void_p()
    lib.expcache_select_split_ids_async(
        h, layer, _ptr(_ids([5, 2, 5], bits)), bits, 3, None, ptrs, resident, ctypes.byref(ready)
    )
    lib.expcache_ready_wait_async(h, ready, None)
    lib.expcache_synchronize(h, None)
    assert_served(twin, source, layer, [5, 2, 5], [[r.gate, r.up, r.down] for r in ptrs])
    plain_ptrs = (_lib.ExpertPtrs * 3)()
    lib.expcache_select_split_async(
        p, layer, _ptr(np.array([5, 2, 5], np.uint32)), 3, None, plain_ptrs, (ctypes.c_uint8 * 3)(), ctypes.byref(ready)
    )
    lib.expcache_ready_wait_async(p, ready, None)

    compact = _lib.Compact()
    compact.struct_size = ctypes.sizeof(compact)
    lib.expcache_compact_load_ids_async(h, layer, _ptr(_ids([7, 2], bits)), bits, 2, None, ctypes.byref(compact))
    lib.expcache_synchronize(h, None)
    stride = compact.gate_bytes  # the gate parts first, one after the other
    assert_served(
        twin,
        source,
        layer,
        [7, 2],
        [
            [
                compact.base + compact.gate_offset + i * stride,
                compact.base + compact.up_offset + i * compact.up_bytes,
                compact.base + compact.down_offset + i * compact.down_bytes,
            ]
            for i in range(2)
        ],
    )
    plain_compact = _lib.Compact()
    plain_compact.struct_size = ctypes.sizeof(plain_compact)
    lib.expcache_compact_load_async(p, layer, _ptr(np.array([7, 2], np.uint32)), 2, None, ctypes.byref(plain_compact))

    batch_ids = (ctypes.c_uint32 * 4)()
    batch_ptrs = (_lib.ExpertPtrs * 4)()
    count, batch = ctypes.c_uint32(), ctypes.c_uint64()
    lib.expcache_batch_prepare_ids_async(
        h,
        layer,
        _ptr(_ids([9, 2, 9, 4], bits)),
        bits,
        4,
        None,
        batch_ids,
        batch_ptrs,
        ctypes.byref(count),
        ctypes.byref(batch),
    )
    assert count.value == 3 and list(batch_ids)[:3] == [9, 2, 4]
    lib.expcache_synchronize(h, None)
    assert_served(twin, source, layer, [9, 2, 4], [[r.gate, r.up, r.down] for r in batch_ptrs[:3]])
    lib.expcache_batch_finish(h, batch.value, None)
    lib.expcache_batch_prepare_async(
        p,
        layer,
        _ptr(np.array([9, 2, 9, 4], np.uint32)),
        4,
        None,
        (ctypes.c_uint32 * 4)(),
        (_lib.ExpertPtrs * 4)(),
        ctypes.byref(count),
        ctypes.byref(batch),
    )
    lib.expcache_batch_finish(p, batch.value, None)

    for path in ("decode", "compact", "batch", "control"):
        a, b = twin.stats().path(path), plain.stats().path(path)
        assert (a.hits, a.misses, a.evictions) == (b.hits, b.misses, b.evictions), path
