"""The parts of a quantized checkpoint's experts, from its Hugging Face ``quantization_config``
(:meth:`~pyexpcache.ModelLayout.from_hf_config` reads them when no ``quant`` is given): each
stored tensor of an expert one part, named, typed and shaped as transformers holds it.

- ``quant_method: "fp8"`` (DeepSeek V3/V4, Qwen3-FP8, GLM FP8: transformers' ``FP8Experts``,
  integrations/finegrained_fp8.py): ``gate_up_proj`` ``[2F, H]`` and ``down_proj`` ``[H, F]`` in
  float8_e4m3fn, each with its inverse block scales ``*_scale_inv`` ``[ceil(rows / b0), ceil(cols
  / b1)]`` for ``weight_block_size`` ``[b0, b1]`` (float32, or float8_e8m0fnu for ``scale_fmt:
  "ue8m0"``; the fused gate-up's at least 2 rows, one per half). ``expert_dtype: "fp4"``
  (DeepSeek V4's experts): int8 weights of two FP4 values a byte ``[rows, cols / 2]``, a scale per
  row and 32 columns. ``activation_scheme: "static"`` adds each projection's activation scale
  (``*_activation_scale``, one float32 an expert).
- ``quant_method: "mxfp4"`` (GPT-OSS, as its checkpoints store it: transformers'
  ``Mxfp4GptOssExperts``, integrations/mxfp4.py): ``gate_up_proj_blocks`` ``[2F, H / 32, 16]``
  and ``down_proj_blocks`` ``[H, F / 32, 16]`` (uint8, two FP4 values a byte), their shared
  exponents ``*_scales`` ``[rows, cols / 32]`` (uint8), and the biases ``gate_up_proj_bias``
  ``[2F]`` and ``down_proj_bias`` ``[H]`` in the config's ``torch_dtype`` (bfloat16 when it gives
  none).

H is ``hidden_size``, F the expert's FFN width."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

from .layer_spec import PartSpec, dtype_itemsize
from .layout_file import LayoutFile, shown

#: The ``quant_method`` values read here.
QUANT_METHODS = ("fp8", "mxfp4")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _part(name: str, dtype: str, shape: tuple[int, ...]) -> PartSpec:
    nbytes = dtype_itemsize(dtype)
    for d in shape:
        nbytes *= d
    return PartSpec(name, nbytes, dtype, shape)


def quantized_parts(
    config: Mapping, qconfig: Mapping, hidden: int, ffn: int, ffn_key: str, file: LayoutFile
) -> tuple[list[PartSpec], str]:
    """The parts of an expert of ``config``'s quantized checkpoint (``ffn`` read from ``ffn_key``)
    and a label for the layout's name; LayoutFileError naming the key for a value that cannot be
    read."""
    method = qconfig.get("quant_method")
    if method == "fp8":
        return _fp8_parts(qconfig, hidden, ffn, file)
    if method == "mxfp4":
        return _mxfp4_parts(config, hidden, ffn, ffn_key, file)
    raise file.fail("quantization_config.quant_method", f"expected one of {', '.join(QUANT_METHODS)}, got {method!r}")


def _choice(qconfig: Mapping, key: str, allowed: tuple, file: LayoutFile) -> str:
    value = qconfig.get(key, allowed[0])
    if value not in allowed:
        raise file.fail(f"quantization_config.{key}", f"expected one of {', '.join(allowed)}, got {shown(value)}")
    return value


def _fp8_parts(qconfig: Mapping, hidden: int, ffn: int, file: LayoutFile) -> tuple[list[PartSpec], str]:
    at = "quantization_config.weight_block_size"
    block: Optional[list] = qconfig.get("weight_block_size", [128, 128])
    if block is not None and (
        not isinstance(block, list)
        or len(block) != 2
        or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in block)
    ):
        raise file.fail(at, f"expected [rows, cols] of whole numbers >= 1 (or null), got {shown(block)}")
    scale_dtype = "float32" if _choice(qconfig, "scale_fmt", ("float", "ue8m0"), file) == "float" else "float8_e8m0fnu"
    fp4 = _choice(qconfig, "expert_dtype", ("fp8", "fp4"), file) == "fp4"
    static = _choice(qconfig, "activation_scheme", ("dynamic", "static"), file) == "static"

    def projection(name: str, rows: int, cols: int, min_scale_rows: int = 1) -> list[PartSpec]:
        # transformers' _alloc_expert_proj: FP4 halves the columns and scales each row per 32
        # columns; FP8 scales each [b0, b1] block (one scale for the whole matrix without blocks).
        if fp4:
            if cols % 2:
                raise file.fail("quantization_config.expert_dtype", f"fp4 packs two values a byte: {cols} columns")
            weight = _part(name, "int8", (rows, cols // 2))
            scale_shape = (max(rows, min_scale_rows), _cdiv(cols, 32))
        else:
            weight = _part(name, "float8_e4m3fn", (rows, cols))
            grid = (_cdiv(rows, block[0]), _cdiv(cols, block[1])) if block is not None else (1, 1)
            scale_shape = (max(grid[0], min_scale_rows), grid[1])
        parts = [weight, _part(f"{name}_scale_inv", scale_dtype, scale_shape)]
        if static:
            parts.append(_part(f"{name}_activation_scale", "float32", ()))
        return parts

    parts = projection("gate_up_proj", 2 * ffn, hidden, min_scale_rows=2) + projection("down_proj", hidden, ffn)
    return parts, "fp4" if fp4 else "fp8"


def _mxfp4_parts(config: Mapping, hidden: int, ffn: int, ffn_key: str, file: LayoutFile) -> tuple[list[PartSpec], str]:
    for key, width in (("hidden_size", hidden), (ffn_key, ffn)):
        if width % 32:
            raise file.fail(key, f"MXFP4 quantizes blocks of 32 values: {width} is not a multiple of 32")
    bias = next((config[k] for k in ("torch_dtype", "dtype") if config.get(k) is not None), "bfloat16")
    bias = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(bias, bias)

    def projection(name: str, rows: int, cols: int) -> list[PartSpec]:
        return [
            _part(f"{name}_blocks", "uint8", (rows, cols // 32, 16)),
            _part(f"{name}_scales", "uint8", (rows, cols // 32)),
            _part(f"{name}_bias", bias, (rows,)),
        ]

    try:
        return projection("gate_up_proj", 2 * ffn, hidden) + projection("down_proj", hidden, ffn), "mxfp4"
    except TypeError as exc:
        raise file.fail("torch_dtype", f"the biases' dtype: {exc}") from None
