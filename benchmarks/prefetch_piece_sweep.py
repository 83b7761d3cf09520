"""The engine model (``expcache bench engine``) at several prefetch piece sizes, one
source for all, each size's settings side by side with ``none`` in its own table.

A piece is the most prefetch data in flight (two transfers of half), what a demand miss shares
the link with; a bigger one lets a right prefetch cover more of the window before the select, and
each transfer costs the prefetch thread two API calls. Run::

    python3 benchmarks/prefetch_piece_sweep.py --pieces 256K,1M,4M --layer-compute-us 60
"""

from __future__ import annotations

import argparse
import sys

from expcache_bench import HOST_SCALE, Bench, format_report, resolve_backend
from expcache_bench.modes.engine import run_engine
from expcache_bench.options import sizes as _sizes
from pyexpcache import ModelLayout
from pyexpcache.layout import GiB


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pieces", type=_sizes, default=_sizes("256K,1M,4M"))
    p.add_argument("--layer-compute-us", type=float, default=60.0)
    p.add_argument("--prefetch", default="cooc,oracle:1.0")
    p.add_argument("--hints", action="store_true")
    p.add_argument("--traces", default=None, help="comma list (default: the seven bundled decode traces)")
    args = p.parse_args(argv)
    backend = resolve_backend("auto")
    scale = 1 if backend == "cuda" else HOST_SCALE
    layout = ModelLayout.preset("mixed", scale=scale)
    bench = Bench(layout, backend=backend, budget_bytes=12 * GiB // scale, scale=scale)
    kwargs = {} if args.traces is None else {"traces": args.traces.split(",")}
    failed = False
    try:
        for piece in args.pieces:
            bench.cache_options["prefetch_piece_bytes"] = piece
            report = run_engine(
                bench, prefetch=args.prefetch.split(","), hints=args.hints, compute_us=args.layer_compute_us, **kwargs
            )
            print(f"## prefetch pieces of {piece // 1024} KiB")
            print(format_report(report), flush=True)
            print()
            failed = failed or report.checksum_errors > 0
    finally:
        bench.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
