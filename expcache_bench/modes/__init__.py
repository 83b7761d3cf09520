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
- ``OPTIONS``: the :class:`~pyexpcache.bench.options.Option` objects it takes, which its parser
  is built from, and ``SELECTED_BY``: the options that choose it when ``expcache bench`` is given
  options rather than a mode's name (the flag spelling, see :func:`choose`);
- ``USES_BENCH``: whether it runs on a :class:`~pyexpcache.bench.Bench` the command line makes
  from the shared options (then ``device_bytes(args, budget, model_bytes)``: the emulated device
  memory its caches hold at once, for the host backend's memory check);
- ``check(args)``: :class:`~pyexpcache.bench.options.UsageError` for what it cannot run, before
  anything is allocated;
- ``run(bench, args)``: its :class:`~pyexpcache.bench.report.Report` objects, each yielded when it
  is complete (``bench`` is None when ``USES_BENCH`` is false; output files opened by the command
  line are in ``args.outputs``, keyed by option);
- ``describe(report)`` and ``table(report)``: the lines it adds under the report's header, and its
  table (:func:`~pyexpcache.bench.report.format_report` prints them).
"""

from __future__ import annotations

import importlib

from ..options import UsageError

# Mode name -> its module, in the order the help lists them. Defined here only.
_MODULES = {
    "variants": "variants",
    "engine": "engine",
    "torch": "torch_loop",
    "graph": "graph_loop",
    "devices": "devices",
    "curve": "curve",
    "transfer": "transfer",
}
NAMES = tuple(_MODULES)
# The flag spelling, `expcache bench [options]`: the modes its options can choose, the one it
# runs when they choose none, and which wins when options of several are given.
FLAG_MODES = ("variants", "engine", "torch", "graph", "devices")
DEFAULT = "variants"
PRECEDENCE = ("devices", "torch", "graph", "engine")


def by_name(name: str):
    """The module of the mode ``name``."""
    try:
        module = _MODULES[name]
    except KeyError:
        raise ValueError(f"unknown mode {name!r}: expected one of {', '.join(NAMES)}") from None
    return importlib.import_module(f"{__name__}.{module}")


def flag_options() -> list:
    """Every option of the flag spelling, once each, in the modes' order."""
    out = []
    for name in FLAG_MODES:
        mode = by_name(name)
        out += [o for o in mode.OPTIONS + mode.SELECTED_BY if o not in out]
    return out


def choose(args):
    """The mode the flag spelling's options ask for: the first of :data:`PRECEDENCE` one of whose
    ``SELECTED_BY`` options is given, else :data:`DEFAULT`. UsageError when an option given is
    not that mode's, naming the mode it belongs to."""
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
    return chosen
