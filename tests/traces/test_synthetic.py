"""Synthetic traces (expcache_bench/traces/synthetic.py): the real traces' locality by default,
shape and reproducibility, parameters, the fit to a real trace, and refused sizes and types."""

import numpy as np
import pytest

from expcache_bench.traces import (
    DEFAULT_REUSE,
    DEFAULT_ZIPF,
    SYNTHETIC_MAX_BYTES,
    fit_synthetic_params,
    locality_stats,
    synthetic_trace,
)


def test_synthetic_defaults_match_real_locality(coffee):
    target = locality_stats(coffee)["top10_share"]
    for seed in (0, 1):
        s = locality_stats(synthetic_trace(299, seed=seed))
        assert abs(s["reuse_previous"] - DEFAULT_REUSE) <= 0.05
        assert abs(s["top10_share"] - target) <= 0.05


def test_synthetic_shape_distinct_and_range():
    t = synthetic_trace(50, num_layers=7, num_experts=64, k=4, seed=3)
    assert t.ids.shape == (50, 7, 4) and t.ids.dtype == np.int32
    assert t.ids.min() >= 0 and t.ids.max() < 64 and t.num_experts == 64
    srt = np.sort(t.ids, axis=2)
    assert np.all(srt[:, :, 1:] != srt[:, :, :-1])  # k distinct ids per (token, layer)
    assert t.weights is None and t.positions.tolist() == list(range(50))


def test_synthetic_reproducible():
    a = synthetic_trace(40, seed=7)
    b = synthetic_trace(40, seed=7)
    c = synthetic_trace(40, seed=8)
    assert np.array_equal(a.ids, b.ids)
    assert not np.array_equal(a.ids, c.ids)
    # Longer traces are block-generated; the prefix must not depend on the length.
    assert np.array_equal(synthetic_trace(300, seed=7).ids[:40], a.ids)


def test_synthetic_parameters_control_statistics():
    assert locality_stats(synthetic_trace(100, reuse=0.0))["reuse_previous"] == 0.0
    frozen = synthetic_trace(20, reuse=1.0)
    assert np.all(frozen.ids == frozen.ids[0])
    flat = locality_stats(synthetic_trace(300, zipf=0.0))["top10_share"]
    steep = locality_stats(synthetic_trace(300, zipf=2.0))["top10_share"]
    assert flat < 0.25 < 0.8 < steep


def test_fit_synthetic_params_on_coffee(coffee):
    fit = fit_synthetic_params(coffee)
    stats = locality_stats(coffee)
    assert fit["reuse"] == pytest.approx(stats["reuse_previous"])
    assert fit["zipf"] == pytest.approx(DEFAULT_ZIPF, abs=0.1)  # the default was fitted to this trace
    syn = locality_stats(synthetic_trace(299, seed=11, zipf=fit["zipf"], reuse=fit["reuse"]))
    assert abs(syn["top10_share"] - stats["top10_share"]) <= 0.02
    assert abs(syn["reuse_previous"] - stats["reuse_previous"]) <= 0.02


# --------------------------------------------------------------------------- sizes and types


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        ((0,), {}, r"num_tokens must be >= 1, got 0"),
        ((-5,), {}, r"num_tokens must be >= 1"),
        ((10**13,), {}, r"num_tokens=10000000000000 is too large: .*4 GiB.*at most 4473924 tokens"),
        ((10, 0), {}, r"num_layers must be >= 1"),
        ((1, 10**9), {}, r"num_layers=1000000000 and num_experts=256 are too large: .*4 GiB"),
        ((1, 1, 2**40), {}, r"num_experts must be in \[2, 2147483648\]"),
        ((1, 1, 2**32), {}, r"num_experts must be in \[2, 2147483648\]"),
        ((1, 40, 2**24), {}, r"num_layers=40 and num_experts=16777216 are too large"),
        ((10, 4, 1), {}, r"num_experts must be in \[2, "),
        ((10,), {"k": 0}, r"need 0 < k <= num_experts // 2"),
        ((10, 4, 16), {"k": 9}, r"need 0 < k <= num_experts // 2"),
        ((10,), {"zipf": float("nan")}, r"zipf must be a finite number >= 0"),
        ((10,), {"zipf": float("inf")}, r"zipf must be a finite number >= 0"),
        ((10,), {"reuse": float("nan")}, r"reuse must be in \[0, 1\]"),
    ],
    ids=[
        "tokens-zero",
        "tokens-negative",
        "tokens-huge",
        "layers-zero",
        "layers-huge",
        "experts-2**40",
        "experts-2**32",
        "experts-times-layers-huge",
        "experts-one",
        "k-zero",
        "k-over-half",
        "zipf-nan",
        "zipf-inf",
        "reuse-nan",
    ],
)
def test_synthetic_refuses_bad_sizes(args, kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        synthetic_trace(*args, **kwargs)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"num_tokens": True}, "num_tokens"),
        ({"num_tokens": 10.0}, "num_tokens"),
        ({"num_tokens": "10"}, "num_tokens"),
        ({"num_tokens": 10, "num_layers": np.bool_(True)}, "num_layers"),
        ({"num_tokens": 10, "num_experts": 64.0}, "num_experts"),
        ({"num_tokens": 10, "k": 2.5}, "k"),
        ({"num_tokens": 10, "k": False}, "k"),
    ],
    ids=["tokens-bool", "tokens-float", "tokens-str", "layers-numpy-bool", "experts-float", "k-float", "k-bool"],
)
def test_synthetic_refuses_non_integers(kwargs, name):
    with pytest.raises(TypeError, match=rf"^{name} must be an int, got "):
        synthetic_trace(**kwargs)


def test_synthetic_accepts_numpy_integers_and_the_size_limit():
    t = synthetic_trace(np.int64(5), np.int32(3), np.uint16(32), np.int8(2), seed=1)
    assert t.ids.shape == (5, 3, 2) and t.num_experts == 32
    assert np.array_equal(t.ids, synthetic_trace(5, 3, 32, 2, seed=1).ids)
    assert SYNTHETIC_MAX_BYTES == 4 * 2**30
    # Exactly at the limit is allowed (only checked, not generated: 4 GiB of ids).
    with pytest.raises(ValueError, match=r"num_tokens=4473925 is too large"):
        synthetic_trace(SYNTHETIC_MAX_BYTES // (40 * 6 * 4) + 1)


def test_synthetic_many_experts_same_trace_as_small_blocks():
    # Wide layers are generated in smaller token blocks; the trace must not
    # depend on the block size (the random streams are consumed token by token).
    a = synthetic_trace(40, num_layers=2, num_experts=2**17, k=4, seed=5)
    b = synthetic_trace(3, num_layers=2, num_experts=2**17, k=4, seed=5)
    assert np.array_equal(a.ids[:3], b.ids)
    srt = np.sort(a.ids, axis=2)
    assert np.all(srt[:, :, 1:] != srt[:, :, :-1]) and a.ids.max() < 2**17
