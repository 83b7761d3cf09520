"""GGUF block types: how many weights a block of each type holds and its bytes, and the bytes of a
matrix stored in one (:func:`matrix_bytes`), which layout files, Hugging Face configs and the
presets size expert parts by. Read through :mod:`pyexpcache.layout`, which exports them."""

from __future__ import annotations

import functools

from ._ints import checked_int
from ._lib import MAX_PART_BYTES_LIMIT

# (weights per block, bytes per block) of the GGUF types used for experts, used when the gguf
# package is not installed; with it, its GGML_QUANT_SIZES (every type it knows) is used, and
# tests/test_layout.py holds this table to it. Source: llama.cpp's gguf-py/gguf/constants.py.
_BUILTIN_BLOCKS = {
    "F32": (1, 4),
    "F16": (1, 2),
    "BF16": (1, 2),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q2_K": (256, 84),
    "Q3_K": (256, 110),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
    "IQ1_S": (256, 50),
    "IQ1_M": (256, 56),
    "IQ2_XXS": (256, 66),
    "IQ2_XS": (256, 74),
    "IQ2_S": (256, 82),
    "IQ3_XXS": (256, 98),
    "IQ3_S": (256, 110),
    "IQ4_NL": (32, 18),
    "IQ4_XS": (256, 136),
    "MXFP4": (32, 17),
}
# The unquantized types as Hugging Face configs and PyTorch spell them (upper case).
_DTYPE_NAMES = {
    "BFLOAT16": "BF16",
    "FLOAT16": "F16",
    "FP16": "F16",
    "HALF": "F16",
    "FLOAT32": "F32",
    "FP32": "F32",
    "FLOAT": "F32",
}


@functools.lru_cache(maxsize=1)
def _block_table() -> tuple[dict[str, tuple[int, int]], str]:
    """The block sizes and where they come from (for messages)."""
    try:
        from gguf.constants import GGML_QUANT_SIZES
    except ImportError:
        return dict(_BUILTIN_BLOCKS), "the built-in table; pip install gguf for every type it knows"
    return {t.name: (int(b), int(n)) for t, (b, n) in GGML_QUANT_SIZES.items()}, "the gguf package"


def quant_types() -> dict[str, tuple[int, int]]:
    """Every GGUF block type whose size is known here: its name -> (weights per block, bytes per
    block), e.g. ``"Q4_K": (256, 144)``. From the gguf package's ``GGML_QUANT_SIZES`` when it is
    installed, else a built-in table of the types used for experts (F32, F16, BF16, Q4_0 to
    Q8_0, the K quants Q2_K to Q6_K, the IQ quants, MXFP4)."""
    return dict(_block_table()[0])


def quant_type(name: str) -> str:
    """The GGUF type name ``name`` stands for: a GGUF type in any case (``"q4_k"`` is ``"Q4_K"``)
    or an unquantized dtype as Hugging Face and PyTorch write it (``"bfloat16"``,
    ``"torch.float16"``, ``"fp32"`` are BF16, F16, F32). ValueError for an unknown name, listing
    the known types; TypeError for anything but a string."""
    if not isinstance(name, str):
        raise TypeError(f"a quant type is a name such as 'Q4_K' or 'bf16', got {type(name).__name__} {name!r}")
    key = name.strip().upper()
    key = key[len("TORCH.") :] if key.startswith("TORCH.") else key
    key = _DTYPE_NAMES.get(key, key)
    table, origin = _block_table()
    if key not in table:
        raise ValueError(
            f"unknown quant type {name!r}: the known types ({origin}) are {', '.join(table)}; "
            "the dtypes bf16, fp16 and fp32 are BF16, F16 and F32"
        )
    return key


def matrix_bytes(quant: str, rows: int, cols: int) -> int:
    """Bytes of a ``[rows, cols]`` matrix stored in the GGUF block type ``quant`` (any name
    :func:`quant_type` takes: ``"Q4_K"``, ``"MXFP4"``, ``"bf16"``).

    ``cols`` is the row length, the contiguous dimension along which a block runs: a PyTorch
    weight ``[out_features, in_features]`` is ``[rows, cols]`` (GGUF lists the same shape the
    other way round, its ``ne[0]`` being ``cols``). An expert's gate and up matrices are
    ``[ffn, hidden]`` and its down matrix ``[hidden, ffn]``. Mixtral 8x7B's gate in Q4_K is
    ``matrix_bytes("Q4_K", 14336, 4096)`` = 14336 * 4096 / 256 * 144 = 33,030,144 bytes.

    Raises ValueError for an unknown type (listing the known ones) or a row length that is not
    a multiple of the type's block, TypeError for a size that is not an integer.
    """
    name = quant_type(quant)
    block, size = _block_table()[0][name]
    rows = checked_int(rows, "rows", 1, MAX_PART_BYTES_LIMIT)
    cols = checked_int(cols, "cols", 1, MAX_PART_BYTES_LIMIT)
    if cols % block:
        raise ValueError(
            f"a row of {cols} weights is not a multiple of the {name} block of {block} weights "
            f"(in a [rows, cols] matrix, cols is the row length)"
        )
    return rows * (cols // block) * size
