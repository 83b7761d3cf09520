"""triton_kernels' routing metadata moved from expert ids to slot ids in one kernel launch.

The metadata of a forward (``RoutingData.expt_data``) keeps, per expert, its routes' count
(``hist``), the first of their rows in the expert-sorted order (``token_offs_raw``), its tiles'
start for each tile height (``token_offs_pad``), and per tile its expert and block
(``block_pid_map``: ``block << 16 | expert``, -1 for none). With every route of expert e given
slot s, the same metadata over slots is each per-expert entry moved from e to s and each tile's
expert replaced by its slot: the rows, their order, the gather and scatter indices, the tiles
and the grid stay as they are, so the matmul reads every row as the model's forward does.
The slot of expert e is the slot of its first row's route. Triton is what triton_kernels runs
on, so it is there whenever an MXFP4 model is served.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 256


@triton.jit
def _to_slots(
    hist,
    offs,
    pad,
    pad_stride,
    tile_map,
    map_stride,
    tiles,
    src,
    slots,
    experts,
    cap,
    hist_out,
    offs_out,
    pad_out,
    map_out,
    HEIGHTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Every slot's entries first: none but the totals past the last.
    for s0 in range(0, cap + 1, BLOCK):
        s = s0 + tl.arange(0, BLOCK)
        zero = tl.zeros([BLOCK], dtype=tl.int32)
        tl.store(hist_out + s, zero, mask=s < cap)
        tl.store(offs_out + s, tl.where(s == cap, tl.load(offs + experts), zero), mask=s <= cap)
        for b in tl.static_range(HEIGHTS):
            total = tl.load(pad + b * pad_stride + experts)
            tl.store(pad_out + b * (cap + 1) + s, tl.where(s == cap, total, zero), mask=s <= cap)
    tl.debug_barrier()
    # Each expert with routes: its entries at its slot.
    for e0 in range(0, experts, BLOCK):
        e = e0 + tl.arange(0, BLOCK)
        count = tl.load(hist + e, mask=e < experts, other=0)
        used = (e < experts) & (count > 0)
        start = tl.load(offs + e, mask=used, other=0)
        slot = tl.load(slots + tl.load(src + start, mask=used, other=0), mask=used, other=0)
        tl.store(hist_out + slot, count, mask=used)
        tl.store(offs_out + slot, start, mask=used)
        for b in tl.static_range(HEIGHTS):
            tl.store(pad_out + b * (cap + 1) + slot, tl.load(pad + b * pad_stride + e, mask=used, other=0), mask=used)
    # Each tile: its expert's slot.
    for t0 in range(0, tiles, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        for b in tl.static_range(HEIGHTS):
            v = tl.load(tile_map + b * map_stride + t, mask=t < tiles, other=-1)
            used = (t < tiles) & (v != -1)
            start = tl.load(offs + (v & 0xFFFF), mask=used, other=0)
            slot = tl.load(slots + tl.load(src + start, mask=used, other=0), mask=used, other=0)
            tl.store(map_out + b * tiles + t, tl.where(used, (v & -65536) | slot, v), mask=t < tiles)


def _rows(table: dict) -> tuple[list, torch.Tensor, int] | None:
    """A dict of equally spaced rows of one int32 tensor (by tile height): (heights, the first
    row, the rows' spacing in elements); None where they are not."""
    heights = sorted(table)
    first = table[heights[0]]
    spacing = (table[heights[1]].data_ptr() - first.data_ptr()) // 4 if len(heights) > 1 else 0
    for i, h in enumerate(heights):
        row = table[h]
        if row.dtype != torch.int32 or row.stride(-1) != 1 or row.data_ptr() != first.data_ptr() + 4 * i * spacing:
            return None
        if row.shape != first.shape:
            return None
    return heights, first, spacing


def movable(data) -> bool:
    """Whether :func:`to_slots` takes ``data``: its tables laid out as triton_kernels' routing
    lays them out (else the caller builds the metadata over slots anew)."""
    pads, maps = _rows(data.token_offs_pad), _rows(data.block_pid_map)
    return (
        pads is not None
        and maps is not None
        and pads[0] == maps[0]
        and data.hist.dtype == data.token_offs_raw.dtype == torch.int32
    )


def to_slots(hub, data, src_indx: torch.Tensor, slots: torch.Tensor, cap: int):
    """``data`` (``ExptData`` over the model's experts, :func:`movable`), whose routes' rows
    ``src_indx`` gives, route by route token-major, their slots ``slots``, over ``cap`` slots."""
    heights, pad, pad_stride = _rows(data.token_offs_pad)
    _, tile_map, map_stride = _rows(data.block_pid_map)
    experts, tiles, device = data.hist.shape[0], tile_map.shape[0], slots.device
    hist = torch.empty(cap, dtype=torch.int32, device=device)
    offs = torch.empty(cap + 1, dtype=torch.int32, device=device)
    pad_out = torch.empty(len(heights), cap + 1, dtype=torch.int32, device=device)
    map_out = torch.empty(len(heights), tiles, dtype=torch.int32, device=device)
    _to_slots[(1,)](
        data.hist,
        data.token_offs_raw,
        pad,
        pad_stride,
        tile_map,
        map_stride,
        tiles,
        src_indx,
        slots,
        experts,
        cap,
        hist,
        offs,
        pad_out,
        map_out,
        HEIGHTS=len(heights),
        BLOCK=_BLOCK,
        num_warps=4,
    )
    return hub.routing.ExptData(
        hist, offs, {h: pad_out[i] for i, h in enumerate(heights)}, {h: map_out[i] for i, h in enumerate(heights)}
    )
