"""The bench's experts in a file (expcache_bench/file_source.py): the file holds a HostSource's
bytes where it puts them, its checksums are the HostSource's, a cache serves it byte for byte read
and mapped, the folder's room is checked before anything is written, a failed write leaves
nothing, the file goes when the source is released (the disk's read rate on it: test_disk.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections import namedtuple

import numpy as np
import pytest

from expcache_bench import cli, disk, file_source
from expcache_bench.file_source import FileSource, NotEnoughSpace
from pyexpcache import ExpertCache, HostSource, ModelLayout, testing
from pyexpcache.layout import LayerSpec


def small_layout() -> ModelLayout:
    """Three MoE layers of two sizes, parts not multiples of 256 bytes, a dense layer between."""
    return ModelLayout(
        (LayerSpec(5, 1000, 1000, 1200), None, LayerSpec(7, 512, 512, 768), LayerSpec(5, 1000, 1000, 1200)),
        name="small",
    )


@pytest.mark.parametrize("arrangement", ["expert", "tensor"])
@pytest.mark.parametrize("reads", file_source.READS)
def test_the_file_holds_the_host_sources_bytes_where_it_puts_them(tmp_path, reads, arrangement):
    layout = small_layout()
    with (
        HostSource(layout, arrangement=arrangement) as host,
        FileSource(layout, reads=reads, arrangement=arrangement, directory=str(tmp_path)) as src,
    ):
        assert os.path.getsize(src.path) == host.nbytes == file_source.file_bytes(layout, arrangement)
        assert src.file_path == (src.path if reads == "file" else None) and src.pinned is False
        for layer in layout.moe_layers:
            ours, theirs = src.placement(layer), host.placement(layer)
            origin = 0 if reads == "file" else src.buffer.ctypes.data
            assert [b - origin for b in ours.bases] == [b - host.buffer.ctypes.data for b in theirs.bases]
            assert (ours.strides, ours.sizes) == (theirs.strides, theirs.sizes)
            for e in range(layout[layer].num_experts):
                assert np.array_equal(src.expert_bytes(layer, e), host.expert_bytes(layer, e))
                assert src.expected_checksum(layer, e) == host.expected_checksum(layer, e)


@pytest.mark.parametrize("reads,file_reads", [("mmap", "buffered"), ("file", "buffered"), ("file", "direct")])
def test_a_cache_serves_the_file_byte_for_byte(tmp_path, reads, file_reads):
    layout = small_layout()
    with (
        FileSource(layout, reads=reads, directory=str(tmp_path)) as src,
        ExpertCache(layout, src, budget_experts=3, backend="host", file_reads=file_reads, log_level=0) as cache,
    ):
        for layer in layout.moe_layers:
            ids = np.arange(layout[layer].num_experts)
            for start in range(0, len(ids), 3):
                chunk = ids[start : start + 3]
                ptrs = cache.select(layer, chunk)
                for e, row in zip(chunk, ptrs):
                    for p, (addr, nbytes) in enumerate(zip(row, layout[layer].class_key)):
                        assert (testing.read_device(cache, int(addr), nbytes) == src.part(layer, int(e), p)).all()
                assert testing.checksum(cache, layer, ptrs).tolist() == [
                    src.expected_checksum(layer, int(e)) for e in chunk
                ]


def test_the_file_and_its_folder_go_when_the_source_is_released(tmp_path, monkeypatch):
    monkeypatch.setattr(file_source.tempfile, "tempdir", str(tmp_path))
    layout = small_layout()
    src = FileSource(layout)  # in a folder of its own
    folder = os.path.dirname(src.path)
    assert os.path.dirname(folder) == str(tmp_path)
    with ExpertCache(layout, src, budget_experts=3, backend="host", log_level=0):
        src.close()  # a cache keeps its source: the file stays until the cache closes
        assert os.path.exists(src.path)
    assert not os.path.exists(folder)
    given = FileSource(layout, directory=str(tmp_path))
    given.close()  # in a folder given: the file goes, the folder stays
    assert os.listdir(tmp_path) == []


def test_no_room_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    layout = small_layout()
    need = file_source.file_bytes(layout, "expert")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 40, (1 << 40) - need + 1, need - 1))
    with pytest.raises(NotEnoughSpace, match=re.escape(f"needs 0.00 GiB in {tmp_path}, which has 0.00 GiB free")):
        FileSource(layout, directory=str(tmp_path))
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 40, 0, need))
    FileSource(layout, directory=str(tmp_path)).close()  # exactly enough


def test_a_write_that_stops_leaves_nothing(tmp_path):
    def stop(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        FileSource(small_layout(), directory=str(tmp_path), progress=stop)
    assert os.listdir(tmp_path) == []


def test_the_page_cache_share_of_the_file(tmp_path):
    layout = ModelLayout((LayerSpec(64, 4096, 4096, 8192),))
    with FileSource(layout, reads="mmap", directory=str(tmp_path)) as src:
        src.buffer.sum()  # every page read through the mapping
        assert src.page_cache_fraction() == 1.0
        src.drop_page_cache()
        after = src.page_cache_fraction()
        assert 0.0 <= after <= 1.0
        if disk.direct_allowed(src.path):  # a file system on a disk (not tmpfs, whose pages are the file)
            assert after < 1.0


# -- the command line ------------------------------------------------------------------------

BENCH = ["bench", "graph", "--backend", "host", "--layers", "3-6", "--traces", "smoke_count64", "--quiet"]


def test_the_command_line_serves_both_loops_from_a_file_and_removes_it(tmp_path):
    folder, out = tmp_path / "files", tmp_path / "r.json"
    folder.mkdir()
    argv = BENCH + ["--source", "file", "--file-dir", str(folder), "--json", str(out)]
    assert cli.main(argv) == 0
    (report,) = json.loads(out.read_text())
    assert report["source"] == "file" and report["disk_bytes_per_s"] > 0
    assert report["source_file"]["reads"] in ("direct", "direct refused")  # --file-reads direct: the default
    assert [r["checksum_errors"] for r in report["results"]] == [0, 0]
    assert all(r["bound_by"] == report["results"][0]["bound_by"] and r["of_bound"] > 0 for r in report["results"])
    assert os.listdir(folder) == []


def test_the_command_line_refuses_a_file_the_disk_has_no_room_for(tmp_path, monkeypatch, capsys):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 40, 1 << 40, 1 << 20))
    assert cli.main(BENCH + ["--source", "mmap", "--file-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"expcache bench graph: --source mmap: the file source needs \d+\.\d\d GiB in {re.escape(str(tmp_path))}, "
        r"which has 0\.00 GiB free: give --file-dir on a disk with room, fewer --layers or a larger --scale",
        err,
    ), err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--file-dir", "."], "--file-dir is where a file source is written: give --source mmap or file"),
        (["--source", "file", "--file-dir", "/no/such/folder"], "--file-dir /no/such/folder: no such folder"),
        (
            ["--source", "mmap", "--file-reads", "buffered"],
            "--file-reads buffered applies to reads of a file: --source file, or --gguf-reads file",
        ),
        (
            ["--source", "file", "--gguf", "model.gguf"],
            "--source file serves the generated experts from a file; --gguf serves its own file (--gguf-reads "
            "mmap or file): drop one",
        ),
    ],
)
def test_the_file_options_apply_where_they_mean_something(argv, message, capsys):
    assert cli.main(BENCH + argv) == 2
    assert capsys.readouterr().err.strip().endswith(message)
