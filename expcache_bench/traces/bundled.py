"""The bundled DeepSeek-V4-Flash traces and the route-CSV format: finding, reading and
validating trace files (plain or gzip) into :class:`~pyexpcache.routing.Trace` and
:class:`~expcache_bench.traces.PrefillPrompt`."""

from __future__ import annotations

import csv
import gzip
import os
import warnings
import zlib
from pathlib import Path
from typing import NamedTuple

import numpy as np

from pyexpcache._errors import stacklevel_outside
from pyexpcache.routing import PathLike, Trace, TraceWarning

from .types import DECODE_FIRST_LAYER, DECODE_NUM_LAYERS, NUM_EXPERTS, PREFILL_NUM_LAYERS, PrefillPrompt, TraceInfo

#: Folder holding the bundled DeepSeek-V4-Flash traces (``decode/``, ``prefill/``).
TRACE_DIR: Path = Path(__file__).resolve().parent.parent / "data" / "traces" / "ds4-flash-reap-loop"

_SUFFIX = ".route.csv"
_KINDS = ("decode", "prefill")
_GZIP_MAGIC = b"\x1f\x8b"
# Leading bytes of other compressors, to name them when such a file is passed.
_OTHER_MAGIC = {b"\x28\xb5\x2f\xfd": "zstd", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"PK\x03\x04": "zip"}


def list_traces() -> list[TraceInfo]:
    """Bundled traces, sorted by kind (decode first) then name.

    Returns:
        ``TraceInfo(name, kind, path)`` for every ``*.route.csv`` in
        ``TRACE_DIR/decode`` and ``TRACE_DIR/prefill``; ``name`` is the file name
        without ``.route.csv`` (e.g. ``"podA_a_coffee_full"``).
    """
    out = []
    for kind in _KINDS:
        folder = TRACE_DIR / kind
        for path in sorted(folder.glob("*" + _SUFFIX)):
            out.append(TraceInfo(path.name[: -len(_SUFFIX)], kind, path))
    return out


def _is_path_name(name: str) -> bool:
    """Whether a str argument is a file path rather than a bundled trace name."""
    seps = [s for s in (os.sep, os.altsep, "/") if s]
    return any(s in name for s in seps) or name.endswith((".csv", ".gz"))


def _resolve(name_or_path: PathLike, kind: str | None) -> tuple[Path, str | None]:
    """Map a bundled trace name or a file path to ``(path, kind)``; kind may be None for a path.

    A str is a path when it contains a path separator or ends in ``.csv`` or
    ``.gz`` (``x.route.csv.gz``); any other str is a bundled name.

    Raises:
        FileNotFoundError: unknown bundled name or missing file.
    """
    if isinstance(name_or_path, str) and not _is_path_name(name_or_path):
        for info in list_traces():
            if info.name == name_or_path and (kind is None or info.kind == kind):
                return info.path, info.kind
        wanted = [i.name for i in list_traces() if kind is None or i.kind == kind]
        raise FileNotFoundError(f"no bundled {kind or ''} trace named {name_or_path!r}; available: {', '.join(wanted)}")
    path = Path(name_or_path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    guessed = path.parent.name if path.parent.name in _KINDS else None
    return path, kind or guessed


def is_route_csv(path: PathLike) -> bool:
    """Whether the file at ``path`` (plain or gzip) starts with a route CSV's header (``pos,layer,n,``):
    how a ``*.csv`` path not named ``*.route.csv`` is told from a generic trace's CSV. False for
    anything unreadable (its reader says why)."""
    try:
        fh, _ = _open_text(Path(path))
        with fh:
            first = fh.readline(256)
    except (OSError, UnicodeDecodeError, EOFError, zlib.error):
        return False
    return first.replace(" ", "").startswith("pos,layer,n,")


def _stem(path: Path) -> str:
    """Trace name of a file: its name without ``.gz`` and then ``.route.csv`` (or the last suffix)."""
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    return name[: -len(_SUFFIX)] if name.endswith(_SUFFIX) else Path(name).stem


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


class _Row(NamedTuple):
    line: int  # 1-based line number in the file, for error messages
    pos: int
    layer: int
    ids: list
    weights: list | None


class _Cut(NamedTuple):
    line: int  # first truncated line
    columns: int  # its columns
    of: int  # columns of the header
    more: int  # further truncated lines after it

    def __str__(self) -> str:
        text = f"line {self.line} is cut short ({self.columns} of {self.of} columns)"
        if self.more:
            text += f" and {self.more} more incomplete line{'s follow' if self.more > 1 else ' follows'} it"
        return text


class _Rows(NamedTuple):
    k: int
    has_weights: bool
    rows: list[_Row]
    cut: _Cut | None  # truncated line(s) dropped at the end of the file


def _open_text(path: Path):
    """Open a route CSV as UTF-8 text, through gzip when the name ends in ``.gz`` or the
    content starts with the gzip magic bytes.  Returns ``(text file, first bytes of the file)``."""
    with open(path, "rb") as raw:
        magic = raw.read(8)
    if path.name.endswith(".gz") or magic.startswith(_GZIP_MAGIC):
        return gzip.open(path, "rt", encoding="utf-8", newline=""), magic
    return open(path, encoding="utf-8", newline=""), magic


def _read_rows(path: Path, num_experts: int) -> _Rows:
    """Parse and validate a route CSV, plain or gzip-compressed.

    A row with missing or empty columns is tolerated only at the end of the file
    (an interrupted logger leaves a truncated last line, e.g. ``143,`` upstream's
    oracle50_k0w ended with) and dropped there (``cut`` says which); anywhere else it is an
    error, because silently dropping it would shift the token/layer structure.

    Raises:
        ValueError: one line naming the file: not UTF-8 text, not CSV (a NUL
            byte), corrupt or truncated gzip data, an empty file, an unexpected
            header, or a malformed row (naming the line too).
    """
    fh, magic = _open_text(path)
    reader = csv.reader(fh)
    try:
        with fh:
            return _parse_rows(path, reader, num_experts)
    except UnicodeDecodeError as exc:
        byte = exc.object[exc.start : exc.start + 1].hex()
        other = next((name for m, name in _OTHER_MAGIC.items() if magic.startswith(m)), None)
        hint = f"; the file looks like {other} data, and only gzip is read" if other else ""
        raise ValueError(
            f"{path}: not a UTF-8 CSV route trace (byte 0x{byte} is not UTF-8: {exc.reason}{hint})"
        ) from None
    except csv.Error as exc:
        raise ValueError(f"{path}, line {reader.line_num}: not a UTF-8 CSV route trace ({_one_line(exc)})") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise ValueError(f"{path}: not a readable gzip file ({_one_line(exc)})") from None


def _parse_rows(path: Path, reader, num_experts: int) -> _Rows:
    """The work of :func:`_read_rows` on an open ``csv.reader``; decoding errors propagate to it."""
    try:
        header = next(reader)
    except StopIteration:
        raise ValueError(f"{path}: empty file (no header)") from None
    if any("\0" in h for h in header):
        raise ValueError(f"{path}, line {reader.line_num}: not a UTF-8 CSV route trace (line contains NUL)")
    header = [h.strip() for h in header]
    k = sum(1 for h in header if h.startswith("e"))
    expected = ["pos", "layer", "n"] + [f"e{j}" for j in range(k)]
    has_weights = len(header) == 3 + 2 * k
    if has_weights:
        expected += [f"w{j}" for j in range(k)]
    if k == 0 or header != expected:
        raise ValueError(f"{path}: unexpected header {header}; expected pos,layer,n,e0..e(k-1)[,w0..w(k-1)]")
    ncol = len(header)
    rows: list[_Row] = []
    first_incomplete = None  # (line, ncols) of the first truncated row seen
    incomplete = 0  # truncated rows seen (all at the end unless an error follows)
    for fields in reader:
        line = reader.line_num
        if not fields:  # blank line
            continue
        if any("\0" in f for f in fields):
            # csv.Error on Python < 3.11; newer csv modules pass NUL through.
            raise ValueError(f"{path}, line {line}: not a UTF-8 CSV route trace (line contains NUL)")
        if len(fields) > ncol:
            raise ValueError(f"{path}, line {line}: {len(fields)} columns, header has {ncol}")
        if len(fields) < ncol or any(f.strip() == "" for f in fields):
            if first_incomplete is None:
                first_incomplete = (line, len(fields))
            incomplete += 1
            continue
        if first_incomplete is not None:
            bad_line, got = first_incomplete
            raise ValueError(
                f"{path}, line {bad_line}: incomplete row ({got} of {ncol} columns) followed by "
                f"complete rows; only a truncated final line is tolerated"
            )
        try:
            ints = [int(f) for f in fields[: 3 + k]]
        except ValueError:
            raise ValueError(
                f"{path}, line {line}: pos/layer/n/expert ids must be integers, got {fields[: 3 + k]}"
            ) from None
        pos, layer, n = ints[:3]
        ids = ints[3:]
        if n != k:
            raise ValueError(f"{path}, line {line}: n={n} but the file has {k} expert-id columns")
        for e in ids:
            if not 0 <= e < num_experts:
                raise ValueError(f"{path}, line {line}: expert id {e} outside [0, {num_experts})")
        weights = None
        if has_weights:
            try:
                weights = [float(f) for f in fields[3 + k :]]
            except ValueError:
                raise ValueError(f"{path}, line {line}: non-numeric gate weight in {fields[3 + k :]}") from None
        rows.append(_Row(line, pos, layer, ids, weights))
    cut = None if first_incomplete is None else _Cut(*first_incomplete, ncol, incomplete - 1)
    return _Rows(k, has_weights, rows, cut)


def _assemble_tokens(
    rows: list[_Row], path: Path, first_layer: int, num_layers: int, allow_truncated_tail: bool
) -> tuple[list[list[_Row]], list[_Row]]:
    """Group token-major rows into complete tokens of ``num_layers`` consecutive layers.

    Returns ``(tokens, tail)`` where ``tail`` holds the rows of a trailing
    incomplete token (only when ``allow_truncated_tail``; otherwise it is an
    error), empty when the last token is complete.
    """
    tokens: list[list[_Row]] = []
    cur: list[_Row] = []

    def close(token: list[_Row], at_end: bool) -> bool:
        if len(token) == num_layers:
            tokens.append(token)
            return True
        if at_end and allow_truncated_tail:
            return False
        last = token[-1]
        raise ValueError(
            f"{path}, line {last.line}: token at pos {last.pos} ends at layer {last.layer}; "
            f"layers {last.layer + 1}..{first_layer + num_layers - 1} are missing"
        )

    for row in rows:
        if cur and row.pos != cur[0].pos:
            close(cur, at_end=False)
            if row.pos <= cur[0].pos:
                raise ValueError(
                    f"{path}, line {row.line}: token positions must increase, pos {row.pos} follows {cur[0].pos}"
                )
            cur = []
        want = first_layer + len(cur)
        if len(cur) == num_layers:
            raise ValueError(
                f"{path}, line {row.line}: token at pos {row.pos} has more than {num_layers} layer rows "
                f"(layer {row.layer} after layer {want - 1})"
            )
        if row.layer != want:
            raise ValueError(
                f"{path}, line {row.line}: token at pos {row.pos} has layer {row.layer} where layer {want} "
                f"was expected (a layer is missing or out of order)"
            )
        cur.append(row)
    if cur and not close(cur, at_end=True):
        return tokens, cur
    return tokens, []


def _layers_of(tail: list[_Row], first_layer: int, num_layers: int) -> str:
    """``"layers 3..37 of 3..42"`` for the rows of an incomplete token."""
    return f"layers {tail[0].layer}..{tail[-1].layer} of {first_layer}..{first_layer + num_layers - 1}"


def _no_complete_token(path: Path, tail: list[_Row], cut: _Cut | None, first_layer: int, num_layers: int) -> str:
    """Message of the ValueError for a file whose rows make up no complete token."""
    if tail:
        why = f"the only token, at pos {tail[0].pos}, has only {_layers_of(tail, first_layer, num_layers)}"
    elif cut:
        why = f"the only data line, line {cut.line}, is cut short ({cut.columns} of {cut.of} columns)"
    else:
        why = "the file has a header but no data rows"
    return f"{path}: no complete token ({why})"


def _warn_truncated_tail(
    path: Path, where: str, tail: list[_Row], cut: _Cut | None, kept: int, first_layer: int, num_layers: int
) -> None:
    """Issue the one :class:`TraceWarning` of a file load that dropped a trailing token or cut line."""
    if not tail and cut is None:
        return
    parts = []
    if tail:
        parts.append(
            f"pos {tail[0].pos} has only {_layers_of(tail, first_layer, num_layers)} "
            f"({len(tail)} rows from line {tail[0].line})"
        )
    if cut is not None:
        parts.append(str(cut))
    warnings.warn(
        f"{path}: the file ends inside a token{where}, which is dropped: {' and '.join(parts)}; "
        f"{kept} complete token{'s' if kept != 1 else ''} kept",
        TraceWarning,
        stacklevel=stacklevel_outside(__name__),
    )


def _tokens_to_trace(
    name: str, tokens: list[list[_Row]], k: int, first_layer: int, num_layers: int, has_weights: bool, num_experts: int
) -> Trace:
    ids = np.array([[r.ids for r in tok] for tok in tokens], dtype=np.int32).reshape(len(tokens), num_layers, k)
    weights = None
    if has_weights:
        weights = np.array([[r.weights for r in tok] for tok in tokens], dtype=np.float32)
        weights = weights.reshape(len(tokens), num_layers, k)
    positions = np.array([tok[0].pos for tok in tokens], dtype=np.int64)
    return Trace(name, ids, weights, first_layer, positions, num_experts)


def load_decode_trace(
    name_or_path: PathLike,
    *,
    num_experts: int = NUM_EXPERTS,
    first_layer: int = DECODE_FIRST_LAYER,
    num_layers: int = DECODE_NUM_LAYERS,
) -> Trace:
    """Load a token-major decode route CSV, plain or gzip-compressed (see :func:`load_trace`).

    Args:
        name_or_path: a bundled decode trace name (see :func:`list_traces`) or a file path.
        num_experts: ids must lie in ``[0, num_experts)``.
        first_layer, num_layers: every token must have exactly the rows for model
            layers ``first_layer .. first_layer + num_layers - 1``, in order.

    Returns:
        A :class:`Trace` with ``ids`` ``[tokens, num_layers, k]``, at least one token.
        A truncated last line and a trailing token with only a prefix of its
        layers are dropped (the logger was interrupted), with a :class:`TraceWarning`
        naming the file, the token's position and layers, and the cut line.

    Raises:
        ValueError: one line naming the file (and the line where there is one):
            not UTF-8 CSV text, corrupt gzip data, an empty file, no complete token
            (a header-only file), non-integer ids, ids out of range, ``n`` different
            from the number of id columns, a layer missing or out of order inside
            a token, non-increasing positions.
        FileNotFoundError: unknown name or missing file.
    """
    path, _ = _resolve(name_or_path, "decode" if isinstance(name_or_path, str) else None)
    k, has_weights, rows, cut = _read_rows(path, num_experts)
    tokens, tail = _assemble_tokens(rows, path, first_layer, num_layers, allow_truncated_tail=True)
    if not tokens:
        raise ValueError(_no_complete_token(path, tail, cut, first_layer, num_layers))
    _warn_truncated_tail(path, "", tail, cut, len(tokens), first_layer, num_layers)
    return _tokens_to_trace(_stem(path), tokens, k, first_layer, num_layers, has_weights, num_experts)


def load_prefill_trace(
    name_or_path: PathLike,
    *,
    num_experts: int = NUM_EXPERTS,
    num_prefill_layers: int = PREFILL_NUM_LAYERS,
    decode_first_layer: int = DECODE_FIRST_LAYER,
    decode_num_layers: int = DECODE_NUM_LAYERS,
) -> list[PrefillPrompt]:
    """Load a prefill route CSV: a sequence of prompts, each prefill + decode token(s).

    File layout per prompt: the prefill is layer-major (positions 0..P-1 of
    layer 0, then of layer 1, ... up to ``num_prefill_layers - 1``), followed by
    token-major decode rows (model layers ``decode_first_layer`` ..).  A new
    prompt starts at each row with ``layer == 0`` and ``pos == 0``.  The file
    may be gzip-compressed.

    Returns:
        One :class:`PrefillPrompt` per prompt, in file order, at least one.  Only
        the last prompt's decode part may be truncated: its incomplete token (and
        a cut last line) is dropped with a :class:`TraceWarning`.

    Raises:
        ValueError: malformed content, one line naming the file (and the line):
            see :func:`load_decode_trace`; a header-only file is "no complete token".
        FileNotFoundError: unknown name or missing file.
    """
    path, _ = _resolve(name_or_path, "prefill" if isinstance(name_or_path, str) else None)
    k, has_weights, rows, cut = _read_rows(path, num_experts)
    if not rows:
        raise ValueError(_no_complete_token(path, [], cut, decode_first_layer, decode_num_layers))
    if (rows[0].pos, rows[0].layer) != (0, 0):
        raise ValueError(f"{path}, line {rows[0].line}: a prefill file must start at pos 0, layer 0")
    starts = [i for i, r in enumerate(rows) if r.pos == 0 and r.layer == 0] + [len(rows)]
    stem = _stem(path)
    prompts = []
    tail: list[_Row] = []
    for index, (lo, hi) in enumerate(zip(starts[:-1], starts[1:])):
        seg = rows[lo:hi]
        # Prompt length = the run of layer-0 rows at the start of the segment.
        P = 0
        while P < len(seg) and seg[P].layer == 0:
            P += 1
        need = P * num_prefill_layers
        for j in range(need):
            want_layer, want_pos = divmod(j, P)
            if j >= len(seg):
                raise ValueError(
                    f"{path}: prompt {index} ends inside its prefill (layer {want_layer}, pos {want_pos} missing)"
                )
            r = seg[j]
            if (r.layer, r.pos) != (want_layer, want_pos):
                raise ValueError(
                    f"{path}, line {r.line}: prompt {index} prefill has (layer {r.layer}, pos {r.pos}) where "
                    f"(layer {want_layer}, pos {want_pos}) was expected"
                )
        pre = seg[:need]
        prefill = np.array([r.ids for r in pre], dtype=np.int32).reshape(num_prefill_layers, P, k)
        pre_w = None
        if has_weights:
            pre_w = np.array([r.weights for r in pre], dtype=np.float32).reshape(num_prefill_layers, P, k)
        tokens, tail = _assemble_tokens(
            seg[need:],
            path,
            decode_first_layer,
            decode_num_layers,
            allow_truncated_tail=(hi == len(rows)),
        )
        name = f"{stem}#{index}"
        decode = _tokens_to_trace(
            name + ":decode", tokens, k, decode_first_layer, decode_num_layers, has_weights, num_experts
        )
        prompts.append(PrefillPrompt(name, index, prefill, pre_w, np.arange(P, dtype=np.int64), decode))
    last = prompts[-1]
    _warn_truncated_tail(
        path,
        f" of prompt {last.index}'s decode part",
        tail,
        cut,
        last.decode.num_tokens,
        decode_first_layer,
        decode_num_layers,
    )
    return prompts


def load_trace(name_or_path: PathLike, kind: str | None = None, **kwargs) -> Trace | list[PrefillPrompt]:
    """Load a trace of either kind.

    ``kind`` is looked up for bundled names, guessed from the parent folder
    (``decode/`` or ``prefill/``) for paths, or given explicitly.  Returns a
    :class:`Trace` for decode files and a list of :class:`PrefillPrompt` for
    prefill files; ``kwargs`` go to the specific loader.

    A str argument is a path when it contains a path separator or ends in
    ``.csv`` or ``.gz``, otherwise a bundled name.  A file is read through gzip
    when its name ends in ``.gz`` or its content starts with the gzip magic bytes
    ``1f 8b``.  A file that ends inside a token loads without it and with a
    :class:`TraceWarning`.

    Raises:
        ValueError: an unknown ``kind``, a path of unknown kind, or malformed
            content (one line naming the file; see :func:`load_decode_trace`).
        FileNotFoundError: unknown name or missing file.
    """
    if kind is not None and kind not in _KINDS:
        raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
    path, kind = _resolve(name_or_path, kind)
    if kind is None:
        raise ValueError(f"cannot tell the kind of {path}; pass kind='decode' or kind='prefill'")
    loader = load_decode_trace if kind == "decode" else load_prefill_trace
    return loader(path, **kwargs)
