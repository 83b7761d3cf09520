"""Decode tokens/s with a pageable source for several staging configurations, in one process
over one source (GPU): which copy thread count and chunk size serve misses fastest when each
layer waits for the previous one. First, the rate at which that many threads can copy random
chunks out of the same pageable source at all (numpy copies, which release the GIL): the host's
side of the bound, next to the link's. Usage:

    python3 benchmarks/staging_sweep.py [--threads 4,8,12] [--chunks 256K,512K,1M] [--traces NAME]
                                        [--env VAR=a,b ...] [--repeat N]

--env runs each configuration with the environment variable VAR set to each value in turn, read
when the configuration's cache is created (EXPCACHE_STAGING_NT_MAX, _COALESCE, _MIN_PIECES,
_FILE_BOUNCE, _COPY, _SHORT, _PREFETCH, _PREFETCH_HINT: libexpcache/src/backend/staging_tuning.hpp
says what each sets and accepts, docs/transfers.md what each default was measured against; a
malformed value stops the sweep with the library's message); several --env options make a grid.
--repeat runs the whole grid N times, so that configurations alternate in one process rather than
following each other.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

from tabulate import tabulate

import expcache_bench as bench
from expcache_bench.modes.transfer import host_copy_gb_s
from expcache_bench.options import sizes as _sizes
from pyexpcache import StagingStats
from pyexpcache.layout import ModelLayout
from pyexpcache.progress import Progress

GiB = 1 << 30


def _env_values(text: str) -> tuple[str, list[str]]:
    name, sep, values = text.partition("=")
    if not sep or not name or not values:
        raise argparse.ArgumentTypeError(f"{text!r}: expected VAR=value[,value...]")
    return name, values.split(",")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default="4,8,12")
    p.add_argument("--chunks", type=_sizes, default=[256 << 10, 512 << 10, 1 << 20])
    p.add_argument("--traces", default="podA_c_python_full")
    p.add_argument("--layout", default="mixed")
    p.add_argument("--budget-gib", type=float, default=12.0)
    p.add_argument(
        "--env",
        action="append",
        default=[],
        type=_env_values,
        metavar="VAR=a,b",
        help="run each configuration with VAR set to each value (repeatable: a grid)",
    )
    p.add_argument("--repeat", type=int, default=1, help="run the grid this many times, alternating")
    args = p.parse_args()
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    if bench.resolve_backend() != "cuda":
        print("staging_sweep: needs a CUDA device", file=sys.stderr)
        return 1
    layout = ModelLayout.preset(args.layout)
    traces = [t for t in args.traces.split(",") if t]
    shared = bench.Bench(layout, pinned=False, budget_bytes=int(args.budget_gib * GiB), progress=Progress(False))
    rows = []
    thread_counts = [int(t) for t in args.threads.split(",")]
    try:
        fill = [
            [t, f"{c >> 10} KiB", f"{host_copy_gb_s(shared.source.buffer, c, t):.1f}"]
            for t in [1] + thread_counts
            for c in args.chunks
        ]
        print(
            tabulate(fill, headers=["threads", "piece", "host copy GB/s (pageable source)"], disable_numparse=True),
            flush=True,
        )
        settings = [
            dict(zip([name for name, _ in args.env], values))
            for values in itertools.product(*[values for _, values in args.env])
        ]
        grid = [
            (threads, chunk, env)
            for _ in range(args.repeat)
            for threads in thread_counts
            for chunk in args.chunks
            for env in settings
        ]
        for threads, chunk, env in grid:
            os.environ.update(env)  # read when the configuration's cache is created
            env_label = " ".join(f"{k}={v}" for k, v in env.items())
            shared.cache_options = {"copy_threads": threads, "staging_chunk_bytes": chunk}
            report = bench.run(
                layout, "decode", variants=["expcache"], traces=traces, budget_bytes=shared.budget_bytes, bench=shared
            )
            r = report.results[0]
            st = r.staging
            rows.append(
                [
                    threads,
                    f"{chunk >> 10} KiB",
                    env_label,
                    f"{r.tokens_per_s:.2f}",
                    f"{100 * r.hit_rate:.1f} %",
                    f"{100 * r.tokens_per_s / r.link_bound_tokens_per_s:.0f} %",
                    f"{r.serve_us_per_call:.0f}",
                    f"{r.after_serve_us_per_call:.0f}",
                    *st.columns(),
                    f"{r.checksum_errors} bad / {r.experts_checked}",
                ]
            )
            print(
                f"staging_sweep: {threads} threads, {chunk >> 10} KiB chunks {env_label}: {r.tokens_per_s:.2f} tok/s",
                file=sys.stderr,
                flush=True,
            )  # progress; the table follows at the end
            if r.checksum_errors:
                return 1
    finally:
        shared.close()
    print(
        tabulate(
            rows,
            headers=[
                "copy threads",
                "chunk",
                "environment",
                "decode tok/s",
                "hit rate",
                "of link bound",
                "select µs/call",
                "after select µs/call",
                *StagingStats.COLUMNS,
                "checksums",
            ],
            disable_numparse=True,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
