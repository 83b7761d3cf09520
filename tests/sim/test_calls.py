"""Request streams (expcache_bench/sim/calls.py): decode and prompt streams from the bundled
traces, token boundaries, and the class map a stream must fit."""

import numpy as np
import pytest

from expcache_bench.sim import BATCH, DECODE, Call, decode_stream, prompt_stream, simulate_lru, token_index
from expcache_bench.traces import load_prefill_trace

from support.sim_streams import B, D, counters


def test_decode_stream_order_and_layers(coffee):
    s = decode_stream(coffee)
    assert len(s) == 299 * 40
    assert s[0] == D(0, *coffee.ids[0, 0].tolist())
    assert s[41] == D(1, *coffee.ids[1, 1].tolist())  # token-major: token 1, layer index 1
    assert decode_stream(coffee, first_layer=3)[41].layer == 4
    # A Trace, its array and its stream give the same result.
    a = simulate_lru(coffee, 500)
    assert counters(simulate_lru(coffee.ids, 500)) == counters(a) == counters(simulate_lru(s, 500))


def test_prompt_stream_prefill_then_decode():
    p = load_prefill_trace("pod12_prefill_learn")[0]
    s = prompt_stream(p)
    assert [c.kind for c in s] == [BATCH] * 43 + [DECODE] * 40
    assert [c.layer for c in s] == list(range(43)) + list(range(3, 43))
    assert s[5].ids == tuple(p.prefill[5].ravel().tolist())  # token-major within the layer
    # Unbounded cache: prefill misses = distinct experts per layer; the decode
    # token hits exactly the experts its layer already saw in the prefill.
    r = simulate_lru(s, 43 * 256)
    distinct = sum(len(np.unique(p.prefill[layer])) for layer in range(43))
    seen = sum(len(set(p.decode.ids[0, i].tolist()) & set(p.prefill[i + 3].ravel().tolist())) for i in range(40))
    assert int(r.appends[0]) == distinct
    assert int(r.hits[0]) == seen and int(r.inserts[0]) == 240 - seen
    assert int(r.evictions[0]) == 0 and int(r.direct[0]) == 0
    # Layer filter and decode switch.
    s2 = prompt_stream(p, decode=False, layers=range(3, 43))
    assert [c.layer for c in s2] == list(range(3, 43)) and all(c.kind == BATCH for c in s2)


def test_layer_class_must_cover_stream():
    with pytest.raises(ValueError, match="layer_class"):
        simulate_lru([D(5, 1)], 2, layer_class=[0, 0])
    with pytest.raises(ValueError, match="capacity"):
        simulate_lru([D(1, 1)], [2], layer_class=[0, 1])
    with pytest.raises(ValueError):
        Call("prefill", 0, (1,))


def test_token_index():
    # A new token starts when the layer does not increase.
    assert token_index([D(3, 1), D(4, 1), D(3, 1), B(0, 1), B(1, 1), D(3, 1)]) == [0, 0, 1, 2, 2, 2]
    # A prompt: prefill batches over layers 0..42 (one "token"), then its decode token (3..42).
    prompt = load_prefill_trace("pod12_prefill_eval")[0]
    toks = token_index(prompt_stream(prompt))
    assert toks == [0] * 43 + [1] * 40
