"""A one-line progress bar on stderr."""

from __future__ import annotations

import sys
import time
from typing import Optional


class Progress:
    """A one-line progress bar on stderr (nothing when stderr is not a terminal, unless forced)."""

    def __init__(self, enabled: Optional[bool] = None, stream=None):
        self.stream = sys.stderr if stream is None else stream  # sys.stderr as it is now (it may be redirected)
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self._last = 0.0

    def __call__(self, label: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        width = 30
        filled = width * done // max(total, 1)
        self.stream.write(f"\r{label:<28} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()
