"""Bundled traces the simulator's tests replay (each loaded once per module)."""

from __future__ import annotations

import pytest

from expcache_bench.traces import load_decode_trace


@pytest.fixture(scope="module")
def coffee():
    return load_decode_trace("podA_a_coffee_full")


@pytest.fixture(scope="module")
def python_trace():
    return load_decode_trace("podA_c_python_full")
