"""Does a smaller (so warmer) staging ring fill faster? Library miss throughput from pageable
memory, calls of 6 experts back to back as in `expcache bench transfer`, for staging rings of 4, 16 and
64 MiB (the default), each measured twice, with the staging counters. CUDA only.

    python3 benchmarks/staging_ring_size.py
"""

import sys

from expcache_bench.modes import transfer
from pyexpcache import _cuda
from pyexpcache.layout import LayerSpec, ModelLayout
from pyexpcache.source import HostSource


def main() -> int:
    rt = _cuda.runtime()
    _cuda.check(rt.cudaSetDevice(0), "cudaSetDevice")
    stream = int(_cuda.check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreate"))
    try:
        for size in ("0.5 MiB", "6.75 MiB"):
            parts = transfer.SIZES[size]
            layout = ModelLayout((LayerSpec(max(64, (512 << 20) // sum(parts)), *parts),) * 2, name=size)
            with HostSource(layout, pinned=False, arrangement="tensor") as src:
                for threads in (8, 12):
                    for chunk in (256 << 10, 1 << 20):
                        for ring in (4 << 20, 16 << 20, 64 << 20):
                            runs = []
                            for _ in range(2):
                                gb_s, _, st = transfer.library_gb_s(
                                    layout,
                                    src,
                                    stream,
                                    copy_threads=threads,
                                    staging_chunk_bytes=chunk,
                                    staging_bytes=ring,
                                )
                                runs.append(
                                    f"{gb_s:.1f} GB/s, span {st.span_us_per_call:.0f} µs, fill "
                                    f"{st.fill_us_per_piece:.1f} µs/piece, {st.threads_filling:.1f} "
                                    f"threads filling, first piece {st.first_fill_us_per_call:.1f} µs"
                                )
                            print(
                                f"{size} expert, {threads} threads, {chunk >> 10} KiB chunks, {ring >> 20} MiB "
                                f"ring: " + " | ".join(runs),
                                flush=True,
                            )
    finally:
        rt.cudaStreamDestroy(stream)
    return 0


if __name__ == "__main__":
    sys.exit(main())
