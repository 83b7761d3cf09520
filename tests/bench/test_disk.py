"""The disk's read rate (expcache_bench/disk.py): the feed's piece as the library computes it,
the reads of each shape (whole experts, each part in pieces, or an expert's adjacent parts in one
read), the search over shapes (the depths at the feed's piece, then larger pieces at the fastest
depth, each on its own share of the bytes, too short a share skipped or fitted) and the best
shape reported with its rate; and a measurement of a bench file, read for real."""

from __future__ import annotations

import os

import pytest

from expcache_bench import disk
from expcache_bench.disk import Shape
from expcache_bench.file_source import FileSource
from pyexpcache import ModelLayout
from pyexpcache.layout import LayerSpec
from pyexpcache.source import LayerPlacement

KiB, MiB = 1 << 10, 1 << 20


def test_the_feed_piece_is_the_librarys():
    # feed.cpp: max(kFeedMinPiece, the largest part / kFeedPieces rounded up to kFeedChunk)
    assert disk.feed_piece([1000]) == disk.feed_piece([4 * MiB]) == 256 * KiB
    assert disk.feed_piece([10 * MiB, 1000]) == 640 * KiB
    assert disk.feed_piece([5 * MiB + 1]) == 336 * KiB  # 327,681 bytes a piece, up to 16 KiB
    assert disk.feed_piece([100 * MiB]) == 6400 * KiB


def test_the_pieces_tried_go_from_the_feeds_up_to_whole_experts():
    three = LayerPlacement((0, 2 * MiB, 4 * MiB), (6 * MiB,) * 3, (2 * MiB,) * 3)
    assert disk.pieces([(three, 4)]) == [256 * KiB, 512 * KiB, 1 * MiB, None]
    small = LayerPlacement((0, 4096), (8192, 8192), (1000, 3000))
    assert disk.pieces([(small, 4), (three, 1)]) == [256 * KiB, 512 * KiB, 1 * MiB, None]
    assert disk.pieces([(small, 4)]) == [256 * KiB, None]


def test_the_reads_of_an_expert():
    # Parts together (the expert arrangement; the second after a gap under a block): one range.
    together = LayerPlacement((0, 1000, 3000), (6000, 6000, 6000), (1000, 1500, 3000))
    assert disk.expert_ranges(together, 2) == [(12000, 6000)]
    # Parts apart (the tensor arrangement): a range each, in file order.
    apart = LayerPlacement((1 << 20, 0), (1000, 1000), (1000, 1000))
    assert disk.expert_ranges(apart, 3) == [(3000, 1000), ((1 << 20) + 3000, 1000)]
    assert disk.reads_of(apart, 3, None) == disk.expert_ranges(apart, 3)
    # In pieces: each part cut from its start, the last piece the rest, no read across parts.
    assert disk.reads_of(together, 1, 700) == [
        (6000, 700),
        (6700, 300),
        (7000, 700),
        (7700, 700),
        (8400, 100),
        (9000, 700),
        (9700, 700),
        (10400, 700),
        (11100, 700),
        (11800, 200),
    ]


def three_parts(tmp_path, experts: int) -> tuple[str, list]:
    """A sparse file of ``experts`` experts of three adjacent 2 MiB parts, and its placement."""
    path = str(tmp_path / "experts.bin")
    with open(path, "wb") as f:
        f.truncate(experts * 6 * MiB)
    return path, [(LayerPlacement((0, 2 * MiB, 4 * MiB), (6 * MiB,) * 3, (2 * MiB,) * 3), experts)]


RATE = {8: 1.0, 12: 2.0, 16: 5.0, 32: 3.0, 40: 2.5, 64: 1.0}  # bytes a second of each thread count


@pytest.fixture
def reads(monkeypatch):
    """The reads each shape asked for, ``(threads, [(offset, size), ...])``: none is read, each
    takes its bytes over RATE of its threads (twice that in 1 MiB pieces)."""
    seen = []

    def fake(fd, path, asked, threads):
        seen.append((threads, list(asked)))
        largest = max(size for _, size in asked)
        return sum(size for _, size in asked) / (RATE.get(threads, 0.5) * (2 if largest == MiB else 1))

    monkeypatch.setattr(disk, "_read", fake)
    return seen


def test_the_search_reports_the_best_shape(tmp_path, reads):
    path, layers = three_parts(tmp_path, 64)
    # 8 shapes (5 thread counts at the feed's piece, 3 larger pieces): 48 MiB, 8 experts, each.
    measured = disk.measure(path, layers, threads=12, total_bytes=8 * 48 * MiB)
    feed = 256 * KiB
    assert [s for s, _ in measured.tried] == [
        Shape(8, feed),
        Shape(12, feed),
        Shape(16, feed),
        Shape(32, feed),
        Shape(64, feed),
        Shape(16, 512 * KiB),  # the fastest count's, in larger pieces
        Shape(16, MiB),
        Shape(4, None),  # whole experts: 8 reads, for 4 threads two each
    ]
    assert [rate for _, rate in measured.tried] == [1.0, 2.0, 5.0, 3.0, 1.0, 5.0, 10.0, 0.5]
    assert measured.shape == Shape(16, MiB) and measured.bytes_per_s == 10.0
    assert measured.label.endswith(": 16 threads, pieces of 1 MiB")
    assert "the library's 12 threads and 8, 16, 32, 64 in the feed's pieces of 256 KiB" in measured.label
    assert "best of 8 shapes" in measured.label and "384 MiB" in measured.label
    # Each shape read whole experts of its own (the file's 64, each once), in its pieces.
    starts = [sorted({offset - offset % (6 * MiB) for offset, _ in asked}) for _, asked in reads]
    assert [len(s) for s in starts] == [8] * 8
    assert sorted(o for s in starts for o in s) == [e * 6 * MiB for e in range(64)]
    for (shape, _), (threads, asked) in zip(measured.tried, reads):
        assert threads == shape.threads and sum(size for _, size in asked) == 48 * MiB
        assert max(size for _, size in asked) == (6 * MiB if shape.piece is None else shape.piece)


def test_a_short_share_skips_the_counts_it_cannot_keep_busy(tmp_path, reads):
    path, layers = three_parts(tmp_path, 64)
    # 12 MiB a shape: 2 experts, 48 reads of 256 KiB: enough for 8 and 16 threads, not 32 or 64;
    # the library's 40 read all the same. Then, fitted to their reads, 512 KiB pieces (24) by 12
    # threads, 1 MiB pieces (12) by 6, whole experts (2) by one.
    measured = disk.measure(path, layers, threads=40, total_bytes=8 * 12 * MiB)
    assert [s for s, _ in measured.tried] == [
        Shape(8, 256 * KiB),
        Shape(16, 256 * KiB),
        Shape(40, 256 * KiB),
        Shape(12, 512 * KiB),
        Shape(6, MiB),
        Shape(1, None),
    ]
    assert measured.shape == Shape(16, 256 * KiB) and measured.bytes_per_s == 5.0
    # The library's count alone: the depths given.
    alone = disk.measure(path, layers, threads=3, depths=(), total_bytes=12 * MiB)
    assert [s.threads for s, _ in alone.tried][0] == 3


def test_buffered_reads_drop_the_page_cache_before_each_shape(tmp_path, reads, monkeypatch):
    path, layers = three_parts(tmp_path, 64)
    dropped = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, at, n, advice: dropped.append(advice))
    measured = disk.measure(path, layers, threads=12, total_bytes=8 * 48 * MiB, direct=False)
    assert not measured.direct and measured.label.startswith("buffered (the page cache dropped first)")
    assert dropped == [os.POSIX_FADV_DONTNEED] * len(measured.tried) == [os.POSIX_FADV_DONTNEED] * 8


def test_bad_arguments_are_refused(tmp_path):
    path, layers = three_parts(tmp_path, 2)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        disk.measure(path, layers, threads=0)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        disk.measure(path, layers, threads=4, depths=(8, 0))
    with pytest.raises(ValueError, match="no experts to read"):
        disk.measure(path, [(layers[0][0], 0)], threads=4)


def test_the_disk_rate_is_measured_on_the_file(tmp_path):
    layout = ModelLayout((LayerSpec(5, 1000, 1000, 1200), None, LayerSpec(7, 512, 512, 768)), name="small")
    with FileSource(layout, directory=str(tmp_path)) as src:
        layers = [(src.file_placements[i], layout[i].num_experts) for i in layout.moe_layers]
        measured = disk.measure(src.path, layers, threads=3, depths=(2, 4))
        assert measured.bytes_per_s == max(rate for _, rate in measured.tried) > 0
        assert measured.shape in [s for s, _ in measured.tried]
        assert measured.direct == disk.direct_allowed(src.path)
        assert "the library's 3 threads and 2, 4" in measured.label
        assert ("O_DIRECT reads" in measured.label) == measured.direct
        # Up to total_bytes of random experts, whole experts: one expert is the library's shape's.
        one = disk.measure(src.path, layers, threads=1, total_bytes=1)
        assert [s for s, _ in one.tried] == [Shape(1, 256 * KiB)] and one.bytes_per_s > 0


def test_a_replay_reads_the_runs_misses_in_its_order(tmp_path, reads):
    """disk.replay: each miss's parts in the feed's pieces, misses in the run's order (repeats
    read again), by the threads given; the first misses only past limit_bytes."""
    path, layers = three_parts(tmp_path, 8)
    places = {3: layers[0][0]}
    misses = [(3, 5), (3, 1), (3, 5), (3, 0)]
    found = disk.replay(path, places, misses, threads=12)
    ((threads, asked),) = reads
    assert threads == 12 and found.shape == Shape(12, 256 * KiB)
    want = [r for _, e in misses for r in disk.reads_of(places[3], e, 256 * KiB)]
    assert asked == want and len(asked) == 4 * 3 * 8  # 3 parts of 2 MiB in 256 KiB pieces each
    assert found.bytes_per_s == 2.0 and found.tried == ((found.shape, 2.0),)
    assert "replaying the run's own misses, its 4 misses (24 MiB) in its order" in found.label
    assert (found.read_bytes, found.reads, found.misses, found.of_misses) == (24 * MiB, 96, 4, 4)
    cut = disk.replay(path, places, misses, threads=8, limit_bytes=13 * MiB)
    assert reads[-1][1] == want[:48] and "its first 2 of 4 misses (12 MiB)" in cut.label
    assert (cut.read_bytes, cut.reads, cut.misses, cut.of_misses) == (12 * MiB, 48, 2, 4)
    with pytest.raises(ValueError, match="no misses to replay"):
        disk.replay(path, places, [], threads=8)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        disk.replay(path, places, misses, threads=0)


def test_the_disk_bound_is_the_faster_rate():
    """disk.faster: the replay's rate where it is the larger, else the cold one (and without one)."""
    assert disk.faster(1.4e9, 2.1e9) == (2.1e9, "replay")
    assert disk.faster(1.4e9, 0.9e9) == (1.4e9, "cold")
    assert disk.faster(1.4e9, 1.4e9) == (1.4e9, "cold")
    assert disk.faster(1.4e9, None) == (1.4e9, "cold")


def test_the_reader_threads_report_a_short_read_and_bad_arguments(tmp_path):
    """disk._read (C threads): a read past the file's end fails naming its place; bad arguments
    are refused by the C side (EINVAL), never read."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * (3 * 4096))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert disk._read(fd, str(path), [(0, 4096), (5000, 100), (8192, 4096)], 2) >= 0
        with pytest.raises(OSError, match=r"a read at 12288 came back short"):
            disk._read(fd, str(path), [(0, 4096), (12288, 10)], 2)
        with pytest.raises(OSError, match="Invalid argument"):
            disk._read(fd, str(path), [(0, 4096)], 0)
    finally:
        os.close(fd)
