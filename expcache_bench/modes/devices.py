"""The decode traces over several devices (``expcache bench devices --devices N``; ``expcache bench
--devices N``).

Three runs side by side in one process, on one source: one device at the per-device budget, one
device at N times it (where it fits), and N devices at the per-device budget each, the experts
placed by a :class:`~pyexpcache.placement.Placement`. Each decode call is one layer: its ids are
split by owner, every owner's select and checksum enqueued on that owner's stream, then the layer
waits for all of them (``expcache_replay_devices`` in ``replay.c``, one thread: with a pinned
source the owners' copies overlap; a pageable source's are staged one owner after another).

Reported per run: tok/s, the hit rate, MiB moved per token, the link bound and the share of it
reached; per device: hit rate, MiB per token and how busy its link was. The link bound of a run
is what its links allow for the bytes each device moved in each layer: a layer takes at least
its busiest link's bytes (those of every device on that GPU) over the link's measured bandwidth,
so the bound of N links is the decode tokens over the sum, over layers, of that maximum (for
one device, of its bytes). Devices listed on the same GPU share its link in the bound too.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Optional

import numpy as np
from tabulate import tabulate

from pyexpcache import _cuda
from pyexpcache.multi import MultiDeviceCache
from pyexpcache.placement import Placement, loads_from_calls

from .. import replay as _replay
from ..options import BENCH, OUTPUT, Option, UsageError, synthetic_traces
from ..report import DecodeRate, HitRate, Report, share, timed
from ..workload import DEFAULT_TRACES, decode_trace, decode_workload, trace_label

PLACEMENTS = ("balanced", "round-robin")

NAME = "devices"
TITLE = "several-devices run"
HELP = "one device, one device at N times the budget, and N devices side by side"
DESCRIPTION = (
    "Spread the experts over N devices: one device, one device at N times the budget, and N devices "
    "side by side (decode scenario, the library's default policy; --budget-gib is each device's)."
)
RUNS = "replays the decode scenario, waiting after every layer, with the library's default policy"
USES_BENCH = True

DEVICES = Option(
    "--devices",
    type=int,
    default=None,
    metavar="N",
    help="spread the experts over N devices (2..64; the host backend emulates them; with fewer GPUs "
    "than N the caches share a GPU and its link)",
)
DEVICE_PLACEMENT = Option(
    "--device-placement",
    choices=PLACEMENTS,
    default="balanced",
    help="which device owns each expert: balanced by the replayed traces' request counts "
    "(default), or expert e on device e mod N",
)
OPTIONS = BENCH + (DEVICES, DEVICE_PLACEMENT) + OUTPUT
SELECTED_BY = (DEVICES,)


@dataclass
class DeviceRun(HitRate):
    """One device's share of a run."""

    device: int
    hits: int = 0
    misses: int = 0
    bytes_h2d: int = 0
    link_bytes_per_s: float = 0.0


@dataclass
class DevicesResult(DecodeRate):
    name: str
    num_devices: int
    budget_bytes: int  # per device
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    bound_seconds: float = 0.0  # what the links need for the bytes each device moved, layer by layer
    checksum_errors: int = 0
    experts_checked: int = 0
    devices: list[DeviceRun] = field(default_factory=list)

    DERIVED: ClassVar[tuple[str, ...]] = (
        "tokens_per_s",
        "link_bound_tokens_per_s",
        "share_of_bound",
        "hit_rate",
        "bytes_per_token",
    )

    @property
    def link_bound_tokens_per_s(self) -> float:
        return self.decode_tokens / self.bound_seconds if self.bound_seconds else float("inf")

    @property
    def share_of_bound(self) -> float:
        bound = self.link_bound_tokens_per_s
        return self.tokens_per_s / bound if bound != float("inf") and bound else 0.0

    @property
    def hit_rate(self) -> float:
        hits = sum(d.hits for d in self.devices)
        total = hits + sum(d.misses for d in self.devices)
        return hits / total if total else 0.0

    @property
    def bytes_per_token(self) -> float:
        return sum(d.bytes_h2d for d in self.devices) / self.decode_tokens if self.decode_tokens else 0.0

    def link_busy(self, d: DeviceRun) -> float:
        if not self.decode_seconds or not d.link_bytes_per_s:
            return 0.0
        return d.bytes_h2d / d.link_bytes_per_s / self.decode_seconds


def _placement(layout, n: int, kind: str, calls) -> Placement:
    if kind == "round-robin":
        return Placement.round_robin(layout, n)
    if kind == "balanced":
        return Placement.balanced(layout, n, loads_from_calls(layout, calls))
    raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {kind!r}")


def _fits(bench, device: int, nbytes: int) -> bool:
    """Whether ``device`` has room for a cache of ``nbytes`` beside the reserve (host: always)."""
    if not bench.is_cuda:
        return True
    rt = _cuda.runtime()
    _cuda.check(rt.cudaSetDevice(device), "cudaSetDevice")
    free, _ = _cuda.check(rt.cudaMemGetInfo(), "cudaMemGetInfo")
    _cuda.check(rt.cudaSetDevice(bench.device), "cudaSetDevice")
    reserve = bench.reserve_bytes if bench.reserve_bytes is not None else 1 << 30
    return int(free) >= nbytes + reserve + (1 << 30)


def _replay_run(
    bench, name: str, multi: MultiDeviceCache, streams: list[int], workload, links: dict, result: DevicesResult
) -> None:

    calls, ids = workload.arrays()
    n = multi.num_devices
    owners = np.zeros((bench.layout.num_layers, bench.expected.shape[1]), np.uint8)
    for layer, own in enumerate(multi.placement.owners):
        if own is not None:
            owners[layer, : own.size] = own
    call_bytes = np.zeros((len(calls), n), np.uint64)
    devs = (_replay.ReplayDevice * n)()

    def loop(dll, api, progress, out):
        expected = np.ascontiguousarray(bench.expected)
        with contextlib.ExitStack() as stack:
            for d, cache in enumerate(multi.caches):
                devs[d].cache = stack.enter_context(cache.raw_handle())
                devs[d].stream = streams[d] or None
                devs[d].max_classes = cache.max_classes
            dll.expcache_replay_devices(
                ctypes.byref(api),
                devs,
                n,
                owners.ctypes.data,
                ctypes.addressof(calls),
                len(calls),
                ids.ctypes.data,
                expected.ctypes.data,
                expected.shape[1],
                progress,
                call_bytes.ctypes.data,
                ctypes.byref(out),
            )

    out = bench.run_c_loop(name, loop)
    result.decode_seconds = out.decode_seconds
    result.bound_seconds = link_bound_seconds(call_bytes, multi.devices, links)
    result.checksum_errors = out.checksum_errors
    result.experts_checked = out.experts_checked
    for d, (dev, st) in enumerate(zip(multi.devices, multi.stats())):
        decode = st.path("decode")
        result.devices.append(DeviceRun(dev, decode.hits, decode.misses, int(call_bytes[:, d].sum()), links[dev]))


def link_bound_seconds(call_bytes: np.ndarray, devices: Sequence[int], links: dict) -> float:
    """The least time the links need for ``call_bytes`` ([calls, devices] bytes): per call, the
    busiest link's bytes (summed over the devices on it) over its bandwidth, summed over calls."""
    gpus = sorted(set(devices))
    per_link = np.stack([call_bytes[:, [i for i, d in enumerate(devices) if d == g]].sum(axis=1) for g in gpus], axis=1)
    return float((per_link / np.array([links[g] for g in gpus])).max(axis=1).sum())


def run_devices(
    bench,
    num_devices: int,
    *,
    traces: Sequence[str] = DEFAULT_TRACES,
    placement: str = "balanced",
    policy: Optional[str] = None,
) -> Report:
    """One device at ``bench.budget_bytes``, one at ``num_devices`` times it where that fits, and
    ``num_devices`` devices at ``bench.budget_bytes`` each, every cache of ``policy`` (None: the
    library's default); see the module docstring."""
    if not 2 <= num_devices <= 64:
        raise ValueError(f"--devices must be 2..64, got {num_devices}")
    gpus = _cuda.device_count() if bench.is_cuda else num_devices
    devices = [(bench.device + i) % max(gpus, 1) for i in range(num_devices)]
    loaded = [decode_trace(name, bench.layout) for name in traces]
    workload = decode_workload(loaded, bench.layout.moe_layers)
    measured = {dev: bench.measure_link(dev) for dev in sorted(set(devices))}
    links = {dev: link.bytes_per_s for dev, link in measured.items()}
    report = Report(
        "devices",
        f"decode over {num_devices} devices",
        **bench.report_header(),
        traces=[trace_label(t) for t in traces],
        link_bytes_per_s=links[bench.device],
        link_label=measured[bench.device].label,
        settings=dict(devices=devices, device_placement=placement, shared_gpus=len(set(devices)) < num_devices),
    )
    # Each cache's budget: at divided sizes the one keeping the full-size run's slot counts.
    runs = [
        ("1 device", [bench.device], bench.budget_bytes),
        (f"1 device, {num_devices}x budget", [bench.device], bench.budget_for(num_devices * bench.full_budget_bytes)),
        (f"{num_devices} devices", devices, bench.budget_bytes),
    ]
    streams: dict[int, int] = {bench.device: bench.stream}
    rt = _cuda.runtime() if bench.is_cuda else None
    try:
        for name, devs, budget in runs:
            if len(devs) == 1 and budget > bench.budget_bytes and not _fits(bench, devs[0], budget):
                report.skipped.append(f"{name}: {budget / (1 << 30):.1f} GiB does not fit on device {devs[0]}")
                continue
            for dev in devs:
                if dev not in streams and rt is None:
                    streams[dev] = 0  # host backend: no streams
                elif dev not in streams:
                    _cuda.check(rt.cudaSetDevice(dev), "cudaSetDevice")
                    streams[dev] = int(
                        _cuda.check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreate")
                    )
            if rt is not None:
                _cuda.check(rt.cudaSetDevice(bench.device), "cudaSetDevice")
            place = _placement(bench.layout, len(devs), placement, workload.calls)
            options = dict(bench.cache_options)
            if bench.reserve_bytes is not None:
                options.setdefault("reserve_bytes", bench.reserve_bytes)
            result = DevicesResult(name, len(devs), budget, decode_tokens=workload.decode_tokens)
            with MultiDeviceCache(
                bench.layout,
                bench.source,
                devices=devs,
                placement=place,
                budget_bytes=budget,
                backend=bench.backend,
                policy=policy,
                log_level=1,
                **options,
            ) as multi:
                _replay_run(bench, name, multi, [streams[d] for d in devs], workload, links, result)
            report.results.append(result)
    finally:
        for s in streams.values():
            if rt is not None and s != bench.stream:
                rt.cudaStreamDestroy(s)
    return report


# -- the mode ---------------------------------------------------------------------------------


def check(args) -> None:
    if args.devices is None:
        raise UsageError("name the number of devices: --devices N (2..64)")
    if not 2 <= args.devices <= 64:
        raise UsageError(f"--devices must be 2..64, got {args.devices}")
    synthetic_traces(args)


def device_bytes(args, budget: int, model_bytes: int) -> int:
    return budget * args.devices  # the N devices' caches, or one of N times the budget


def run(bench, args) -> Iterator[Report]:
    yield run_devices(bench, args.devices, traces=args.traces, placement=args.device_placement)


def describe(report: Report) -> list[str]:
    """The several-devices run's lines under the header: the devices, the placement, the bound."""
    st = report.settings
    lines = [
        f"the budget is each device's; devices {st['devices']}; placement {st['device_placement']}"
        + (" (by the replayed traces' request counts)" if st["device_placement"] == "balanced" else ""),
        "link bound: per layer, the busiest link's bytes (every device on that GPU) over its measured bandwidth, "
        "summed over layers",
    ]
    if st["shared_gpus"]:
        lines.append(
            "fewer GPUs than devices: caches share a GPU and its link (the logic is exercised, the "
            "other links are not; the bound counts the shared link once)"
        )
    return lines


def table(report: Report) -> str:
    """The three runs side by side, with each one's ratio to the first."""

    ref = report.results[0] if report.results else None
    rows = []
    for r in report.results:
        per = "; ".join(
            f"#{i} ({d.device}): {100 * d.hit_rate:.1f} % / "
            f"{d.bytes_h2d / r.decode_tokens / (1 << 20):.1f} MiB / {share(r.link_busy(d))}"
            for i, d in enumerate(r.devices)
        )
        rows.append(
            [
                r.name,
                f"{r.budget_bytes * r.num_devices / (1 << 30):.2f}",
                f"{r.tokens_per_s:.2f}",
                f"{r.tokens_per_s / ref.tokens_per_s:.2f}×" if ref and ref.tokens_per_s else "—",
                f"{100 * r.hit_rate:.1f} %",
                f"{r.bytes_per_token / (1 << 20):.1f}",
                f"{r.link_bound_tokens_per_s:.2f}",
                share(r.share_of_bound),
                per,
                f"{r.checksum_errors} bad / {r.experts_checked}",
            ]
        )
    return tabulate(
        rows,
        headers=[
            "run",
            "GiB in all",
            timed(report, "decode tok/s"),
            timed(report, "vs 1 device"),
            "hit rate",
            "MiB moved/token",
            timed(report, "link bound tok/s"),
            timed(report, "of bound"),
            "per device: hit rate / MiB per token / " + timed(report, "link busy"),
            "checksums",
        ],
        disable_numparse=True,
    )
