"""The transfer benchmark (expcache_bench/modes/transfer.py): the host copy rate, the table's rows
and what they say, and (CUDA) every byte of every source moved. Its command line is in
tests/test_cli.py."""

from __future__ import annotations

import numpy as np
import pytest

from support.cache import CUDA_OK, CUDA_REASON


def test_host_copy_rate_copies_and_refuses_bad_pieces():
    from expcache_bench.modes import transfer

    buffer = np.arange(8 << 20, dtype=np.uint8)
    rates = transfer.host_copy_rates([1, 2], piece=64 << 10, buffer_bytes=8 << 20, total=16 << 20)
    assert list(rates) == [1, 2] and all(r > 0 for r in rates.values())
    assert transfer.host_copy_gb_s(buffer, 64 << 10, 2, total=4 << 20) > 0
    for threads, piece in ((0, 4096), (1, 0), (1, 8 << 20)):
        with pytest.raises(ValueError, match="host_copy_gb_s"):
            transfer.host_copy_gb_s(buffer, piece, threads)


def test_transfer_refuses_unknown_sources():
    from expcache_bench.modes import transfer

    with pytest.raises(ValueError, match="unknown sources"):
        transfer.measure(sources=("pinned", "nvme"))


def test_transfer_table_formats_rows_and_says_what_raw_means():
    from expcache_bench.modes import transfer
    from pyexpcache import StagingStats

    staged = StagingStats(
        calls=2,
        pieces=8,
        bytes=8 << 20,
        caller_fills=2,
        fill_ns=800_000,
        wait_ns=100_000,
        send_ns=24_000,
        sends=4,
        span_ns=400_000,
        first_fill_ns=20_000,
    )
    rows = [
        transfer.TransferRow("pinned", 0, 0, "0.5 MiB", "tensor", 50.0, 42.0, 42.0, 1 << 20),
        transfer.TransferRow("pageable", 8, 1 << 20, "0.5 MiB", "expert", 21.0, 14.0, 42.0, 1 << 20, staged),
    ]
    text = transfer.format_rows(rows, detail=True)
    lines = text.splitlines()
    assert "119 %" in lines[2] and "50 %" in lines[3]  # library / raw pinned, per row
    # the call (4 MiB at 21 GB/s); pieces per call and per send; its span, first piece, wait;
    # threads filling; fill, send per piece; caller fills
    assert lines[3].split()[-11:] == ["199.7", "4.0", "2.0", "200.0", "10.0", "50.0", "2.0", "100.0", "3.00", "25", "%"]
    assert lines[2].split()[-10:] == ["—"] * 10  # a pinned source stages nothing
    assert "cudaMemcpyBatchAsync" in text and "one expert at a time" in text


@pytest.mark.skipif(not CUDA_OK, reason=CUDA_REASON)
def test_transfer_table_moves_every_byte_from_every_source(tmp_path):
    from expcache_bench.modes import transfer

    rows = transfer.measure(
        sizes=["0.5 MiB"], total_bytes=64 << 20, copy_threads=(1, 4), chunks=(256 << 10,), file_dir=str(tmp_path)
    )
    assert sorted({r.source for r in rows}) == sorted(transfer.SOURCES)
    for r in rows:
        assert r.library_gb_s > 0 and r.raw_pinned_gb_s > 0
        assert r.bytes_moved == 128 * sum(transfer.SIZES["0.5 MiB"])  # every expert of layer 1 once
    text = transfer.format_rows(rows)
    assert "file-direct" in text and "256 KiB" in text
    for r in rows:  # staged sources say where their time went; pinned ones stage nothing
        assert (r.staging is None) == (r.source == "pinned")
        if r.staging is not None:
            assert r.staging.bytes == r.bytes_moved
    assert "caller wait" in transfer.format_rows(rows, detail=True)
