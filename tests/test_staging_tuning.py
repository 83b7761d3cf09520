"""The staging ring's EXPCACHE_STAGING_* variables (libexpcache/src/backend/staging_tuning.hpp
says what each sets): read when a cache is created, a malformed value ignored there with a
warning naming the variable, its value and what is accepted (never a failed create); good values reach the
ring and the bytes it serves are right. Host backend: the ring is the same code on both."""

from __future__ import annotations

import pytest

from pyexpcache import ExpertCache, HostSource, LayerSpec, ModelLayout, testing

from support.scripts import load_benchmark_script

ANY_BYTES = "a number of bytes between 0 and 18446744073709551615"
SWITCH = "one of 1, true, yes, on (through a bounce buffer) or 0, false, no, off (into the chunk)"

# (variable, value, what the message says is accepted: VAR="value" is not ...)
BAD = [
    ("EXPCACHE_STAGING_NT_MAX", "lots", ANY_BYTES),
    ("EXPCACHE_STAGING_NT_MAX", "-1", ANY_BYTES),  # strtoull took it for 2^64 - 1
    ("EXPCACHE_STAGING_NT_MAX", "18446744073709551616", ANY_BYTES),  # 2^64
    ("EXPCACHE_STAGING_FILE_BOUNCE", "2", SWITCH),
    ("EXPCACHE_STAGING_FILE_BOUNCE", "", SWITCH),
    ("EXPCACHE_STAGING_COALESCE", "4M", ANY_BYTES),  # garbage after digits
    ("EXPCACHE_STAGING_COALESCE", " 4096", ANY_BYTES),
    ("EXPCACHE_STAGING_MIN_PIECES", "1025", "a whole number between 0 and 1024"),
    ("EXPCACHE_STAGING_MIN_PIECES", "", "a whole number between 0 and 1024"),
    ("EXPCACHE_STAGING_SHORT", "17", "a whole number between 0 and 16"),  # clamped to 16 before
    ("EXPCACHE_STAGING_SHORT", "3.5", "a whole number between 0 and 16"),
    (
        "EXPCACHE_STAGING_COPY",
        "avx2",
        "one of wide (64-byte stores where the CPU has AVX-512) or sse2 (16-byte stores)",
    ),
    ("EXPCACHE_STAGING_PREFETCH", "67108865", "a number of bytes between 0 and 67108864"),
    ("EXPCACHE_STAGING_PREFETCH", "0x1000", "a number of bytes between 0 and 67108864"),
    ("EXPCACHE_STAGING_PREFETCH_HINT", "t1", "one of t0 (into L1), t2 (into L2) or nta (non-temporal)"),
    ("EXPCACHE_STAGING_TRACE", "", "a file path (unset it for no trace)"),
    ("EXPCACHE_STAGING_TRACE_PIECES", "16777217", "a whole number between 0 and 16777216"),
    ("EXPCACHE_STAGING_TRACE_PIECES", "-5", "a whole number between 0 and 16777216"),
]

# An expert's misses are three uploads (its parts), each under a chunk.
LAYOUT = ModelLayout((LayerSpec(16, 300_000, 300_000, 400_000),), name="staged")
CHUNK = 1 << 20
CALLS = ([0, 1, 2], [3, 4, 0], [5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [1, 2])  # evictions past 8 experts


def make_cache(source, **kwargs):
    kwargs.setdefault("budget_experts", 8)
    return ExpertCache(
        LAYOUT,
        source,
        backend="host",
        copy_threads=4,
        staging_bytes=8 << 20,
        staging_chunk_bytes=CHUNK,
        log_level=2,
        **kwargs,
    )


def serve_and_check(cache, source):
    """Every call's experts arrive with the source's bytes."""
    for ids in CALLS:
        ptrs = cache.select(0, ids)
        assert testing.checksum(cache, 0, ptrs).tolist() == [source.expected_checksum(0, e) for e in ids]
        for e in ids[:2]:
            assert (testing.read_expert(cache, 0, e) == source.expert_bytes(0, e)).all()


@pytest.mark.parametrize("name, value, accepted", BAD, ids=[f"{n[17:]}={v!r}" for n, v, _ in BAD])
def test_a_malformed_value_is_ignored_naming_it(monkeypatch, capfd, name, value, accepted):
    """The cache is made with the variable's default, and says why (a warning, once per process:
    each case's variable and value are its own)."""
    monkeypatch.setenv(name, value)
    with HostSource(LAYOUT) as source, make_cache(source) as cache:
        serve_and_check(cache, source)
    assert f'{name}="{value}" is not {accepted}; ignored' in capfd.readouterr().err


def test_a_malformed_value_is_ignored_even_without_staging_threads(monkeypatch, capfd):
    monkeypatch.setenv("EXPCACHE_STAGING_COPY", "fast")
    with HostSource(LAYOUT) as source, ExpertCache(LAYOUT, source, backend="host", budget_experts=4, copy_threads=0):
        pass
    assert 'EXPCACHE_STAGING_COPY="fast" is not one of' in capfd.readouterr().err


GOOD = [
    {"EXPCACHE_STAGING_COPY": "sse2"},
    {"EXPCACHE_STAGING_COPY": "WIDE"},
    {"EXPCACHE_STAGING_NT_MAX": "0"},  # memcpy only
    {"EXPCACHE_STAGING_NT_MAX": "18446744073709551615", "EXPCACHE_STAGING_COALESCE": "18446744073709551615"},
    {"EXPCACHE_STAGING_PREFETCH": "0"},
    {"EXPCACHE_STAGING_PREFETCH": "67108864", "EXPCACHE_STAGING_PREFETCH_HINT": "t0"},
    {"EXPCACHE_STAGING_PREFETCH": "8192", "EXPCACHE_STAGING_PREFETCH_HINT": "nta"},
    {
        "EXPCACHE_STAGING_NT_MAX": "65536",
        "EXPCACHE_STAGING_FILE_BOUNCE": "off",
        "EXPCACHE_STAGING_COALESCE": "0",
        "EXPCACHE_STAGING_MIN_PIECES": "1024",
        "EXPCACHE_STAGING_SHORT": "16",
        "EXPCACHE_STAGING_COPY": "sse2",
        "EXPCACHE_STAGING_PREFETCH": "4096",
        "EXPCACHE_STAGING_PREFETCH_HINT": "T2",
        "EXPCACHE_STAGING_TRACE_PIECES": "0",
    },
]


@pytest.mark.parametrize("arrangement", ["tensor", "expert"])
@pytest.mark.parametrize("env", GOOD, ids=[" ".join(f"{k[17:]}={v}" for k, v in e.items()) for e in GOOD])
def test_good_values_serve_the_right_bytes_from_a_pageable_source(monkeypatch, env, arrangement):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with HostSource(LAYOUT, pinned=False, arrangement=arrangement) as source:
        with make_cache(source) as cache:
            serve_and_check(cache, source)
            assert cache.staging_stats().pieces > 0  # the ring staged them


def test_short_and_min_pieces_reach_the_ring(monkeypatch):
    with HostSource(LAYOUT, pinned=False) as source:
        with make_cache(source) as cache:
            cache.select(0, [0, 1, 2])
            assert cache.staging_stats().pieces > 9  # by default: short pieces first, 2 or more an upload
        monkeypatch.setenv("EXPCACHE_STAGING_SHORT", "0")
        monkeypatch.setenv("EXPCACHE_STAGING_MIN_PIECES", "1")
        with make_cache(source) as cache:
            cache.select(0, [0, 1, 2])
            assert cache.staging_stats().pieces == 9  # one piece an upload: 3 experts of 3 parts


def test_trace_pieces_reach_the_ring(tmp_path, monkeypatch):
    staging_trace = load_benchmark_script("staging_trace")
    path = tmp_path / "trace.csv"
    monkeypatch.setenv("EXPCACHE_STAGING_TRACE", str(path))
    monkeypatch.setenv("EXPCACHE_STAGING_TRACE_PIECES", "7")
    with HostSource(LAYOUT, pinned=False) as source:
        with make_cache(source) as cache:
            serve_and_check(cache, source)
            stats = cache.staging_stats()
    assert stats.pieces > 7
    (ring,) = staging_trace.read(str(path))
    assert len(ring.pieces) == 7 and len(ring.calls) == stats.calls


def test_variables_are_read_when_the_cache_is_created(tmp_path, monkeypatch):
    path = tmp_path / "trace.csv"
    with HostSource(LAYOUT, pinned=False) as source:
        with make_cache(source) as cache:
            # Set after creation, before the ring is made (at the first staged upload): not read.
            monkeypatch.setenv("EXPCACHE_STAGING_TRACE", str(path))
            monkeypatch.setenv("EXPCACHE_STAGING_SHORT", "lots")
            serve_and_check(cache, source)
    assert not path.exists()


@pytest.mark.parametrize("bounce", ["on", "off"])
def test_file_bounce_either_way_reads_the_right_bytes(tmp_path, monkeypatch, bounce):
    pytest.importorskip("gguf")
    from pyexpcache.gguf import GGUFSource

    from support.gguf_files import Q4, write_model

    monkeypatch.setenv("EXPCACHE_STAGING_FILE_BOUNCE", bounce)
    path = write_model(tmp_path / "bounce.gguf", [Q4] * 3)
    with GGUFSource(path, reads="file") as source:
        layout = source.layout
        with ExpertCache(layout, source, budget_experts=6, backend="host", copy_threads=4, log_level=0) as cache:
            for layer in layout.moe_layers:
                for ids in ([0, 1, 2], [3, 4, 5, 6], [7, 0]):
                    cache.select(layer, ids)
                    for e in ids:
                        assert (testing.read_expert(cache, layer, e) == source.expert_bytes(layer, e)).all()
            assert cache.staging_stats().pieces > 0
