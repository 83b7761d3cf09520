"""FileSource: every part of every expert at a (file, offset) of its own, the tables registered
through parts[] (three parts included) and range-checked before ctypes sees them."""

import numpy as np
import pytest

from pyexpcache import ArgumentRangeError, ExpertCache, FileSource, LayerPlacement, LayerSpec, ModelLayout

NUM_EXPERTS = 8
SPEC = LayerSpec(NUM_EXPERTS, 512, 512, 768)


def _shards(tmp_path, seed=1):
    """Two files holding every expert's parts in a shuffled order, 100 bytes apart: the source,
    and each (layer, expert, part)'s bytes."""
    rng = np.random.default_rng(seed)
    layout = ModelLayout((SPEC, None, SPEC), name="shards")
    data, blobs = {}, [bytearray(b"\7" * 64), bytearray(b"\7" * 96)]
    offsets, files = {}, {}
    for layer in layout.moe_layers:
        offsets[layer] = [[0] * NUM_EXPERTS for _ in range(3)]
        files[layer] = [[0] * NUM_EXPERTS for _ in range(3)]
        for p in range(3):
            for e in rng.permutation(NUM_EXPERTS).tolist():
                f = int(rng.integers(2))
                data[layer, e, p] = rng.integers(0, 256, SPEC.class_key[p], dtype=np.uint8)
                files[layer][p][e], offsets[layer][p][e] = f, len(blobs[f])
                blobs[f] += data[layer, e, p].tobytes() + b"\0" * 100
    paths = []
    for i, blob in enumerate(blobs):
        paths.append(tmp_path / f"shard{i}.bin")
        paths[-1].write_bytes(bytes(blob))
    placements = {
        layer: LayerPlacement((0, 0, 0), (0, 0, 0), SPEC.class_key, tuple(offsets[layer]), tuple(files[layer]))
        for layer in layout.moe_layers
    }
    return FileSource(paths, layout, placements), data


@pytest.mark.parametrize("lookup", ["host", "device"])
@pytest.mark.parametrize("file_reads", ["buffered", "direct"])
def test_experts_spread_over_files_are_served_byte_for_byte(tmp_path, lookup, file_reads):
    source, data = _shards(tmp_path)
    assert all((source.part(2, e, p) == data[2, e, p]).all() for e in range(NUM_EXPERTS) for p in range(3))
    with ExpertCache(
        source.layout, source, budget_experts=3, backend="host", lookup=lookup, file_reads=file_reads, log_level=0
    ) as cache:
        for layer, ids in ((0, [1, 6]), (2, [0, 7]), (0, [3, 1]), (2, [5, 2]), (0, [4, 6]), (2, [1, 6])):
            if lookup == "host":
                for e, view in zip(ids, cache.select_views(layer, ids)):
                    for p, name in enumerate(("gate", "up", "down")):
                        assert np.asarray(view[name]).tobytes() == data[layer, e, p].tobytes()
            else:
                import torch

                slots = cache.select_device(layer, torch.tensor([ids]))
                bank = cache.bank(layer, dtype="uint8", shapes=((512,), (512,), (768,)))
                for e, slot in zip(ids, slots[0].tolist()):
                    for p, name in enumerate(("gate", "up", "down")):
                        row = np.asarray(getattr(bank, name))[slot]
                        assert row.tobytes() == data[layer, e, p].tobytes()
        assert cache.stats().total.misses > 0 and cache.stats().total.evictions > 0


def _place(offsets=None, files=None, strides=(0, 0, 0)):
    return {0: LayerPlacement((0, 0, 0), strides, SPEC.class_key, offsets, files)}


def test_bad_tables_are_refused_naming_the_layer_part_and_expert(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"\0" * 8192)
    layout = ModelLayout((SPEC,), name="one")
    good = [512 * e for e in range(NUM_EXPERTS)]
    with pytest.raises(ArgumentRangeError, match=r"layer 0 part 'up' offsets\[3\] must be in \[0, "):
        FileSource([path], layout, _place((good, good[:3] + [-1] + good[4:], good)))
    with pytest.raises(
        ArgumentRangeError, match=r"layer 0 part 'gate' offsets\[0\] must be in .*got 18446744073709551616"
    ):
        FileSource([path], layout, _place(([1 << 64] + good[1:], None, None)))
    with pytest.raises(TypeError, match=r"layer 0 part 'down' offsets\[2\] must be an integer, got float"):
        FileSource([path], layout, _place((None, None, good[:2] + [2.5] + good[3:])))
    with pytest.raises(TypeError, match=r"offsets\[1\] must be an integer, got a bool"):
        FileSource([path], layout, _place((None, [0, True] + good[2:], None)))
    with pytest.raises(ValueError, match=r"layer 0 part 'gate' offsets has 7 entries for a layer of 8 experts"):
        FileSource([path], layout, _place((good[:7], None, None)))
    with pytest.raises(ArgumentRangeError, match=r"layer 0 part 'gate' files\[5\] must be in \[0, 0\], got 1"):
        FileSource([path], layout, _place((good, good, good), ([0] * 5 + [1, 0, 0], None, None)))
    with pytest.raises(ValueError, match="the placement's files has 2 tables for 3 parts"):
        FileSource([path], layout, _place((good, good, good), ([0] * 8, [0] * 8)))
    with pytest.raises(ValueError, match="layer 0 has 8 experts but no placement"):
        FileSource([path], layout, {})
    with pytest.raises(ValueError, match="not a regular file"):
        FileSource([tmp_path], layout, _place())
    with pytest.raises(ValueError, match="a file source reads 1..1024 files, got 0"):
        FileSource([], layout, _place())
    # Checked again where the descriptor is filled: a stride beside offsets, past the file's end.
    source = FileSource([path], layout, _place((good, good, good), strides=(512, 0, 0)))
    with pytest.raises(ValueError, match="part 'gate': stride must be 0 with per-expert offsets, got 512"):
        ExpertCache(layout, source, budget_experts=2, backend="host", log_level=0)
    source = FileSource([path], layout, _place(([e * 1100 for e in range(NUM_EXPERTS)], good, good)))
    with pytest.raises(ValueError, match="part of expert 7 ends at byte 8212, past the end of"):
        ExpertCache(layout, source, budget_experts=2, backend="host", log_level=0)
