"""What a run reports: per-variant results, the report with what made it (version,
library, commit, command line, traces), its text tables and JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Optional


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
    results: list = field(default_factory=list)
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


def write_json(report: Report, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report.to_json(), f, indent=2)
