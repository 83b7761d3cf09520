"""Every integer the wrapper passes to C is range-checked against its C type first: ctypes
would wrap 2**32 + 5 to 5 and serve layer 5. A value that does not fit raises
ArgumentRangeError (a ValueError and an OverflowError) naming the parameter."""

from __future__ import annotations

import numpy as np
import pytest

from pyexpcache import ArgumentRangeError, ExpertCache, HostSource, ModelLayout, testing

from support.cache import SCALE

BIG32 = 2**32 + 5
BIG64 = 2**64 + 2**20

CALLS = [
    ("select layer", lambda c: c.select(BIG32, [1]), "layer"),
    ("select negative layer", lambda c: c.select(-1, [1]), "layer"),
    ("select expert id", lambda c: c.select(5, [2**32 + 1]), "expert_ids"),
    ("load_compact layer", lambda c: c.load_compact(BIG32, [1]), "layer"),
    ("prepare_batch layer", lambda c: c.prepare_batch(BIG32, [[1]]), "layer"),
    ("read_expert layer", lambda c: testing.read_expert(c, BIG32, 1), "layer"),
    ("read_expert expert", lambda c: testing.read_expert(c, 5, 2**32 + 1), "expert"),
    ("read_device address", lambda c: testing.read_device(c, BIG64, 8), "address"),
    ("read_device nbytes", lambda c: testing.read_device(c, 0, BIG64), "nbytes"),
    ("bind_class", lambda c: c.bind_class(BIG32), "layer"),
    ("checksum layer", lambda c: testing.checksum(c, BIG32, np.zeros((1, 3), np.uint64)), "layer"),
    ("checksum_async first", lambda c: testing.checksum_async(c, 5, np.zeros((1, 3), np.uint64), BIG32), "first"),
    ("checksum_results n", lambda c: testing.checksum_results(c, 0, BIG32), "n"),
    ("fail_device_alloc_after", lambda c: testing.fail_device_alloc_after(c, BIG64), "n"),
    ("fail_copy_after count", lambda c: testing.fail_copy_after(c, 0, -1), "count"),
    ("select stream", lambda c: c.select(5, [1], stream=BIG64), "stream"),
]


@pytest.mark.parametrize("name, call, parameter", CALLS, ids=[c[0] for c in CALLS])
def test_out_of_range_integers_raise_naming_the_parameter(make_cache, name, call, parameter):
    cache, source = make_cache(budget_experts=4)
    cache.select(5, [1])
    before = cache.stats().total
    with pytest.raises((ArgumentRangeError, ValueError, OverflowError), match=parameter):
        call(cache)
    after = cache.stats().total
    assert (after.calls, after.hits, after.misses) == (before.calls, before.hits, before.misses), (
        "a refused call reached the library"
    )
    assert (testing.read_expert(cache, 5, 1) == source.expert_bytes(5, 1)).all()


def test_range_error_is_both_value_and_overflow_error():
    assert issubclass(ArgumentRangeError, ValueError) and issubclass(ArgumentRangeError, OverflowError)


@pytest.mark.parametrize(
    "option, value",
    [
        ("budget_bytes", 2**64 + 2**20),
        ("budget_experts", 2**64),
        ("reserve_bytes", -1),
        ("max_classes", 2**32 + 4),
        ("device", 2**31),
        ("slab_bytes", 2**64),
        ("log_level", 2**32 + 1),
        ("copy_threads", 2**32 + 2),
        ("staging_bytes", 2**64 + (64 << 20)),
        ("staging_chunk_bytes", -(512 << 10)),
        ("device_capacity_bytes", 2**70),
    ],
)
def test_out_of_range_config_raises_naming_the_option(option, value):
    layout = ModelLayout.preset("q2", scale=SCALE)
    with HostSource(layout) as src:
        kwargs = {"budget_experts": 4, option: value}
        with pytest.raises(ArgumentRangeError, match=option):
            ExpertCache(layout, src, backend="host", **kwargs)
        assert src.users == 0


@pytest.mark.parametrize("value", [1.5, "3", True, None])
def test_non_integer_layer_is_a_type_error(make_cache, value):
    cache, _ = make_cache(budget_experts=4)
    with pytest.raises(TypeError, match="layer"):
        cache.select(value, [1])


def test_numpy_integers_are_accepted(make_cache):
    cache, source = make_cache(budget_experts=4)
    ptrs = cache.select(np.int64(5), np.array([1, 2], dtype=np.int64))
    assert ptrs.shape == (2, 3)
    assert (testing.read_expert(cache, np.uint32(5), np.int16(2)) == source.expert_bytes(5, 2)).all()


# -- the shape of expert ids ---------------------------------------------------------------
# One token's calls take 1-D ids; a 2-D array used to be flattened into one select of every
# token's experts (and a scalar served as one id). prepare_batch takes tokens x k.

SINGLE_TOKEN_CALLS = [
    ("select", lambda c, ids: c.select(5, ids)),
    ("select_views", lambda c, ids: c.select_views(5, ids)),
    ("select_split", lambda c, ids: c.select_split(5, ids)),
    ("prefetch", lambda c, ids: c.prefetch(5, ids)),
    ("hint", lambda c, ids: c.hint(5, ids)),
    ("load_compact", lambda c, ids: c.load_compact(5, ids)),
]
NOT_1D = [
    pytest.param(np.array([[1, 2], [3, 4]]), r"a 2-D array of shape \(2, 2\)", id="2d-int64"),
    pytest.param(np.array([[1, 2], [3, 4]], dtype=np.uint32), r"a 2-D array of shape \(2, 2\)", id="2d-uint32"),
    pytest.param([[1, 2]], r"a 2-D array of shape \(1, 2\)", id="nested-list"),
    pytest.param(np.zeros((1, 2, 1), dtype=np.uint32), r"a 3-D array", id="3d"),
    pytest.param(3, r"a scalar \(3\)", id="int"),
    pytest.param(np.uint32(3), r"a scalar \(3\)", id="numpy-scalar"),
]


@pytest.mark.parametrize("ids, got", NOT_1D)
@pytest.mark.parametrize("name, call", SINGLE_TOKEN_CALLS, ids=[c[0] for c in SINGLE_TOKEN_CALLS])
def test_single_token_calls_refuse_ids_that_are_not_1d(make_cache, name, call, ids, got):
    cache, source = make_cache(budget_experts=4)
    cache.select(5, [1])
    before = cache.stats().total
    with pytest.raises(
        ValueError,
        match=rf"expert_ids must be 1-D \(one token's expert ids\), got {got}.*"
        r"prepare_batch takes 2-D \(tokens x k\) ids",
    ):
        call(cache, ids)
    after = cache.stats().total
    assert (after.calls, after.hits, after.misses) == (before.calls, before.hits, before.misses), (
        "a refused call reached the library"
    )
    assert cache.prefetch_stats().calls == 0 and cache.prefetch_stats().hints == 0


def test_ragged_ids_are_refused_naming_the_parameter(make_cache):
    cache, _ = make_cache(budget_experts=4)
    with pytest.raises(ValueError, match="expert_ids_2d must be a rectangular array of ids, got a ragged nesting"):
        cache.prepare_batch(5, [[1, 2], [3]])
    with pytest.raises(ValueError, match="expert_ids must be"):
        cache.select(5, [[1, 2], [3]])


@pytest.mark.parametrize(
    "ids",
    [np.array([[1, 2], [2, 3]], dtype=np.uint32), [[1, 2], [2, 3]], [1, 2, 3]],
    ids=["2d-uint32", "nested-list", "1d"],
)
def test_prepare_batch_takes_tokens_by_k_ids(make_cache, ids):
    cache, source = make_cache(budget_experts=8)
    with cache.prepare_batch(5, ids) as batch:
        assert sorted(batch.ids.tolist()) == [1, 2, 3]


# -- dense layers ----------------------------------------------------------------------------
# A None in the layout is a layer without routed experts: the library never hears of it, and
# used to answer "layer 0 is not registered".

LAYER_CALLS = [
    ("select", lambda c, layer: c.select(layer, [1])),
    ("select_views", lambda c, layer: c.select_views(layer, [1])),
    ("select_split", lambda c, layer: c.select_split(layer, [1])),
    ("prefetch", lambda c, layer: c.prefetch(layer, [1])),
    ("hint", lambda c, layer: c.hint(layer, [1])),
    ("load_compact", lambda c, layer: c.load_compact(layer, [1])),
    ("prepare_batch", lambda c, layer: c.prepare_batch(layer, [[1]])),
    ("read_expert", lambda c, layer: testing.read_expert(c, layer, 1)),
    ("bind_class", lambda c, layer: c.bind_class(layer)),
    ("checksum", lambda c, layer: testing.checksum(c, layer, np.zeros((1, 3), np.uint64))),
]


@pytest.mark.parametrize("name, call", LAYER_CALLS, ids=[c[0] for c in LAYER_CALLS])
@pytest.mark.parametrize("dense", [0, 2])
def test_a_dense_layer_is_named_as_such(make_cache, name, call, dense):
    q2 = ModelLayout.preset("q2", scale=SCALE)[3]
    layout = ModelLayout((None, q2, None) + (q2,) * 4, name="three-dense")
    cache, _ = make_cache(layout, budget_experts=4)
    with pytest.raises(
        ValueError,
        match=rf"layer {dense} has no routed experts: it is a dense layer of three-dense; "
        r"the layers with routed experts are 1, 3-6",
    ):
        call(cache, dense)
    assert cache.stats().total.calls == 0


def test_the_library_says_an_unregistered_layer_may_be_dense():
    layout = ModelLayout((None, ModelLayout.preset("q2", scale=SCALE)[3]))
    with HostSource(layout) as src, ExpertCache(layout, src, budget_experts=4, backend="host") as cache:
        from pyexpcache import InvalidStateError, _lib

        ids = np.array([1], dtype=np.uint32)
        out = np.empty((1, 3), dtype=np.uint64)
        with (
            cache.raw_handle() as h,
            pytest.raises(
                InvalidStateError,
                match=(
                    r"layer 0 is not registered \(a dense layer, or expcache_layer_register was not called for it\)"
                ),
            ),
        ):
            _lib.lib.expcache_select_async(h, 0, ids.ctypes.data, 1, None, out.ctypes.data)
