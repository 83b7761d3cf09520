"""Layouts (pyexpcache/layout.py) are checked against the library's limits when they are made,
before a source fills anything: a LayerSpec's counts and sizes must be integers (not a bool, a
float such as 768.0 or a string) within the limits of expcache.h, and a ModelLayout must hold
LayerSpecs or None, at most the library's number of layers."""

from __future__ import annotations

import json
import re
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from pyexpcache import ArgumentRangeError, ExpertCache, HostSource, LayerSpec, ModelLayout, _lib

GOOD = dict(num_experts=8, gate_bytes=768, up_bytes=768, down_bytes=1024)


@pytest.mark.parametrize("field", list(GOOD))
@pytest.mark.parametrize(
    "value, shown",
    [
        (768.0, "float 768.0"),
        ("8", "str '8'"),
        (True, "a bool (True)"),
        (None, "NoneType None"),
        (np.float32(8), f"float32 {np.float32(8)!r}"),
    ],
)
def test_a_non_integer_field_is_a_type_error_naming_it(field, value, shown):
    with pytest.raises(TypeError, match=re.escape(f"LayerSpec.{field} must be an integer, got {shown}")):
        LayerSpec(**dict(GOOD, **{field: value}))


@pytest.mark.parametrize(
    "field, value, limit",
    [
        ("num_experts", 2**20, _lib.MAX_EXPERTS_LIMIT),
        ("num_experts", _lib.MAX_EXPERTS_LIMIT + 1, _lib.MAX_EXPERTS_LIMIT),
        ("num_experts", 0, _lib.MAX_EXPERTS_LIMIT),
        ("gate_bytes", 0, _lib.MAX_PART_BYTES_LIMIT),
        ("up_bytes", -768, _lib.MAX_PART_BYTES_LIMIT),
        ("down_bytes", _lib.MAX_PART_BYTES_LIMIT + 1, _lib.MAX_PART_BYTES_LIMIT),
    ],
)
def test_a_field_outside_the_librarys_limits_is_refused_naming_it(field, value, limit):
    with pytest.raises(
        ArgumentRangeError,
        match=rf"LayerSpec.{field} must be 1..{limit} \(the library's limit\), "
        rf"got {value}",
    ):
        LayerSpec(**dict(GOOD, **{field: value}))


def test_the_limits_themselves_are_accepted_and_numpy_integers_become_ints():
    assert LayerSpec(_lib.MAX_EXPERTS_LIMIT, 1, 1, _lib.MAX_PART_BYTES_LIMIT).num_experts == _lib.MAX_EXPERTS_LIMIT
    spec = LayerSpec(np.int64(8), np.uint32(768), 768, np.int16(1024))
    assert spec == LayerSpec(**GOOD) and all(type(v) is int for v in (spec.num_experts, *spec.class_key))


def test_a_refused_layout_fills_nothing():
    """2**20 experts were refused by the library only after the source had filled for seconds."""
    start = time.monotonic()
    with pytest.raises(ValueError, match="num_experts"):
        ModelLayout.preset("q2").with_experts(2**20)
    assert time.monotonic() - start < 1.0


def test_a_layout_names_the_layer_of_a_bad_entry():
    with pytest.raises(TypeError, match=r"layer 1 must be a LayerSpec or None \(a dense layer\), got tuple"):
        ModelLayout((LayerSpec(**GOOD), (8, 768, 768, 1024)))


def test_a_layout_has_at_most_the_librarys_layers():
    limit = _lib.MAX_LAYERS_LIMIT
    ModelLayout((None,) * (limit - 1) + (LayerSpec(**GOOD),))
    with pytest.raises(ValueError, match=rf"a layout has 1..{limit} layers \(the library's limit\), got {limit + 1}"):
        ModelLayout((None,) * limit + (LayerSpec(**GOOD),))


def test_a_list_of_layers_is_kept_as_a_tuple():
    spec = LayerSpec(**GOOD)
    layout = ModelLayout([None, spec])
    assert layout.layers == (None, spec) and layout == ModelLayout((None, spec))
    with HostSource(layout) as src, ExpertCache(layout, src, budget_experts=2, backend="host", log_level=0) as cache:
        assert cache.select(1, [1]).shape == (1, 3)


# -- matrix_bytes: every GGUF block type -----------------------------------------------------------

from pyexpcache import (  # noqa: E402
    LayoutFileError,
    matrix_bytes,
    quant as quant_module,
)
from pyexpcache.layout import PRESET_SOURCES, PRESETS, quant_type, quant_types  # noqa: E402

from support import hf_configs  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "layouts" / "mixtral-8x7b-q4k.json"
MIXTRAL_PART = 14336 * 4096 // 256 * 144  # the issue's hand computation: 33,030,144 bytes


@pytest.fixture
def without_gguf(monkeypatch):
    """The gguf package hidden: the built-in block table answers."""
    monkeypatch.setitem(sys.modules, "gguf", None)
    monkeypatch.setitem(sys.modules, "gguf.constants", None)
    quant_module._block_table.cache_clear()
    yield
    quant_module._block_table.cache_clear()


def test_matrix_bytes_of_every_type_the_gguf_package_knows():
    gguf = pytest.importorskip("gguf")
    assert len(gguf.GGML_QUANT_SIZES) == len(quant_types())
    for qtype, (block, size) in gguf.GGML_QUANT_SIZES.items():
        assert quant_types()[qtype.name] == (block, size)
        assert matrix_bytes(qtype.name, 3, 2 * block) == 3 * 2 * size, qtype.name


def test_the_built_in_table_agrees_with_the_gguf_package():
    gguf = pytest.importorskip("gguf")
    known = {t.name: (int(b), int(s)) for t, (b, s) in gguf.GGML_QUANT_SIZES.items()}
    for name, sizes in quant_module._BUILTIN_BLOCKS.items():
        assert known[name] == sizes, name


def test_without_the_gguf_package_the_built_in_table_answers(without_gguf):
    assert quant_types() == quant_module._BUILTIN_BLOCKS
    assert matrix_bytes("Q4_K", 14336, 4096) == MIXTRAL_PART
    assert matrix_bytes("MXFP4", 2880, 2880) == 2880 * 2880 // 32 * 17
    with pytest.raises(
        ValueError,
        match=r"unknown quant type 'TQ1_0': the known types \(the built-in table; pip "
        r"install gguf for every type it knows\) are F32, F16, BF16, Q4_0",
    ):
        matrix_bytes("TQ1_0", 1, 256)


def test_matrix_bytes_is_the_issues_mixtral_computation():
    assert matrix_bytes("Q4_K", 14336, 4096) == MIXTRAL_PART == 33_030_144
    assert matrix_bytes("Q4_K", 4096, 14336) == MIXTRAL_PART  # down: [hidden, ffn]


@pytest.mark.parametrize(
    "name, canonical",
    [
        ("q4_k", "Q4_K"),
        (" Q6_K ", "Q6_K"),
        ("bf16", "BF16"),
        ("bfloat16", "BF16"),
        ("torch.float16", "F16"),
        ("fp16", "F16"),
        ("half", "F16"),
        ("float32", "F32"),
        ("fp32", "F32"),
        ("mxfp4", "MXFP4"),
    ],
)
def test_quant_type_takes_any_case_and_the_dtype_spellings(name, canonical):
    assert quant_type(name) == canonical


def test_matrix_bytes_errors_say_what_is_wrong():
    with pytest.raises(ValueError, match=r"unknown quant type 'Q4K': the known types \(.*\) are F32, F16, .*Q4_K"):
        matrix_bytes("Q4K", 1, 256)
    with pytest.raises(
        ValueError,
        match=r"a row of 1408 weights is not a multiple of the Q4_K block of 256 "
        r"weights \(in a \[rows, cols\] matrix, cols is the row length\)",
    ):
        matrix_bytes("Q4_K", 2048, 1408)
    with pytest.raises(TypeError, match="rows must be an integer, got float 2.0"):
        matrix_bytes("F16", 2.0, 32)
    with pytest.raises(ValueError, match=r"cols must be in \[1, "):
        matrix_bytes("F16", 2, 0)
    with pytest.raises(TypeError, match="a quant type is a name such as 'Q4_K' or 'bf16', got int 12"):
        matrix_bytes(12, 2, 32)


# -- layout files -------------------------------------------------------------------------------------


def test_the_mixtral_example_file_is_the_issues_numbers():
    layout = ModelLayout.from_json(EXAMPLE)
    assert layout.name == "mixtral-8x7b-q4k" and layout.num_layers == 32 and layout.moe_layers == list(range(32))
    assert {s for s in layout.layers} == {LayerSpec(8, MIXTRAL_PART, MIXTRAL_PART, MIXTRAL_PART)}
    assert layout.total_bytes == 32 * 8 * 3 * 14336 * 4096 // 256 * 144
    assert layout == ModelLayout.preset("mixtral-8x7b-q4k")


def test_the_plain_format_with_dense_layers():
    layout = ModelLayout.from_json(
        {
            "name": "tiny",
            "layers": [
                None,
                {"experts": 4, "gate_bytes": 768, "up_bytes": 768, "down_bytes": 1024},
                {"experts": 8, "gate_bytes": 512, "up_bytes": 512, "down_bytes": 512},
            ],
        }
    )
    assert layout == ModelLayout((None, LayerSpec(4, 768, 768, 1024), LayerSpec(8, 512, 512, 512)), name="tiny")


def test_a_type_is_taken_from_the_part_else_the_layer_else_the_file():
    layout = ModelLayout.from_json(
        {
            "type": "Q4_K",
            "layers": [
                {"experts": 2, "gate": {"shape": [2, 256]}, "up": {"shape": [2, 256]}, "down": {"shape": [1, 512]}},
                {
                    "experts": 2,
                    "dtype": "bf16",
                    "gate": {"shape": [2, 256]},
                    "up": {"type": "Q8_0", "shape": [2, 256]},
                    "down_bytes": 99,
                },
            ],
        }
    )
    assert layout[0] == LayerSpec(2, 2 * 144, 2 * 144, 2 * 144)
    assert layout[1] == LayerSpec(2, 2 * 256 * 2, 2 * 8 * 34, 99)


def test_a_repeat_takes_one_layer_or_a_group():
    moe = {"experts": 4, "gate_bytes": 10, "up_bytes": 10, "down_bytes": 20}
    layout = ModelLayout.from_json(
        {"name": "r", "layers": [{"repeat": 2, "layer": None}, {"repeat": 3, "layers": [None, moe]}, moe]}
    )
    spec = LayerSpec(4, 10, 10, 20)
    assert layout.layers == (None, None, None, spec, None, spec, None, spec, spec)


def test_a_repeat_gives_its_type_to_its_layers():
    layout = ModelLayout.from_json(
        {
            "layers": [
                {
                    "repeat": 2,
                    "type": "F16",
                    "layer": {
                        "experts": 1,
                        "gate": {"shape": [1, 4]},
                        "up": {"shape": [1, 4]},
                        "down": {"shape": [4, 1]},
                    },
                }
            ]
        }
    )
    assert layout.layers == (LayerSpec(1, 8, 8, 8),) * 2


def test_the_name_defaults_to_the_files(tmp_path):
    path = tmp_path / "my-model.json"
    path.write_text(json.dumps({"layers": [{"experts": 1, "gate_bytes": 1, "up_bytes": 1, "down_bytes": 1}]}))
    assert ModelLayout.from_json(path).name == "my-model"
    assert ModelLayout.from_json(str(path)).name == "my-model"


@pytest.mark.parametrize(
    "layout",
    [
        ModelLayout.preset("mixed"),
        ModelLayout.preset("deepseek-v3-q4k"),
        ModelLayout.preset("q2", scale=256),
        ModelLayout(
            (
                None,
                LayerSpec(4, 768, 768, 1024),
                None,
                None,
                LayerSpec(4, 768, 768, 1024),
                LayerSpec(4, 768, 768, 1024),
                LayerSpec(8, 1, 2, 3),
            ),
            name="odd one",
        ),
    ],
    ids=lambda layout: layout.name,
)
def test_to_json_round_trips_through_a_file(tmp_path, layout):
    assert ModelLayout.from_json(layout.to_json()) == layout
    path = tmp_path / "layout.json"
    layout.write_json(path)
    assert ModelLayout.from_json(path) == layout
    assert json.loads(path.read_text()) == layout.to_json()


def test_to_json_writes_a_run_of_equal_layers_once():
    assert ModelLayout.preset("deepseek-v3-q4k").to_json() == {
        "name": "deepseek-v3-q4k",
        "layers": [
            {"repeat": 3, "layer": None},
            {
                "repeat": 58,
                "layer": {"experts": 256, "gate_bytes": 8257536, "up_bytes": 8257536, "down_bytes": 8257536},
            },
        ],
    }


def _bad(**layer):
    return {"name": "bad", "layers": [dict({"experts": 8, "gate_bytes": 1, "up_bytes": 1, "down_bytes": 1}, **layer)]}


SHAPED = {"type": "Q4_K", "shape": [14336, 4096]}


@pytest.mark.parametrize(
    "obj, message",
    [
        ({"name": "x"}, r"the layout: no \"layers\" list$"),
        (
            hf_configs.CONFIGS["Mixtral-8x7B-v0.1"],
            r"no \"layers\" list: this looks like a Hugging Face config.json "
            r"\(ModelLayout.from_hf_config reads it\)",
        ),
        ({"layers": [], "layer": 1}, r"top level: unknown key 'layer'; expected name, layers, type, dtype"),
        ({"layers": {}}, r"layers: expected a list of layers, got \{\}"),
        ({"layers": [None, None]}, r"layers: a layout needs at least one MoE layer"),
        ({"name": 3, "layers": []}, r"name: expected a non-empty string, got 3"),
        ({"layers": [{"gate_bytes": 1, "up_bytes": 1, "down_bytes": 1}]}, r"layers\[0\]: no \"experts\""),
        (_bad(experts=0), r"layers\[0\].experts: must be 1..65536 \(the library's limit\), got 0"),
        (_bad(experts=8.0), r"layers\[0\].experts: expected a whole number, got 8.0"),
        (_bad(experts="8"), r"layers\[0\].experts: expected a whole number, got \"8\""),
        (_bad(down_bytes=True), r"layers\[0\].down_bytes: expected a whole number, got true"),
        (_bad(expert=8), r"layers\[0\]: unknown key 'expert'; expected experts, type, dtype, gate, up, down"),
        (
            {"layers": [{"experts": 8, "gate_bytes": 1, "up_bytes": 1}]},
            r"layers\[0\]: no \"down_bytes\" \(or \"down\": \{\"type\": ..., \"shape\": \[rows, cols\]\}\)",
        ),
        (_bad(gate=SHAPED), r"layers\[0\]: give \"gate_bytes\" or \"gate\", not both"),
        (
            {"layers": [{"experts": 8, "gate": {"shape": [1, 256]}, "up_bytes": 1, "down_bytes": 1}]},
            r"layers\[0\].gate: no type: give \"type\" here, in the layer or at the top of the file",
        ),
        (
            {"type": "Q4_K", "layers": [{"experts": 8, "gate": {"shape": [256]}, "up_bytes": 1, "down_bytes": 1}]},
            r"layers\[0\].gate.shape: expected \[rows, cols\], got \[256\]",
        ),
        (
            {"type": "Q4_K", "layers": [{"experts": 8, "gate": {"shapes": [1, 256]}, "up_bytes": 1, "down_bytes": 1}]},
            r"layers\[0\].gate: unknown key 'shapes'; expected type, dtype, shape",
        ),
        (
            {"type": "Q4_K", "layers": [{"experts": 8, "gate": {"shape": [1, 100]}, "up_bytes": 1, "down_bytes": 1}]},
            r"layers\[0\].gate: a row of 100 weights is not a multiple of the Q4_K block of 256 weights",
        ),
        (
            {"type": "Q4_K", "layers": [{"experts": 8, "gate": {"shape": [0, 256]}, "up_bytes": 1, "down_bytes": 1}]},
            r"layers\[0\].gate.shape\[0\]: must be 1..1099511627776",
        ),
        ({"type": "Q4K", "layers": []}, r"top level.type: unknown quant type 'Q4K': the known types"),
        ({"type": "F16", "dtype": "F16", "layers": []}, r"top level: give \"type\" or \"dtype\", not both"),
        (
            {"layers": [{"repeat": 2, "layer": None, "layers": []}]},
            r"layers\[0\]: a repeat takes \"layer\" \(one layer, or null\) or \"layers\"",
        ),
        ({"layers": [{"repeat": 0, "layer": None}]}, r"layers\[0\].repeat: must be 1..4096"),
        ({"layers": [{"repeat": 2, "layers": []}]}, r"layers\[0\].layers: an empty group"),
        (
            {"layers": [{"repeat": 4096, "layers": [None, None]}]},
            r"layers\[0\]: the layers pass the library's limit "
            r"of 4096",
        ),
        (
            {"layers": [{"repeat": 2, "layers": [_bad(experts=-1)["layers"][0]]}]},
            r"layers\[0\].layers\[0\].experts: must be 1..65536",
        ),
    ],
)
def test_a_bad_layout_names_the_entry(obj, message):
    with pytest.raises(LayoutFileError, match=message):
        ModelLayout.from_json(obj)


def test_a_bad_file_is_named(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"layers": [')
    with pytest.raises(LayoutFileError, match=rf"{re.escape(str(path))}: not JSON: "):
        ModelLayout.from_json(path)
    path.write_text(json.dumps(_bad(experts=0)))
    with pytest.raises(LayoutFileError, match=rf"^{re.escape(str(path))}: layers\[0\].experts: must be 1..65536"):
        ModelLayout.from_json(path)
    with pytest.raises(FileNotFoundError):
        ModelLayout.from_json(tmp_path / "missing.json")
    path.write_text("[]")
    with pytest.raises(
        LayoutFileError,
        match=r'broken.json: expected an object \{"name": ..., "layers": \[...\]\}, '
        r"got \[\]",
    ):
        ModelLayout.from_json(path)
    with pytest.raises(LayoutFileError, match=r"broken.json: expected a JSON object, got \[\]"):
        ModelLayout.from_hf_config(path)


def test_comments_are_allowed_anywhere():
    layout = ModelLayout.from_json(
        {
            "comment": "from somewhere",
            "type": "F16",
            "layers": [
                {
                    "comment": ["any", "value"],
                    "experts": 1,
                    "gate": {"comment": 1, "shape": [1, 1]},
                    "up_bytes": 2,
                    "down_bytes": 2,
                }
            ],
        }
    )
    assert layout.layers == (LayerSpec(1, 2, 2, 2),)


# -- Hugging Face config.json -----------------------------------------------------------------------


def _spec(experts, ffn, hidden, block, size):
    part = ffn * hidden // block * size
    return LayerSpec(experts, part, part, part)


# The stored parts of the quantized checkpoints (their quantization_config; test_hf_quant.py has
# the rules): DeepSeek V3's FP8 with 128 x 128 blocks, GPT-OSS's MXFP4 with bf16 biases.
FP8_DEEPSEEK_V3 = LayerSpec.of_parts(
    256,
    [
        ("gate_up_proj", 4096 * 7168, "float8_e4m3fn", (4096, 7168)),
        ("gate_up_proj_scale_inv", 32 * 56 * 4, "float32", (32, 56)),
        ("down_proj", 7168 * 2048, "float8_e4m3fn", (7168, 2048)),
        ("down_proj_scale_inv", 56 * 16 * 4, "float32", (56, 16)),
    ],
)
MXFP4_GPT_OSS_20B = LayerSpec.of_parts(
    32,
    [
        ("gate_up_proj_blocks", 5760 * 90 * 16, "uint8", (5760, 90, 16)),
        ("gate_up_proj_scales", 5760 * 90, "uint8", (5760, 90)),
        ("gate_up_proj_bias", 5760 * 2, "bfloat16", (5760,)),
        ("down_proj_blocks", 2880 * 90 * 16, "uint8", (2880, 90, 16)),
        ("down_proj_scales", 2880 * 90, "uint8", (2880, 90)),
        ("down_proj_bias", 2880 * 2, "bfloat16", (2880,)),
    ],
)


@pytest.mark.parametrize(
    "model, layers, moe, spec",
    [
        ("Mixtral-8x7B-v0.1", 32, range(32), _spec(8, 14336, 4096, 1, 2)),
        ("Qwen1.5-MoE-A2.7B", 24, range(24), _spec(60, 1408, 2048, 1, 2)),
        ("Qwen3-30B-A3B", 48, range(48), _spec(128, 768, 2048, 1, 2)),
        ("OLMoE-1B-7B-0924", 16, range(16), _spec(64, 1024, 2048, 1, 4)),
        ("DeepSeek-V3", 61, range(3, 61), FP8_DEEPSEEK_V3),
        ("gpt-oss-20b", 24, range(24), MXFP4_GPT_OSS_20B),
    ],
)
def test_a_hugging_face_config_gives_the_experts(tmp_path, model, layers, moe, spec):
    path = hf_configs.write(tmp_path, model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layout = ModelLayout.from_hf_config(path)
    assert layout.num_layers == layers and layout.moe_layers == list(moe)
    assert {layout[i] for i in moe} == {spec}
    # DeepSeek V3's fp8 and GPT-OSS's mxfp4 are read from quantization_config: nothing to say.
    assert [str(w.message) for w in caught] == []
    label = {"gpt-oss-20b": "mxfp4", "DeepSeek-V3": "fp8"}.get(model, "f32" if model.startswith("OLMoE") else "bf16")
    assert layout.name == f"{model}-{label}"


def test_a_quant_type_overrides_the_configs():
    config = hf_configs.CONFIGS["Mixtral-8x7B-v0.1"]
    q4k = ModelLayout.from_hf_config(config, "q4_k")
    assert q4k.layers == ModelLayout.preset("mixtral-8x7b-q4k").layers and q4k.name == "mixtral-q4_k"
    mixed = ModelLayout.from_hf_config(config, {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}, name="m")
    assert mixed.name == "m" and mixed[0] == LayerSpec(8, MIXTRAL_PART, MIXTRAL_PART, 4096 * 14336 // 256 * 210)
    with pytest.raises(ValueError, match="quant as a dict names gate, up and down, got gate"):
        ModelLayout.from_hf_config(config, {"gate": "Q4_K"})
    with pytest.raises(ValueError, match="unknown quant type 'Q3'"):
        ModelLayout.from_hf_config(config, "Q3")


@pytest.mark.parametrize(
    "preset, model",
    [
        ("mixtral-8x7b-q4k", "Mixtral-8x7B-v0.1"),
        ("qwen3-30b-a3b-bf16", "Qwen3-30B-A3B"),
        ("olmoe-1b-7b-bf16", "OLMoE-1B-7B-0924"),
        ("deepseek-v3-q4k", "DeepSeek-V3"),
        ("gpt-oss-20b-mxfp4", "gpt-oss-20b"),
    ],
)
def test_each_preset_is_its_models_config(preset, model):
    quant = ModelLayout.preset(preset).name.rpartition("-")[2].replace("q4k", "Q4_K")
    assert ModelLayout.preset(preset).layers == ModelLayout.from_hf_config(hf_configs.CONFIGS[model], quant).layers
    assert ModelLayout.preset(preset).name == preset
    assert PRESET_SOURCES[preset].startswith("https://huggingface.co/")


def test_every_preset_has_a_source_and_an_unknown_one_lists_them():
    assert set(PRESET_SOURCES) == set(PRESETS)
    assert ModelLayout.preset("deepseek-v4-flash-mixed") == ModelLayout.preset("mixed")
    with pytest.raises(
        ValueError,
        match=r"unknown preset 'mixtral': the presets are q2, q4, mixed, .*"
        r"mixtral-8x7b-q4k, .*gpt-oss-20b-mxfp4",
    ):
        ModelLayout.preset("mixtral")


def test_the_dense_layer_rules_of_each_family():
    base = {
        "model_type": "x",
        "num_hidden_layers": 8,
        "num_experts": 4,
        "hidden_size": 32,
        "intermediate_size": 32,
        "torch_dtype": "float16",
    }

    def moe(**rules):
        return ModelLayout.from_hf_config(dict(base, **rules)).moe_layers

    assert moe() == list(range(8))
    assert moe(decoder_sparse_step=2) == [1, 3, 5, 7]  # Qwen2-MoE: (i + 1) % step == 0
    assert moe(mlp_only_layers=[0, 5]) == [1, 2, 3, 4, 6, 7]
    assert moe(first_k_dense_replace=3) == [3, 4, 5, 6, 7]  # DeepSeek
    assert moe(first_k_dense_replace=1, moe_layer_freq=2) == [2, 4, 6]
    assert moe(decoder_sparse_step=1, mlp_only_layers=[], first_k_dense_replace=0, moe_layer_freq=1) == list(range(8))


def test_the_moe_layer_rules_of_llama4_jamba_and_the_other_families():
    """Each family's rule for which layers have routed experts, as transformers' modeling code (or
    the config class building the list it reads) applies it; a config of any other key has experts
    in every layer."""
    base = {
        "model_type": "x",
        "num_hidden_layers": 8,
        "num_experts": 4,
        "hidden_size": 32,
        "intermediate_size": 32,
        "torch_dtype": "float16",
    }

    def moe(**rules):
        return ModelLayout.from_hf_config(dict(base, **rules)).moe_layers

    assert moe(interleave_moe_layer_step=2) == [1, 3, 5, 7]  # Llama 4: range(step - 1, n, step)
    assert moe(interleave_moe_layer_step=4) == [3, 7]
    assert moe(moe_layers=[0, 5]) == [0, 5]  # Llama 4's list overrides the step
    assert moe(moe_layers=[0, 5], interleave_moe_layer_step=1) == [0, 5]
    assert moe(expert_layer_period=2, expert_layer_offset=1) == [1, 3, 5, 7]  # Jamba: i % period == offset
    assert moe(expert_layer_period=3, expert_layer_offset=0) == [0, 3, 6]
    assert moe(model_type="jamba") == [1, 3, 5, 7]  # transformers' Jamba defaults: period 2, offset 1
    assert moe(layers_num_experts=[1, 4, 1, 4, 4, 1, 1, 4]) == [1, 3, 4, 7]  # Jamba's derived list
    assert moe(mlp_layer_types=["dense", "sparse", "moe", "hash_moe", "dense", "sparse", "dense", "sparse"]) == [
        1,
        2,
        3,
        5,
        7,
    ]  # GLM-4.7-Flash, DeepSeek V3.2/V4, ...
    assert moe(mlp_layer_types=["dense"] + ["sparse"] * 7, first_k_dense_replace=1) == list(range(1, 8))
    assert moe(moe_layers_enum="3,4,5,6,7,8,9") == [3, 4, 5, 6, 7]  # Step 3.7 (its MTP layers past the last)
    assert moe(moe_layers_enum=[2, 6]) == [2, 6]
    assert moe(num_dense_layers=3) == [3, 4, 5, 6, 7]  # AFMoE, LFM2-MoE
    assert moe(model_type="lfm2_moe") == [2, 3, 4, 5, 6, 7]  # its default: 2 dense layers
    assert moe(dense_mlp_idx=2) == list(range(2, 8))  # Inkling's legacy key
    assert moe(moe_layer_freq=[0, 1, 1, 0, 1, 1, 0, 1]) == [1, 2, 4, 5, 7]  # dots.llm3, MiniMax-M3: a flag each
    assert moe(moe_layer_start_index=1, moe_layer_end_index=-1, moe_layer_interval=2) == [1, 3, 5, 7]  # ERNIE 4.5
    assert moe(moe_layer_start_index=2, moe_layer_end_index=5, moe_layer_interval=1) == [2, 3, 4, 5]
    assert moe(model_type="ernie4_5_moe") == list(range(1, 8))  # its default start: 1
    assert moe(enable_moe_block=True) == list(range(8))  # Gemma 4
    assert moe(layers_block_type=["mamba", "attention"] * 4) == list(range(8))  # Jamba/GraniteMoeHybrid: attention


def test_the_layer_rules_of_real_llama4_and_jamba_configs():
    """Llama 4 Maverick (MoE in every second layer: 24 of its 48) and Jamba v0.1 (16 of 32): the
    keys of their config.json files on the Hub."""
    maverick = {
        "model_type": "llama4",
        "torch_dtype": "bfloat16",
        "text_config": {
            "model_type": "llama4_text",
            "num_hidden_layers": 48,
            "num_local_experts": 128,
            "hidden_size": 5120,
            "intermediate_size": 8192,
            "intermediate_size_mlp": 16384,
            "interleave_moe_layer_step": 2,
        },
    }
    layout = ModelLayout.from_hf_config(maverick)
    assert layout.moe_layers == list(range(1, 48, 2))
    assert layout[1] == LayerSpec(128, 8192 * 5120 * 2, 8192 * 5120 * 2, 5120 * 8192 * 2)
    jamba = {
        "model_type": "jamba",
        "torch_dtype": "bfloat16",
        "num_hidden_layers": 32,
        "num_experts": 16,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "attn_layer_period": 8,
        "attn_layer_offset": 4,
    }
    assert ModelLayout.from_hf_config(jamba).moe_layers == list(range(1, 32, 2))


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            dict(hybrid_override_pattern="MEM*EME"),
            r"hybrid_override_pattern: Nemotron-H's block pattern .* this reader "
            r"does not implement it; a layout file describes the model",
        ),
        (
            dict(layers_block_type=["linear_attention", "moe", "full_attention", "moe"] * 2),
            r"layers_block_type: Nemotron-H's block types .*experts, which have no gate",
        ),
        (
            dict(pyramid_num_routed=[-1, 4, 8, 12, 16, 20, 24, 28]),
            r"pyramid_num_routed: dots.llm3's routed experts per layer",
        ),
        (dict(per_layer_config={"3": {"num_experts": 2}}), r"per_layer_config: per-layer overrides of num_experts"),
        (
            dict(num_experts=[4] * 8),
            r"num_experts: a list, one value per layer \(the routed experts per layer\), which "
            r"this reader does not implement",
        ),
        (dict(moe_intermediate_size=[32, 16]), r"moe_intermediate_size: a list, one value per layer"),
        (
            dict(moe_layers=[1], mlp_layer_types=["dense"] * 8),
            r"the layers with routed experts differ by key \(mlp_layer_types gives none; moe_layers gives 1\)",
        ),
        (
            dict(mlp_layer_types=["sparse"] * 7),
            r"mlp_layer_types: expected one of 'sparse', 'moe', 'hash_moe', 'dense' "
            r"for each of the 8 layers",
        ),
        (dict(mlp_layer_types=["shared"] * 8), r"mlp_layer_types: expected one of"),
        (dict(moe_layers=[8]), r"moe_layers: expected layer numbers below 8, got \[8\]"),
        (dict(expert_layer_period=2, expert_layer_offset=2), r"expert_layer_offset: must be below expert_layer_period"),
        (dict(interleave_moe_layer_step=0), r"interleave_moe_layer_step: expected a whole number >= 1"),
        (dict(moe_layer_freq=[1, 0]), r"moe_layer_freq: expected a whole number, or a flag for each of the 8 layers"),
        (dict(enable_moe_block=False), r"a layout needs at least one MoE layer"),  # Gemma 4 without its experts
    ],
)
def test_a_layer_rule_it_does_not_implement_or_a_bad_one_is_refused(changes, message):
    base = {
        "model_type": "x",
        "num_hidden_layers": 8,
        "num_experts": 4,
        "hidden_size": 32,
        "intermediate_size": 32,
        "torch_dtype": "float16",
    }
    with pytest.raises(LayoutFileError, match=message):
        ModelLayout.from_hf_config(dict(base, **changes))


#: transformers config class -> arguments: the families whose MoE layers follow a rule, built tiny.
_TRANSFORMERS_CONFIGS = {
    "Llama4TextConfig": dict(num_local_experts=4, interleave_moe_layer_step=2, intermediate_size_mlp=64),
    "Llama4TextConfig/moe_layers": dict(num_local_experts=4, moe_layers=[0, 4, 5], intermediate_size_mlp=64),
    "JambaConfig": dict(
        num_experts=4,
        expert_layer_period=3,
        expert_layer_offset=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        use_mamba_kernels=False,
    ),
    "JambaConfig/defaults": dict(num_experts=4, use_mamba_kernels=False),
    "Qwen2MoeConfig": dict(
        num_experts=4,
        decoder_sparse_step=2,
        mlp_only_layers=[1],
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
    ),
    "Qwen3MoeConfig": dict(num_experts=4, decoder_sparse_step=3, moe_intermediate_size=16),
    "DeepseekV3Config": dict(
        n_routed_experts=4,
        first_k_dense_replace=2,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        kv_lora_rank=8,
        q_lora_rank=None,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        num_key_value_heads=4,
        moe_intermediate_size=16,
    ),
    "Ernie4_5_MoeConfig": dict(
        moe_num_experts=4,
        moe_layer_start_index=1,
        moe_layer_end_index=4,
        moe_layer_interval=2,
        moe_intermediate_size=16,
    ),
    "Glm4MoeLiteConfig": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        kv_lora_rank=8,
        q_lora_rank=None,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        num_key_value_heads=4,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=16,
    ),
    "AfmoeConfig": dict(num_experts=4, num_dense_layers=2, moe_intermediate_size=16),
    "Lfm2MoeConfig": dict(
        num_experts=4, num_dense_layers=3, layer_types=["conv", "full_attention"] * 3, moe_intermediate_size=16
    ),
    "DeepseekV4Config": dict(n_routed_experts=4),
    "GraniteMoeHybridConfig": dict(
        num_local_experts=4, layers_block_type=["mamba", "attention"] * 3, mamba_d_head=8, mamba_n_heads=8
    ),
    "MixtralConfig": dict(num_local_experts=4),
}


@pytest.mark.parametrize("name", sorted(_TRANSFORMERS_CONFIGS))
def test_the_moe_layers_are_those_transformers_builds(name):
    """A tiny model of each family built by transformers (on the meta device: no memory): the
    layers holding experts (a 3-D gate_up_proj or up_proj), their number and their bytes are the
    layout's from the config's to_dict(), the keys its config.json has."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers", minversion="5")
    config_class = getattr(transformers, name.split("/")[0], None)
    if config_class is None:
        pytest.skip(f"this transformers has no {name}")
    kwargs = dict(
        vocab_size=64,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=16,
        num_hidden_layers=6,
        head_dim=8,
    )
    try:  # the configs validate through huggingface_hub's strict dataclasses
        from huggingface_hub.errors import StrictDataclassError as refused
    except ImportError:
        refused = ValueError
    try:
        config = config_class(**{**kwargs, **_TRANSFORMERS_CONFIGS[name]})
    except (ValueError, refused) as exc:
        # transformers 5.17's GraniteMoeHybridConfig refuses its own family's layer types
        # ("mamba", "attention"), which 5.24 builds: nothing of the layout reader is tested then.
        pytest.skip(f"transformers {transformers.__version__} does not build this {name}: {exc}")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    built = {}
    for parameter_name, p in model.named_parameters():
        match = re.search(r"layers\.(\d+)\..*\b(gate_up_proj|up_proj)$", parameter_name)
        if match and p.dim() == 3:
            built[int(match.group(1))] = (p.shape[0], p[0].numel() * 4)
    layout = ModelLayout.from_hf_config(config.to_dict(), "F32")
    assert {i: (s.num_experts, s.gate_bytes + s.up_bytes) for i, s in enumerate(layout.layers) if s} == built
    assert layout.num_layers == 6 and 0 < len(built) <= 6


def test_a_nemotron_h_config_from_transformers_is_refused():
    transformers = pytest.importorskip("transformers", minversion="5")
    config = transformers.NemotronHConfig(vocab_size=64, hidden_size=32, n_routed_experts=4)
    with pytest.raises(LayoutFileError, match=r"layers_block_type: Nemotron-H's block types"):
        ModelLayout.from_hf_config(config.to_dict(), "F32")


def test_a_config_under_text_config_is_read_there():
    outer = {
        "model_type": "wrapper",
        "torch_dtype": "bfloat16",
        "text_config": {k: v for k, v in hf_configs.CONFIGS["Qwen3-30B-A3B"].items() if k != "torch_dtype"},
    }
    assert ModelLayout.from_hf_config(outer).layers == ModelLayout.preset("qwen3-30b-a3b-bf16").layers


def test_the_dtype_key_of_newer_configs():
    config = {k: v for k, v in hf_configs.CONFIGS["OLMoE-1B-7B-0924"].items() if k != "torch_dtype"}
    assert (
        ModelLayout.from_hf_config(dict(config, dtype="bfloat16")).layers
        == ModelLayout.preset("olmoe-1b-7b-bf16").layers
    )


def _without(model, *keys, **changes):
    return dict({k: v for k, v in hf_configs.CONFIGS[model].items() if k not in keys}, **changes)


@pytest.mark.parametrize(
    "config, quant, message",
    [
        (
            _without("Mixtral-8x7B-v0.1", "hidden_size"),
            None,
            r"the config: no 'hidden_size' key \(the model width\) in this mixtral config; a layout file describes any "
            r"model \(docs/models.md\)",
        ),
        (
            _without("Mixtral-8x7B-v0.1", "num_local_experts"),
            None,
            r"no 'num_local_experts' or 'num_experts' or 'n_routed_experts' or 'moe_num_experts' key "
            r"\(the routed experts per layer\) in this mixtral config",
        ),
        (
            _without("Qwen3-30B-A3B", "moe_intermediate_size", "intermediate_size"),
            None,
            r"no 'moe_intermediate_size' or 'intermediate_size' key \(an expert's FFN width\) in this qwen3_moe config",
        ),
        (
            _without("Qwen3-30B-A3B", "num_hidden_layers", "model_type"),
            None,
            r"no 'num_hidden_layers' key \(the number of layers\) in this Qwen3MoeForCausalLM config",
        ),
        (_without("Qwen3-30B-A3B", num_experts=0), None, r"num_experts: 0 routed experts: not a mixture-of-experts"),
        (_without("Qwen3-30B-A3B", hidden_size=2048.5), None, r"hidden_size: expected a whole number >= 1"),
        (_without("Qwen3-30B-A3B", decoder_sparse_step=0), None, r"decoder_sparse_step: expected a whole number >= 1"),
        (_without("Qwen3-30B-A3B", mlp_only_layers="0"), None, r"mlp_only_layers: expected a list of layer numbers"),
        (
            _without("Qwen3-30B-A3B", "torch_dtype"),
            None,
            r"no 'torch_dtype' or 'dtype' key \(the experts' type\): give the type \(quant=..., or --layout "
            r"CONFIG.json:TYPE\)",
        ),
        (_without("Qwen3-30B-A3B", torch_dtype="int4"), None, r"torch_dtype: unknown quant type 'int4'"),
        (
            hf_configs.CONFIGS["Qwen1.5-MoE-A2.7B"],
            "Q4_K",
            r"experts of \[1408, 2048\] gate/up and \[2048, 1408\] down in Q4_K/Q4_K/Q4_K: a row of 1408 weights is "
            r"not a multiple of the Q4_K block of 256 weights",
        ),
    ],
)
def test_a_config_the_reader_cannot_use_names_the_key(config, quant, message):
    with pytest.raises(LayoutFileError, match=message):
        ModelLayout.from_hf_config(config, quant)
