"""The progress bar: on a terminal by default, silent elsewhere, and written to sys.stderr as it
is when the bar is made (a redirected stderr gets it)."""

import io
import sys

from expcache_bench import Progress


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_the_bar_shows_on_a_terminal_and_ends_its_line():
    out = Terminal()
    bar = Progress(None, out)
    bar("placing", 1, 2)
    bar("placing", 2, 2)
    text = out.getvalue()
    assert "1/2" in text and text.endswith("2/2\n")


def test_the_bar_is_silent_off_a_terminal_unless_forced():
    out = io.StringIO()
    Progress(None, out)("placing", 1, 1)
    assert out.getvalue() == ""
    Progress(True, out)("placing", 1, 1)
    assert out.getvalue().endswith("1/1\n")


def test_the_default_stream_is_stderr_as_it_is_when_the_bar_is_made(monkeypatch):
    redirected = Terminal()
    monkeypatch.setattr(sys, "stderr", redirected)
    Progress()("placing", 3, 3)
    assert redirected.getvalue().endswith("3/3\n")
