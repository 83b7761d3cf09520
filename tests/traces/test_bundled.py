"""The bundled traces and their loaders (expcache_bench/traces/bundled.py): the files against
upstream, decode and prefill loading, compressed and unreadable files, files without a complete
token, and the notice for a truncated tail. Locality and synthetic traces: test_locality.py,
test_synthetic.py."""

import csv
import gzip
import hashlib
import re
import warnings

import numpy as np
import pytest

from expcache_bench.traces import (
    DECODE_FIRST_LAYER,
    TRACE_DIR,
    PrefillPrompt,
    Trace,
    TraceWarning,
    list_traces,
    load_decode_trace,
    load_prefill_trace,
    load_trace,
)

DECODE_TOKENS = {
    "podA_a_coffee_full": 299,
    "podA_b2_json_long_full": 206,
    "podA_c_python_full": 117,
    "podA_b_json_full": 37,
    "oracle50_k0w": 79,  # logged 80: the 80th was cut off upstream and is trimmed here (README)
    "livemask_forensic_k0": 60,
    "smoke_count64": 65,
}


# --------------------------------------------------------------------------- bundled files


def test_list_traces_names_and_kinds():
    infos = list_traces()
    kinds = {i.name: i.kind for i in infos}
    assert kinds == {
        **{n: "decode" for n in DECODE_TOKENS},
        "pod12_prefill_learn": "prefill",
        "pod12_prefill_eval": "prefill",
    }
    for info in infos:
        assert info.path.is_file() and info.path.parent == TRACE_DIR / info.kind


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_bundled_files_match_upstream_git_blobs():
    # The README lists each file's git blob id in imanu86/reap-loop; matching it
    # proves the copy is byte-for-byte, without needing the upstream checkout. A file
    # expcache changed matches the blob its "Changed by expcache" entry gives instead.
    readme = (TRACE_DIR / "README.md").read_text()
    rows = re.findall(r"^\| ((?:decode|prefill)/\S+) \|.*\| ([0-9a-f]{40}) \|$", readme, flags=re.M)
    assert len(rows) == 10
    changed_section = readme.split("## Changed by expcache", 1)[1]
    changed = dict(
        re.findall(r"^- `((?:decode|prefill)/\S+)`:.*?git blob ([0-9a-f]{40})", changed_section, flags=re.M | re.S)
    )
    assert list(changed) == ["decode/oracle50_k0w.route.csv"]
    for rel, blob in rows:
        assert _git_blob_id((TRACE_DIR / rel).read_bytes()) == changed.get(rel, blob), rel


def test_attribution_names_licence_and_copyright():
    text = (TRACE_DIR / "ATTRIBUTION.md").read_text()
    assert "imanu86/reap-loop" in text
    assert "Copyright (c) 2026 REAP-LOOP contributors" in text
    assert "Permission is hereby granted, free of charge" in text


# --------------------------------------------------------------------------- decode loader


@pytest.mark.parametrize("name,tokens", sorted(DECODE_TOKENS.items()))
def test_decode_trace_shapes(name, tokens):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = load_decode_trace(name)
    assert not caught  # see test_bundled_traces_load_without_the_truncation_warning
    assert (t.num_tokens, t.num_layers, t.k) == (tokens, 40, 6)
    assert t.ids.dtype == np.int32 and t.ids.shape == (tokens, 40, 6)
    assert t.first_layer == DECODE_FIRST_LAYER == 3
    assert t.ids.min() >= 0 and t.ids.max() < 256
    assert np.all(np.diff(t.positions) == 1)
    if name in ("smoke_count64", "livemask_forensic_k0"):
        assert t.weights is None
    else:
        assert t.weights.dtype == np.float32 and t.weights.shape == t.ids.shape
        # ds4 applies the routed scaling factor 1.5 to the normalised gates.
        np.testing.assert_allclose(t.weights.sum(axis=2), 1.5, atol=1e-3)


def test_coffee_trace_content(coffee):
    assert coffee.positions[0] == 218 and coffee.positions[-1] == 516
    # First and last data rows of the file.
    assert coffee.ids[0, 0].tolist() == [68, 71, 235, 177, 202, 96]
    assert coffee.ids[-1, -1].tolist() == [229, 38, 77, 33, 120, 143]
    assert coffee.weights[0, 0, 0] == pytest.approx(0.33447817)
    # layer_ids takes the model layer: model layer 4 is array index 1.
    assert coffee.layer_ids(4)[0].tolist() == [97, 8, 122, 201, 113, 161]
    assert np.array_equal(coffee.layer_ids(42), coffee.ids[:, 39])
    assert list(coffee.layers) == list(range(3, 43))
    with pytest.raises(IndexError):
        coffee.layer_ids(2)
    with pytest.raises(IndexError):
        coffee.layer_ids(43)


@pytest.mark.parametrize("info", list_traces(), ids=lambda info: info.name)
def test_bundled_traces_load_without_the_truncation_warning(info):
    # Upstream, oracle50_k0w ends inside a token ("143," after layers 3..37 of pos 143);
    # the bundled copy is trimmed to its whole tokens 64..142, so no bundled trace warns
    # (the warning is for users' traces: see the truncated tail notices below).
    with warnings.catch_warnings():
        warnings.simplefilter("error", TraceWarning)
        loaded = load_trace(info.name)
    if info.name == "oracle50_k0w":
        assert loaded.num_tokens == 79 and loaded.positions[0] == 64 and loaded.positions[-1] == 142


def test_load_by_path_and_dispatch(coffee):
    by_path = load_decode_trace(TRACE_DIR / "decode" / "podA_a_coffee_full.route.csv")
    assert np.array_equal(by_path.ids, coffee.ids)
    assert isinstance(load_trace("podA_a_coffee_full"), Trace)
    prompts = load_trace("pod12_prefill_eval")
    assert isinstance(prompts, list) and all(isinstance(p, PrefillPrompt) for p in prompts)
    with pytest.raises(FileNotFoundError, match="podA_a_coffee_full"):
        load_decode_trace("no_such_trace")
    with pytest.raises(FileNotFoundError):
        load_decode_trace("pod12_prefill_learn")  # a prefill name is not a decode trace


HEADER = "pos,layer,n,e0,e1,e2,e3,e4,e5\n"


def _row(pos, layer, ids=(1, 2, 3, 4, 5, 6), n=6):
    return f"{pos},{layer},{n}," + ",".join(str(e) for e in ids) + "\n"


def _write(tmp_path, text, name="t.route.csv"):
    path = tmp_path / name
    path.write_text(text)
    return path


def _token(pos, first=3, last=42):
    return "".join(_row(pos, layer) for layer in range(first, last + 1))


def test_small_decode_file_roundtrip(tmp_path):
    text = HEADER + _token(10) + _token(11).replace("11,3,6,1,2,3,4,5,6", "11,3,6,9,8,7,6,5,4")
    t = load_decode_trace(_write(tmp_path, text))
    assert t.name == "t" and t.num_tokens == 2 and t.weights is None
    assert t.positions.tolist() == [10, 11]
    assert t.ids[1, 0].tolist() == [9, 8, 7, 6, 5, 4]


def test_trailing_incomplete_token_dropped(tmp_path):
    text = HEADER + _token(10) + _token(11, last=20) + "11,21,6,1,2"
    with pytest.warns(TraceWarning):
        t = load_decode_trace(_write(tmp_path, text))
    assert t.num_tokens == 1 and t.positions.tolist() == [10]


@pytest.mark.parametrize(
    "text,match",
    [
        (HEADER + _token(10).replace("10,7,6,1,", "10,7,6,x,"), r"line 6: .*integers"),
        (HEADER + _token(10).replace("10,7,6,1,", "10,7,6,256,"), r"line 6: expert id 256 outside \[0, 256\)"),
        (HEADER + _token(10).replace("10,7,6,1,", "10,7,6,-1,"), r"line 6: expert id -1"),
        (HEADER + _token(10).replace("10,7,6,", "10,7,5,"), r"line 6: n=5 but the file has 6"),
        (HEADER + _token(10).replace(_row(10, 7), "") + _token(11), r"line 6: .*layer 8 where layer 7"),
        (HEADER + _token(10, last=30) + _token(11), r"line 29: token at pos 10 ends at layer 30"),
        (HEADER + _token(10) + _token(11, last=20) + _row(11, 22), r"layer 22 where layer 21"),
        (HEADER + _token(10).replace(_row(10, 7), "10,7,6,1\n") + _token(11), r"line 6: incomplete row"),
        (HEADER + _token(11) + _token(10), r"positions must increase"),
        (HEADER + _token(10).replace(_row(10, 7), _row(10, 7).strip() + ",9\n"), r"line 6: 10 columns"),
        ("pos,layer,e0\n", r"unexpected header"),
    ],
    ids=[
        "non-integer-id",
        "id-too-large",
        "id-negative",
        "n-mismatch",
        "layer-missing-in-middle",
        "token-cut-short-mid-file",
        "trailing-token-with-gap",
        "truncated-row-mid-file",
        "positions-decrease",
        "extra-column",
        "bad-header",
    ],
)
def test_malformed_decode_files(tmp_path, text, match):
    path = _write(tmp_path, text, "bad.route.csv")
    with pytest.raises(ValueError, match=match) as err:
        load_decode_trace(path)
    assert "bad.route.csv" in str(err.value)


def test_num_experts_parameter(tmp_path):
    path = _write(tmp_path, HEADER + _token(10).replace("10,7,6,1,", "10,7,6,300,"))
    with pytest.raises(ValueError, match="outside"):
        load_decode_trace(path)
    t = load_decode_trace(path, num_experts=512)
    assert t.ids[0, 4, 0] == 300 and t.num_experts == 512


# --------------------------------------------------------------------------- prefill loader


@pytest.mark.parametrize(
    "name,lengths",
    [("pod12_prefill_learn", [72, 66, 74, 65, 76, 68]), ("pod12_prefill_eval", [54, 49, 47, 53])],
)
def test_prefill_prompts(name, lengths):
    prompts = load_prefill_trace(name)
    assert [p.num_prefill_tokens for p in prompts] == lengths
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        assert p.index == i
        assert p.prefill.dtype == np.int32 and p.prefill.shape == (43, n, 6)
        assert p.prefill_weights.shape == (43, n, 6)
        assert p.positions.tolist() == list(range(n))
        d = p.decode
        assert (d.num_tokens, d.num_layers, d.first_layer, d.k) == (1, 40, 3, 6)
        assert d.positions.tolist() == [n]  # the decode token follows the prompt
        assert np.array_equal(p.layer_ids(5), p.prefill[5])


def test_prefill_layer_major_mapping():
    # Check the reshaping against raw rows: row (pos, layer) of prompt 1 must land
    # at prefill[layer, pos]; its decode row at decode.ids[0, layer - 3].
    prompts = load_prefill_trace("pod12_prefill_learn")
    path = TRACE_DIR / "prefill" / "pod12_prefill_learn.route.csv"
    with open(path, newline="") as fh:
        rows = list(csv.reader(fh))[1:]
    p0 = 72 * 43 + 40  # rows of prompt 0
    first = rows[p0]
    assert first[:2] == ["0", "0"]
    p = prompts[1]
    for r in rows[p0 : p0 + 66 * 43 + 40 : 97]:  # a spread of rows from prompt 1
        pos, layer = int(r[0]), int(r[1])
        ids = [int(x) for x in r[3:9]]
        idx = rows.index(r, p0)
        if idx - p0 < 66 * 43:
            assert p.prefill[layer, pos].tolist() == ids
        else:
            assert p.decode.ids[0, layer - 3].tolist() == ids
    assert prompts[0].prefill[0, 0].tolist() == [254, 222, 245, 200, 53, 35]
    assert prompts[0].prefill[0, 1].tolist() == [177, 92, 159, 84, 130, 21]


def test_malformed_prefill(tmp_path):
    def prompt(P, layers=43):
        return "".join(_row(pos, layer) for layer in range(layers) for pos in range(P)) + _token(P)

    ok = load_prefill_trace(_write(tmp_path, HEADER + prompt(2) + prompt(3)))
    assert [p.num_prefill_tokens for p in ok] == [2, 3]
    # A missing prefill row inside prompt 0 is an error naming the line.
    bad = (HEADER + prompt(2) + prompt(3)).replace(_row(1, 5), "", 1)
    with pytest.raises(ValueError, match=r"bad.route.csv, line \d+: prompt 0 prefill has \(layer 6, pos 0\)"):
        load_prefill_trace(_write(tmp_path, bad, "bad.route.csv"))
    with pytest.raises(ValueError, match="must start at pos 0, layer 0"):
        load_prefill_trace(_write(tmp_path, HEADER + _token(5), "bad.route.csv"))


# --------------------------------------------------------------------------- compressed and unreadable files


def _write_bytes(tmp_path, data, name):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _one_line_error(exc, name):
    msg = str(exc.value)
    assert name in msg and "\n" not in msg, msg
    return msg


def test_gzip_decode_trace(tmp_path, coffee):
    src = TRACE_DIR / "decode" / "podA_a_coffee_full.route.csv"
    path = _write_bytes(tmp_path, gzip.compress(src.read_bytes()), "coffee.route.csv.gz")
    for arg in (path, str(path)):  # a str ending in .csv.gz is a path, not a bundled name
        t = load_decode_trace(arg)
        assert t.name == "coffee"
        assert np.array_equal(t.ids, coffee.ids) and np.array_equal(t.weights, coffee.weights)
        assert np.array_equal(t.positions, coffee.positions)
    assert isinstance(load_trace(str(path), kind="decode"), Trace)


def test_gzip_relative_name_is_a_path(tmp_path, monkeypatch):
    _write_bytes(tmp_path, gzip.compress((HEADER + _token(10)).encode()), "mine.csv.gz")
    monkeypatch.chdir(tmp_path)
    t = load_decode_trace("mine.csv.gz")
    assert t.name == "mine" and t.num_tokens == 1
    with pytest.raises(FileNotFoundError, match="trace file not found: missing.csv.gz"):
        load_decode_trace("missing.csv.gz")


def test_gzip_detected_by_magic_bytes(tmp_path):
    # Compressed content under a plain .csv name is still read.
    path = _write_bytes(tmp_path, gzip.compress((HEADER + _token(10) + _token(11)).encode()), "t.route.csv")
    t = load_decode_trace(path)
    assert t.name == "t" and t.positions.tolist() == [10, 11]


def test_gzip_prefill_trace(tmp_path):
    src = TRACE_DIR / "prefill" / "pod12_prefill_eval.route.csv"
    path = _write_bytes(tmp_path, gzip.compress(src.read_bytes()), "eval.route.csv.gz")
    prompts = load_prefill_trace(path)
    assert [p.num_prefill_tokens for p in prompts] == [54, 49, 47, 53]
    assert prompts[0].name == "eval#0"


def _corrupt_gzip(kind):
    data = bytearray(gzip.compress((HEADER + _token(10) + _token(11)).encode()))
    if kind == "truncated":
        return bytes(data[: len(data) // 2])  # EOFError inside the deflate stream
    if kind == "bad-crc":
        data[-8] ^= 0xFF  # gzip.BadGzipFile: CRC check failed
        return bytes(data)
    if kind == "bad-method":
        data[2] = 0  # gzip.BadGzipFile: unknown compression method
        return bytes(data)
    assert kind == "garbage-deflate"
    return bytes(data[:10]) + b"\xff" * 40 + bytes(data[50:])  # zlib.error


@pytest.mark.parametrize("kind", ["truncated", "bad-crc", "bad-method", "garbage-deflate"])
def test_corrupt_gzip_is_a_one_line_value_error(tmp_path, kind):
    path = _write_bytes(tmp_path, _corrupt_gzip(kind), "bad.route.csv.gz")
    with pytest.raises(ValueError, match=r"bad\.route\.csv\.gz: not a readable gzip file \(.+\)") as err:
        load_decode_trace(path)
    _one_line_error(err, "bad.route.csv.gz")


def test_random_bytes_are_a_one_line_value_error(tmp_path):
    data = np.random.default_rng(0).bytes(4096)
    assert data[:2] != b"\x1f\x8b"
    path = _write_bytes(tmp_path, data, "noise.route.csv")
    with pytest.raises(ValueError, match=r"noise\.route\.csv: not a UTF-8 CSV route trace \(.*byte 0x") as err:
        load_decode_trace(path)
    _one_line_error(err, "noise.route.csv")


def test_latin1_byte_after_valid_rows(tmp_path):
    path = _write_bytes(tmp_path, (HEADER + _token(10)).encode() + b"11,3,6,1,2,3,4,5,\xe9\n", "l1.route.csv")
    with pytest.raises(ValueError, match=r"l1\.route\.csv: not a UTF-8 CSV route trace \(.*byte 0xe9"):
        load_decode_trace(path)


def test_other_compression_is_named(tmp_path):
    path = _write_bytes(tmp_path, b"\x28\xb5\x2f\xfd" + bytes(range(128, 256)), "t.route.csv.zst")
    with pytest.raises(ValueError, match=r"t\.route\.csv\.zst: not a UTF-8 CSV route trace .*zstd"):
        load_decode_trace(path)


def test_nul_bytes_are_a_one_line_value_error(tmp_path):
    text = HEADER + _token(10).replace("10,7,6,1,", "10,7,6,1\0,")
    path = _write(tmp_path, text, "nul.route.csv")
    with pytest.raises(ValueError, match=r"nul\.route\.csv, line 6: not a UTF-8 CSV route trace \(.*NUL") as err:
        load_decode_trace(path)
    _one_line_error(err, "nul.route.csv")


@pytest.mark.parametrize("data", [b"", gzip.compress(b"")], ids=["plain", "gzip"])
def test_empty_file(tmp_path, data):
    path = _write_bytes(tmp_path, data, "empty.route.csv.gz" if data else "empty.route.csv")
    for load in (load_decode_trace, load_prefill_trace):
        with pytest.raises(ValueError, match="empty file") as err:
            load(path)
        _one_line_error(err, path.name)


# --------------------------------------------------------------------------- no complete token


@pytest.mark.parametrize(
    "text,why",
    [
        (HEADER, r"the file has a header but no data rows"),
        (HEADER + "\n\n", r"the file has a header but no data rows"),
        (HEADER + _token(10, last=20), r"the only token, at pos 10, has only layers 3\.\.20 of 3\.\.42"),
        (HEADER + "10,3,", r"the only data line, line 2, is cut short \(3 of 9 columns\)"),
    ],
    ids=["header-only", "header-and-blank-lines", "one-partial-token", "one-cut-line"],
)
def test_no_complete_token_is_an_error(tmp_path, text, why):
    path = _write(tmp_path, text, "short.route.csv")
    with pytest.raises(ValueError, match=r"short\.route\.csv: no complete token \(" + why) as err:
        load_decode_trace(path)
    _one_line_error(err, "short.route.csv")
    with pytest.raises(ValueError, match="no complete token"):
        load_trace(path, kind="decode")


def test_header_only_prefill_is_an_error(tmp_path):
    path = _write(tmp_path, HEADER, "pre.route.csv")
    with pytest.raises(ValueError, match=r"pre\.route\.csv: no complete token") as err:
        load_prefill_trace(path)
    _one_line_error(err, "pre.route.csv")


# --------------------------------------------------------------------------- truncated tail notice


def _tail_warning(path, load=load_decode_trace):
    with pytest.warns(TraceWarning) as rec:
        result = load(path)
    assert len(rec) == 1  # one notice per file load
    msg = str(rec[0].message)
    assert str(path) in msg and "\n" not in msg, msg
    assert rec[0].filename == __file__  # stacklevel points at the caller of the loader
    return result, msg


def test_truncated_token_and_cut_line_notice(tmp_path):
    text = HEADER + _token(10) + _token(11, last=20) + "11,21,6,1,2"
    t, msg = _tail_warning(_write(tmp_path, text, "cut.route.csv"))
    assert t.positions.tolist() == [10]
    assert "pos 11 has only layers 3..20 of 3..42 (18 rows from line 42)" in msg
    assert "line 60 is cut short (5 of 9 columns)" in msg
    assert "1 complete token kept" in msg


def test_truncated_token_notice(tmp_path):
    t, msg = _tail_warning(_write(tmp_path, HEADER + _token(10) + _token(11) + _token(12, last=4), "cut.route.csv"))
    assert t.num_tokens == 2
    assert "pos 12 has only layers 3..4 of 3..42 (2 rows from line 82)" in msg and "cut short" not in msg


def test_cut_last_line_notice(tmp_path):
    t, msg = _tail_warning(_write(tmp_path, HEADER + _token(10) + "11,3,6,", "cut.route.csv"))
    assert t.num_tokens == 1
    assert "line 42 is cut short (4 of 9 columns)" in msg and "has only layers" not in msg


def test_several_cut_lines_notice(tmp_path):
    t, msg = _tail_warning(_write(tmp_path, HEADER + _token(10) + "11,3,6,\n,,\n11", "cut.route.csv"))
    assert t.num_tokens == 1
    assert "line 42 is cut short (4 of 9 columns) and 2 more incomplete lines follow it" in msg


def test_notice_through_load_trace(tmp_path):
    path = _write(tmp_path, HEADER + _token(10) + _token(11, last=5), "cut.route.csv")
    t, _ = _tail_warning(path, lambda p: load_trace(p, kind="decode"))
    assert t.num_tokens == 1


def test_notice_for_gzip_file(tmp_path):
    path = _write_bytes(tmp_path, gzip.compress((HEADER + _token(10) + "11,3").encode()), "cut.route.csv.gz")
    t, msg = _tail_warning(path)
    assert t.num_tokens == 1 and "line 42 is cut short" in msg


def test_truncated_prefill_notice(tmp_path):
    def prompt(P, last=42):
        return "".join(_row(pos, layer) for layer in range(43) for pos in range(P)) + _token(P, last=last)

    path = _write(tmp_path, HEADER + prompt(2) + prompt(3, last=10), "cut.route.csv")
    prompts, msg = _tail_warning(path, load_prefill_trace)
    assert [p.decode.num_tokens for p in prompts] == [1, 0]
    assert "prompt 1" in msg and "pos 3 has only layers 3..10 of 3..42" in msg


def test_complete_files_give_no_notice(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", TraceWarning)
        load_decode_trace(_write(tmp_path, HEADER + _token(10) + "\n\n"))
        load_prefill_trace("pod12_prefill_learn")
        load_prefill_trace("pod12_prefill_eval")


def test_trace_warning_is_a_user_warning():
    assert issubclass(TraceWarning, UserWarning)
    import expcache_bench.traces as traces

    assert "TraceWarning" in traces.__all__ and "SYNTHETIC_MAX_BYTES" in traces.__all__
