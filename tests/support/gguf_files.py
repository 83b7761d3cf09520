"""Tiny GGUF model files for the tests, written with gguf.GGUFWriter: tiny shapes (256-weight
rows, a few rows per expert), random bytes standing in for quantized blocks. Used by
test_gguf.py and test_lifetimes.py (needs the gguf package: import it after
``pytest.importorskip("gguf")`` where that is optional)."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

ROW = 256  # weights per row: one block of every K/IQ type
ARCH = "testmoe"


def row_bytes(qtype: Q) -> int:
    block, type_size = GGML_QUANT_SIZES[qtype]
    return ROW // block * type_size


def part_bytes(qtype: Q, rows: int) -> int:
    return rows * row_bytes(qtype)


def exps(rng, qtype: Q, rows: int, experts: int) -> np.ndarray:
    """A [experts, rows, row bytes] uint8 tensor of random "quantized" bytes."""
    return rng.integers(0, 256, size=(experts, rows, row_bytes(qtype)), dtype=np.uint8)


def moe_tensors(rng, layer, types=(Q.Q4_K, Q.Q4_K, Q.Q4_K), experts=8, rows=(4, 4, 2), fused=False):
    """(name, array, qtype) of one MoE layer's expert tensors, plus its router and shared expert."""
    out = [
        (f"blk.{layer}.ffn_gate_inp.weight", rng.random((experts, ROW), dtype=np.float32), None),
        (f"blk.{layer}.ffn_gate_shexp.weight", rng.random((4, ROW), dtype=np.float32), None),
    ]
    if fused:
        out.append((f"blk.{layer}.ffn_gate_up_exps.weight", exps(rng, types[0], 2 * rows[0], experts), types[0]))
    else:
        out.append((f"blk.{layer}.ffn_gate_exps.weight", exps(rng, types[0], rows[0], experts), types[0]))
        out.append((f"blk.{layer}.ffn_up_exps.weight", exps(rng, types[1], rows[1], experts), types[1]))
    out.append((f"blk.{layer}.ffn_down_exps.weight", exps(rng, types[2], rows[2], experts), types[2]))
    return out


def dense_tensors(rng, layer):
    return [
        (f"blk.{layer}.ffn_{p}.weight", rng.random((4, ROW), dtype=np.float32), None) for p in ("gate", "up", "down")
    ]


def write_tensors(path, tensors, *, block_count=None, arch=ARCH) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    if block_count is not None:
        w.add_block_count(block_count)
    # array fields (strings and integers) for the corruption tests
    w.add_array("tokenizer.ggml.tokens", ["<s>", "a", "b", "c"])
    w.add_array("testmoe.layer_kinds", [1, 2, 3, 4])
    w.add_uint32("testmoe.expert_count", 8)
    for name, arr, qtype in tensors:
        w.add_tensor(name, arr, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def write_model(path, layers, *, seed=0, block_count="auto", embd=True) -> Path:
    """layers: per model layer None (dense) or a dict of moe_tensors keyword arguments."""
    rng = np.random.default_rng(seed)
    tensors = [("token_embd.weight", rng.random((8, ROW), dtype=np.float32), None)] if embd else []
    for i, spec in enumerate(layers):
        tensors += dense_tensors(rng, i) if spec is None else moe_tensors(rng, i, **spec)
    return write_tensors(path, tensors, block_count=len(layers) if block_count == "auto" else block_count)


def tensor_data(path) -> dict[str, np.ndarray]:
    """Every tensor's bytes as the gguf reader sees them, as [experts, bytes per expert] copies."""
    reader = gguf.GGUFReader(str(path))
    out = {
        t.name: np.array(t.data).view(np.uint8).reshape(int(t.shape[-1]), -1)
        for t in reader.tensors
        if "_exps" in t.name
    }
    del reader
    return out


def file_parts(path, layer, expert) -> list[np.ndarray]:
    """(gate, up, down) of one expert straight from the reader, splitting a fused gate_up."""
    data = tensor_data(path)
    down = data[f"blk.{layer}.ffn_down_exps.weight"][expert]
    fused = data.get(f"blk.{layer}.ffn_gate_up_exps.weight")
    if fused is not None:
        half = fused.shape[1] // 2
        return [fused[expert, :half], fused[expert, half:], down]
    return [data[f"blk.{layer}.ffn_gate_exps.weight"][expert], data[f"blk.{layer}.ffn_up_exps.weight"][expert], down]


Q2_LIKE = dict(types=(Q.IQ2_XXS, Q.IQ2_XXS, Q.Q2_K))
Q4 = dict(types=(Q.Q4_K, Q.Q4_K, Q.Q4_K))
MIXED = [None, None, Q2_LIKE, Q2_LIKE, Q2_LIKE, Q4, Q4]  # dense 0-1, "q2" 2-4, q4 5-6


def shrinking_model(tmp_path: Path) -> tuple[Path, bytes]:
    """A three-layer Q4 model file for the tests of reads that come short, and its bytes (to write
    it whole again)."""
    path = write_model(Path(tmp_path) / "shrinks.gguf", [Q4] * 3)
    return path, path.read_bytes()


def end_early(path: Path, source, layer: int, first: int) -> None:
    """Truncate ``path``, the file ``source`` (a GGUFSource) reads, so that the down part (the
    layer's last tensor) of experts ``first``.. of ``layer`` ends early."""
    os.truncate(path, source.records[layer].offsets[2] + first * source.layout[layer].down_bytes)
