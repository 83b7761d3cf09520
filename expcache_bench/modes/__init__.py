"""The benchmark's modes, one module each behind one interface (``expcache bench MODE``):

=============  ============  ==============================================================
mode           module        what it runs
=============  ============  ==============================================================
``variants``   variants      the library's policies next to the designs they replace, per
                             scenario (the default)
``engine``     engine        each layer as an engine runs it: non-expert work, prefetch or
                             hints, the split select (the C loop)
``torch``      torch_loop    a torch decode loop over zero-copy views
``graph``      graph_loop    each token's step captured in a CUDA graph: select_device and
                             a kernel reading the experts through the bank
``devices``    devices       the experts spread over N devices
``curve``      curve         hit rate against budget, from the simulator
``transfer``   transfer      miss throughput per source kind next to the raw link (GPU)
=============  ============  ==============================================================

A mode's module has:

- ``NAME``, ``TITLE`` (how messages call it), ``HELP`` and ``DESCRIPTION`` (its help texts) and
  ``RUNS`` (what it runs, for messages about options it does not take);
- ``OPTIONS``: the :class:`~expcache_bench.options.Option` objects it takes, which its parser
  is built from, and ``SELECTED_BY``: the options that choose it when ``expcache bench`` is given
  options rather than a mode's name (the flag spelling, deprecated: see :func:`choose`);
- ``USES_BENCH``: whether it runs on a :class:`~expcache_bench.Bench` the command line makes
  from the shared options (then ``device_bytes(args, budget, model_bytes)``: the emulated device
  memory its caches hold at once, for the host backend's memory check);
- ``check(args)``: :class:`~expcache_bench.options.UsageError` for what it cannot run, before
  anything is allocated;
- ``run(bench, args)``: its :class:`~expcache_bench.report.Report` objects, each yielded when it
  is complete (``bench`` is None when ``USES_BENCH`` is false; output files opened by the command
  line are in ``args.outputs``, keyed by option);
- ``describe(report)`` and ``table(report)``: the lines it adds under the report's header, and its
  table (:func:`format_report` prints them).
"""

from __future__ import annotations

import warnings

from ..options import UsageError
from ..report import Report, header_lines, table_notes
from . import curve, devices, engine, graph_loop, torch_loop, transfer, variants

# Mode name -> its module, in the order the help lists them. Defined here only.
_MODULES = {
    "variants": variants,
    "engine": engine,
    "torch": torch_loop,
    "graph": graph_loop,
    "devices": devices,
    "curve": curve,
    "transfer": transfer,
}
NAMES = tuple(_MODULES)
# The flag spelling, `expcache bench [options]` (deprecated but for the default mode: the mode's
# name is the one spelling): the modes its options can choose, the one it runs when they choose
# none, and which wins when options of several are given.
FLAG_MODES = ("variants", "engine", "torch", "graph", "devices")
DEFAULT = "variants"
PRECEDENCE = ("devices", "torch", "graph", "engine")


def by_name(name: str):
    """The module of the mode ``name``."""
    try:
        return _MODULES[name]
    except KeyError:
        raise ValueError(f"unknown mode {name!r}: expected one of {', '.join(NAMES)}") from None


def flag_options() -> list:
    """Every option of the flag spelling, once each, in the modes' order."""
    out = []
    for name in FLAG_MODES:
        mode = by_name(name)
        for option in mode.OPTIONS + mode.SELECTED_BY:
            if option not in out:
                out.append(option)
    return out


def choose(args):
    """The mode the flag spelling's options ask for: the first of :data:`PRECEDENCE` one of whose
    ``SELECTED_BY`` options is given, else :data:`DEFAULT`. UsageError when an option given is
    not that mode's, naming the mode it belongs to. An option that chooses a mode other than the
    default is a deprecated spelling of ``expcache bench MODE`` (kept for one release): a
    DeprecationWarning names the mode's spelling."""
    chosen, by = by_name(DEFAULT), None
    for name in PRECEDENCE:
        mode = by_name(name)
        by = next((o for o in mode.SELECTED_BY if o.chooses(args, name)), None)
        if by is not None:
            chosen = mode
            break
    own = chosen.OPTIONS + chosen.SELECTED_BY
    for option in flag_options():
        if option.given(args) and option not in own:
            owner = next(by_name(n) for n in FLAG_MODES if option in by_name(n).OPTIONS + by_name(n).SELECTED_BY)
            raise UsageError(
                f"the {chosen.TITLE}{f' ({by.spelled_for(chosen.NAME)})' if by else ''} {chosen.RUNS}: drop the "
                f"{owner.TITLE}'s {option.flags[0]}, or run the {owner.TITLE} (expcache bench "
                f"{owner.NAME})"
            )
    if by is not None:
        less = f" less {by.flags[0]}" if by.selects else ""
        warnings.warn(
            f"choosing the {chosen.TITLE} by an option ({by.spelled_for(chosen.NAME)}) is deprecated and goes "
            f"in the next release: run 'expcache bench {chosen.NAME}' with the same options{less}",
            DeprecationWarning,
            stacklevel=2,
        )
    return chosen


def format_report(report: Report) -> str:
    """The report as text: the header, the lines its mode adds, the mode's table, the notes on its
    figures (:func:`table_notes`) and what was skipped."""
    mode = by_name(report.mode)
    head = header_lines(report) + mode.describe(report)
    table = mode.table(report)
    tail = "".join(f"\n{line}" for line in table_notes(report, table))
    tail += "".join(f"\nskipped: {s}" for s in report.skipped)
    return "\n".join(head) + "\n\n" + table + tail
