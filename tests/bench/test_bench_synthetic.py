"""Synthetic traces in the benchmark (``--traces synthetic:TOKENS[:SEED]``, expcache_bench/workload.py,
expcache_bench/traces/synthetic.py): shaped by the layout (its MoE layers, experts per layer, and a top-k from
--top-k or the model's config), the DeepSeek V4 Flash layouts' trace unchanged."""

from __future__ import annotations

import json

import numpy as np
import pytest

import expcache_bench as bench
from expcache_bench import cli
from expcache_bench.traces import MISSING, check_layout, synthetic_trace
from expcache_bench.workload import decode_trace
from pyexpcache import ModelLayout
from pyexpcache.layout import LayerSpec

#: Qwen3-30B-A3B's config.json (the keys the layout and the top-k are read from).
QWEN3 = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    num_hidden_layers=48,
    num_experts=128,
    num_experts_per_tok=8,
    hidden_size=2048,
    moe_intermediate_size=768,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    torch_dtype="bfloat16",
)


@pytest.fixture
def qwen3_config(tmp_path):
    path = tmp_path / "Qwen3-30B-A3B" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(QWEN3))
    return path


def test_a_synthetic_trace_takes_the_layouts_geometry():
    layout = ModelLayout.from_hf_config(QWEN3, "Q4_K")
    trace = decode_trace("synthetic:20:1", layout)
    assert (trace.num_tokens, list(trace.layers), trace.num_experts, trace.k) == (20, list(range(48)), 128, 6)
    assert trace.name == "synthetic:20:1" and trace.complete
    check_layout(trace, layout)
    assert decode_trace("synthetic:20:1", layout, k=8).k == 8
    assert decode_trace("synthetic:20:1", layout.scaled(256)).ids.tolist() == trace.ids.tolist()


def test_deepseek_layouts_keep_the_default_trace():
    """DeepSeek V4 Flash's layouts (any quant, any scale): the trace of layers 3-42 it always had."""
    default = synthetic_trace(30, seed=2, name="synthetic:30:2")
    for layout in (ModelLayout.preset("mixed"), ModelLayout.preset("q2", scale=4096)):
        trace = decode_trace("synthetic:30:2", layout)
        assert trace.first_layer == 3 and trace.num_layers == 40
        assert np.array_equal(trace.ids, default.ids)
    assert np.array_equal(decode_trace("synthetic:30:2").ids, default.ids)  # no layout: the same


def test_dense_layers_have_no_records():
    spec = LayerSpec(16, 256, 256, 256)
    layout = ModelLayout((None, spec, spec, None, spec, None), name="holes")
    trace = decode_trace("synthetic:12", layout, k=2)
    assert trace.first_layer == 1 and list(trace.layers) == [1, 2, 3, 4]
    assert trace.routed_layers == [1, 2, 4] and trace.missing_records == 0
    assert (trace.ids[:, 2] == MISSING).all()
    check_layout(trace, layout)
    v3 = decode_trace("synthetic:5", ModelLayout.preset("deepseek-v3-q4k"))  # three dense layers first
    assert v3.first_layer == 3 and v3.num_layers == 58 and v3.num_experts == 256


def test_a_top_k_that_does_not_fit_names_it():
    layout = ModelLayout.preset("mixtral-8x7b-q4k")  # 8 experts per layer
    with pytest.raises(ValueError, match=r"k=6 .*\(8 experts per layer\): k at most 4"):
        decode_trace("synthetic:5", layout)
    assert decode_trace("synthetic:5", layout, k=2).k == 2


def test_bench_run_replays_a_synthetic_trace_of_the_layout():
    layout = ModelLayout.from_hf_config(QWEN3, "Q4_K").scaled(256)
    report = bench.run(layout, "decode", variants=["lru"], traces=["synthetic:6"], backend="host")
    assert report.results[0].experts_checked == 6 * 48 * 6 and report.traces == ["synthetic:6"]


def cli_report(tmp_path, capsys, *argv):
    out = tmp_path / "r.json"
    rc = cli.main(["bench", "--backend", "host", "--variants", "lru", "--quiet", "--json", str(out), *argv])
    err = capsys.readouterr().err
    return rc, err, (json.loads(out.read_text())[0] if rc == 0 else None)


def test_the_cli_shapes_synthetic_traces_by_the_layout(tmp_path, capsys, qwen3_config):
    rc, err, report = cli_report(tmp_path, capsys, "--layout", f"{qwen3_config}:Q4_K", "--traces", "synthetic:10")
    assert rc == 0, err
    lru = report["results"][0]
    assert lru["experts_checked"] == 10 * 48 * 8  # k from the config's num_experts_per_tok
    rc, err, report = cli_report(
        tmp_path,
        capsys,
        "--layout",
        f"{qwen3_config}:Q4_K",
        "--traces",
        "synthetic:10",
        "--top-k",
        "4",
        "--layers",
        "0-5",
    )
    assert rc == 0, err
    assert report["results"][0]["experts_checked"] == 10 * 6 * 4


def test_the_cli_asks_for_a_top_k_that_fits(tmp_path, capsys):
    rc, err, _ = cli_report(tmp_path, capsys, "--layout", "mixtral-8x7b-q4k", "--traces", "synthetic:10")
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith(
        "expcache bench: --traces synthetic:10: layout mixtral-8x7b-q4k has 8 experts per layer, "
        "too few for the default top-k of 6: give --top-k K, 1 <= K <= 4"
    ), err
    rc, err, report = cli_report(
        tmp_path, capsys, "--layout", "mixtral-8x7b-q4k", "--traces", "synthetic:10", "--top-k", "2", "--scale", "4096"
    )
    assert rc == 0, err
    assert report["results"][0]["experts_checked"] == 10 * 32 * 2
    rc, err, _ = cli_report(
        tmp_path, capsys, "--layout", "mixtral-8x7b-q4k", "--traces", "synthetic:10", "--top-k", "5"
    )
    assert rc == 2 and "--top-k 5: layout mixtral-8x7b-q4k has 8 experts per layer: 1 <= K <= 4" in err, err


def test_top_k_without_a_synthetic_trace_is_refused(tmp_path, capsys):
    rc, err, _ = cli_report(tmp_path, capsys, "--traces", "smoke_count64", "--top-k", "4")
    assert rc == 2 and "--top-k applies to synthetic:TOKENS traces" in err, err


def test_the_variants_table_serves_a_quantized_layout_of_four_parts_by_slot(tmp_path, capsys):
    """A quantized checkpoint's config gives its stored parts (FP8: weights and scales, four per
    expert): the variants table's C loop serves them by slot id and its checksum reads every part
    of every routed expert from the bank, each checked against the source; the hits are the
    simulator's (the table fails where they are not); the header names the parts. Its
    quantization as one GGUF type runs as before."""
    path = fp8_config(tmp_path)
    argv = ["--layout", str(path), "--traces", "synthetic:4", "--scale", "128", "--budget-fraction", "0.25"]
    rc, err, report = cli_report(tmp_path, capsys, *argv, "--variants", "lru,nocache")
    assert rc == 0, err
    lru, nocache = report["results"]
    assert lru["checksum_errors"] == 0 and lru["experts_checked"] == 4 * 48 * 8
    assert lru["hits"] > 0 and lru["misses"] > 0 and lru["hits"] + lru["misses"] == 4 * 48 * 8
    assert "compact loads serve experts of three parts only" in nocache["skipped"]
    assert report["parts"] == (
        "4 parts: gate_up_proj, gate_up_proj_scale_inv, down_proj, down_proj_scale_inv; served by slot id"
    )
    rc = cli.main(["bench", "--backend", "host", "--variants", "lru", *argv])
    out = capsys.readouterr().out
    assert rc == 0 and "(experts of 4 parts: gate_up_proj, gate_up_proj_scale_inv, down_proj" in out
    rc, err, report = cli_report(tmp_path, capsys, "--layout", f"{path}:Q8_0", "--traces", "synthetic:4")
    assert rc == 0, err
    assert report["results"][0]["experts_checked"] == 4 * 48 * 8 and report["parts"] is None


def test_modes_that_hand_out_three_pointers_refuse_a_quantized_layout(tmp_path, capsys):
    """The devices mode (its C loop selects three pointers per expert), the torch loop and the
    engine model's split select refuse four-part experts at once, naming the modes that serve them
    and the way around."""
    path = fp8_config(tmp_path)
    layout = ["--backend", "host", "--layout", str(path), "--traces", "synthetic:4", "--scale", "128"]
    assert cli.main(["bench", "devices", "--devices", "2", *layout]) == 2
    err = capsys.readouterr().err
    assert "its experts have 4 parts" in err and "CONFIG.json:TYPE" in err, err
    assert "`engine` and `graph` serve it by slot id" in err
    assert cli.main(["bench", "engine", "--split", *layout]) == 2
    err = capsys.readouterr().err
    assert "the split select (--split) hands out three pointers per expert: drop --split" in err, err


def fp8_config(tmp_path):
    path = tmp_path / "Qwen3-FP8" / "config.json"
    path.parent.mkdir()
    fp8 = dict(QWEN3, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    path.write_text(json.dumps(fp8))
    return path


def mode_report(tmp_path, capsys, mode: str, layout) -> dict:
    """The JSON report of `expcache bench MODE` on the host backend over ``layout``'s layers 0-3
    (4 synthetic tokens, a quarter of the experts cached, sizes / 128), which must succeed."""
    out = tmp_path / f"{mode}.json"
    argv = ["bench", mode, "--backend", "host", "--quiet", "--json", str(out), "--layout", str(layout)]
    rc = cli.main(argv + ["--traces", "synthetic:4", "--layers", "0-3", "--scale", "128", "--budget-fraction", "0.25"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return json.loads(out.read_text())[0]


def test_the_graph_loop_serves_a_quantized_layout_of_four_parts(tmp_path, capsys):
    """expcache bench graph on an FP8 checkpoint's config: the experts' four parts (weights and
    scales) are the class, every part of every routed expert is read by slot from the bank and
    checked against the source, by the graph loop (select_device) and by the C loop beside it
    (select_slots, the bank checksum of host slots); both loops' hits and misses equal."""
    from pyexpcache.layout import ModelLayout as Layout

    path = fp8_config(tmp_path)
    layout = Layout.from_hf_config(str(path))
    assert {len(layout[i].class_key) for i in layout.moe_layers} == {4}
    report = mode_report(tmp_path, capsys, "graph", path)
    c_loop, graph = report["results"]
    assert c_loop["loop"] == "C loop, host select" and graph["loop"] == "graph loop, select_device"
    for r in (c_loop, graph):
        assert r["checksum_errors"] == 0 and r["experts_checked"] == 4 * 4 * 8
        assert r["hits"] > 0 and r["misses"] > 0
    assert (c_loop["hits"], c_loop["misses"]) == (graph["hits"], graph["misses"])
    assert report["same_hits_as_c_loop"] is True
    assert not any("C loop" in s for s in report["skipped"])
    # the engine model's C loop serves it by slot too, with prefetches of predicted experts
    engine = mode_report(tmp_path, capsys, "engine", path)
    assert engine["results"] and all(r["checksum_errors"] == 0 for r in engine["results"])
    # the simulator's curve takes it too (hit rates do not depend on the parts)
    assert cli.main(["bench", "curve", "--quiet", "--layout", str(path), "--traces", "synthetic:4"]) == 0
