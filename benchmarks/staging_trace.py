"""Where a staged call's time goes, piece by piece, from a staging ring's trace. Run any staged
workload with EXPCACHE_STAGING_TRACE=FILE (each staging ring appends its first
EXPCACHE_STAGING_TRACE_PIECES pieces, default 65536, to FILE when it is destroyed), then:

    python3 benchmarks/staging_trace.py FILE[.gz] [--ring N --calls K,L,...]

The first table has one row per ring and the median over its calls of: the pieces and MiB a
call staged, when (from the call's first piece queued) its last piece was queued, finish() began,
the first piece was filled and sent, the last piece was sent and finish() returned, the time until
the next call's first piece (the caller's own work: its wait for the link, the engine), how many
fillers took its pieces, and the fill time a piece. --ring and --calls print the timeline of those
calls, a line per piece. Works on the host backend too (its "link" is a memcpy).
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import sys
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TextIO

import numpy as np
from tabulate import tabulate


@dataclass
class Ring:
    """One ring's trace: calls as (begun, finishing, finished) and pieces as (seq, bytes, queued,
    taken, filled, sent, send, filler), times in ns from the ring's making."""

    title: str
    calls: list[tuple] = field(default_factory=list)
    pieces: list[tuple] = field(default_factory=list)

    def pieces_by_call(self) -> list[list[tuple]]:
        """Each call's pieces, found by when they were queued (a call's pieces are queued after it
        began and before the next began)."""
        begun = [c[0] for c in self.calls]
        out: list[list[tuple]] = [[] for _ in self.calls]
        for p in self.pieces:
            i = bisect.bisect_right(begun, p[2]) - 1
            if i >= 0:
                out[i].append(p)
        return out


def _open(path: str) -> TextIO:
    return gzip.open(path, "rt") if path.endswith(".gz") else open(path)


def read(path: str) -> list[Ring]:
    """The rings of a trace file, in the order they were written."""
    rings: list[Ring] = []
    with _open(path) as f:
        for lineno, line in enumerate(f, 1):
            fields = line.rstrip("\n").split(",")
            if line.startswith("# ring"):
                rings.append(Ring(line[2:].strip()))
            elif fields[0] in ("call", "piece") and fields[1] not in ("index", "seq"):
                if not rings:
                    raise ValueError(f"{path}:{lineno}: a {fields[0]} line before any '# ring' line")
                try:
                    values = tuple(int(v) for v in fields[1:])
                except ValueError:
                    raise ValueError(f"{path}:{lineno}: not a trace line: {line.strip()!r}") from None
                if fields[0] == "call":
                    rings[-1].calls.append(values[1:4])
                else:  # seq, call, bytes, queued, taken, filled, sent, send, filler
                    seq, _, size, queued, taken, filled, sent, send, filler = values
                    rings[-1].pieces.append((seq, size, queued, taken, filled, sent, send, filler))
            elif line.strip() and fields[0] not in ("call", "piece"):
                raise ValueError(f"{path}:{lineno}: not a trace line: {line.strip()!r}")
    return rings


SUMMARY = [
    "ring",
    "calls",
    "pieces/call",
    "MiB/call",
    "last queued µs",
    "finish() µs",
    "first filled µs",
    "first sent µs",
    "last sent µs",
    "returned µs",
    "to next call µs",
    "fillers",
    "fill µs/piece",
]


def summary_rows(rings: Sequence[Ring]) -> Iterator[list]:
    for i, ring in enumerate(rings):
        calls = [(c, ps) for c, ps in zip(ring.calls, ring.pieces_by_call()) if ps]
        if not calls:
            continue
        rows = []
        for k, (c, ps) in enumerate(calls):
            begun = c[0]
            nxt = calls[k + 1][0][0] - c[2] if k + 1 < len(calls) else np.nan
            first = min(ps, key=lambda p: p[0])
            sent = [p[5] for p in ps if p[5]]
            rows.append(
                [
                    len(ps),
                    sum(p[1] for p in ps) / 2**20,
                    max(p[2] for p in ps) - begun,
                    c[1] - begun,
                    first[4] - begun,
                    (min(sent) - begun) if sent else np.nan,
                    (max(sent) - begun) if sent else np.nan,
                    c[2] - begun,
                    nxt,
                    len({p[7] for p in ps}),
                    np.mean([p[4] - p[3] for p in ps]),
                ]
            )
        with warnings.catch_warnings():  # a column without a value in any call (no piece sent): "—"
            warnings.simplefilter("ignore", RuntimeWarning)
            med = np.nanmedian(np.array(rows, dtype=float), axis=0)
        us = ["—" if np.isnan(v) else f"{v / 1e3:.1f}" for v in med]
        yield [
            f"{i}: {ring.title.split(':', 1)[-1].strip()}",
            len(calls),
            f"{med[0]:.1f}",
            f"{med[1]:.2f}",
            *us[2:9],
            f"{med[9]:.0f}",
            us[10],
        ]


def timeline_rows(ring: Ring, call: int) -> Iterator[list]:
    by_call = ring.pieces_by_call()
    if not 0 <= call < len(ring.calls):
        raise ValueError(f"no call {call}: the ring traced {len(ring.calls)}")
    begun = ring.calls[call][0]
    for seq, size, queued, taken, filled, sent, send, filler in by_call[call]:
        yield [
            call,
            seq,
            f"{size >> 10}",
            *(f"{(t - begun) / 1e3:.1f}" for t in (queued, taken, filled)),
            f"{(filled - taken) / 1e3:.1f}",
            f"{(sent - begun) / 1e3:.1f}" if sent else "—",
            send or "—",
            filler,
        ]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", help="the file EXPCACHE_STAGING_TRACE named (.gz read as gzip)")
    p.add_argument("--ring", type=int, default=None, help="the ring whose calls --calls shows (first column)")
    p.add_argument("--calls", default="", help="comma list of call numbers of --ring to show piece by piece")
    args = p.parse_args(argv)
    try:
        rings = read(args.trace)
    except (OSError, ValueError) as e:
        print(f"staging_trace: {e}", file=sys.stderr)
        return 2
    print(tabulate(list(summary_rows(rings)), headers=SUMMARY, disable_numparse=True))
    if args.calls:
        if args.ring is None or not 0 <= args.ring < len(rings):
            p.error(f"--calls needs --ring, one of 0..{len(rings) - 1}")
        try:
            rows = [r for k in args.calls.split(",") if k.strip() for r in timeline_rows(rings[args.ring], int(k))]
        except ValueError as e:
            p.error(str(e))
        print()
        print(
            tabulate(
                rows,
                headers=[
                    "call",
                    "piece",
                    "KiB",
                    "queued µs",
                    "taken µs",
                    "filled µs",
                    "fill µs",
                    "sent µs",
                    "send",
                    "filler",
                ],
                disable_numparse=True,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
