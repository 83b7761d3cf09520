"""A device select over a source the GPU cannot read (pageable memory, a memory-mapped GGUF, a GGUF
read with pread or O_DIRECT): its misses come through the class's feed (the library's threads
read them into pinned rows, the select's grid copies them into their slots; see
libexpcache/src/kernels/feed_protocol.hpp). Each select is checked byte for byte against the
source, its choices against the same select from a pinned source."""

from __future__ import annotations

import numpy as np
import pytest

from pyexpcache import ExpcacheWarning, ExpertCache, GGUFSource, HostSource, LayerSpec, ModelLayout, testing

from support.cache import SCALE, bank_rows, device_ids, to_numpy


def _layout():
    return ModelLayout.preset("q2", scale=SCALE)


def _served(cache, source, layer, ids, slots):
    """The selected slots hold exactly the source's bytes."""
    bank = cache.bank(layer)
    cache.synchronize()
    for e, row in zip(ids, bank_rows(bank, slots)):
        for part, (addr, nbytes) in enumerate(zip(row, cache.layout[layer].class_key)):
            got = testing.read_device(cache, int(addr), nbytes)
            assert (got == source.part(layer, int(e), part)).all(), f"layer {layer} expert {e} part {part}"


def _trace(layout, steps, seed=3):
    """(layer, ids) per select: up to 20 ids, more than the feed's 8 rows, repeats included."""
    rng = np.random.default_rng(seed)
    out = []
    for step in range(steps):
        layer = layout.moe_layers[step % len(layout.moe_layers)]
        k = [3, 6, 20, 1][step % 4]
        out.append((layer, rng.integers(0, layout[layer].num_experts, k)))
    return out


@pytest.mark.arrangements
@pytest.mark.parametrize("policy", ["lru", "duel"])
def test_a_pageable_source_is_fed_byte_exact_with_the_pinned_choices(backend, policy, bank_arrangement):
    """Select for select, the fed cache gives the slots the pinned one gives and its slots hold
    the source's bytes, misses of one select beyond the feed's rows and evictions included."""
    layout = _layout()
    options = dict(
        budget_experts=24, backend=backend, lookup="device", policy=policy, bank_arrangement=bank_arrangement
    )
    with (
        HostSource(layout, pinned=False) as pageable,
        HostSource(layout, pinned=True) as pinned,
        ExpertCache(layout, pageable, **options) as fed,
        ExpertCache(layout, pinned, **options) as mapped,
    ):
        for layer, ids in _trace(layout, 24):
            got = to_numpy(fed.select_device(layer, device_ids(fed, ids)))
            want = to_numpy(mapped.select_device(layer, device_ids(mapped, ids)))
            assert got.tolist() == want.tolist()
            _served(fed, pageable, layer, ids, got)
        a, b = fed.stats().path("device"), mapped.stats().path("device")
        assert (a.hits, a.misses, a.evictions) == (b.hits, b.misses, b.evictions)
        assert a.evictions > 0


@pytest.mark.parametrize("copy_threads", [0, 3])
def test_large_experts_are_fed_in_pieces(backend, copy_threads):
    """Parts larger than a piece (256 KiB) are read by the copy threads at once (one when the
    config has none) and copied piece by piece, a part that ends mid-chunk and one not a multiple
    of 16 bytes included."""
    layout = ModelLayout([LayerSpec(12, 700_000, 300_016, 1_100_001), LayerSpec(12, 700_000, 300_016, 1_100_001)])
    with (
        HostSource(layout, pinned=False) as source,
        ExpertCache(
            layout, source, budget_experts=10, backend=backend, lookup="device", policy="lru", copy_threads=copy_threads
        ) as cache,
    ):
        rng = np.random.default_rng(2)
        for step in range(10):
            layer = step % 2
            ids = rng.choice(12, 9 if step == 3 else 4, replace=False)
            slots = to_numpy(cache.select_device(layer, device_ids(cache, ids)))
            _served(cache, source, layer, ids, slots)
        assert cache.stats().path("device").evictions > 0


@pytest.mark.parametrize("reads,file_reads", [("mmap", "buffered"), ("file", "buffered"), ("file", "direct")])
def test_a_gguf_file_is_fed(tmp_path, backend, policy, reads, file_reads):
    """A GGUF file, mapped or read (through the page cache or O_DIRECT), of two size classes."""
    pytest.importorskip("gguf", reason="a GGUF file source needs the gguf package")
    from support.gguf_files import Q2_LIKE, Q4, write_model

    path = write_model(tmp_path / "m.gguf", [None, Q2_LIKE, Q4, Q2_LIKE])
    with GGUFSource(path, reads=reads) as src:
        layout = src.layout
        with ExpertCache(
            layout, src, budget_experts=10, backend=backend, lookup="device", file_reads=file_reads, policy=policy
        ) as cache:
            for layer, ids in _trace(layout, 16, seed=5):
                ids = ids[:8] % layout[layer].num_experts
                slots = to_numpy(cache.select_device(layer, device_ids(cache, ids)))
                _served(cache, src, layer, ids, slots)
            assert len(cache.classes()) == 2
            assert cache.stats().path("device").misses > 0


def test_a_failed_read_frees_its_slot_and_says_why(tmp_path, backend, policy):
    """A read that fails (the file shrank) is logged with the reason; the select still ends, gives
    the failed expert's ids slot -1, the expert is not resident (the count agrees) and the experts
    read fine are; once the file is whole again the next select reads it."""
    pytest.importorskip("gguf", reason="a GGUF file source needs the gguf package")
    from support.gguf_files import end_early, shrinking_model

    path, whole = shrinking_model(tmp_path)
    with GGUFSource(path, reads="file") as src:
        layout = src.layout
        last = layout.moe_layers[-1]
        with ExpertCache(layout, src, budget_experts=8, backend=backend, lookup="device", policy=policy) as cache:
            cache.bank(last)
            end_early(path, src, last, 4)  # experts 4-7 of `last` end early
            with pytest.warns(ExpcacheWarning, match=f"expert 6 of layer {last}.*ended early.*slot -1"):
                got = to_numpy(cache.select_device(last, device_ids(cache, [6, 2, 6])))
                cache.synchronize()
            assert got[0] == got[2] == -1 and got[1] >= 0  # nobody is pointed at bytes that never came
            assert testing.read_expert(cache, last, 6) is None
            assert (testing.read_expert(cache, last, 2) == src.expert_bytes(last, 2)).all()
            assert cache.classes()[0].resident_experts == 1
            path.write_bytes(whole)
            slots = to_numpy(cache.select_device(last, device_ids(cache, [6, 2])))
            _served(cache, src, last, [6, 2], slots)
            assert cache.stats().path("device").misses == 3


def test_close_right_after_a_fed_select(backend, policy):
    """A cache closed with a fed select still running: the feed serves it before its threads stop."""
    layout = _layout()
    with HostSource(layout, pinned=False) as source:
        cache = ExpertCache(layout, source, budget_experts=16, backend=backend, lookup="device", policy=policy)
        layer = layout.moe_layers[0]
        cache.select_device(layer, device_ids(cache, list(range(12))))
        cache.close()


def test_a_fed_select_is_captured_and_replayed(backend, policy):
    """The whole fed select, reads included, is one graph node: each replay selects the ids the
    input tensor holds then and its misses are read and copied."""
    if backend != "cuda":
        pytest.skip("CUDA graphs are the CUDA backend's")
    torch = pytest.importorskip("torch")
    layout = _layout()
    with (
        HostSource(layout, pinned=False) as source,
        ExpertCache(layout, source, budget_experts=12, backend=backend, lookup="device", policy=policy) as cache,
    ):
        layer = layout.moe_layers[0]
        cache.bank(layer)  # binds the class and makes its feed: a capture may not allocate
        ids = torch.zeros(6, dtype=torch.int64, device="cuda")
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            cache.select_device(layer, ids)  # warm-up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            slots = cache.select_device(layer, ids)
        rng = np.random.default_rng(1)
        for _ in range(8):
            want = rng.choice(layout[layer].num_experts, 6, replace=False)
            ids.copy_(torch.from_numpy(want))
            graph.replay()
            torch.cuda.synchronize()
            _served(cache, source, layer, want, to_numpy(slots))
        assert cache.stats().path("device").misses > 6
