"""What every mode of the benchmark returns: one :class:`Report` type, with one header (the
mode, where it ran, on what layout, source, budget and traces, against which link, and the
version, library, commit and command line that made it), the mode's own settings and its rows;
printed (:func:`~expcache_bench.modes.format_report`: the header, then the mode's lines and table)
and serialized (:meth:`Report.to_json`) one way for every mode."""

from __future__ import annotations

import json
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from pyexpcache import __version__, library_version
from pyexpcache.layout import GiB


class DecodeRate:
    """A row that timed ``decode_tokens`` over ``decode_seconds``: its decode rate."""

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


class HitRate:
    """A row that counted ``hits`` and ``misses``: the share of hits."""

    @property
    def hit_rate(self) -> float:
        asked = self.hits + self.misses
        return self.hits / asked if asked else 0.0


@dataclass
class Report:
    mode: str  # the mode that made it (expcache_bench.modes)
    title: str  # what ran, as the first line names it: "decode", "engine model", ...
    backend: Optional[str] = None  # "host" or "cuda"; None where nothing ran on a backend (a simulator)
    device: Optional[str] = None  # the device's name
    layout: Optional[str] = None
    # The experts' parts where they are not gate, up and down, e.g. "4 parts: gate_up_proj, ...; served
    # by slot id" (a quantized checkpoint's weights and scales; Bench.parts_header); None otherwise.
    parts: Optional[str] = None
    source: Optional[str] = None  # "pinned" or "pageable" host memory, or a file: "mmap" or "file" (bench.SOURCES)
    placement: Optional[str] = None  # where an expert's parts lie in the source
    budget_bytes: Optional[int] = None  # the cache budget (per device where there are several)
    budget_fraction: Optional[float] = None  # the full-size budget over the bytes of every expert of the model
    host_scale: int = 1  # expert sizes divided by this
    # At host_scale != 1: the full-size budget whose slot counts the caches' budget_bytes gives every
    # class (checked with the library); None where that was not checked.
    full_budget_bytes: Optional[int] = None
    traces: list[str] = field(default_factory=list)
    link_bytes_per_s: Optional[float] = None  # the link measured in the run (expcache_bench.link)
    link_label: Optional[str] = None
    # A source in a file: its read rate measured in the run (expcache_bench.disk), and what the run
    # read it with and what the page cache could hold of it (Bench.file_header).
    disk_bytes_per_s: Optional[float] = None
    disk_label: Optional[str] = None
    # Where a run's own misses were read again (disk.replay, bench graph): the cold best shape's
    # rate (disk_label's), and the replay's fields (bytes_per_s, bytes, reads, misses, of_misses,
    # direct, label, bound: "replay" or "cold", the larger, which disk_bytes_per_s is), or
    # {"skipped": why}. None where no replay was tried.
    disk_cold_bytes_per_s: Optional[float] = None
    disk_replay: Optional[dict] = None
    source_file: Optional[dict] = None
    settings: dict = field(default_factory=dict)  # the mode's own; in the JSON beside the header's fields
    results: list = field(default_factory=list)  # the mode's rows (dataclasses)
    skipped: list[str] = field(default_factory=list)  # what the mode could not run here, and why
    # What a kept report needs to be read later: which code, which command.
    version: str = ""  # pyexpcache's version
    library: Optional[str] = None  # the loaded libexpcache: version and path
    git_commit: Optional[str] = None  # of the source tree the package runs from, when it is one
    argv: Optional[list[str]] = None  # the command line, when run from it

    @property
    def checksum_errors(self) -> int:
        """Experts served with bytes that differ from the source, over every row."""
        return sum(getattr(r, "checksum_errors", 0) for r in self.results)

    @property
    def bound_by(self) -> str:
        """What the bounds of the report's rows are taken at: ``"link"``, or ``"disk"`` where a file
        source's measured read rate is below the link's (:func:`bound`)."""
        return bound(self.link_bytes_per_s, self.disk_bytes_per_s)[1]

    @property
    def bound_name(self) -> str:
        """:attr:`bound_by`, and where it is the disk and a replay was measured, which of the
        disk's two rates: ``"disk (replay)"`` or ``"disk (cold)"``."""
        which = (self.disk_replay or {}).get("bound")
        return f"disk ({which})" if self.bound_by == "disk" and which else self.bound_by

    def to_json(self) -> dict:
        """The report as a JSON-ready dict: the header's fields, the settings beside them, and each
        row's fields with the figures its class derives from them (its ``DERIVED`` properties)."""
        out = asdict(self)
        settings = out.pop("settings")
        for r, d in zip(self.results, out["results"]):
            d.update((name, getattr(r, name)) for name in getattr(type(r), "DERIVED", ()))
        keys = list(out)
        at = keys.index("results")
        ordered = {k: out[k] for k in keys[:at]}
        ordered.update(settings)
        ordered.update((k, out[k]) for k in keys[at:])
        return ordered


def bound(link_bytes_per_s: Optional[float], disk_bytes_per_s: Optional[float] = None) -> tuple[float, str]:
    """The rate a bound is taken at, and what sets it: the link, or the disk where a file source's
    read rate (measured) is lower; misses reach the device at most as fast as the slower of the
    two gives them. ``(0.0, "link")`` when neither was measured."""
    if disk_bytes_per_s and (not link_bytes_per_s or disk_bytes_per_s < link_bytes_per_s):
        return disk_bytes_per_s, "disk"
    return link_bytes_per_s or 0.0, "link"


def made_by() -> dict:
    """The header's version, library and git_commit: what made a report."""
    try:
        library = library_version()
    except (ImportError, OSError):  # a mode that needs no library (the simulator) runs without one
        library = None
    return dict(version=__version__, library=library, git_commit=git_commit())


def git_commit() -> Optional[str]:
    """The commit of the git work tree this package runs from (``-dirty`` when tracked files
    changed), or None for an installed package or without git."""
    tree = Path(__file__).resolve().parents[1]  # expcache_bench/report.py -> the tree
    if not (tree / ".git").exists():
        return None
    try:
        head = subprocess.run(
            ["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def _bytes(n: int) -> str:
    """A budget as GiB (two decimals), or MiB, KiB or B below one GiB (a host run's are small)."""
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def header_lines(report: Report) -> list[str]:
    """The header every mode's report is printed with: what ran on which device; the layout,
    source and budget; the times and the link; the traces. Parts a report lacks are left out."""
    lines = [f"expcache bench — {report.title}" + (f" on {report.device}" if report.device else "")]
    what = []
    if report.layout:
        what.append(f"layout {report.layout}" + (f" (experts of {report.parts})" if report.parts else ""))
    if report.source:
        what.append(f"{report.source} source" + (f" ({report.placement} placement)" if report.placement else ""))
    if report.budget_bytes is not None:
        scaled = report.host_scale != 1
        kept = scaled and report.full_budget_bytes is not None
        what.append(
            f"budget {_bytes(report.full_budget_bytes if kept else report.budget_bytes)}"
            + (
                f" = {100 * report.budget_fraction:.1f} % of the experts' bytes"
                if report.budget_fraction is not None
                else ""
            )
            + (
                f" (sizes / {report.host_scale} here, budget {_bytes(report.budget_bytes)}: the same slot counts)"
                if kept
                else f" (sizes and budget / {report.host_scale}; slot counts not checked against the full size's)"
                if scaled
                else ""
            )
        )
    if what:
        lines.append(", ".join(what))
    how = []
    if report.backend:
        how.append(f"times {'host-emulated' if report.backend == 'host' else 'measured on the GPU'}")
    if report.link_bytes_per_s:
        how.append(f"link {report.link_bytes_per_s / 1e9:.1f} GB/s ({report.link_label})")
    if report.disk_bytes_per_s:
        how.append(disk_line(report) + f": the bounds are the {report.bound_by}'s, the lower")
    if how:
        lines.append("; ".join(how))
    if report.source_file:
        lines.append(file_line(report.source_file))
    if report.traces:
        lines.append(f"traces {', '.join(report.traces)}")
    return lines


def disk_line(report: Report) -> str:
    """The header's disk: its rate and how it was measured; where a run's misses were read again
    (:attr:`Report.disk_replay`), the cold rate, the replay's, and which the disk bound uses."""
    replay = report.disk_replay
    if not replay:
        return f"disk {report.disk_bytes_per_s / 1e9:.1f} GB/s ({report.disk_label})"
    cold = report.disk_cold_bytes_per_s or report.disk_bytes_per_s
    line = f"disk {cold / 1e9:.1f} GB/s cold ({report.disk_label})"
    if "skipped" in replay:
        return line + f"; {replay['skipped']}"
    which = "replay" if replay["bound"] == "replay" else "cold shapes"
    return (
        line
        + f", {replay['bytes_per_s'] / 1e9:.1f} GB/s {replay['label']}: the disk bound uses "
        + f"{report.disk_bytes_per_s / 1e9:.1f} GB/s (the {which}, the faster)"
    )


def file_line(f: dict) -> str:
    """A file source's line in the header: the file, how misses read it, and what the page cache
    could hold of it (the fields :meth:`~expcache_bench.bench.Bench.file_header` gives)."""
    reads = {
        "mmap": "misses copied from a mapping of it (through the page cache)",
        "buffered": "misses read with pread through the page cache (--file-reads buffered)",
        "direct": "misses read with O_DIRECT (the page cache bypassed: every miss reads the disk)",
        "direct refused": "misses read with pread through the page cache (the file system refuses O_DIRECT)",
    }[f["reads"]]
    line = f"file {f['path']} ({_bytes(f['bytes'])}): {reads}"
    if f["reads"] == "direct":
        return line
    available = f.get("memory_available")
    if available is None:
        return line + "; whether the page cache can hold it is not known here"
    if f["bytes"] <= available:
        return (
            line
            + f"; it fits in the page cache ({_bytes(available)} of memory available): "
            + ("the bench drops it before each loop, but " if f.get("dropped") else "")
            + "an expert read once may stay there, so a loop can pass the disk bound"
        )
    return line + f"; it does not fit in the page cache ({_bytes(available)} of memory available)"


#: Marks, in a table, a share of a link bound above 100 %; :func:`table_notes` says why under it.
OVER_BOUND = "†"


def share(ratio: float, digits: int = 0) -> str:
    """A share of a link bound (or a link's busy time) as a table prints it, ``87 %``; above
    100 % marked with :data:`OVER_BOUND`."""
    return f"{100 * ratio:.{digits}f} %" + (f" {OVER_BOUND}" if ratio > 1 else "")


def timed(report: Report, label: str) -> str:
    """A table column of times, rates or link shares: on the host backend labelled as emulation."""
    return f"{label} (emulated)" if report.backend == "host" else label


def table_notes(report: Report, table: str) -> list[str]:
    """What a table's figures are where they are not GPU measurements: on the host backend, the
    emulation; a share above 100 % of a link bound (marked :data:`OVER_BOUND`), why."""
    host = report.backend == "host"
    notes = []
    if host:
        notes.append(
            "host backend: the (emulated) columns are host emulation, not GPU measurements: host memory "
            "stands in for the device's and a memcpy for the link, so they do not rank the rows as a GPU "
            "would; the hits and misses are the GPU's"
        )
    if OVER_BOUND in table:
        notes.append(
            f"{OVER_BOUND} above 100 %: "
            + (
                "the emulated link (a memcpy rate measured once, on one expert's bytes, before the run) is no bound on "
                "the host backend's copies"
                + (", nor the disk rate measured on its small file" if report.bound_by == "disk" else "")
                if host
                else "the run moved its misses faster than the link measured before it"
                if report.bound_by == "link"
                else "the run read its misses faster than the disk was measured to read"
                + (
                    " (both cold and replaying the run's own misses)"
                    if "bytes_per_s" in (report.disk_replay or {})
                    else ""
                )
                + ("" if (report.source_file or {}).get("reads") == "direct" else " (the page cache served some)")
            )
        )
    return notes


def write_json(report: Report, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report.to_json(), f, indent=2)
