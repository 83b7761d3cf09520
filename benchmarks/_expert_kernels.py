"""Two Triton kernels of ``flashlib_side_by_side.py``: the reading of the served experts (the same
kernel for both caches) and the copy of flashlib's miss plan from the pinned source.

- :func:`read_experts`: every byte of the experts in ``slots`` of a table (a row of ``stride``
  bytes per slot, the three parts at the given offsets), summed as expcache's checksum kernel
  sums them (64-bit little-endian words ``w_j`` times ``2j + 1`` modulo 2^64, ``j`` counted from
  each part's start; ``expcache_testing.h``), so the sums compare with
  :meth:`pyexpcache.HostSource.expected_checksum`. The memory-bound floor of the expert GEMVs.
  Each program reads one chunk of one part of one expert and stores its partial sum; the partials
  are added up after the step, outside the timing (:func:`sums_of`), so the step has no atomics
  and no memset.
- :func:`copy_plan`: the rows flashlib's ``lru_ensure`` lists (``src_indices`` -> ``dst_indices``,
  ``num_copy`` of them, all read on the device) from page-locked host memory, which the GPU reads
  through its unified address, into the table: a fixed grid (one program per SM by default, as
  expcache's copy kernel has one block per SM), each looping over (row, chunk) pieces, so it can
  be captured in a graph whatever the step misses; with nothing to copy it returns at once.

Both run under ``TRITON_INTERPRET=1`` on CPU tensors, which is how the script checks itself
without a GPU.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

READ_CHUNK_WORDS = 8192  # 64 KiB of one part per program
READ_BLOCK_WORDS = 1024
COPY_BLOCK_WORDS = 2048  # 16 KiB per piece


@triton.jit
def _read_kernel(
    base_ptr,
    slots_ptr,
    partial_ptr,
    stride,
    off0,
    off1,
    off2,
    words0,
    words1,
    words2,
    CHUNKS: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)  # the expert (its index in slots)
    p = tl.program_id(1)  # its part
    c = tl.program_id(2)  # the chunk of that part
    off = tl.where(p == 0, off0, tl.where(p == 1, off1, off2)).to(tl.int64)
    words = tl.where(p == 0, words0, tl.where(p == 1, words1, words2)).to(tl.int64)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    start = c.to(tl.int64) * CHUNK
    acc = tl.zeros([BLOCK], dtype=tl.int64)
    if (slot >= 0) & (start < words):
        part = (base_ptr + slot * stride + off).to(tl.pointer_type(tl.int64))
        for b in range(0, CHUNK, BLOCK):
            j = start + b + tl.arange(0, BLOCK).to(tl.int64)
            w = tl.load(part + j, mask=j < words, other=0)
            acc += w * (2 * j + 1)
    tl.store(partial_ptr + (i * 3 + p) * CHUNKS + c, tl.sum(acc, axis=0))


def read_chunks(parts) -> int:
    """Programs per part of :func:`read_experts` for parts of ``(offset, bytes)``."""
    return max(-(-(nbytes // 8) // READ_CHUNK_WORDS) for _, nbytes in parts)


def read_experts(table: torch.Tensor, stride: int, parts, slots: torch.Tensor, partials: torch.Tensor) -> None:
    """Launch the reading kernel over ``slots`` (int32, ``[n]``) of ``table`` (a uint8 tensor whose
    ``data_ptr`` is slot 0's row; rows ``stride`` bytes apart; ``parts``: three ``(offset, bytes)``
    within a row, bytes a multiple of 8) into ``partials`` (int64 ``[n, 3, read_chunks(parts)]``).
    A slot below 0 reads nothing (sum 0)."""
    n, chunks = slots.numel(), read_chunks(parts)
    assert partials.dtype == torch.int64 and partials.numel() == n * 3 * chunks, "partials of the wrong shape"
    (o0, b0), (o1, b1), (o2, b2) = parts
    assert b0 % 8 == b1 % 8 == b2 % 8 == 0, "each part must be a multiple of 8 bytes"
    _read_kernel[(n, 3, chunks)](
        table,
        slots,
        partials,
        stride,
        o0,
        o1,
        o2,
        b0 // 8,
        b1 // 8,
        b2 // 8,
        CHUNKS=chunks,
        CHUNK=READ_CHUNK_WORDS,
        BLOCK=READ_BLOCK_WORDS,
        num_warps=4,
    )


def sums_of(partials: torch.Tensor, n: int) -> np.ndarray:
    """The per-expert checksums (uint64) of ``n`` experts from :func:`read_experts`'s partials,
    added up modulo 2^64 (after the step, outside the timing)."""
    return partials.view(n, -1).cpu().numpy().view(np.uint64).sum(axis=1, dtype=np.uint64)


@triton.jit
def _copy_kernel(
    src_ptr,
    dst_ptr,
    src_idx_ptr,
    dst_idx_ptr,
    num_copy_ptr,
    stride_words,
    words,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    n = tl.load(num_copy_ptr).to(tl.int32)
    per_row = tl.cdiv(words, BLOCK)
    src = src_ptr.to(tl.pointer_type(tl.int64))
    dst = dst_ptr.to(tl.pointer_type(tl.int64))
    for piece in range(pid, n * per_row, programs):
        i = piece // per_row
        j = (piece - i * per_row).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        e = tl.load(src_idx_ptr + i).to(tl.int64)
        s = tl.load(dst_idx_ptr + i).to(tl.int64)
        keep = j < words
        v = tl.load(src + e * stride_words + j, mask=keep)
        tl.store(dst + s * stride_words + j, v, mask=keep)


def copy_plan(
    source_rows: torch.Tensor,
    table: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    num_copy: torch.Tensor,
    programs: int,
) -> None:
    """Copy rows ``src_indices[:num_copy]`` of ``source_rows`` (uint8 ``[experts, stride]``,
    page-locked host memory on the GPU) into rows ``dst_indices[:num_copy]`` of ``table`` (uint8
    ``[slots, stride]``) with ``programs`` programs; ``num_copy`` stays on the device."""
    stride = source_rows.shape[1]
    assert table.shape[1] == stride and stride % 8 == 0, "source and table rows must match, a multiple of 8 bytes"
    _copy_kernel[(programs,)](
        source_rows,
        table,
        src_indices,
        dst_indices,
        num_copy,
        stride // 8,
        stride // 8,
        BLOCK=COPY_BLOCK_WORDS,
        num_warps=8,
    )
