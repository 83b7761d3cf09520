"""Every mode of the benchmark behind one interface (expcache_bench/modes/__init__.py): the same
contract for each module, the flag spelling's choice of a mode and its refusals, and a named mode
running the same replay as its flag spelling."""

from __future__ import annotations

import argparse
import inspect
import json
import re
import warnings

import pytest

import expcache_bench as bench
from expcache_bench import cli, format_report, modes, options
from expcache_bench.report import Report

TRACE = "podA_b_json_full"


@pytest.mark.parametrize("name", modes.NAMES)
def test_every_mode_has_the_interface(name):
    mode = modes.by_name(name)
    assert mode.NAME == name
    for text in (mode.TITLE, mode.HELP, mode.DESCRIPTION, mode.RUNS):
        assert isinstance(text, str) and text and "`" not in text
    assert all(isinstance(o, options.Option) for o in mode.OPTIONS + mode.SELECTED_BY)
    assert options.QUIET in mode.OPTIONS and options.JSON in mode.OPTIONS
    assert isinstance(mode.USES_BENCH, bool)
    for function in ("check", "run", "describe", "table") + (("device_bytes",) if mode.USES_BENCH else ()):
        assert callable(getattr(mode, function)), function
    assert inspect.isgeneratorfunction(mode.run)  # reports are yielded as they are finished
    assert list(inspect.signature(mode.run).parameters) == ["bench", "args"]
    parser = argparse.ArgumentParser()
    for option in mode.OPTIONS:  # no option twice, and each one's default is what `given` compares with
        option.add_to(parser)
    defaults = parser.parse_args([])
    assert not any(o.given(defaults) for o in mode.OPTIONS)


@pytest.mark.parametrize(
    "argv, name",
    [
        ([], "variants"),
        (["--scenario", "all", "--variants", "lru"], "variants"),
        (["--prefetch", "cooc"], "engine"),
        (["--layer-compute-us", "60", "--prefetch-top", "3"], "engine"),
        (["--split"], "engine"),
        (["--loop", "torch", "--layer-compute-us", "60"], "torch"),
        (["--loop", "graph", "--layer-compute-us", "60"], "graph"),
        (["--loop", "c", "--hints", "--prefetch", "cooc"], "engine"),
        (["--devices", "2", "--device-placement", "round-robin"], "devices"),
    ],
)
def test_the_flag_spelling_chooses_a_mode(argv, name):
    args = cli._parse(["bench"] + argv)
    assert args.mode is None
    if name == modes.DEFAULT:  # `expcache bench [options]` runs the default mode: not deprecated
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert modes.choose(args).NAME == name
    else:  # an option chose the mode: deprecated, the warning names the mode's spelling
        with pytest.warns(DeprecationWarning, match=re.escape(f"run 'expcache bench {name}' with the same options")):
            assert modes.choose(args).NAME == name


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--prefetch-top", "3"],
            "the variants table replays each --scenario through every --variants: drop the "
            "engine model's --prefetch-top, or run the engine model (expcache bench engine)",
        ),
        (
            ["--loop", "torch", "--split"],
            "the torch loop (--loop torch) replays the decode scenario in torch, plain and "
            "split selects side by side: drop the engine model's --split",
        ),
        (
            ["--loop", "graph", "--split"],
            "the graph loop (--loop graph) replays the decode scenario with the device-side "
            "select in a CUDA graph, next to the C loop: drop the engine model's --split",
        ),
        (["--prefetch", "cooc", "--no-layer-sync"], "drop the variants table's --no-layer-sync"),
        (["--device-placement", "round-robin"], "drop the several-devices run's --device-placement"),
    ],
)
def test_the_flag_spelling_refuses_options_of_another_mode(argv, message):
    with pytest.raises(options.UsageError, match=re.escape(message)):
        modes.choose(cli._parse(["bench"] + argv))


def test_a_named_mode_takes_only_its_options(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "curve", "--variants", "lru"])
    assert "expcache bench curve: error: unrecognized arguments: --variants lru" in capsys.readouterr().err
    assert cli.main(["bench", "devices", "--traces", TRACE, "--quiet"]) == 2
    assert capsys.readouterr().err.strip() == "expcache bench devices: name the number of devices: --devices N (2..64)"


@pytest.mark.parametrize(
    "named, flags",
    [
        (["variants", "--variants", "oppclass,lru"], ["--variants", "oppclass,lru"]),
        (["devices", "--devices", "2"], ["--devices", "2"]),
        (["engine", "--prefetch", "oracle:1.0", "--hints"], ["--prefetch", "oracle:1.0", "--hints"]),
    ],
    ids=["variants", "devices", "engine"],
)
def test_a_named_mode_runs_what_its_flag_spelling_runs(tmp_path, capsys, named, flags):
    common = ["--backend", "host", "--traces", TRACE, "--quiet", "--scale", "4096"]
    out = {}
    for key, argv in (("named", ["bench"] + named), ("flags", ["bench"] + flags)):
        path = tmp_path / f"{key}.json"
        assert cli.main(argv + common + ["--json", str(path)]) == 0
        (out[key],) = json.loads(path.read_text())
    capsys.readouterr()
    named_, flags_ = out["named"], out["flags"]
    assert named_["mode"] == flags_["mode"] == named[0]
    # The same calls and caches: the same counters (prefetch settings depend on timing: hints do not).
    for a, b in zip(named_["results"], flags_["results"]):
        if str(a.get("setting", "")).startswith("prefetch"):
            continue
        for key in ("hits", "misses", "bytes_h2d", "experts_checked", "checksum_errors"):
            if key in a:
                assert a[key] == b[key], key


def test_curve_mode_reports_the_simulator(tmp_path, capsys):
    path = tmp_path / "curve.json"
    assert cli.main(["bench", "curve", "--traces", "podA_c_python_full", "--json", str(path)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("expcache bench — hit rate against budget, offline simulator\n")
    (report,) = json.loads(path.read_text())
    assert report["mode"] == "curve" and report["backend"] is None and report["decode_tokens"] == 117
    assert [p["fraction"] for p in report["results"]] == list(modes.by_name("curve").FRACTIONS)
    assert (
        report["policies"] == list(bench.policy_variants()) and report["default_policy"] == bench.policy_variants()[0]
    )
    for p in report["results"]:
        assert list(p["hit_rates"]) == report["policies"]
        assert all(rate <= p["belady"] for rate in p["hit_rates"].values())
    assert f"{report['default_policy']} (the default)" in text


def test_one_header_for_every_report():
    report = Report(
        "devices",
        "decode over 2 devices",
        backend="host",
        device="host (emulated)",
        layout="L",
        source="pageable",
        placement="expert",
        budget_bytes=50 << 20,
        budget_fraction=0.25,
        host_scale=256,
        full_budget_bytes=12 << 30,
        traces=["a", "b"],
        link_bytes_per_s=2e9,
        link_label="memcpy",
        settings=dict(devices=[0, 1], device_placement="balanced", shared_gpus=False),
    )
    lines = format_report(report).splitlines()
    assert lines[:4] == [
        "expcache bench — decode over 2 devices on host (emulated)",
        "layout L, pageable source (expert placement), budget 12.00 GiB = 25.0 % of the experts' "
        "bytes (sizes / 256 here, budget 50 MiB: the same slot counts)",
        "times host-emulated; link 2.0 GB/s (memcpy)",
        "traces a, b",
    ]
    report.full_budget_bytes = None  # divided sizes whose slot counts nothing checked: not claimed
    assert format_report(report).splitlines()[1] == (
        "layout L, pageable source (expert placement), budget 50 MiB = 25.0 % of the experts' bytes (sizes and "
        "budget / 256; slot counts not checked against the full size's)"
    )
    data = report.to_json()
    assert (
        data["devices"] == [0, 1]
        and "settings" not in data
        and list(data).index("devices") < list(data).index("results")
    )
