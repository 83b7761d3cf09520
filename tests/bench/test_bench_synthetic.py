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


def test_a_layout_of_other_than_three_parts_is_refused_naming_the_way_around(tmp_path, capsys):
    """A quantized checkpoint's config gives its stored parts (FP8: weights and scales, four per
    expert); the bench's loops hand out three pointers per expert, so it says so at once, and its
    quantization as one GGUF type is benchmarked instead."""
    path = tmp_path / "Qwen3-FP8" / "config.json"
    path.parent.mkdir()
    fp8 = dict(QWEN3, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    path.write_text(json.dumps(fp8))
    rc, err, _ = cli_report(tmp_path, capsys, "--layout", str(path), "--traces", "synthetic:4")
    assert rc == 2 and "its experts have 4 parts" in err and "CONFIG.json:TYPE" in err, err
    assert "`expcache bench graph` runs the graph loop on it" in err
    rc, err, report = cli_report(tmp_path, capsys, "--layout", f"{path}:Q8_0", "--traces", "synthetic:4")
    assert rc == 0, err
    assert report["results"][0]["experts_checked"] == 4 * 48 * 8


def fp8_config(tmp_path):
    path = tmp_path / "Qwen3-FP8" / "config.json"
    path.parent.mkdir()
    fp8 = dict(QWEN3, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    path.write_text(json.dumps(fp8))
    return path


def test_the_graph_loop_serves_a_quantized_layout_of_four_parts(tmp_path, capsys):
    """expcache bench graph on an FP8 checkpoint's config: the experts' four parts (weights and
    scales) are the class, every part of every routed expert is read by slot from the bank and
    checked against the source; the C loop (three pointers an expert) is skipped, saying why."""
    from pyexpcache.layout import ModelLayout as Layout

    path = fp8_config(tmp_path)
    layout = Layout.from_hf_config(str(path))
    assert {len(layout[i].class_key) for i in layout.moe_layers} == {4}
    out = tmp_path / "g.json"
    argv = ["bench", "graph", "--backend", "host", "--quiet", "--json", str(out), "--layout", str(path)]
    rc = cli.main(argv + ["--traces", "synthetic:4", "--layers", "0-3", "--scale", "128"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    report = json.loads(out.read_text())[0]
    (graph,) = report["results"]
    assert graph["loop"] == "graph loop, select_device" and graph["misses"] > 0
    assert graph["checksum_errors"] == 0 and graph["experts_checked"] == 4 * 4 * 8
    assert any("the C loop: the experts have 4 parts" in s for s in report["skipped"])
    # the simulator's curve takes it too (hit rates do not depend on the parts)
    assert cli.main(["bench", "curve", "--quiet", "--layout", str(path), "--traces", "synthetic:4"]) == 0
