"""GGUF files as expert sources: layouts, served bytes, and malformed files.

Every file is written with gguf.GGUFWriter (tests/support/gguf_files.py): tiny shapes (256-weight
rows, a few rows per expert), random bytes standing in for quantized blocks.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from pyexpcache import ExpertCache, LayerSpec, ModelLayout, MultiDeviceCache, checksum_bytes, testing
from pyexpcache.gguf import (
    GGUFLayoutError,
    GGUFSource,
    describe_gguf,
    inspect_table,
    layout_from_gguf,
)

from support.gguf_files import (
    MIXED,
    Q4,
    ROW,
    exps,
    file_parts,
    moe_tensors,
    part_bytes,
    tensor_data,
    write_model,
    write_tensors,
)


@pytest.fixture
def mixed_file(tmp_path):
    return write_model(tmp_path / "mixed.gguf", MIXED)


# ---------------------------------------------------------------------------
# Layouts


def test_uniform_file_gives_one_class(tmp_path):
    path = write_model(tmp_path / "uniform.gguf", [Q4] * 4)
    layout = layout_from_gguf(path)
    spec = LayerSpec(8, part_bytes(Q.Q4_K, 4), part_bytes(Q.Q4_K, 4), part_bytes(Q.Q4_K, 2))
    assert layout == ModelLayout((spec,) * 4, name="uniform.gguf")
    assert spec.class_key == (576, 576, 288)
    assert list(layout.classes()) == [spec.class_key]


def test_mixed_quant_file_gives_two_classes_and_dense_layers_none(mixed_file):
    layout = layout_from_gguf(mixed_file)
    q2 = LayerSpec(8, part_bytes(Q.IQ2_XXS, 4), part_bytes(Q.IQ2_XXS, 4), part_bytes(Q.Q2_K, 2))
    q4 = LayerSpec(8, part_bytes(Q.Q4_K, 4), part_bytes(Q.Q4_K, 4), part_bytes(Q.Q4_K, 2))
    assert layout.layers == (None, None, q2, q2, q2, q4, q4)
    assert q2.class_key == (264, 264, 168)
    assert layout.classes() == {q2.class_key: [2, 3, 4], q4.class_key: [5, 6]}
    assert layout.moe_layers == [2, 3, 4, 5, 6]
    records = describe_gguf(mixed_file)
    assert records[0] is None and records[1] is None
    assert records[2].types == ("IQ2_XXS", "IQ2_XXS", "Q2_K")
    assert records[6].types == ("Q4_K", "Q4_K", "Q4_K")
    assert [r.layer for r in records if r] == [2, 3, 4, 5, 6]
    assert not any(r.fused for r in records if r)


def test_same_bytes_different_types_share_a_class(tmp_path):
    # Q4_0 and IQ4_NL are both 18 bytes per 32 weights: one class, different type names.
    path = write_model(tmp_path / "f.gguf", [dict(types=(Q.Q4_0,) * 3), dict(types=(Q.IQ4_NL,) * 3)])
    layout = layout_from_gguf(path)
    assert len(layout.classes()) == 1
    assert [r.types[0] for r in describe_gguf(path)] == ["Q4_0", "IQ4_NL"]


def test_expert_size_and_count_differences_give_distinct_classes(tmp_path):
    path = write_model(tmp_path / "f.gguf", [Q4, dict(Q4, rows=(4, 4, 4)), dict(Q4, experts=4)])
    layout = layout_from_gguf(path)
    assert [s.num_experts for s in layout.layers] == [8, 8, 4]
    assert layout.classes() == {(576, 576, 288): [0, 2], (576, 576, 576): [1]}


def test_layer_count_from_block_count_else_max_block_index(tmp_path):
    with_bc = write_model(tmp_path / "bc.gguf", [None, Q4, Q4], block_count=6)
    assert layout_from_gguf(with_bc).layers[3:] == (None, None, None)
    assert layout_from_gguf(with_bc).num_layers == 6
    without = write_model(tmp_path / "nobc.gguf", [None, Q4, Q4, None], block_count=None)
    # Without metadata the trailing dense layer is invisible: 1 + the largest expert block index.
    assert layout_from_gguf(without).num_layers == 3


def test_fused_gate_up_split_into_halves(tmp_path):
    path = write_model(tmp_path / "fused.gguf", [dict(Q4, fused=True, rows=(4, 4, 2))] * 2)
    layout = layout_from_gguf(path)
    assert layout[0] == LayerSpec(8, 576, 576, 288)
    rec = describe_gguf(path)[1]
    assert rec.fused and rec.types == ("Q4_K", "Q4_K", "Q4_K")
    assert rec.up_offset == rec.gate_offset + 576
    assert rec.gate_stride == rec.up_stride == 1152
    with GGUFSource(path) as src:
        place = src.placement(1)
        assert place.bases[1] - place.bases[0] == 576 and place.strides[:2] == (1152, 1152)
        for e in (0, 3, 7):
            want = file_parts(path, 1, e)
            for p in range(3):
                assert (src.part(1, e, p) == want[p]).all()
            # gate then up are the expert's whole fused run
            assert (
                np.concatenate([src.part(1, e, 0), src.part(1, e, 1)])
                == tensor_data(path)["blk.1.ffn_gate_up_exps.weight"][e]
            ).all()


def test_expert_biases_are_parts_of_their_own_and_shared_expert_tensors_are_ignored(tmp_path):
    """GPT-OSS's GGUF keeps each expert bias apart from its weight: a part after gate, up and down,
    served byte for byte; the shared expert's tensors are not routed experts."""
    rng = np.random.default_rng(3)
    gate_bias, down_bias = rng.random((8, 4), dtype=np.float32), rng.random((8, 6), dtype=np.float32)
    tensors = moe_tensors(rng, 0) + [
        ("blk.0.ffn_down_exps.bias", down_bias, None),
        ("blk.0.ffn_gate_exps.bias", gate_bias, None),
        ("blk.0.ffn_down_shexp.weight", rng.random((4, ROW), dtype=np.float32), None),
    ]
    path = write_tensors(tmp_path / "b.gguf", tensors)
    spec = LayerSpec.of_parts(
        8,
        [
            ("gate", 576),
            ("up", 576),
            ("down", 288),
            ("gate_bias", 16, "float32", (4,)),
            ("down_bias", 24, "float32", (6,)),
        ],
    )
    assert layout_from_gguf(path).layers == (spec,)
    with GGUFSource(path) as src, ExpertCache(src.layout, src, budget_experts=3, backend="host", log_level=0) as cache:
        for ids in ([1, 5], [2, 7], [5, 0]):
            for e, view in zip(ids, cache.select_views(0, ids)):
                assert np.asarray(view["gate_bias"]).tobytes() == gate_bias[e].tobytes()
                assert np.asarray(view["down_bias"]).view(np.float32).tolist() == down_bias[e].tolist()
                assert (np.asarray(view["up"]) == src.part(0, e, "up")).all()
    plain = write_tensors(tmp_path / "p.gguf", moe_tensors(np.random.default_rng(3), 0))
    assert layout_from_gguf(plain).layers == (LayerSpec(8, 576, 576, 288),)


# ---------------------------------------------------------------------------
# Served bytes


def test_source_parts_equal_file_bytes(mixed_file):
    with GGUFSource(mixed_file) as src:
        assert src.pinned is False
        assert src.nbytes == mixed_file.stat().st_size
        assert src.layout == layout_from_gguf(mixed_file)
        assert src.placement(0) is None and src.placement(1) is None
        raw = mixed_file.read_bytes()
        for layer in src.layout.moe_layers:
            spec, place = src.layout[layer], src.placement(layer)
            assert place.sizes == spec.class_key
            assert place.strides == spec.class_key  # separate tensors: stride = per-expert bytes
            for e in range(spec.num_experts):
                want = file_parts(mixed_file, layer, e) if e in (0, 5, 7) else None
                for p in range(3):
                    got = src.part(layer, e, p)
                    if want is not None:
                        assert (got == want[p]).all(), (layer, e, p)
                    # the placement's absolute address holds the same bytes
                    addr = place.bases[p] + e * place.strides[p]
                    assert ctypes.string_at(addr, place.sizes[p]) == got.tobytes()
                    assert got.tobytes() in raw
                assert (src.expert_bytes(layer, e) == np.concatenate([src.part(layer, e, p) for p in range(3)])).all()
                expected = sum(checksum_bytes(src.part(layer, e, p)) for p in range(3)) % (1 << 64)
                assert src.expected_checksum(layer, e) == expected


def test_source_rejects_bad_arguments_and_closes_idempotently(mixed_file):
    src = GGUFSource(mixed_file)
    with pytest.raises(ValueError, match="no routed experts"):
        src.part(0, 0, 0)
    with pytest.raises(ValueError, match="out of range"):
        src.part(2, 8, 0)
    with pytest.raises(ValueError, match="part"):
        src.part(2, 0, 3)
    view = src.part(2, 1, 0).copy()
    kept = src.part(2, 1, 0)  # a live view keeps the mapping valid past close
    src.close()
    src.close()
    assert src.nbytes == 0
    assert (kept == view).all()
    with pytest.raises(ValueError, match="closed"):
        src.placement(2)
    with GGUFSource(mixed_file) as s2:
        assert s2.nbytes > 0
    assert s2.nbytes == 0


def test_source_layout_argument_must_match_file(mixed_file, tmp_path):
    layout = layout_from_gguf(mixed_file)
    with GGUFSource(mixed_file, layout=layout) as src:
        assert src.layout is layout
    other = layout_from_gguf(write_model(tmp_path / "u.gguf", [Q4] * 7))
    with pytest.raises(ValueError, match="differs"):
        GGUFSource(mixed_file, layout=other)


@pytest.mark.parametrize("reads", ["mmap", "file"])
def test_several_devices_serve_one_file(mixed_file, backend, policy, reads):
    """Every device's cache reads the same GGUF file (each opens it for itself): each expert from
    its owner, with the file's bytes, the file kept open until the last cache closes."""
    src = GGUFSource(mixed_file, reads=reads)
    layout = src.layout
    devices = [0, 0, 0] if backend == "cuda" else [0, 1, 2]
    multi = MultiDeviceCache(
        layout, src, devices=devices, budget_experts=2, backend=backend, policy=policy, log_level=0
    )
    src.close()  # the caches keep it
    with multi:
        rng = np.random.default_rng(11)
        for step in range(12):
            layer = layout.moe_layers[step % len(layout.moe_layers)]
            ids = rng.choice(8, 4, replace=False)
            sel = multi.select(layer, ids)
            for e, row, d in zip(ids, sel.pointers, sel.owners):
                want = file_parts(mixed_file, layer, int(e))
                for p, (addr, nbytes) in enumerate(zip(row, layout[layer].class_key)):
                    assert (testing.read_device(multi.caches[d], int(addr), nbytes) == want[p]).all()
        assert all(st.total.misses > 0 for st in multi.stats())
    assert src.users == 0


@pytest.mark.parametrize("reads,file_reads", [("mmap", "buffered"), ("file", "buffered"), ("file", "direct")])
def test_cache_serves_file_bytes(mixed_file, backend, policy, reads, file_reads):
    with GGUFSource(mixed_file, reads=reads) as src:
        layout = src.layout
        with ExpertCache(layout, src, budget_experts=4, backend=backend, file_reads=file_reads, policy=policy) as cache:
            rng = np.random.default_rng(7)
            for step in range(12):
                layer = layout.moe_layers[step % len(layout.moe_layers)]
                k = 6 if step == 5 else 3  # one call larger than the budget (served through staging)
                ids = rng.choice(8, k, replace=False)
                ptrs = cache.select(layer, ids)
                assert ptrs.shape == (k, 3)
                for e, row in zip(ids, ptrs):
                    want = file_parts(mixed_file, layer, int(e)) if step < 3 else None
                    for p, (addr, nbytes) in enumerate(zip(row, layout[layer].class_key)):
                        got = testing.read_device(cache, int(addr), nbytes)
                        assert (got == src.part(layer, int(e), p)).all()
                        if want is not None:
                            assert (got == want[p]).all()
                sums = testing.checksum(cache, layer, ptrs)
                assert sums.tolist() == [src.expected_checksum(layer, int(e)) for e in ids]
            assert len(cache.classes()) == 2
            assert cache.stats().path("decode").evictions > 0


@pytest.mark.parametrize("file_reads", ["buffered", "direct"])
@pytest.mark.parametrize("copy_threads", [0, 4])
def test_file_reads_fail_cleanly_when_the_file_shrinks(tmp_path, backend, policy, file_reads, copy_threads):
    from pyexpcache import SourceIOError

    path = write_model(tmp_path / "shrinks.gguf", [Q4] * 3)
    with GGUFSource(path, reads="file") as src:
        layout = src.layout
        with ExpertCache(
            layout,
            src,
            budget_experts=8,
            backend=backend,
            log_level=0,
            file_reads=file_reads,
            copy_threads=copy_threads,
            policy=policy,
        ) as cache:
            ok = cache.select(0, [0, 1])
            last = layout.moe_layers[-1]
            # Cut inside the last layer's down tensor, after expert 3's bytes: experts 0-3 of that
            # layer read fine, 4-7 end early.
            rec = src.records[last]
            os.truncate(path, rec.offsets[2] + 4 * layout[last].down_bytes)
            with pytest.raises(SourceIOError, match="ended early"):
                cache.select(last, [2, 6, 3, 7])
            # The reads run on the staging threads: the call fails as a whole and none of its
            # experts is resident, the ones whose reads succeeded included.
            assert all(testing.read_expert(cache, last, e) is None for e in (2, 3, 6, 7))
            assert sum(c.resident_experts for c in cache.classes()) == 2
            # What was read before is intact and still served; the readable experts load again.
            again = cache.select(0, [0, 1])
            assert (again == ok).all()
            assert (testing.read_expert(cache, 0, 1) == src.expert_bytes(0, 1)).all()
            cache.select(last, [2, 3])
            assert (testing.read_expert(cache, last, 3) == src.expert_bytes(last, 3)).all()


def test_file_layout_past_the_end_of_the_file_is_refused(tmp_path):
    from pyexpcache import InvalidArgumentError

    path = write_model(tmp_path / "short.gguf", [Q4] * 2)
    with GGUFSource(path, reads="file") as src:
        os.truncate(path, src.records[1].offsets[2] + 10)
        with pytest.raises(InvalidArgumentError, match="past the end of"):
            ExpertCache(src.layout, src, budget_experts=4, backend="host")


def test_missing_source_file_is_an_io_error(tmp_path):
    from pyexpcache import SourceIOError

    path = write_model(tmp_path / "gone.gguf", [Q4] * 2)
    with GGUFSource(path, reads="file") as src:
        src.file_path = str(tmp_path / "missing.gguf")
        with pytest.raises(SourceIOError, match="cannot open"):
            ExpertCache(src.layout, src, budget_experts=4, backend="host")


# ---------------------------------------------------------------------------
# Inspection


def test_inspect_table_lists_layers_classes_and_total(mixed_file):
    layout = layout_from_gguf(mixed_file)
    text = inspect_table(mixed_file)
    assert "IQ2_XXS/IQ2_XXS/Q2_K" in text and "Q4_K/Q4_K/Q4_K" in text
    assert "264 / 264 / 168" in text and "576 / 576 / 288" in text
    assert "2-4" in text and "5-6" in text
    assert f"total: {layout.total_bytes:,} bytes" in text
    assert "dense: 0-1" in text
    lines = text.splitlines()
    for layer in layout.moe_layers:  # one row per MoE layer, with its bytes per layer
        spec = layout[layer]
        row = [ln for ln in lines if ln.split()[:1] == [str(layer)] and "/" in ln and "Q" in ln]
        assert len(row) == 1 and f"{spec.num_experts * spec.expert_bytes:,}" in row[0]
    # a layout (no file) and a source give the same size figures
    assert f"total: {layout.total_bytes:,} bytes" in inspect_table(layout)
    with GGUFSource(mixed_file) as src:
        assert inspect_table(src) == text.replace(str(mixed_file), src.path)
    preset = inspect_table(ModelLayout.preset("mixed"))
    assert "2,162,688 / 2,162,688 / 2,752,512" in preset and "0-36" in preset and "37-42" in preset


# ---------------------------------------------------------------------------
# Errors


def test_bad_magic_and_non_gguf_files(tmp_path, mixed_file):
    data = bytearray(mixed_file.read_bytes())
    data[:4] = b"GGML"
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFLayoutError, match=r"not a GGUF file: bad magic b'GGML'") as exc:
        layout_from_gguf(bad)
    assert str(bad) in str(exc.value)
    text = tmp_path / "notes.txt"
    text.write_text("hello, this is not a model\n" * 4)
    with pytest.raises(GGUFLayoutError, match="bad magic"):
        GGUFSource(text)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFLayoutError, match="not a GGUF file"):
        layout_from_gguf(empty)
    with pytest.raises(FileNotFoundError):
        layout_from_gguf(tmp_path / "missing.gguf")


def truncation_points(path) -> dict[str, int]:
    reader = gguf.GGUFReader(str(path))
    size = path.stat().st_size
    kv = reader.fields["tokenizer.ggml.tokens"].offset
    first_ti = reader.tensors[0].field.offset
    last = reader.tensors[-1]
    points = {
        "magic": 2,
        "header": 12,
        "end of header": 24,
        "metadata": kv + 6,
        "metadata array": kv + 40,
        "tensor info": first_ti + 3,
        "last tensor info": last.field.offset + 20,
        "before data": reader.data_offset - 1,
        "start of data": reader.data_offset + 1,
        "inside the data": (reader.data_offset + size) // 2,
        "last byte": size - 1,
    }
    assert last.name.endswith("_exps.weight") and last.data_offset + last.n_bytes == size  # no tail padding
    del reader
    return points


def test_truncated_file_is_reported(tmp_path, mixed_file):
    data = mixed_file.read_bytes()
    for where, cut in truncation_points(mixed_file).items():
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(GGUFLayoutError) as exc:
            layout_from_gguf(path)
        msg = str(exc.value)
        assert msg.startswith(f"{path}: "), where
        msg = msg[len(f"{path}: ") :]  # (the path itself says "truncated")
        if cut < 4:
            assert "not a GGUF file" in msg, (where, msg)
        else:
            assert "truncated" in msg, (where, msg)
        with pytest.raises(GGUFLayoutError):
            GGUFSource(path)


def test_truncated_expert_data_names_the_tensor(tmp_path, mixed_file):
    data = mixed_file.read_bytes()
    reader = gguf.GGUFReader(str(mixed_file))
    last = reader.tensors[-1]
    name, start, end = last.name, last.data_offset, last.data_offset + last.n_bytes
    del reader
    path = tmp_path / "short.gguf"
    path.write_bytes(data[:-100])
    with pytest.raises(GGUFLayoutError) as exc:
        layout_from_gguf(path)
    assert str(exc.value) == (
        f"{path}: truncated or corrupted: the data of tensor {name} "
        f"(bytes {start}..{end}) runs past the end of the file ({len(data) - 100} bytes)"
    )


def test_file_without_experts(tmp_path):
    path = write_model(tmp_path / "dense.gguf", [None, None])
    with pytest.raises(GGUFLayoutError, match=r"no MoE expert tensors \(ffn_\*_exps\) found"):
        layout_from_gguf(path)


def test_layer_with_only_some_parts(tmp_path):
    rng = np.random.default_rng(1)
    tensors = moe_tensors(rng, 0) + [t for t in moe_tensors(rng, 1) if "down_exps" not in t[0]]
    with pytest.raises(GGUFLayoutError, match=r"layer 1: incomplete .* no down expert tensor"):
        layout_from_gguf(write_tensors(tmp_path / "nodown.gguf", tensors))
    tensors = [t for t in moe_tensors(rng, 0) if "gate_exps" not in t[0] and "up_exps" not in t[0]]
    with pytest.raises(GGUFLayoutError, match=r"layer 0: .* no gate/up"):
        layout_from_gguf(write_tensors(tmp_path / "onlydown.gguf", tensors))
    tensors = moe_tensors(rng, 0) + [t for t in moe_tensors(rng, 0, fused=True) if "gate_up" in t[0]]
    with pytest.raises(GGUFLayoutError, match="both a fused"):
        layout_from_gguf(write_tensors(tmp_path / "both.gguf", tensors))


def test_expert_counts_disagree(tmp_path):
    rng = np.random.default_rng(2)
    tensors = [t for t in moe_tensors(rng, 0) if "down_exps" not in t[0]]
    tensors.append(("blk.0.ffn_down_exps.weight", exps(rng, Q.Q4_K, 2, 6), Q.Q4_K))
    with pytest.raises(GGUFLayoutError, match=r"layer 0: expert counts disagree.*down_exps.weight has 6"):
        layout_from_gguf(write_tensors(tmp_path / "counts.gguf", tensors))


def test_sizes_that_do_not_divide(tmp_path):
    rng = np.random.default_rng(4)
    # A Q4_K row of 100 weights is not a whole number of 256-weight blocks.
    tensors = [t for t in moe_tensors(rng, 0) if "gate_exps" not in t[0]]
    tensors.append(("blk.0.ffn_gate_exps.weight", rng.random((8, 4, 100), dtype=np.float32), Q.Q4_K))
    with pytest.raises(GGUFLayoutError, match="block size"):
        layout_from_gguf(write_tensors(tmp_path / "block.gguf", tensors))
    # A fused gate_up of 3 rows per expert has no equal halves.
    tensors = [t for t in moe_tensors(rng, 0, fused=True) if "gate_up" not in t[0]]
    tensors.append(("blk.0.ffn_gate_up_exps.weight", exps(rng, Q.Q4_K, 3, 8), Q.Q4_K))
    with pytest.raises(GGUFLayoutError, match="equal gate/up halves"):
        layout_from_gguf(write_tensors(tmp_path / "odd.gguf", tensors))
    # A 2-D "expert" tensor has no expert dimension to divide by.
    tensors = [t for t in moe_tensors(rng, 0) if "up_exps" not in t[0]]
    tensors.append(("blk.0.ffn_up_exps.weight", exps(rng, Q.Q4_K, 4, 8)[0], Q.Q4_K))
    with pytest.raises(GGUFLayoutError, match="expected 3 dimensions"):
        layout_from_gguf(write_tensors(tmp_path / "flat.gguf", tensors))


def test_block_count_below_expert_blocks(tmp_path):
    path = write_model(tmp_path / "bc.gguf", [Q4, Q4, Q4], block_count=2)
    with pytest.raises(GGUFLayoutError, match=r"block 2 but testmoe.block_count is 2"):
        layout_from_gguf(path)


def test_random_corruption_never_crashes(tmp_path, mixed_file):
    data = mixed_file.read_bytes()
    reader = gguf.GGUFReader(str(mixed_file))
    header_end = reader.data_offset
    del reader
    outcomes = {"error": 0, "ok": 0}
    start = time.monotonic()
    for seed in range(50):
        rng = np.random.default_rng(seed)
        buf = bytearray(data)
        # mostly the header, metadata and tensor infos, where a parser can go wrong
        hi = header_end if seed % 5 else len(buf)
        for pos in rng.integers(4, hi, size=int(rng.integers(1, 6))):
            buf[pos] = int(rng.integers(0, 256))
        if seed % 7 == 0:
            buf = buf[: int(rng.integers(24, len(buf)))]
        path = tmp_path / f"c{seed}.gguf"
        path.write_bytes(bytes(buf))
        try:
            src = GGUFSource(path)
        except ValueError:  # GGUFLayoutError, or a layout rejected by ModelLayout
            outcomes["error"] += 1
            continue
        with src:
            for layer in src.layout.moe_layers:  # every served byte lies inside the file
                spec = src.layout[layer]
                for p in range(3):
                    last = src.part(layer, spec.num_experts - 1, p)
                    assert last.size == spec.class_key[p]
                src.expected_checksum(layer, 0)
        outcomes["ok"] += 1
    assert outcomes["error"] > 0
    assert time.monotonic() - start < 10


def test_bounded_reader_stops_a_corrupted_array_length(tmp_path, mixed_file):
    # An integer array's length of ~2^62: the stock reader reads past the end of the file
    # without an error (empty slices) and so loops ~2^62 times, growing a list.
    data = bytearray(mixed_file.read_bytes())
    reader = gguf.GGUFReader(str(mixed_file))
    key = "testmoe.layer_kinds"
    field = reader.fields[key]
    assert field.contents() == [1, 2, 3, 4]
    key_len = len(key)
    length_at = field.offset + 8 + key_len + 4 + 4  # key, value type, item type, then the uint64 length
    del reader
    assert int.from_bytes(data[length_at : length_at + 8], "little") == 4
    data[length_at : length_at + 8] = (1 << 62).to_bytes(8, "little")
    path = tmp_path / "longarray.gguf"
    path.write_bytes(bytes(data))
    start = time.monotonic()
    with pytest.raises(
        GGUFLayoutError, match=r"truncated or corrupted: a metadata array .* claims 4611686018427387904"
    ):
        layout_from_gguf(path)
    assert time.monotonic() - start < 2


def test_import_without_gguf_package(tmp_path, mixed_file):
    code = (
        "import sys; sys.modules['gguf'] = None\n"
        "import pyexpcache.gguf as g\n"
        "try:\n"
        f"    g.layout_from_gguf({str(mixed_file)!r})\n"
        "except ImportError as e:\n"
        "    assert 'pip install gguf' in str(e), e\n"
        "    print('advice ok')\n"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "advice ok" in out.stdout


# ---------------------------------------------------------------------------
# Command line


def test_cli_inspect_prints_classes(mixed_file):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "expcache_bench", "inspect", str(mixed_file)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert "Q4_K" in proc.stdout and "IQ2_XXS" in proc.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "expcache_bench", "inspect", str(mixed_file) + ".missing"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 1 and "expcache inspect" in bad.stderr


def test_cli_bench_on_a_gguf_model(tmp_path):
    """The main job on a real file: 43 layers of 256 experts (tiny rows), q2-like and q4 mixed."""
    import json
    import subprocess
    import sys

    layers = [
        dict(types=(Q.Q4_K,) * 3 if i >= 37 else (Q.IQ2_XXS, Q.IQ2_XXS, Q.Q2_K), experts=256, rows=(1, 1, 1))
        for i in range(43)
    ]
    path = write_model(tmp_path / "ds4-tiny.gguf", layers)
    out = tmp_path / "r.json"
    for reads in ("mmap", "file"):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pyexpcache",
                "bench",
                "--gguf",
                str(path),
                "--backend",
                "host",
                "--gguf-reads",
                reads,
                "--traces",
                "podA_b_json_full",
                "--budget-gib",
                "0.0001",
                "--json",
                str(out),
                "--quiet",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        data = json.loads(out.read_text())[0]
        assert data["layout"] == "ds4-tiny.gguf"
        assert all(r["checksum_errors"] == 0 and r["experts_checked"] == 37 * 40 * 6 for r in data["results"])
    # A GGUF whose layers do not match the traces is refused with the reason.
    small = write_model(tmp_path / "small.gguf", [Q4] * 4)
    proc = subprocess.run(
        [sys.executable, "-m", "expcache_bench", "bench", "--gguf", str(small), "--backend", "host", "--quiet"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "does not have" in proc.stderr
