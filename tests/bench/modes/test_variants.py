"""The variants table (expcache_bench/modes/variants.py) on the host backend: every variant side by
side on one workload, checksums that catch wrong bytes, decode bytes and times apart from
prefill's, one wait per token serving what one wait per layer serves, and every variant from the
experts in a file."""

from __future__ import annotations

import json

import numpy as np
import pytest

import expcache_bench as bench
from expcache_bench.modes.variants import run_variant
from expcache_bench.sim import DECODE, Call
from pyexpcache import ModelLayout, _lib


def test_bench_run_host_reports_every_variant():
    layout = ModelLayout.preset("mixed", scale=4096)
    report = bench.run(
        layout, "decode", traces=["podA_b_json_full"], budget_bytes=(12 << 30) // 4096, backend="host", host_scale=4096
    )
    names = [r.variant for r in report.results]
    assert names == list(bench.variants())
    r = {x.variant: x for x in report.results}
    assert report.checksum_errors == 0 and r["oppclass"].experts_checked == 37 * 40 * 6
    assert r["resident"].hit_rate == 1.0 and r["nocache"].hit_rate == 0.0
    assert r["slab"].hit_rate < r["oppclass"].hit_rate <= r["oppclass"].belady_hit_rate + 0.02
    assert r["slab"].releases > 37  # the old design released at every size change
    assert r["oppclass"].decode_bytes_h2d == r["oppclass"].bytes_h2d > 0  # decode only: every byte is decode's
    for x in report.results:  # the serving calls' share of the decode time
        assert x.decode_calls == 37 * 40
        assert 0 < x.decode_serve_seconds < x.decode_seconds
        assert x.serve_us_per_call > 0 and x.after_serve_us_per_call > 0
    text = bench.format_report(report)
    assert "host-emulated" in text and "Belady" in text
    json.dumps(report.to_json())


def test_variants_are_the_librarys_policies_then_the_baselines():
    """The policy variants are the library's table, by name, its default first: nothing typed."""
    assert bench.policy_variants()[0] == _lib.DEFAULT_POLICY
    assert sorted(bench.policy_variants()) == sorted(_lib.POLICIES)
    assert (
        bench.variants()
        == bench.policy_variants() + bench.BASELINES
        == bench.policy_variants() + ("slab", "nocache", "resident")
    )


def test_every_policy_variant_agrees_with_its_simulator(monkeypatch):
    """run_scenario checks each policy variant's hit rate against simulate_policy of the same name
    (one call per policy, with the layout's MoE layers): an LRU special case would show here."""
    from expcache_bench.modes import variants as mode

    calls = []
    real = mode.simulate_policy

    def spy(*args, policy, layers=None, **kw):
        calls.append((policy, tuple(layers)))
        return real(*args, policy=policy, layers=layers, **kw)

    monkeypatch.setattr(mode, "simulate_policy", spy)
    layout = ModelLayout.preset("mixed", scale=4096)
    report = bench.run(
        layout,
        "decode",
        variants=list(bench.policy_variants()),
        traces=["podA_b_json_full"],
        budget_bytes=layout.total_bytes // 20,
        backend="host",
    )
    assert calls == [(p, tuple(layout.moe_layers)) for p in bench.policy_variants()]
    assert [r.variant for r in report.results] == list(bench.policy_variants())


def test_bench_detects_corrupted_bytes(monkeypatch):
    layout = ModelLayout.preset("q2", scale=4096)
    b = bench.Bench(layout, backend="host", budget_bytes=layout.total_bytes // 10)
    try:
        b.expected[5, 7] ^= np.uint64(1)  # as if expert (5, 7) had been served wrong
        w = bench.Workload("t", [Call(DECODE, 5, (7, 8))], 1, 0)
        r = run_variant(b, "lru", w)
        assert r.checksum_errors == 1
    finally:
        b.close()


def test_prefill_bytes_are_not_charged_to_decode():
    layout = ModelLayout.preset("q2", scale=4096)
    report = bench.run(
        layout,
        "turns",
        variants=["oppclass"],
        traces=["podA_b_json_full"],
        budget_bytes=layout.total_bytes // 10,
        backend="host",
    )
    r = report.results[0]
    assert 0 < r.decode_bytes_h2d < r.bytes_h2d
    assert r.link_bound_tokens_per_s == pytest.approx(r.decode_tokens / (r.decode_bytes_h2d / report.link_bytes_per_s))


@pytest.mark.parametrize("variant", ["lru", "oppclass", "nocache"])
def test_no_layer_sync_serves_the_same_bytes_and_counts(variant):
    """One wait per token instead of per layer: the same hits, misses and checksums, and a
    corrupted expectation is still caught."""
    layout = ModelLayout.preset("mixed", scale=4096)
    w = bench.build_workload("decode", ["podA_b_json_full"])
    results = {}
    for sync in (True, False):
        b = bench.Bench(layout, backend="host", budget_bytes=layout.total_bytes // 10, layer_sync=sync)
        try:
            results[sync] = run_variant(b, variant, w)
            b.expected[5, int(w.calls[2].ids[0])] ^= np.uint64(1)  # layer 5 of the first token, its first expert
            bad = run_variant(b, variant, w)
        finally:
            b.close()
        assert results[sync].checksum_errors == 0
        assert bad.checksum_errors >= 1
    a, b_ = results[True], results[False]
    assert (a.hits, a.misses, a.experts_checked, a.decode_bytes_h2d, a.decode_calls) == (
        b_.hits,
        b_.misses,
        b_.experts_checked,
        b_.decode_bytes_h2d,
        b_.decode_calls,
    )
    assert 0 < b_.decode_serve_seconds < b_.decode_seconds


def test_a_layout_the_traces_never_route_to_is_an_error_not_a_bug():
    # Before: every variant ran on no calls, then "library hit rate 0.0 differs from the simulator's nan ... a bug".
    full = ModelLayout.preset("q2", scale=4096)
    layout = ModelLayout(tuple(s if i < 3 else None for i, s in enumerate(full.layers)), name="layers 0-2")
    with pytest.raises(ValueError, match="the traces route none of layout layers 0-2's layers"):
        bench.run(layout, "decode", traces=["podA_b_json_full"], backend="host", budget_bytes=1 << 20)


@pytest.mark.parametrize("kind", ["mmap", "file"])
def test_every_variant_from_a_file_source(tmp_path, kind):
    """Every variant served from the generated experts in a file (read with O_DIRECT where the file
    system allows it), byte-exact; each row's bound the lower of its link and disk bounds."""
    layout = ModelLayout.preset("mixed", scale=4096)
    b = bench.Bench(
        layout,
        backend="host",
        kind=kind,
        file_dir=str(tmp_path),
        budget_bytes=(12 << 30) // 4096,
        cache_options=dict(file_reads="direct"),
        scale=4096,
    )
    try:
        report = bench.run(layout, "decode", traces=["podA_b_json_full"], bench=b)
        assert report.checksum_errors == 0 and report.source == kind and report.disk_bytes_per_s > 0
        for r in report.results:
            assert r.experts_checked == 37 * 40 * 6 and 0.0 <= r.page_cache_after <= 1.0
            if r.decode_bytes_h2d:
                assert r.bound_tokens_per_s == min(r.link_bound_tokens_per_s, r.disk_bound_tokens_per_s)
        assert f"of {report.bound_by} bound" in bench.format_report(report)
        assert json.loads(json.dumps(report.to_json()))["source_file"]["path"] == b.source.path
    finally:
        b.close()


def _four_parts(layout: ModelLayout) -> ModelLayout:
    """``layout`` with each expert as four parts, as an FP8 checkpoint stores it: gate and up as one
    weight, down, and a scale beside each."""
    from pyexpcache.layout import LayerSpec

    def four(spec):
        g, u, d = spec.class_key
        parts = [("gate_up_proj", g + u), ("gate_up_proj_scale_inv", 40), ("down_proj", d), ("down_proj_scale_inv", 24)]
        return LayerSpec.of_parts(spec.num_experts, parts)

    return ModelLayout(tuple(four(s) if s else None for s in layout.layers), name=f"{layout.name}-4parts")


def test_experts_of_four_parts_are_served_by_slot_in_every_scenario():
    """A layout of four-part experts: the C loop serves them by slot id (select_slots, prefill
    batches by slot, the bank checksum of every part); every expert checked, none bad, the policy
    variants' hits the simulator's (run_scenario checks), the slab and resident baselines too;
    compact loads (nocache) skipped, saying why."""
    three = ModelLayout.preset("q2", scale=4096)
    layout = _four_parts(three)
    for scenario in ("decode", "turns"):
        kw = dict(traces=["podA_b_json_full"], budget_bytes=three.total_bytes // 10, backend="host")
        report = bench.run(layout, scenario, variants=["lru", "slab", "nocache", "resident"], **kw)
        rows = {r.variant: r for r in report.results}
        assert "nocache" in rows and "compact loads serve experts of three parts only" in rows["nocache"].skipped
        ran = [r for r in report.results if r.skipped is None]
        assert [r.variant for r in ran] == ["lru", "slab", "resident"]
        for r in ran:
            assert r.checksum_errors == 0 and r.experts_checked > 0, r.variant
        if scenario == "turns":
            assert rows["lru"].prefill_tokens > 0 and rows["lru"].prefill_seconds > 0
        assert rows["lru"].hits > 0 and rows["lru"].misses > 0 and rows["resident"].misses == 0


@pytest.mark.parametrize("layer_sync", [True, False])
def test_a_corrupted_part_of_a_four_part_expert_is_caught(layer_sync):
    """One byte of one part (a scale) of one expert changed in the source after the expected sums
    were taken: the bank checksum by slot reads every part, so the loop counts it bad, with one
    wait per layer or per token."""
    layout = _four_parts(ModelLayout.preset("q2", scale=4096))
    b = bench.Bench(layout, backend="host", budget_bytes=layout.total_bytes // 10, layer_sync=layer_sync)
    try:
        w = bench.Workload("t", [Call(DECODE, 5, (7, 8)), Call(DECODE, 6, (1, 2))], 1, 0)
        assert run_variant(b, "lru", w).checksum_errors == 0
        b.source.part(5, 7, 3)[-1] ^= 1  # the down projection's last scale byte of expert (5, 7)
        r = run_variant(b, "lru", w)
        assert (r.checksum_errors, r.experts_checked) == (1, 4)
    finally:
        b.close()
