"""The generic routing-trace format (pyexpcache/routing/format.py, docs/traces.md): a round trip per
format, the missing-data cases, malformed input, the incremental writer, and the check against a
layout."""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

from expcache_bench.sim import decode_stream, simulate_lru
from expcache_bench.traces import (
    MISSING,
    Trace,
    TraceWarning,
    TraceWriter,
    check_layout,
    read_trace,
    synthetic_trace,
    write_trace,
)
from pyexpcache import ModelLayout
from pyexpcache.layout import LayerSpec

FORMATS = ["jsonl", "csv", "npz", "jsonl.gz", "csv.gz", "npz.gz"]


def _trace(tokens=5, layers=4, k=2, experts=8, seed=0, weights=True, sequences=False, first_layer=1) -> Trace:
    rng = np.random.default_rng(seed)
    ids = np.stack([[rng.choice(experts, k, replace=False) for _ in range(layers)] for _ in range(tokens)])
    ids[0, 0, 0] = experts - 1  # the largest id appears: num_experts reads back the same
    w = rng.random(ids.shape).astype(np.float32) if weights else None
    seqs = np.repeat(np.arange((tokens + 1) // 2), 2)[:tokens] if sequences else None
    return Trace("t", ids, w, first_layer, np.arange(tokens) + 10, experts, sequences=seqs)


def _same(a: Trace, b: Trace) -> None:
    assert (a.ids == b.ids).all() and a.first_layer == b.first_layer and a.num_experts == b.num_experts
    assert (a.positions == b.positions).all()
    assert (a.weights is None) == (b.weights is None)
    if a.weights is not None:
        assert np.array_equal(a.weights, b.weights, equal_nan=True)
    assert (a.sequences is None) == (b.sequences is None)
    if a.sequences is not None:
        assert (a.sequences == b.sequences).all()


def _lines(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("weights,sequences", [(True, False), (False, True)])
def test_round_trip(tmp_path, fmt, weights, sequences):
    trace = _trace(weights=weights, sequences=sequences)
    path = tmp_path / f"r.{fmt}"
    assert write_trace(path, trace) == trace.num_tokens * trace.num_layers
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a complete trace: no notice
        back = read_trace(path)
    _same(trace, back)
    assert back.name == "r" and back.complete
    if fmt.endswith(".gz"):
        assert path.read_bytes()[:2] == b"\x1f\x8b"


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_with_records_missing(tmp_path, fmt):
    trace = _trace()
    ids = trace.ids.copy()
    ids[1, 2] = MISSING
    ids[3, 0] = MISSING
    weights = trace.weights.copy()
    weights[ids < 0] = np.nan
    holed = Trace("t", ids, weights, trace.first_layer, trace.positions, trace.num_experts)
    path = tmp_path / f"h.{fmt}"
    assert write_trace(path, holed) == trace.num_tokens * trace.num_layers - 2
    with pytest.warns(
        TraceWarning,
        match=r"2 of 20 \(token, layer\) records are missing \(the first: token 11, "
        r"layer 3\)",
    ):
        back = read_trace(path)
    _same(holed, back)
    assert back.missing_records == 2 and not back.complete


def test_the_csv_format(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("seq,token,layer,experts,weights\n7,0,3,5 1,0.75 0.25\n7,1,3,1 2,0.5 0.5\n")
    t = read_trace(path)
    assert t.ids.tolist() == [[[5, 1]], [[1, 2]]] and t.sequences.tolist() == [7, 7] and t.first_layer == 3
    assert t.weights.tolist() == [[[0.75, 0.25]], [[0.5, 0.5]]] and t.num_experts == 6
    # Columns in any order; without the optional ones.
    path.write_text("layer,experts,token\n3,5 1,0\n")
    assert read_trace(path).ids.tolist() == [[[5, 1]]]


def test_geometry_comes_from_the_records(tmp_path):
    path = tmp_path / "g.jsonl"
    _lines(path, [{"token": 0, "layer": 4, "experts": [0, 9, 2]}, {"token": 0, "layer": 6, "experts": [1, 2, 3]}])
    t = read_trace(path)
    # Layers 4..6, the never-routed layer 5 a row of -1 (not a missing record: no token has it).
    assert (t.first_layer, t.num_layers, t.k, t.num_experts) == (4, 3, 3, 10)
    assert t.routed_layers == [4, 6] and t.missing_records == 0 and t.present.tolist() == [[True, False, True]]
    assert read_trace(path, num_experts=16).num_experts == 16
    with pytest.raises(ValueError, match=r"g\.jsonl:1: expert id 9 outside \[0, 8\)"):
        read_trace(path, num_experts=8)


def test_a_token_missing_a_layer_is_served_with_the_others(tmp_path):
    path = tmp_path / "m.jsonl"
    records = [{"token": t, "layer": layer, "experts": [t % 4, 4 + layer]} for t in range(3) for layer in range(3)]
    del records[4]  # token 1, layer 1
    _lines(path, records)
    with pytest.warns(TraceWarning) as caught:
        t = read_trace(path)
    assert len(caught) == 1 and "1 of 9 (token, layer) records are missing (the first: token 1, layer 1)" in str(
        caught[0].message
    )
    assert t.num_tokens == 3 and t.present.tolist() == [[True] * 3, [True, False, True], [True] * 3]
    calls = decode_stream(t)
    assert [(c.layer, c.ids) for c in calls[3:5]] == [(0, (1, 4)), (2, (1, 6))]
    assert len(calls) == 8 and t.num_requests == 16


def test_a_layer_missing_for_some_tokens(tmp_path):
    path = tmp_path / "m.csv"
    rows = [f"{t},{layer},{t} {layer + 4}" for t in range(6) for layer in range(2, 5) if not (layer == 3 and t % 2)]
    path.write_text("token,layer,experts\n" + "\n".join(rows) + "\n")
    with pytest.warns(TraceWarning, match=r"3 of 18 .*the first: token 1, layer 3\)"):
        t = read_trace(path)
    assert t.routed_layers == [2, 3, 4] and t.missing_records == 3
    assert t.present[:, 1].tolist() == [True, False] * 3
    # The simulator replays the records present only: the same as the calls without the holes.
    full = simulate_lru(decode_stream(t), 2)
    assert full.requests == 15 * 2


def test_records_out_of_order_are_sorted(tmp_path):
    # Layer-major, tokens shuffled; two sequences: the one seen first replays first, whatever its id.
    records = [
        {"seq": s, "token": tok, "layer": layer, "experts": [s, tok, layer]}
        for layer in (1, 0)
        for s in (9, 2)
        for tok in (3, 1, 2)
    ]
    path = tmp_path / "o.jsonl"
    _lines(path, records)
    t = read_trace(path)
    assert t.sequences.tolist() == [9, 9, 9, 2, 2, 2] and t.positions.tolist() == [1, 2, 3, 1, 2, 3]
    assert t.ids[:, :, 1].tolist() == [[1, 1], [2, 2], [3, 3], [1, 1], [2, 2], [3, 3]]
    assert t.ids[0, :, 2].tolist() == [0, 1] and t.complete


def test_a_duplicate_record_is_an_error(tmp_path):
    path = tmp_path / "d.jsonl"
    _lines(
        path,
        [
            {"token": 0, "layer": 0, "experts": [1]},
            {"token": 1, "layer": 0, "experts": [1]},
            {"token": 0, "layer": 0, "experts": [2]},
        ],
    )
    with pytest.raises(ValueError, match=r"d\.jsonl:3: duplicate record \(\(token 0, layer 0\) is also at line 1\)"):
        read_trace(path)
    # The same token and layer in two sequences is not a duplicate.
    _lines(
        path, [{"seq": 0, "token": 0, "layer": 0, "experts": [1]}, {"seq": 1, "token": 0, "layer": 0, "experts": [2]}]
    )
    assert read_trace(path).num_tokens == 2


@pytest.mark.parametrize(
    "text,message",
    [
        ('{"token": 0, "layer": 0, "experts": [1]}\nnot json\n', r":2: not a JSON object"),
        ("[1, 2]\n", r":1: a record is a JSON object, got list"),
        ('{"token": 0, "layer": 0}\n', r":1: no 'experts'"),
        ('{"token": 0, "layer": 0, "experts": [1], "expert": 2}\n', r":1: unknown key 'expert'"),
        ('{"token": 0.5, "layer": 0, "experts": [1]}\n', r":1: token must be an integer, got 0.5"),
        ('{"token": true, "layer": 0, "experts": [1]}\n', r":1: token must be an integer"),
        ('{"token": 0, "layer": -1, "experts": [1]}\n', r":1: token and layer must be >= 0"),
        ('{"token": 0, "layer": 0, "experts": [1, "2"]}\n', r":1: experts must be a list of integers"),
        ('{"token": 0, "layer": 0, "experts": []}\n', r":1: experts is empty"),
        ('{"token": 0, "layer": 0, "experts": [-3]}\n', r":1: expert ids must be >= 0"),
        (
            '{"token": 0, "layer": 0, "experts": [1, 2]}\n{"token": 1, "layer": 0, "experts": [1]}\n',
            r":2: 1 experts where the first record \(.*:1\) has 2: every record has the same k",
        ),
        (
            '{"token": 0, "layer": 0, "experts": [1], "weights": [0.5]}\n{"token": 1, "layer": 0, "experts": [1]}\n',
            r":2: no weights where the first record",
        ),
        ('{"token": 0, "layer": 0, "experts": [1], "weights": [0.5, 1]}\n', r":1: 2 weights for 1 experts"),
        ('{"token": 0, "layer": 0, "experts": [1], "weights": [NaN]}\n', r":1: weights must be finite"),
        (
            '{"seq": 1, "token": 0, "layer": 0, "experts": [1]}\n{"token": 1, "layer": 0, "experts": [1]}\n',
            r":2: no seq where the first record",
        ),
        ("\n\n", r": no records"),
    ],
)
def test_malformed_jsonl_names_the_file_and_line(tmp_path, text, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"bad\.jsonl" + message):
        read_trace(path)


@pytest.mark.parametrize(
    "text,message",
    [
        ("", r"bad\.csv: empty file"),
        ("token,layer\n0,0\n", r"bad\.csv:1: header token,layer; expected the columns token,layer,experts"),
        ("token,layer,experts,extra\n", r"bad\.csv:1: header"),
        ("pos,layer,n,e0\n0,3,1,5\n", r"bundled route-CSV format .* \*\.route\.csv"),
        ("token,layer,experts\n0,0,1 2\n1,0\n", r"bad\.csv:3: 2 columns, the header has 3"),
        ("token,layer,experts\n0,x,1 2\n", r"bad\.csv:2: layer must be an integer, got 'x'"),
        ("token,layer,experts\n0,0,1;2\n", r"bad\.csv:2: experts must be integers separated by spaces, got '1;2'"),
        ("token,layer,experts\n0,0,\n", r"bad\.csv:2: experts is empty"),
        ("token,layer,experts,weights\n0,0,1 2,0.5 x\n", r"bad\.csv:2: weights must be numbers separated by spaces"),
    ],
)
def test_malformed_csv_names_the_file_and_line(tmp_path, text, message):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_trace(path)


def test_malformed_npz(tmp_path):
    path = tmp_path / "bad.npz"
    np.savez(path, token=np.arange(2), layer=np.zeros(2, int), experts=np.array([[1], [-1]]))
    with pytest.raises(ValueError, match=r"bad\.npz: record 1: expert ids must be >= 0"):
        read_trace(path)
    np.savez(path, token=np.arange(2), layer=np.zeros(2, int), experts=np.ones((2, 1)))
    with pytest.raises(ValueError, match=r"bad\.npz: array experts must hold integers, got dtype float64"):
        read_trace(path)
    np.savez(path, token=np.arange(2), layer=np.zeros(3, int), experts=np.ones((2, 1), int))
    with pytest.raises(ValueError, match=r"array layer has shape \(3,\), expected \(2,\)"):
        read_trace(path)
    np.savez(path, token=np.arange(2), experts=np.ones((2, 1), int), pos=np.arange(2))
    with pytest.raises(ValueError, match=r"bad\.npz: arrays experts, pos, token; expected token, layer, experts"):
        read_trace(path)
    path.write_bytes(b"not a zip")
    with pytest.raises(ValueError, match=r"bad\.npz: not a readable \.npz file"):
        read_trace(path)


def test_unreadable_files(tmp_path):
    path = tmp_path / "x.jsonl.gz"
    path.write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match=r"x\.jsonl\.gz: not a readable gzip file"):
        read_trace(path)
    path = tmp_path / "y.jsonl"
    path.write_bytes(gzip.compress(b'{"token": 0}\n'))
    with pytest.raises(ValueError, match=r"y\.jsonl: not UTF-8 text .*gzip data without \.gz"):
        read_trace(path)
    with pytest.raises(ValueError, match=r"z\.json: not a routing-trace file name: .*\*\.jsonl, \*\.csv, \*\.npz"):
        read_trace(tmp_path / "z.json")
    with pytest.raises(FileNotFoundError, match="trace file not found"):
        read_trace(tmp_path / "none.jsonl")


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_writer_appends_token_by_token(tmp_path, fmt):
    path = tmp_path / f"w.{fmt}"
    with TraceWriter(path) as writer:
        writer.write_token(0, {5: [1, 2], 4: [3, 0]}, weights={4: [0.5, 0.5], 5: [0.9, 0.1]})
        if not fmt.startswith("npz"):
            writer.flush()
        writer.write_token(1, {4: [2, 1]}, weights={4: [1.0, 0.0]})
        with pytest.raises(ValueError, match="3 experts where the first record has 2"):
            writer.write(2, 4, [1, 2, 3], weights=[0, 0, 0])
        with pytest.raises(ValueError, match="same fields as the first"):
            writer.write(2, 4, [1, 2])
    assert writer.records == 3 and writer.closed
    writer.close()  # idempotent
    with pytest.warns(TraceWarning, match="1 of 4"):
        t = read_trace(path)
    assert t.ids.tolist() == [[[3, 0], [1, 2]], [[2, 1], [-1, -1]]] and t.first_layer == 4
    assert t.weights[0].tolist() == [[0.5, 0.5], [0.8999999761581421, 0.10000000149011612]]
    with pytest.raises(ValueError, match="closed"):
        writer.write(3, 4, [1, 2])


@pytest.mark.filterwarnings("ignore::pyexpcache.routing.TraceWarning")
def test_check_layout(tmp_path):
    layout = ModelLayout((None, LayerSpec(8, 64, 64, 64), LayerSpec(4, 64, 64, 64)), name="small")
    path = tmp_path / "c.jsonl"
    _lines(path, [{"token": 0, "layer": 1, "experts": [7]}, {"token": 0, "layer": 2, "experts": [3]}])
    check_layout(read_trace(path), layout)
    _lines(path, [{"token": 0, "layer": 1, "experts": [7]}, {"token": 1, "layer": 2, "experts": [5]}])
    with pytest.raises(
        ValueError,
        match=r"trace c layer 2 has expert id 5 \(first at token 1\), which layout small "
        r"does not have: it gives that layer 4 experts",
    ):
        check_layout(read_trace(path), layout)
    _lines(path, [{"token": 0, "layer": 0, "experts": [1]}, {"token": 0, "layer": 1, "experts": [1]}])
    with pytest.raises(
        ValueError,
        match=r"trace c has layer 0, which layout small does not have: layer 0 has no "
        r"routed experts: it is a dense layer of small",
    ):
        check_layout(read_trace(path), layout)
    check_layout(read_trace(path), layout, layers=[1])  # only the layers replayed are checked
    _lines(path, [{"token": 0, "layer": 3, "experts": [1]}])
    with pytest.raises(ValueError, match=r"has layer 3, which layout small does not have: .*small has 3 layers"):
        check_layout(read_trace(path), layout)


def test_a_synthetic_trace_round_trips_through_jsonl(tmp_path):
    trace = synthetic_trace(20, seed=4)
    write_trace(tmp_path / "s.jsonl.gz", trace)
    back = read_trace(tmp_path / "s.jsonl.gz", num_experts=trace.num_experts)
    assert (back.ids == trace.ids).all() and back.layers == trace.layers


# -- hostile input: the library's limits, huge integers, a BOM, a directory (issue 36) ----------


def _write_records(path, records) -> None:
    """``records`` (dicts of token, layer, experts) in the format of ``path``'s name, written by hand:
    the writer would not be what is tested."""
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    if name.endswith(".npz"):
        buf = io.BytesIO()
        arrays = {key: np.array([r[key] for r in records], dtype=np.uint64) for key in records[0]}
        np.savez(buf, **arrays)
        data = buf.getvalue()
    elif name.endswith(".csv"):
        header = list(records[0])
        lines = [",".join(header)] + [
            ",".join(" ".join(map(str, r[h])) if isinstance(r[h], list) else str(r[h]) for h in header) for r in records
        ]
        data = ("\n".join(lines) + "\n").encode()
    else:
        data = "".join(json.dumps(r) + "\n" for r in records).encode()
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)


_READ_IN_CHILD = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))  # 1 GiB: a dense array of the layers fails at once
from expcache_bench.traces import read_trace
out = []
for path in sys.argv[1:]:
    try:
        read_trace(path)
        out.append(["read", ""])
    except BaseException as exc:
        out.append([type(exc).__name__, str(exc)])
print(json.dumps(out))
"""


def test_a_layer_past_the_library_limit_is_refused_before_anything_is_allocated(tmp_path):
    # Two records, layers 0 and 10^9: the dense [tokens, layers, k] array would be 14.9 GiB. In a child
    # process under a 1 GiB address-space limit, so a reader that allocates it fails fast instead.
    paths = []
    for fmt in FORMATS:
        path = tmp_path / f"huge.{fmt}"
        _write_records(
            path, [{"token": 0, "layer": 0, "experts": [1, 2]}, {"token": 1, "layer": 10**9, "experts": [1, 2]}]
        )
        paths.append(path)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", _READ_IN_CHILD, *map(str, paths)], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    for path, (kind, message) in zip(paths, json.loads(done.stdout)):
        where = f"{path}: record 1" if ".npz" in path.name else f"{path}:{3 if '.csv' in path.name else 2}"
        assert (kind, message) == (
            "ValueError",
            f"{where}: layer 1000000000 is past the library's limit: a cache has at most 4096 layers (0..4095)",
        )


def test_the_library_limits_bound_layers_and_expert_ids(tmp_path):
    path = tmp_path / "limits.jsonl"
    _lines(path, [{"token": 0, "layer": 4095, "experts": [65535]}])
    t = read_trace(path)
    assert (t.first_layer, t.num_layers, t.num_experts) == (4095, 1, 65536)
    _lines(path, [{"token": 0, "layer": 4096, "experts": [1]}])
    with pytest.raises(
        ValueError,
        match=r"limits\.jsonl:1: layer 4096 is past the library's limit: a cache has at "
        r"most 4096 layers \(0\.\.4095\)",
    ):
        read_trace(path)
    _lines(path, [{"token": 0, "layer": 0, "experts": [1]}, {"token": 0, "layer": 1, "experts": [65536]}])
    with pytest.raises(
        ValueError,
        match=r"limits\.jsonl:2: expert id 65536 is past the library's limit: a layer "
        r"has at most 65536 experts \(ids 0\.\.65535\)",
    ):
        read_trace(path)
    _lines(path, [{"token": 0, "layer": 0, "experts": [1]}])
    with pytest.raises(ValueError, match=r"num_experts must be in 1\.\.65536 \(the library's limit\), got 65537"):
        read_trace(path, num_experts=65537)


@pytest.mark.parametrize(
    "fmt,record,message",
    [
        (
            "jsonl",
            {"token": 2**63, "layer": 0, "experts": [1]},
            r":2: token 9223372036854775808 is too large: at most "
            r"2\^63 - 1",
        ),
        (
            "jsonl",
            {"seq": 2**64, "token": 1, "layer": 0, "experts": [1]},
            r":2: seq 18446744073709551616 is outside "
            r"\[-2\^63, 2\^63 - 1\]",
        ),
        (
            "jsonl",
            {"token": 1, "layer": 2**64, "experts": [1]},
            r":2: layer 18446744073709551616 is past the library's "
            r"limit",
        ),
        (
            "jsonl",
            {"token": 1, "layer": 0, "experts": [1, 2**64]},
            r":2: expert id 18446744073709551616 is past the "
            r"library's limit",
        ),
        ("csv", {"token": 2**63, "layer": 0, "experts": [1]}, r":3: token 9223372036854775808 is too large"),
        ("csv", {"token": 1, "layer": 0, "experts": [2**70]}, r":3: expert id 1180591620717411303424 is past"),
        ("npz", {"token": 2**63, "layer": 0, "experts": [1]}, r": record 1: token 9223372036854775808 is too large"),
        (
            "npz.gz",
            {"token": 1, "layer": 0, "experts": [2**64 - 1]},
            r": record 1: expert id 18446744073709551615 is "
            r"past",
        ),
    ],
)
def test_huge_integers_name_the_file_and_line(tmp_path, fmt, record, message):
    path = tmp_path / f"big.{fmt}"
    first = {key: ([1] if key == "experts" else 0) for key in record}
    _write_records(path, [first, record])
    with pytest.raises(ValueError, match=r"big\." + fmt.replace(".", r"\.") + message) as caught:
        read_trace(path)
    assert type(caught.value) is ValueError  # the reader's class, not an OverflowError


@pytest.mark.parametrize(
    "line,message",
    [
        # Python reads at most 4300 digits of an integer (sys.get_int_max_str_digits): json.loads raises
        # a ValueError of its own, without the file.
        (
            '{"token": 1' + "0" * 5000 + ', "layer": 0, "experts": [1]}',
            r"a number too long to read \(Exceeds the limit",
        ),
        # json.loads raises RecursionError past the interpreter's recursion limit.
        (
            '{"token": 1, "layer": 0, "experts": ' + "[" * 100000 + "]" * 100000 + "}",
            r"not a JSON object \(nested too deeply to read\)",
        ),
    ],
)
def test_a_json_line_python_cannot_read_names_the_line(tmp_path, line, message):
    path = tmp_path / "long.jsonl"
    path.write_text('{"token": 0, "layer": 0, "experts": [1]}\n' + line + "\n")
    with pytest.raises(ValueError, match=r"long\.jsonl:2: " + message) as caught:
        read_trace(path)
    assert type(caught.value) is ValueError


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "jsonl.gz", "csv.gz"])
def test_a_utf8_bom_is_read(tmp_path, fmt):
    # Windows editors (Notepad, Excel's "CSV UTF-8") start a file with the byte-order mark EF BB BF.
    trace = _trace()
    path = tmp_path / f"bom.{fmt}"
    write_trace(path, trace)
    data = path.read_bytes()
    if fmt.endswith(".gz"):
        path.write_bytes(gzip.compress(b"\xef\xbb\xbf" + gzip.decompress(data)))
    else:
        path.write_bytes(b"\xef\xbb\xbf" + data)
    _same(trace, read_trace(path))


def test_a_directory_is_named_as_one(tmp_path):
    path = tmp_path / "runs.jsonl"
    path.mkdir()
    with pytest.raises(IsADirectoryError, match=r"runs\.jsonl is a directory; expected a routing-trace file"):
        read_trace(path)


@pytest.mark.parametrize(
    "record", [{"token": 2**63, "layer": 0, "experts": [1]}, {"token": 0, "layer": 5000, "experts": [1]}]
)
def test_the_command_line_prints_one_line_for_a_hostile_trace(capsys, tmp_path, record):
    from expcache_bench import cli

    path = tmp_path / "bad.jsonl"
    _lines(path, [record])
    assert cli.main(["bench", "--backend", "host", "--traces", str(path), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"expcache bench: {path}:1: ") and "Traceback" not in err
