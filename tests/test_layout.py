"""Layouts (pyexpcache/layout.py) are checked against the library's limits when they are made,
before a source fills anything: a LayerSpec's counts and sizes must be integers (not a bool, a
float such as 768.0 or a string) within the limits of expcache.h, and a ModelLayout must hold
LayerSpecs or None, at most the library's number of layers."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest

from pyexpcache import ArgumentRangeError, ExpertCache, HostSource, LayerSpec, ModelLayout
from pyexpcache import _lib

GOOD = dict(num_experts=8, gate_bytes=768, up_bytes=768, down_bytes=1024)


@pytest.mark.parametrize("field", list(GOOD))
@pytest.mark.parametrize("value, shown", [(768.0, "float 768.0"), ("8", "str '8'"), (True, "a bool (True)"),
                                          (None, "NoneType None"),
                                          (np.float32(8), f"float32 {np.float32(8)!r}")])
def test_a_non_integer_field_is_a_type_error_naming_it(field, value, shown):
    with pytest.raises(TypeError, match=re.escape(f"LayerSpec.{field} must be an integer, got {shown}")):
        LayerSpec(**dict(GOOD, **{field: value}))


@pytest.mark.parametrize("field, value, limit", [
    ("num_experts", 2**20, _lib.MAX_EXPERTS_LIMIT),
    ("num_experts", _lib.MAX_EXPERTS_LIMIT + 1, _lib.MAX_EXPERTS_LIMIT),
    ("num_experts", 0, _lib.MAX_EXPERTS_LIMIT),
    ("gate_bytes", 0, _lib.MAX_PART_BYTES_LIMIT),
    ("up_bytes", -768, _lib.MAX_PART_BYTES_LIMIT),
    ("down_bytes", _lib.MAX_PART_BYTES_LIMIT + 1, _lib.MAX_PART_BYTES_LIMIT),
])
def test_a_field_outside_the_librarys_limits_is_refused_naming_it(field, value, limit):
    with pytest.raises(ArgumentRangeError, match=rf"LayerSpec.{field} must be 1..{limit} \(the library's limit\), "
                                                 rf"got {value}"):
        LayerSpec(**dict(GOOD, **{field: value}))


def test_the_limits_themselves_are_accepted_and_numpy_integers_become_ints():
    assert LayerSpec(_lib.MAX_EXPERTS_LIMIT, 1, 1, _lib.MAX_PART_BYTES_LIMIT).num_experts == _lib.MAX_EXPERTS_LIMIT
    spec = LayerSpec(np.int64(8), np.uint32(768), 768, np.int16(1024))
    assert spec == LayerSpec(**GOOD) and all(type(v) is int for v in (spec.num_experts, *spec.class_key))


def test_a_refused_layout_fills_nothing():
    """2**20 experts were refused by the library only after the source had filled for seconds."""
    start = time.monotonic()
    with pytest.raises(ValueError, match="num_experts"):
        ModelLayout.preset("q2").with_experts(2**20)
    assert time.monotonic() - start < 1.0


def test_a_layout_names_the_layer_of_a_bad_entry():
    with pytest.raises(TypeError, match=r"layer 1 must be a LayerSpec or None \(a dense layer\), got tuple"):
        ModelLayout((LayerSpec(**GOOD), (8, 768, 768, 1024)))


def test_a_layout_has_at_most_the_librarys_layers():
    limit = _lib.MAX_LAYERS_LIMIT
    ModelLayout((None,) * (limit - 1) + (LayerSpec(**GOOD),))
    with pytest.raises(ValueError, match=rf"a layout has 1..{limit} layers \(the library's limit\), got {limit + 1}"):
        ModelLayout((None,) * limit + (LayerSpec(**GOOD),))


def test_a_list_of_layers_is_kept_as_a_tuple():
    spec = LayerSpec(**GOOD)
    layout = ModelLayout([None, spec])
    assert layout.layers == (None, spec) and layout == ModelLayout((None, spec))
    with HostSource(layout) as src, ExpertCache(layout, src, budget_experts=2, backend="host", log_level=0) as cache:
        assert cache.select(1, [1]).shape == (1, 3)
