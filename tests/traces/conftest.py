"""The bundled trace the trace tests read most (loaded once per module)."""

from __future__ import annotations

import pytest

from expcache_bench.traces import load_decode_trace


@pytest.fixture(scope="module")
def coffee():
    return load_decode_trace("podA_a_coffee_full")
