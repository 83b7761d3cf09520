"""What a run reports: per-variant results, the report with what made it (version,
library, commit, command line, traces), its text tables and JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Optional

from ..cache import StagingStats
from ..layout import GiB


@dataclass
class VariantResult:
    variant: str
    decode_seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_calls: int = 0
    # Of decode_seconds, the time in the serving calls (select); the rest is each layer's
    # checksum kernel and the wait for the transfers still crossing when select returned.
    decode_serve_seconds: float = 0.0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    hits: int = 0
    misses: int = 0
    bytes_h2d: int = 0
    decode_bytes_h2d: int = 0
    bytes_d2d: int = 0
    releases: int = 0
    checksum_errors: int = 0
    experts_checked: int = 0
    link_bound_tokens_per_s: Optional[float] = None
    belady_hit_rate: Optional[float] = None
    skipped: Optional[str] = None
    staging: Optional[StagingStats] = None  # pageable or file sources: the staging ring's counters

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def serve_us_per_call(self) -> float:
        """Mean µs a decode call spends in select (or the compact load)."""
        return 1e6 * self.decode_serve_seconds / self.decode_calls if self.decode_calls else 0.0

    @property
    def after_serve_us_per_call(self) -> float:
        """Mean µs of a decode call after select returned: the checksum kernel, the wait for
        transfers still crossing, the readback (per token without the per-layer wait)."""
        return 1e6 * (self.decode_seconds - self.decode_serve_seconds) / self.decode_calls if self.decode_calls else 0.0

    @property
    def hit_rate(self) -> float:
        asked = self.hits + self.misses
        return self.hits / asked if asked else 0.0

    @property
    def gib_per_token(self) -> float:
        """Host-to-device GiB per decode token, counting decode calls only."""
        return self.decode_bytes_h2d / GiB / self.decode_tokens if self.decode_tokens else 0.0


@dataclass
class Report:
    backend: str
    device: str
    layout: str
    scenario: str
    source: str
    placement: str
    budget_bytes: int
    host_scale: int
    decode_tokens: int
    prefill_tokens: int
    link_bytes_per_s: float
    link_label: str
    layer_sync: bool
    results: list[VariantResult] = field(default_factory=list)
    # What a kept report needs to be read later: which traces, which code, which command.
    traces: list[str] = field(default_factory=list)
    version: str = ""                 # pyexpcache's version
    library: str = ""                 # the loaded libexpcache: version and path
    git_commit: Optional[str] = None  # of the source tree the package runs from, when it is one
    argv: Optional[list[str]] = None  # the command line, when run from it

    @property
    def checksum_errors(self) -> int:
        return sum(r.checksum_errors for r in self.results)

    def to_json(self) -> dict:
        return json_with_derived(self, ("tokens_per_s", "hit_rate", "gib_per_token", "serve_us_per_call",
                                        "after_serve_us_per_call"))


def json_with_derived(report, properties) -> dict:
    """A report dataclass as a JSON-ready dict, each of its ``results`` with the named properties
    (figures derived from the counters) added beside its fields."""
    out = asdict(report)
    for r, d in zip(report.results, out["results"]):
        d.update((name, getattr(r, name)) for name in properties)
    return out


def git_commit() -> Optional[str]:
    """The commit of the git work tree this package runs from (``-dirty`` when tracked files
    changed), or None for an installed package or without git."""
    import subprocess
    from pathlib import Path

    tree = Path(__file__).resolve().parent.parent
    if not (tree / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def format_report(report: Report) -> str:
    """The report as text tables (tabulate)."""
    from tabulate import tabulate

    timing = "host-emulated" if report.backend == "host" else "measured on the GPU"
    head = [
        f"expcache bench — {report.scenario} on {report.device}",
        f"layout {report.layout}, {report.source} source ({report.placement} placement), "
        f"budget {report.budget_bytes / GiB:.2f} GiB"
        + (f" (sizes and budget / {report.host_scale}, same slot counts)" if report.host_scale != 1 else ""),
        f"{report.decode_tokens} decode tokens, {report.prefill_tokens} prefill tokens; "
        f"{'a wait after every layer' if report.layer_sync else 'one wait per token (--no-layer-sync)'}; "
        f"times {timing}; "
        f"link {report.link_bytes_per_s / 1e9:.1f} GB/s ({report.link_label})",
    ]
    base = {r.variant: r for r in report.results if r.skipped is None}
    ref = base.get("slab")
    rows = []
    for r in report.results:
        if r.skipped:
            rows.append([r.variant] + ["—"] * 7 + [f"skipped: {r.skipped}"])
            continue
        link_ratio = r.tokens_per_s / r.link_bound_tokens_per_s if r.link_bound_tokens_per_s else None
        rows.append([
            r.variant,
            f"{r.tokens_per_s:.2f}",
            f"{100 * r.hit_rate:.1f} %",
            f"{100 * r.belady_hit_rate:.1f} %" if r.belady_hit_rate is not None else "—",
            f"{r.gib_per_token:.3f}",
            f"{r.link_bound_tokens_per_s:.2f}" if r.link_bound_tokens_per_s else "∞",
            f"{100 * link_ratio:.0f} %" if link_ratio else "—",
            f"{r.tokens_per_s / ref.tokens_per_s:.2f}×" if ref and ref.tokens_per_s else "—",
            f"{r.checksum_errors} bad / {r.experts_checked}",
        ])
    table = tabulate(rows, headers=["variant", "decode tok/s", "hit rate", "Belady", "GiB/decode token",
                                    "link-bound tok/s", "of link bound", "vs slab", "checksums"],
                     disable_numparse=True)
    return "\n".join(head) + "\n\n" + table


def write_json(report: Report, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report.to_json(), f, indent=2)
