"""The staging ring's trace (EXPCACHE_STAGING_TRACE) and benchmarks/staging_trace.py, which
summarizes it: every piece of every staged call noted, and what is not a trace refused."""

from __future__ import annotations

from pyexpcache import ExpertCache, HostSource, ModelLayout, testing

from support.scripts import load_benchmark_script


def test_staging_trace_notes_every_piece_and_summarizes_it(tmp_path, monkeypatch, capsys):
    from pyexpcache.layout import LayerSpec

    staging_trace = load_benchmark_script("staging_trace")
    path = tmp_path / "trace.csv"
    monkeypatch.setenv("EXPCACHE_STAGING_TRACE", str(path))  # read when the cache is created
    layout = ModelLayout((LayerSpec(16, 300_000, 300_000, 400_000),), name="traced")
    with HostSource(layout, pinned=False) as source:
        cache = ExpertCache(
            layout,
            source,
            backend="host",
            budget_bytes=16 * layout[0].expert_bytes,
            copy_threads=4,
            staging_bytes=4 << 20,
            staging_chunk_bytes=256 << 10,
            log_level=2,
        )
        calls = ([0, 1, 2], [3, 4, 0], [5, 6, 7, 8], [1, 2])  # all fit; the last call hits: it stages nothing
        for ids in calls:
            ptrs = cache.select(0, ids)
            assert testing.checksum(cache, 0, ptrs).tolist() == [source.expected_checksum(0, e) for e in ids]
        stats = cache.staging_stats()
        cache.close()  # the ring writes its trace when it is destroyed
    rings = staging_trace.read(str(path))
    assert len(rings) == 1 and "4 copy threads, 262144-byte chunks" in rings[0].title
    ring = rings[0]
    assert len(ring.calls) == stats.calls == 3
    assert sum(p[1] for p in ring.pieces) == stats.bytes == 9 * layout[0].expert_bytes
    assert [p[0] for p in ring.pieces] == list(range(len(ring.pieces))) and len(ring.pieces) == stats.pieces
    for _seq, _size, queued, taken, filled, sent, send, filler in ring.pieces:
        assert 0 < queued <= taken <= filled <= sent and 1 <= send <= stats.sends and 0 <= filler < 4
    for (begun, finishing, finished), pieces in zip(ring.calls, ring.pieces_by_call()):
        assert begun <= finishing <= finished and pieces
        assert all(begun <= p[2] <= finishing and p[5] <= finished for p in pieces)
    assert [sum(p[1] for p in ps) for ps in ring.pieces_by_call()] == [n * layout[0].expert_bytes for n in (3, 2, 4)]
    assert staging_trace.main([str(path), "--ring", "0", "--calls", "0,2"]) == 0
    out = capsys.readouterr().out
    assert out.count("4 copy threads") == 1 and "first sent µs" in out and "filler" in out
    assert sum(1 for line in out.splitlines() if line.startswith(("0 ", "2 "))) == len(ring.pieces_by_call()[0]) + len(
        ring.pieces_by_call()[2]
    )


def test_staging_trace_refuses_what_is_not_a_trace(tmp_path, capsys):
    staging_trace = load_benchmark_script("staging_trace")
    bad = tmp_path / "bad.csv"
    bad.write_text("# ring 0x1: 2 copy threads, 4096-byte chunks\npiece,0,0,12,x,2,3,4,1,1\n")
    assert staging_trace.main([str(bad)]) == 2
    assert "bad.csv:2: not a trace line" in capsys.readouterr().err
    assert staging_trace.main([str(tmp_path / "missing.csv")]) == 2
    assert "No such file" in capsys.readouterr().err
