"""A layer's parts as a layout describes them: LayerSpec.of_parts and PartSpec checked before
anything reaches ctypes, the three-part shorthand equal to its parts, layout files with named parts
(round trip, the old three-size form still read), and from_hf_config's parts for FP8 block-scaled
and MXFP4 checkpoints, checked against transformers' own quantized experts where it is installed."""

from __future__ import annotations

import json
import math
import re
import warnings

import pytest

from pyexpcache import LayerSpec, LayoutFileError, ModelLayout, PartSpec

from support import hf_configs

MAX = 1 << 40  # EXPCACHE_MAX_PART_BYTES_LIMIT


def test_the_shorthand_is_three_named_parts():
    spec = LayerSpec(4, 10, 20, 30)
    parts = LayerSpec.of_parts(4, [("gate", 10), ("up", 20), ("down", 30)])
    assert spec == parts and hash(spec) == hash(parts) and repr(spec) == repr(parts)
    assert spec.class_key == (10, 20, 30) and spec.expert_bytes == 60 and spec.num_parts == 3
    assert (spec.gate_bytes, spec.up_bytes, spec.down_bytes) == (10, 20, 30)
    assert spec.part("up") == PartSpec("up", 20)
    five = LayerSpec.of_parts(4, [("w", 10), PartSpec("s", 2), ("x", 2, "float16", (1,)), ("y", 4), ("z", 5)])
    assert five.class_key == (10, 2, 2, 4, 5) and five.expert_bytes == 23 and five.part_names == tuple("wsxyz")
    assert five != LayerSpec.of_parts(4, [("w", 10), ("s", 2), ("x", 2), ("y", 4), ("z", 5)])  # x's dtype
    with pytest.raises(AttributeError, match="gate_bytes: this layer's experts have the parts w, s, x, y, z"):
        five.gate_bytes  # noqa: B018
    with pytest.raises(KeyError, match="no part 'gate': this layer's parts are w, s, x, y, z"):
        five.part("gate")
    assert five.with_experts(9) == LayerSpec.of_parts(9, five.parts)
    assert five.with_sizes([20, 4, 4, 8, 10]).class_key == (20, 4, 4, 8, 10)
    assert ModelLayout((five, None)).scaled(1).layers[0] == five
    assert ModelLayout((five.with_sizes([20, 4, 4, 8, 10]),)).scaled(2)[0] == five.with_sizes(five.class_key)
    with pytest.raises(ValueError, match=r"part sizes \(10, 2, 2, 4, 5\) are not divisible by 4"):
        ModelLayout((five,)).scaled(4)


@pytest.mark.parametrize(
    "parts, error, message",
    [
        ([], ValueError, "an expert has 1..8 parts (the library's limit), got 0"),
        ([(f"p{i}", 1) for i in range(9)], ValueError, "an expert has 1..8 parts (the library's limit), got 9"),
        ([("a", 1), ("b", 2), ("a", 3)], ValueError, "part names must be unique in a layer: 'a' given twice"),
        ([("a", 0)], ValueError, "part 'a': nbytes must be 1..1099511627776 (the library's limit), got 0"),
        ([("a", MAX + 1)], ValueError, f"part 'a': nbytes must be 1..{MAX} (the library's limit), got {MAX + 1}"),
        ([("a", -5)], ValueError, "part 'a': nbytes must be 1..1099511627776"),
        ([("a", True)], TypeError, "part 'a': nbytes must be an integer, got a bool"),
        ([("a", 2.0)], TypeError, "part 'a': nbytes must be an integer, got float 2.0"),
        ([("a", "8")], TypeError, "part 'a': nbytes must be an integer, got str '8'"),
        ([(3, 8)], TypeError, "a part's name must be a string, got int 3"),
        ([("", 8)], ValueError, "a part's name must be non-empty"),
        ([("a", 8, "float32", (3,))], ValueError, "part 'a': shape [3] of float32 is 12 bytes, not its 8"),
        ([("a", 8, None, (8,))], ValueError, "part 'a': a shape needs a dtype"),
        ([("a", 8, "float32", (0, 2))], ValueError, "part 'a': shape[0] must be 1..1099511627776"),
        ([("a", 8, "float32", (2.0,))], TypeError, "part 'a': shape[0] must be an integer"),
        ([("a", 8, "complex64", None)], TypeError, "part 'a': dtype: dtype complex64 cannot be exported"),
        ([("a", 8, "nonsense", None)], TypeError, "part 'a': dtype: dtype must be a numpy dtype"),
        ([("a",)], TypeError, "parts[0] must be a PartSpec, (name, nbytes) or (name, nbytes, dtype, shape)"),
        ("ab", TypeError, "parts must be a sequence of (name, nbytes) or PartSpec, got str"),
    ],
)
def test_of_parts_refuses_what_the_library_would(parts, error, message):
    with pytest.raises(error, match=re.escape(message)):
        LayerSpec.of_parts(4, parts)


def test_the_expert_count_and_the_shorthand_are_checked():
    with pytest.raises(ValueError, match=re.escape("LayerSpec.num_experts must be 1..65536")):
        LayerSpec.of_parts(65537, [("a", 1)])
    with pytest.raises(TypeError, match="missing down_bytes"):
        LayerSpec(4, 1, 2)
    with pytest.raises(TypeError, match="gate/up/down sizes or parts, not both"):
        LayerSpec(4, 1, parts=[("a", 1)])


def test_8_bit_float_and_scalar_parts():
    spec = LayerSpec.of_parts(
        2, [("w", 256, "float8_e4m3fn", (16, 16)), ("s", 1, "float8_e8m0fnu", ()), ("b", 4, "bfloat16", [2])]
    )
    assert [p.dtype for p in spec.parts] == ["float8_e4m3fn", "float8_e8m0fnu", "bfloat16"]
    assert [p.shape for p in spec.parts] == [(16, 16), (), (2,)]
    torch = pytest.importorskip("torch")
    assert PartSpec("w", 2, torch.float8_e5m2, (2,)).dtype == "float8_e5m2"


# -- layout files ---------------------------------------------------------------------------------


def _mixed_layout() -> ModelLayout:
    fp8 = LayerSpec.of_parts(
        16,
        [
            ("gate_up_proj", 256 * 128, "float8_e4m3fn", (256, 128)),
            ("gate_up_proj_scale_inv", 2 * 1 * 4, "float32", (2, 1)),
            ("down_proj", 128 * 128, "float8_e4m3fn", (128, 128)),
            ("down_proj_scale_inv", 4, "float32", (1, 1)),
            ("down_proj_activation_scale", 4, "float32", ()),
        ],
    )
    plain = LayerSpec(16, 1000, 1000, 2000)
    one = LayerSpec.of_parts(16, [("w", 1234)])
    return ModelLayout((None, fp8, fp8, plain, one, None), name="mixed-parts")


def test_a_layout_with_named_parts_round_trips(tmp_path):
    layout = _mixed_layout()
    path = tmp_path / "m.json"
    layout.write_json(path)
    text = json.loads(path.read_text())
    assert text["layers"][2] == {"experts": 16, "gate_bytes": 1000, "up_bytes": 1000, "down_bytes": 2000}
    assert text["layers"][1]["repeat"] == 2
    assert text["layers"][1]["layer"]["parts"][1] == {
        "name": "gate_up_proj_scale_inv",
        "bytes": 8,
        "dtype": "float32",
        "shape": [2, 1],
    }
    assert text["layers"][3] == {"experts": 16, "parts": [{"name": "w", "bytes": 1234}]}
    assert ModelLayout.from_json(path) == layout
    assert list(layout.classes()) == [layout[1].class_key, (1000, 1000, 2000), (1234,)]


def test_a_layout_file_sizes_parts_by_bytes_dtype_or_gguf_type():
    layout = ModelLayout.from_json(
        {
            "type": "Q4_K",
            "layers": [
                {
                    "experts": 4,
                    "parts": [
                        {"name": "w", "shape": [512, 256]},  # the file's GGUF type
                        {"name": "w8", "type": "Q8_0", "shape": [4, 64]},
                        {"name": "s", "dtype": "bfloat16", "shape": [3, 4]},
                        {"name": "one", "dtype": "float32", "shape": []},
                        {"name": "b", "bytes": 5, "comment": "raw bytes"},
                    ],
                },
                {"experts": 4, "gate": {"shape": [256, 256]}, "up_bytes": 10, "down_bytes": 20},
            ],
        }
    )
    assert layout[0].class_key == (512 * 256 // 256 * 144, 4 * 2 * 34, 24, 4, 5)
    assert layout[0].part("s") == PartSpec("s", 24, "bfloat16", (3, 4))
    assert layout[1] == LayerSpec(4, 256 * 144, 10, 20)


@pytest.mark.parametrize(
    "layer, message",
    [
        ({"experts": 4, "parts": []}, "layers[0].parts: expected a list of 1..8 parts"),
        ({"experts": 4, "parts": [{"name": "a"}]}, 'layers[0].parts[0]: no size: give "bytes", a "dtype"'),
        ({"experts": 4, "parts": [{"bytes": 3}]}, 'layers[0].parts[0]: no "name"'),
        ({"experts": 4, "parts": [{"name": "a", "bytes": 3, "nbytes": 3}]}, "layers[0].parts[0]: unknown key 'nbytes'"),
        ({"experts": 4, "parts": [{"name": "a", "bytes": 3}, {"name": "a", "bytes": 4}]}, "'a' given twice"),
        ({"experts": 4, "parts": [{"name": "a", "bytes": 0}]}, "layers[0].parts[0].bytes: must be 1..1099511627776"),
        ({"experts": 4, "parts": [{"name": "a", "dtype": "float32", "shape": [3], "bytes": 13}]}, "is 12 bytes"),
        ({"experts": 4, "parts": [{"name": "a", "bytes": 3, "shape": [3]}]}, 'a "shape" needs a "dtype"'),
        ({"experts": 4, "parts": [{"name": "a", "dtype": "f77", "shape": [1]}]}, "layers[0].parts[0].dtype: dtype"),
        ({"experts": 4, "parts": [{"name": "a", "dtype": "int8"}]}, 'no "bytes" (or a "shape"'),
        ({"experts": 4, "parts": [{"name": "a", "shape": [3, 32]}]}, 'no type: give "type" here'),
        ({"experts": 4, "gate_bytes": 1, "parts": [{"name": "a", "bytes": 3}]}, "unknown key 'gate_bytes'"),
    ],
)
def test_a_bad_part_in_a_layout_file_is_named(layer, message):
    with pytest.raises(LayoutFileError, match=re.escape(message)):
        ModelLayout.from_json({"layers": [layer]})


# -- quantized Hugging Face checkpoints -----------------------------------------------------------


def _config(model: str, **quantization) -> dict:
    config = json.loads(json.dumps(hf_configs.CONFIGS[model]))
    config["quantization_config"].update(quantization)
    return config


def test_an_fp8_checkpoint_gives_its_weights_and_block_scales():
    layout = ModelLayout.from_hf_config(hf_configs.CONFIGS["DeepSeek-V3"])
    spec = layout[3]
    hidden, ffn = 7168, 2048
    assert layout.name == "deepseek_v3-fp8" and layout.moe_layers == list(range(3, 61))
    assert spec.part_names == ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv")
    assert [(p.dtype, p.shape) for p in spec.parts] == [
        ("float8_e4m3fn", (2 * ffn, hidden)),
        ("float32", (math.ceil(2 * ffn / 128), math.ceil(hidden / 128))),
        ("float8_e4m3fn", (hidden, ffn)),
        ("float32", (math.ceil(hidden / 128), math.ceil(ffn / 128))),
    ]
    bf16 = ModelLayout.from_hf_config(hf_configs.CONFIGS["DeepSeek-V3"], "BF16")[3]  # quant= still decides
    assert spec.expert_bytes == 3 * hidden * ffn + (32 * 56 + 56 * 16) * 4 and bf16.expert_bytes == 6 * hidden * ffn
    # Blocks that do not divide the matrix round up; no blocks: one scale a matrix (two for gate_up).
    odd = ModelLayout.from_hf_config(_config("DeepSeek-V3", weight_block_size=[128, 96]))[3]
    assert odd.part("down_proj_scale_inv").shape == (56, 22)
    whole = ModelLayout.from_hf_config(_config("DeepSeek-V3", weight_block_size=None))[3]
    assert [whole.part(n).shape for n in ("gate_up_proj_scale_inv", "down_proj_scale_inv")] == [(2, 1), (1, 1)]
    v4 = ModelLayout.from_hf_config(
        _config("DeepSeek-V3", scale_fmt="ue8m0", expert_dtype="fp4", activation_scheme="static")
    )[3]
    assert v4.part("gate_up_proj") == PartSpec("gate_up_proj", 2 * ffn * hidden // 2, "int8", (2 * ffn, hidden // 2))
    assert v4.part("down_proj_scale_inv") == PartSpec(
        "down_proj_scale_inv", hidden * ffn // 32, "float8_e8m0fnu", (hidden, ffn // 32)
    )
    assert v4.part("gate_up_proj_activation_scale") == PartSpec("gate_up_proj_activation_scale", 4, "float32", ())
    assert ModelLayout.from_json(layout.to_json()) == layout


@pytest.mark.parametrize(
    "quantization, message",
    [
        ({"weight_block_size": [128]}, "quantization_config.weight_block_size: expected [rows, cols]"),
        ({"weight_block_size": [0, 128]}, "quantization_config.weight_block_size: expected [rows, cols]"),
        ({"scale_fmt": "e4m3"}, "quantization_config.scale_fmt: expected one of float, ue8m0"),
        ({"expert_dtype": "int4"}, "quantization_config.expert_dtype: expected one of fp8, fp4"),
    ],
)
def test_an_unreadable_fp8_config_is_named(quantization, message):
    with pytest.raises(LayoutFileError, match=re.escape(message)):
        ModelLayout.from_hf_config(_config("DeepSeek-V3", **quantization))


def test_an_mxfp4_checkpoint_gives_its_blocks_scales_and_biases():
    layout = ModelLayout.from_hf_config(hf_configs.CONFIGS["gpt-oss-20b"])
    spec = layout[0]
    h = f = 2880
    assert layout.name == "gpt_oss-mxfp4" and spec.num_experts == 32
    assert [(p.name, p.dtype, p.shape) for p in spec.parts] == [
        ("gate_up_proj_blocks", "uint8", (2 * f, h // 32, 16)),
        ("gate_up_proj_scales", "uint8", (2 * f, h // 32)),
        ("gate_up_proj_bias", "bfloat16", (2 * f,)),
        ("down_proj_blocks", "uint8", (h, f // 32, 16)),
        ("down_proj_scales", "uint8", (h, f // 32)),
        ("down_proj_bias", "bfloat16", (h,)),
    ]
    # 4.25 bits a weight, as GGUF's MXFP4 (given as quant=, the three-part form), plus the biases.
    gguf = ModelLayout.from_hf_config(hf_configs.CONFIGS["gpt-oss-20b"], "MXFP4")[0]
    assert gguf == LayerSpec(32, h * f // 32 * 17, h * f // 32 * 17, h * f // 32 * 17)
    assert spec.expert_bytes == gguf.expert_bytes + (2 * f + h) * 2
    odd = dict(hf_configs.CONFIGS["gpt-oss-20b"], intermediate_size=2890)
    with pytest.raises(LayoutFileError, match="intermediate_size: MXFP4 quantizes blocks of 32 values: 2890"):
        ModelLayout.from_hf_config(odd)


def test_another_quant_method_warns_that_the_sizes_are_the_dtypes():
    config = _config("DeepSeek-V3", quant_method="gptq")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layout = ModelLayout.from_hf_config(config)
    assert layout[3] == LayerSpec(256, 2048 * 7168 * 2, 2048 * 7168 * 2, 2048 * 7168 * 2)
    assert [str(w.message) for w in caught] == [
        "the config: the weights are stored as gptq (quantization_config) but the layout has BF16 sizes "
        "(torch_dtype); give the stored type (quant=..., or --layout CONFIG.json:TYPE)"
    ]


def test_the_parts_are_transformers_fp8_experts_parameters():
    """FP8Experts (transformers' integrations/finegrained_fp8.py) holds exactly these parameters,
    per expert, for a small Qwen3-MoE of blocks that do not divide its widths."""
    pytest.importorskip("torch")
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(hidden_size=320, moe_intermediate_size=200, num_experts=4, num_hidden_layers=1)
    for scale_fmt in ("float", "ue8m0"):
        module = fp8.FP8Experts(config, block_size=(128, 128), scale_fmt=scale_fmt)
        hf = dict(config.to_dict(), quantization_config={"quant_method": "fp8", "scale_fmt": scale_fmt})
        spec = ModelLayout.from_hf_config(hf)[0]
        for part in spec.parts:
            param = getattr(module, part.name)
            assert str(param.dtype) == f"torch.{part.dtype}", part.name
            assert tuple(param.shape) == (4, *part.shape), part.name
            assert param[0].nbytes == part.nbytes


def test_the_parts_are_gpt_oss_checkpoint_tensors():
    """GPT-OSS's checkpoint keeps, per expert, the packed FP4 values transformers'
    Mxfp4GptOssExperts loads into gate_up_proj / down_proj ([rows, cols / 2] bytes), regrouped as
    blocks of 32 values (16 bytes) with one uint8 scale each, and biases of the projections' rows."""
    pytest.importorskip("torch")
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    from transformers import GptOssConfig

    config = GptOssConfig(hidden_size=64, intermediate_size=96, num_local_experts=4, num_hidden_layers=1)
    module = mxfp4.Mxfp4GptOssExperts(config)
    spec = ModelLayout.from_hf_config(dict(config.to_dict(), quantization_config={"quant_method": "mxfp4"}))[0]
    for name in ("gate_up_proj", "down_proj"):
        packed, bias = getattr(module, name), getattr(module, f"{name}_bias")
        blocks, scales = spec.part(f"{name}_blocks"), spec.part(f"{name}_scales")
        assert blocks.nbytes == packed[0].nbytes and blocks.shape[0] == packed.shape[1]
        assert scales.shape == blocks.shape[:2] and blocks.shape[2] == 16
        assert spec.part(f"{name}_bias").shape == tuple(bias.shape[1:])
