"""The generic routing-trace format, for any MoE model: one record per (token, layer), as JSON lines,
CSV or .npz, each optionally gzip-compressed (``docs/traces.md`` is the contract); reading it into a
:class:`~pyexpcache.routing.Trace` (:func:`read_trace`) and writing it (:func:`write_trace`, and
:class:`TraceWriter`, which appends records token by token).

A record is ``{"token": int, "layer": int, "experts": [int, ...]}`` with an optional ``"seq"`` (an
integer sequence id) and ``"weights"`` (one float per expert). Records may come in any order. The
tokens are replayed sequence by sequence, in the order each sequence first appears in the file, and
within a sequence in increasing ``token``; a token's layers in increasing ``layer``. The geometry is
the records': the layers from the smallest to the largest ``layer`` of any record, ``k`` the length
of ``experts`` (the same in every record), experts per layer the largest id plus one unless given.
A (token, layer) without a record is replayed without that layer (one :class:`TraceWarning` gives
the count); a duplicate (seq, token, layer), every malformed record and a layer or expert id past
the C library's limits are a ``ValueError`` naming the file and line (or record, in an .npz).
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
import warnings
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Optional

import numpy as np

from .._errors import stacklevel_outside
from .._lib import MAX_EXPERTS_LIMIT, MAX_LAYERS_LIMIT
from .trace import MISSING, PathLike, Trace, TraceWarning

__all__ = ["FORMATS", "trace_format", "is_generic_path", "read_trace", "write_trace", "TraceWriter"]

#: The formats by name, each the file-name ending that chooses it (``.gz`` may follow any).
FORMATS = {"jsonl": ".jsonl", "csv": ".csv", "npz": ".npz"}
#: The record's fields: required, then optional.
_REQUIRED = ("token", "layer", "experts")
_OPTIONAL = ("seq", "weights")
_FIELDS = _REQUIRED + _OPTIONAL
#: token and seq are stored as int64.
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1


def trace_format(path: PathLike) -> tuple[str, bool]:
    """``(format, gzipped)`` of a generic trace file, by the end of its name: ``.jsonl``, ``.csv``
    or ``.npz``, each optionally followed by ``.gz``.

    Raises:
        ValueError: any other name, naming the endings read.
    """
    name = Path(path).name.lower()
    gz = name.endswith(".gz")
    base = name[:-3] if gz else name
    for fmt, suffix in FORMATS.items():
        if base.endswith(suffix):
            return fmt, gz
    endings = ", ".join(f"*{s}" for s in FORMATS.values())
    raise ValueError(
        f"{path}: not a routing-trace file name: the format is chosen by the ending, one of {endings}, "
        "each optionally followed by .gz (docs/traces.md)"
    )


def is_generic_path(name: PathLike) -> bool:
    """Whether ``name`` ends like a generic trace file (a bundled ``*.route.csv`` does not)."""
    text = str(name).lower()
    text = text[:-3] if text.endswith(".gz") else text
    return text.endswith(tuple(FORMATS.values())) and not text.endswith(".route.csv")


# -- reading ---------------------------------------------------------------------------------


class _Columns:
    """The records of a file as columns, with where each came from (for messages)."""

    def __init__(self, path: Path, unit: str):
        self.path = path
        self.unit = unit  # "line" (text formats, 1-based) or "record" (npz, 0-based)
        self.seq: list[int] = []
        self.token: list[int] = []
        self.layer: list[int] = []
        self.experts: list[list[int]] = []
        self.weights: list[Optional[list[float]]] = []
        self.where: list[int] = []
        self.has_seq: Optional[bool] = None

    def at(self, where: int) -> str:
        return f"{self.path}:{where}" if self.unit == "line" else f"{self.path}: record {where}"

    def fail(self, where: int, what: str):
        raise ValueError(f"{self.at(where)}: {what}")

    def add(self, where: int, seq, token, layer, experts, weights) -> None:
        """One record, its values already of the right Python types; the checks every format shares."""
        if token < 0 or layer < 0:
            self.fail(where, f"token and layer must be >= 0, got token {token}, layer {layer}")
        # Checked here, record by record, before any array is made: the trace is dense over the
        # layers, so a stray layer of 10^9 would otherwise become tokens x 10^9 x k cells.
        if token > _I64_MAX:
            self.fail(where, f"token {token} is too large: at most 2^63 - 1")
        if layer >= MAX_LAYERS_LIMIT:
            self.fail(
                where,
                f"layer {layer} is past the library's limit: a cache has at most {MAX_LAYERS_LIMIT} "
                f"layers (0..{MAX_LAYERS_LIMIT - 1})",
            )
        if seq is not None and not _I64_MIN <= seq <= _I64_MAX:
            self.fail(where, f"seq {seq} is outside [-2^63, 2^63 - 1]")
        if not experts:
            self.fail(where, "experts is empty: a record lists the k experts the router chose")
        if min(experts) < 0:
            self.fail(where, f"expert ids must be >= 0, got {experts}")
        if max(experts) >= MAX_EXPERTS_LIMIT:
            self.fail(
                where,
                f"expert id {max(experts)} is past the library's limit: a layer has at most "
                f"{MAX_EXPERTS_LIMIT} experts (ids 0..{MAX_EXPERTS_LIMIT - 1})",
            )
        if self.experts and len(experts) != len(self.experts[0]):
            self.fail(
                where,
                f"{len(experts)} experts where the first record ({self.at(self.where[0])}) has "
                f"{len(self.experts[0])}: every record has the same k",
            )
        if weights is not None and len(weights) != len(experts):
            self.fail(where, f"{len(weights)} weights for {len(experts)} experts")
        if weights is not None and not all(math.isfinite(w) for w in weights):
            self.fail(where, f"weights must be finite numbers, got {weights}")
        if self.weights and (weights is None) != (self.weights[0] is None):
            self.fail(
                where,
                f"{'no ' if weights is None else ''}weights where the first record "
                f"({self.at(self.where[0])}) has {'none' if self.weights[0] is None else 'them'}: "
                "weights are in every record or in none",
            )
        if self.has_seq is None:
            self.has_seq = seq is not None
        elif self.has_seq != (seq is not None):
            self.fail(
                where,
                f"{'no ' if seq is None else ''}seq where the first record ({self.at(self.where[0])}) "
                f"has {'none' if not self.has_seq else 'one'}: seq is in every record or in none",
            )
        self.seq.append(0 if seq is None else seq)
        self.token.append(token)
        self.layer.append(layer)
        self.experts.append(experts)
        self.weights.append(weights)
        self.where.append(where)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _open_text(path: Path, gz: bool):
    # utf-8-sig: UTF-8 that may start with a byte-order mark (Notepad, Excel's "CSV UTF-8").
    if gz:
        return gzip.open(path, "rt", encoding="utf-8-sig", newline="")
    return open(path, encoding="utf-8-sig", newline="")


def _read_jsonl(cols: _Columns, fh) -> None:
    for number, line in enumerate(fh, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            cols.fail(number, f"not a JSON object ({exc.msg} at column {exc.colno})")
        except ValueError as exc:  # an integer of more digits than sys.get_int_max_str_digits()
            cols.fail(number, f"a number too long to read ({exc})")
        except RecursionError:
            cols.fail(number, "not a JSON object (nested too deeply to read)")
        if not isinstance(record, dict):
            cols.fail(number, f"a record is a JSON object, got {type(record).__name__}")
        unknown = [key for key in record if key not in _FIELDS]
        if unknown:
            cols.fail(
                number,
                f"unknown key {unknown[0]!r}: a record has {', '.join(_REQUIRED)} and optionally "
                f"{', '.join(_OPTIONAL)}",
            )
        missing = [key for key in _REQUIRED if key not in record]
        if missing:
            cols.fail(number, f"no {missing[0]!r}: a record has {', '.join(_REQUIRED)}")
        for key in ("token", "layer", "seq"):
            if key in record and not _is_int(record[key]):
                cols.fail(number, f"{key} must be an integer, got {record[key]!r}")
        experts, weights = record["experts"], record.get("weights")
        if not isinstance(experts, list) or not all(_is_int(e) for e in experts):
            cols.fail(number, f"experts must be a list of integers, got {experts!r}")
        if weights is not None and (not isinstance(weights, list) or not all(_is_number(w) for w in weights)):
            cols.fail(number, f"weights must be a list of numbers, got {weights!r}")
        cols.add(
            number,
            record.get("seq"),
            record["token"],
            record["layer"],
            experts,
            None if weights is None else [float(w) for w in weights],
        )


def _ints(cols: _Columns, where: int, key: str, text: str) -> list[int]:
    try:
        return [int(t) for t in text.split()]
    except ValueError:
        cols.fail(where, f"{key} must be integers separated by spaces, got {text!r}")


def _read_csv(cols: _Columns, fh) -> None:
    reader = csv.reader(fh)
    try:
        header = next(reader)
    except StopIteration:
        raise ValueError(f"{cols.path}: empty file (no header)") from None
    header = [h.strip() for h in header]
    if header[:3] == ["pos", "layer", "n"]:
        raise ValueError(
            f"{cols.path}: this is the bundled route-CSV format (pos,layer,n,e0..): name the file "
            "*.route.csv to read it as one"
        )
    bad = [h for h in header if h not in _FIELDS]
    if bad or any(h not in header for h in _REQUIRED) or len(set(header)) != len(header):
        raise ValueError(
            f"{cols.path}:1: header {','.join(header)}; expected the columns token,layer,experts and "
            "optionally seq and weights, each once, in any order"
        )
    index = {h: i for i, h in enumerate(header)}
    for fields in reader:
        number = reader.line_num
        if not fields:
            continue
        if len(fields) != len(header):
            cols.fail(number, f"{len(fields)} columns, the header has {len(header)}")
        values = {h: fields[i].strip() for h, i in index.items()}
        scalars = {}
        for key in ("token", "layer", "seq"):
            if key in values:
                try:
                    scalars[key] = int(values[key])
                except ValueError:
                    cols.fail(number, f"{key} must be an integer, got {values[key]!r}")
        experts = _ints(cols, number, "experts", values["experts"])
        weights = None
        if "weights" in values:
            try:
                weights = [float(t) for t in values["weights"].split()]
            except ValueError:
                cols.fail(number, f"weights must be numbers separated by spaces, got {values['weights']!r}")
        cols.add(number, scalars.get("seq"), scalars["token"], scalars["layer"], experts, weights)


def _read_npz(cols: _Columns, path: Path, gz: bool) -> None:
    try:
        data = gzip.decompress(path.read_bytes()) if gz else path.read_bytes()
        arrays = np.load(io.BytesIO(data), allow_pickle=False)
    except (OSError, ValueError, EOFError, zlib.error) as exc:
        raise ValueError(f"{path}: not a readable .npz file ({' '.join(str(exc).split())})") from None
    with arrays:
        names = set(arrays.files)
        bad = sorted(names - set(_FIELDS))
        missing = [key for key in _REQUIRED if key not in names]
        if bad or missing:
            raise ValueError(
                f"{path}: arrays {', '.join(sorted(names))}; expected token, layer, experts and "
                "optionally seq and weights"
            )
        got = {key: arrays[key] for key in names}
    n = len(got["token"])
    shapes = {"token": (n,), "layer": (n,), "seq": (n,)}
    for key, arr in got.items():
        kind = "f" if key == "weights" else "iu"
        if arr.dtype.kind not in kind and not (key == "weights" and arr.dtype.kind in "iu"):
            raise ValueError(
                f"{path}: array {key} must hold {'numbers' if key == 'weights' else 'integers'}, got dtype {arr.dtype}"
            )
        want = shapes.get(key)
        if want is not None and arr.shape != want:
            raise ValueError(f"{path}: array {key} has shape {arr.shape}, expected ({n},) like token")
        if key in ("experts", "weights") and (arr.ndim != 2 or arr.shape[0] != n):
            raise ValueError(f"{path}: array {key} has shape {arr.shape}, expected ({n}, k)")
    if "weights" in got and got["weights"].shape != got["experts"].shape:
        raise ValueError(f"{path}: weights has shape {got['weights'].shape}, experts {got['experts'].shape}")
    token, layer, experts = got["token"].tolist(), got["layer"].tolist(), got["experts"].tolist()
    seq = got["seq"].tolist() if "seq" in got else [None] * n
    weights = got["weights"].astype(float).tolist() if "weights" in got else [None] * n
    for i in range(n):
        cols.add(i, seq[i], token[i], layer[i], experts[i], weights[i])


def _assemble(cols: _Columns, name: str, num_experts: Optional[int]) -> Trace:
    """The Trace of the records: tokens ordered by (sequence's first appearance, token), layers
    from the smallest to the largest, -1 rows where a (token, layer) has no record."""
    path = cols.path
    if not cols.token:
        raise ValueError(f"{path}: no records")
    first_seen: dict[int, int] = {}
    for s in cols.seq:
        first_seen.setdefault(s, len(first_seen))
    rank = np.array([first_seen[s] for s in cols.seq], dtype=np.int64)
    token = np.array(cols.token, dtype=np.int64)
    layer = np.array(cols.layer, dtype=np.int64)
    experts = np.array(cols.experts, dtype=np.int64)
    keys = np.stack([rank, token], axis=1)
    tokens, tok_index = np.unique(keys, axis=0, return_inverse=True)  # sorted by (rank, token)
    tok_index = tok_index.reshape(-1)
    first_layer, last_layer = int(layer.min()), int(layer.max())
    num_layers = last_layer - first_layer + 1
    top = int(experts.max())
    if num_experts is None:
        num_experts = top + 1
    elif top >= num_experts:
        bad = int(np.flatnonzero((experts >= num_experts).any(axis=1))[0])
        cols.fail(cols.where[bad], f"expert id {int(experts[bad].max())} outside [0, {num_experts})")
    cell = tok_index * num_layers + (layer - first_layer)
    order = np.argsort(cell, kind="stable")
    dup = np.flatnonzero(cell[order][1:] == cell[order][:-1])
    if dup.size:
        a, b = int(order[dup[0]]), int(order[dup[0] + 1])
        seq = f"seq {cols.seq[b]}, " if cols.has_seq else ""
        cols.fail(
            cols.where[b],
            f"duplicate record (({seq}token {cols.token[b]}, layer {cols.layer[b]}) is also at "
            f"{'line' if cols.unit == 'line' else 'record'} {cols.where[a]})",
        )
    k = experts.shape[1]
    ids = np.full((len(tokens), num_layers, k), MISSING, dtype=np.int32)
    ids.reshape(-1, k)[cell] = experts
    weights = None
    if cols.weights[0] is not None:
        weights = np.full(ids.shape, np.nan, dtype=np.float32)
        weights.reshape(-1, k)[cell] = np.array(cols.weights, dtype=np.float32)
    sequences = None
    if cols.has_seq:
        by_rank = {r: s for s, r in first_seen.items()}
        sequences = np.array([by_rank[int(r)] for r in tokens[:, 0]], dtype=np.int64)
    trace = Trace(name, ids, weights, first_layer, tokens[:, 1].copy(), num_experts, sequences=sequences)
    _notice_missing(path, trace)
    return trace


def _notice_missing(path: Path, trace: Trace) -> None:
    """The one TraceWarning of a trace with (token, layer) records missing, with the count."""
    missing = trace.missing_records
    if not missing:
        return
    present = trace.present
    routed = present.any(axis=0)
    t, i = (int(v[0]) for v in np.nonzero(~present & routed[None, :]))
    seq = f"seq {int(trace.sequences[t])}, " if trace.sequences is not None else ""
    total = trace.num_tokens * int(routed.sum())
    warnings.warn(
        f"{path}: {missing} of {total} (token, layer) records are missing (the first: {seq}token "
        f"{int(trace.positions[t])}, layer {trace.first_layer + i}); those tokens are replayed with the layers "
        "they have",
        TraceWarning,
        stacklevel=stacklevel_outside(__name__),
    )


def read_trace(path: PathLike, *, num_experts: Optional[int] = None, name: Optional[str] = None) -> Trace:
    """Read a generic routing trace (JSON lines, CSV or .npz, each optionally ``.gz``; the format by
    the file name's ending, :func:`trace_format`).

    Args:
        path: the file.
        num_experts: experts per layer (every id must be below it); default: the largest id plus one.
        name: the trace's label (default: the file name without its format endings).

    Returns:
        A :class:`Trace` over the layers from the records' smallest to their largest ``layer``;
        ``positions`` are the records' ``token`` numbers, ``sequences`` their ``seq`` (None without
        it), ``weights`` theirs (None without them). A (token, layer) without a record is a row of
        :data:`~pyexpcache.routing.MISSING` (-1): the replays skip it. When some token lacks a layer
        that others have, one :class:`TraceWarning` gives the count and the first one.

    A text file may start with a UTF-8 byte-order mark.

    Raises:
        ValueError: an unknown file-name ending; ``num_experts`` outside 1..65536 (the library's
            ``EXPCACHE_MAX_EXPERTS_LIMIT``); one line naming the file and line (the record, in an
            .npz) for a malformed record (not JSON, a field missing or of the wrong type, an
            unknown field, negative numbers, a different k or weights in some records only, an
            expert id of ``num_experts`` or more), a number past a limit (a layer of 4096 or more,
            ``EXPCACHE_MAX_LAYERS_LIMIT``, refused before the layers' array is made; an expert id
            of 65536 or more; a token or seq outside int64), a duplicate (seq, token, layer), an
            empty file, a CSV header other than the format's, undecodable gzip or UTF-8 data.
        IsADirectoryError: ``path`` is a directory.
        FileNotFoundError: no such file.
    """
    path = Path(path)
    fmt, gz = trace_format(path)
    if num_experts is not None and not 1 <= num_experts <= MAX_EXPERTS_LIMIT:
        raise ValueError(f"num_experts must be in 1..{MAX_EXPERTS_LIMIT} (the library's limit), got {num_experts}")
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory; expected a routing-trace file (docs/traces.md)")
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    if name is None:
        name = path.name[:-3] if path.name.lower().endswith(".gz") else path.name
        name = name[: -len(FORMATS[fmt])]
    cols = _Columns(path, "record" if fmt == "npz" else "line")
    if fmt == "npz":
        _read_npz(cols, path, gz)
    else:
        try:
            with _open_text(path, gz) as fh:
                (_read_jsonl if fmt == "jsonl" else _read_csv)(cols, fh)
        except UnicodeDecodeError as exc:
            hint = "" if gz else "; is it gzip data without .gz in its name?"
            raise ValueError(f"{path}: not UTF-8 text ({exc.reason}){hint}") from None
        except csv.Error as exc:
            raise ValueError(f"{path}: not CSV ({' '.join(str(exc).split())})") from None
        except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
            raise ValueError(f"{path}: not a readable gzip file ({' '.join(str(exc).split())})") from None
    return _assemble(cols, name, num_experts)


# -- writing ---------------------------------------------------------------------------------


class TraceWriter:
    """Writes a generic routing trace record by record (``with TraceWriter(path) as w:``); the format
    by the file name's ending (:func:`trace_format`). JSON lines and CSV are written as records come
    (flushed after each :meth:`write_token`); an .npz is written when the writer closes.

    Every record gets the same fields: weights in all or in none, seq in all or in none (the first
    record decides), and the same number of experts; a record that breaks this, or with a negative
    number, raises ValueError before anything of it is written.
    """

    def __init__(self, path: PathLike):
        self.path = Path(path)
        self.format, self.gzipped = trace_format(self.path)
        self._columns: Optional[dict] = None  # the fields the first record fixed, and an npz's buffers
        self._k: Optional[int] = None
        self._file = None
        self._csv = None
        self._closed = False
        self.records = 0
        if self.format != "npz":
            self._file = (
                gzip.open(self.path, "wt", encoding="utf-8", newline="")
                if self.gzipped
                else open(self.path, "w", encoding="utf-8", newline="")
            )

    def write(
        self,
        token: int,
        layer: int,
        experts: Sequence[int],
        *,
        weights: Optional[Sequence[float]] = None,
        seq: Optional[int] = None,
    ) -> None:
        """One record: the ``experts`` the router chose for ``token`` at ``layer`` (and their gate
        ``weights``; ``seq``: the token's sequence)."""
        if self._closed:
            raise ValueError(f"{self.path}: the writer is closed")
        token, layer = int(token), int(layer)
        experts = [int(e) for e in experts]
        if token < 0 or layer < 0 or not experts or min(experts) < 0:
            raise ValueError(
                f"a record has token and layer >= 0 and k >= 1 experts >= 0, got token {token}, "
                f"layer {layer}, experts {experts}"
            )
        if self._k is None:
            self._k = len(experts)
            self._columns = {"seq": seq is not None, "weights": weights is not None}
            if self.format == "csv":
                self._csv = csv.writer(self._file, lineterminator="\n")
                self._csv.writerow(
                    [c for c in ("seq",) if self._columns["seq"]]
                    + list(_REQUIRED)
                    + [c for c in ("weights",) if self._columns["weights"]]
                )
            if self.format == "npz":
                self._buffers = {key: [] for key in _FIELDS}
        if len(experts) != self._k:
            raise ValueError(f"{len(experts)} experts where the first record has {self._k}")
        if (seq is not None) != self._columns["seq"] or (weights is not None) != self._columns["weights"]:
            raise ValueError(
                "every record has the same fields as the first: seq in all or none, weights in all or none"
            )
        if weights is not None:
            weights = [float(w) for w in weights]
            if len(weights) != len(experts):
                raise ValueError(f"{len(weights)} weights for {len(experts)} experts")
        if self.format == "jsonl":
            record = {"seq": int(seq)} if seq is not None else {}
            record.update(token=token, layer=layer, experts=experts)
            if weights is not None:
                record["weights"] = weights
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        elif self.format == "csv":
            row = [int(seq)] if seq is not None else []
            row += [token, layer, " ".join(map(str, experts))]
            if weights is not None:
                row.append(" ".join(repr(w) for w in weights))
            self._csv.writerow(row)
        else:
            for key, value in (
                ("seq", seq),
                ("token", token),
                ("layer", layer),
                ("experts", experts),
                ("weights", weights),
            ):
                self._buffers[key].append(value)
        self.records += 1

    def write_token(
        self,
        token: int,
        experts: Mapping[int, Sequence[int]],
        *,
        weights: Optional[Mapping[int, Sequence[float]]] = None,
        seq: Optional[int] = None,
    ) -> None:
        """A token's records: ``experts[layer]`` for each of its layers, in increasing layer (and
        ``weights[layer]``), then a flush."""
        for layer in sorted(experts):
            self.write(token, layer, experts[layer], weights=None if weights is None else weights[layer], seq=seq)
        self.flush()

    def flush(self) -> None:
        """What was written so far onto the file (JSON lines and CSV; an .npz waits for close)."""
        if self._file is not None:
            self._file.flush()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Finish the file (an .npz is written now). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.format == "npz":
            if self._k is None:
                raise ValueError(f"{self.path}: no records written: an .npz trace needs at least one")
            b = self._buffers
            arrays = {
                "token": np.array(b["token"], dtype=np.int64),
                "layer": np.array(b["layer"], dtype=np.int64),
                "experts": np.array(b["experts"], dtype=np.int64),
            }
            if self._columns["seq"]:
                arrays["seq"] = np.array(b["seq"], dtype=np.int64)
            if self._columns["weights"]:
                arrays["weights"] = np.array(b["weights"], dtype=np.float32)
            buf = io.BytesIO()
            np.savez_compressed(buf, **arrays)
            data = buf.getvalue()
            self.path.write_bytes(gzip.compress(data) if self.gzipped else data)
        else:
            self._file.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_trace(path: PathLike, trace: Trace) -> int:
    """Write ``trace`` as a generic routing trace (the format by ``path``'s ending): a record per
    (token, layer) it has, token-major; ``token`` is its position, ``seq`` its sequence (when the
    trace has sequences), ``weights`` its gate weights (when it has them). Returns the records
    written. :func:`read_trace` gives back the same ids, weights, positions and sequences, over
    the layers that have records."""
    present = trace.present
    ids = trace.ids.tolist()
    weights = trace.weights.tolist() if trace.weights is not None else None
    with TraceWriter(path) as writer:
        for t in range(trace.num_tokens):
            seq = int(trace.sequences[t]) if trace.sequences is not None else None
            for i in np.flatnonzero(present[t]).tolist():
                writer.write(
                    int(trace.positions[t]),
                    trace.first_layer + i,
                    ids[t][i],
                    weights=None if weights is None else weights[t][i],
                    seq=seq,
                )
        return writer.records
