"""``expcache bench --devices N`` (expcache_bench/modes/devices.py) on the host backend, which emulates
the devices: the three runs, every expert's bytes checked, the per-device counters and the link
bound's arithmetic (times on the host mean nothing: no test looks at them)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import expcache_bench as bench
from expcache_bench.cli import main
from expcache_bench.link import Link
from expcache_bench.modes import devices
from pyexpcache import ModelLayout

TRACE = "podA_b_json_full"  # 40 tokens x 37 layers


@pytest.fixture(scope="module")
def host_bench():
    layout = ModelLayout.preset("mixed", scale=4096)
    b = bench.Bench(layout, backend="host", budget_bytes=(4 << 30) // 4096)
    yield b
    b.close()


@pytest.mark.parametrize("placement", devices.PLACEMENTS)
@pytest.mark.parametrize("n", [2, 3])
def test_the_three_runs_serve_the_right_bytes(host_bench, n, placement):
    report = devices.run_devices(host_bench, n, traces=[TRACE], placement=placement)
    assert [r.name for r in report.results] == ["1 device", f"1 device, {n}x budget", f"{n} devices"]
    assert [r.num_devices for r in report.results] == [1, 1, n]
    assert report.settings["devices"] == list(range(n)) and not report.settings["shared_gpus"]
    one, big, many = report.results
    for r in report.results:
        assert r.checksum_errors == 0 and r.experts_checked == 40 * 37 * 6
        assert sum(d.hits + d.misses for d in r.devices) == 40 * 37 * 6
        assert r.bound_seconds > 0 and r.tokens_per_s > 0
    # N devices at B each hold as much as one at N x B: hit rates far above one device at B.
    assert many.hit_rate > one.hit_rate + 0.05 and big.hit_rate > one.hit_rate + 0.05
    # Each device moved only what it owns: the bytes add up to the run's total.
    assert many.bytes_per_token == sum(d.bytes_h2d for d in many.devices) / many.decode_tokens
    assert all(d.bytes_h2d > 0 for d in many.devices)
    text = bench.format_report(report)
    assert f"{n} devices" in text and "link bound" in text and "0 bad / 8880" in text


@pytest.mark.parametrize("given", [None, {0: 9.76e9, 1: 3.07e9}], ids=["measured", "unequal"])
def test_the_link_bound_is_the_busiest_device_per_layer(host_bench, monkeypatch, given):
    """The bound of a run is the sum over its layers of the busiest device's bytes over that
    device's own link speed. The emulated links are measured one after the other and differ on
    a loaded machine (3.07 and 9.76 GB/s were seen), so each device is held to its own measured
    speed, and the unequal case is also run with given speeds."""
    if given is not None:
        monkeypatch.setattr(host_bench, "measure_link", lambda device=None: Link(given[device], "given"))
    recorded = {}
    real = devices._replay_run

    def spy(bench_, name, multi, streams, workload, links, result):
        real(bench_, name, multi, streams, workload, links, result)
        recorded[name] = (dict(links), result)

    monkeypatch.setattr(devices, "_replay_run", spy)
    report = devices.run_devices(host_bench, 2, traces=[TRACE], placement="round-robin")
    links, many = recorded["2 devices"]
    if given is not None:
        assert links == given
    assert [d.link_bytes_per_s for d in many.devices] == [links[d.device] for d in many.devices]
    # Per layer the busiest device's time: never below what any one device needed in all,
    # nor above what all of them needed one after the other.
    seconds = [d.bytes_h2d / links[d.device] for d in many.devices]
    assert max(seconds) <= many.bound_seconds * (1 + 1e-9)
    assert many.bound_seconds <= sum(seconds) * (1 + 1e-9)
    one = report.results[0]
    assert one.bound_seconds == pytest.approx(one.devices[0].bytes_h2d / links[one.devices[0].device])


def test_cli_devices_writes_json(tmp_path, capsys):
    out = tmp_path / "devices.json"
    assert main(["bench", "--devices", "2", "--traces", TRACE, "--quiet", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "2 devices" in text and "per device" in text
    (data,) = json.loads(out.read_text())
    assert [r["name"] for r in data["results"]] == ["1 device", "1 device, 2x budget", "2 devices"]
    assert all(r["checksum_errors"] == 0 for r in data["results"])
    assert data["results"][2]["link_bound_tokens_per_s"] > 0


@pytest.mark.parametrize(
    "argv, why",
    [
        (["--devices", "1"], "--devices must be 2..64"),
        (["--devices", "2", "--prefetch", "cooc"], "drop the engine model"),
        (["--devices", "2", "--scenario", "prefill"], "decode scenario"),
        (["--devices", "2", "--no-layer-sync"], "decode scenario"),
    ],
)
def test_cli_devices_refuses_what_it_cannot_run(argv, why, capsys):
    assert main(["bench", "--traces", TRACE, "--quiet"] + argv) == 2
    assert why in capsys.readouterr().err


def test_run_devices_refuses_one_device(host_bench):
    with pytest.raises(ValueError, match="2..64"):
        devices.run_devices(host_bench, 1, traces=[TRACE])
    with pytest.raises(ValueError, match="placement must be one of"):
        devices.run_devices(host_bench, 2, traces=[TRACE], placement="nope")


def test_devices_on_one_gpu_share_its_link_in_the_bound():
    b = np.array([[100, 300], [200, 50]], dtype=np.uint64)
    assert devices.link_bound_seconds(b, [0, 1], {0: 100.0, 1: 100.0}) == pytest.approx(3 + 2)
    assert devices.link_bound_seconds(b, [0, 0], {0: 100.0}) == pytest.approx(4 + 2.5)
    assert devices.link_bound_seconds(b, [1, 0], {0: 50.0, 1: 100.0}) == pytest.approx(6 + 2)
