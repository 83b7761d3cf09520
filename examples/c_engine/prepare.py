#!/usr/bin/env python3
"""Write the example C engine's inputs (examples/c_engine/README.md) into a folder:

* ``model.gguf``: a GGUF file of DeepSeek V4 Flash's routed experts in the mixed q2/q4 layout
  (IQ2_XXS gate/up and Q2_K down, Q4_K in layers 37-42), the model layers ``--layers``, random
  bytes standing in for the quantized blocks. ``--scale`` divides every matrix's rows (the expert
  sizes of ``ModelLayout.preset("mixed", scale=...)``), for CI.
* ``model.gguf.sums``: what the engine checks the bytes it reads against, recorded as the bytes
  are made (nothing is read back): per (layer, expert, part) the sum of the part's little-endian
  32-bit words (the last one zero-padded), as uint64.
* ``routing.bin``: the router's stand-in, int32 ids: a prompt's prefill (the first
  ``--prompt-tokens`` tokens of a bundled prefill trace) and the decode tokens of bundled decode
  traces (``--trace``), each ``[tokens][layers][k]``. Decode traces hold layers 3-42; the
  hash-routed layers 0-2 get ids from a hash of the token's position (ds4 hashes the token id).

The free space is checked first; the model is written under a temporary name with a progress
line, flushed to the disk and dropped from the page cache as it goes (so the engine's first reads
come from the disk), then renamed.

File formats (little-endian):
    model.gguf.sums: b"ECSM", int32 version 1, layers L, experts E, int32 layer[L], uint64 [L][E][3]
    routing.bin:     b"ECRT", int32 version 1, layers L, k, prompt tokens P, decode tokens T,
                     experts E, int32 layer[L], int32 prompt[P][L][k], int32 decode[T][L][k]
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run from a checkout without an install
    sys.path.insert(0, str(REPO))

from pyexpcache.layout import ModelLayout  # noqa: E402
from pyexpcache.presets import FIRST_ROUTED_LAYER, MIXED_Q4_LAYERS, NUM_EXPERTS, NUM_LAYERS, TOP_K  # noqa: E402

GiB = 1 << 30
ARCH = "deepseek4-experts"
N_EMBD, N_FF = 4096, 2048  # gate/up [n_embd, n_ff], down [n_ff, n_embd] (GGUF order: fastest first)
QUANTS = {"q2": ("IQ2_XXS", "IQ2_XXS", "Q2_K"), "q4": ("Q4_K", "Q4_K", "Q4_K")}
PARTS = ("gate", "up", "down")
PIECE = 64 << 20  # bytes of experts made (and written) at a time
FLUSH = 256 << 20  # bytes written between a flush to the disk and a page-cache drop
SUMS_MAGIC, ROUTING_MAGIC, VERSION = b"ECSM", b"ECRT", 1


def parse_layers(text: str) -> list[int]:
    """'35-42' or '0-2,37' -> sorted model layers."""
    out = set()
    for item in text.split(","):
        lo, _, hi = item.strip().partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--layers: {item!r} is not a layer or a range a-b") from None
        if not 0 <= first <= last < NUM_LAYERS:
            raise argparse.ArgumentTypeError(f"--layers: {item!r} is outside 0-{NUM_LAYERS - 1}")
        out.update(range(first, last + 1))
    return sorted(out)


def layer_quant(layer: int) -> str:
    return "q4" if layer in MIXED_Q4_LAYERS else "q2"


def tensor_plan(layers: list[int], scale: int) -> list[dict]:
    """Each expert tensor: name, layer, part, ggml type, [experts, rows, row bytes], checked against
    the library's preset sizes (the one table of DeepSeek V4 Flash's expert bytes)."""
    import gguf

    preset = ModelLayout.preset("mixed", scale=scale)
    plan = []
    for layer in layers:
        for p, part in enumerate(PARTS):
            qtype = gguf.GGMLQuantizationType[QUANTS[layer_quant(layer)][p]]
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            row_weights, rows = (N_EMBD, N_FF) if part != "down" else (N_FF, N_EMBD)
            row_bytes = row_weights // block * type_size
            shape = (NUM_EXPERTS, rows // scale, row_bytes)
            assert shape[1] * row_bytes == preset[layer].class_key[p], (layer, part, shape)
            plan.append(dict(name=f"blk.{layer}.ffn_{part}_exps.weight", layer=layer, part=p, qtype=qtype, shape=shape))
    return plan


def make_piece(seed: int, t: dict, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Experts first..first+count-1 of tensor t: their bytes [count, part bytes] and word sums."""
    part_bytes = t["shape"][1] * t["shape"][2]
    rng = np.random.default_rng([seed, t["layer"], t["part"], first])
    words = rng.integers(0, 2**64 - 1, size=-(-count * part_bytes // 8), dtype=np.uint64, endpoint=True)
    data = words.view(np.uint8)[: count * part_bytes].reshape(count, part_bytes)
    return data, word_sums(data)


def word_sums(data: np.ndarray) -> np.ndarray:
    """Per row, the sum of its little-endian uint32 words (the last one zero-padded), as uint64."""
    pad = -data.shape[1] % 4
    if pad:
        data = np.concatenate([data, np.zeros((data.shape[0], pad), np.uint8)], axis=1)
    return data.view("<u4").sum(axis=1, dtype=np.uint64)


class Progress:
    """One line on stderr: bytes written, rate, time left (a line every 10 % when not a terminal)."""

    def __init__(self, label: str, total: int):
        self.label, self.total, self.start = label, total, time.monotonic()
        self.tty = sys.stderr.isatty()
        self.last, self.tenth = 0.0, -1

    def __call__(self, done: int) -> None:
        now = time.monotonic()
        tenth = 10 * done // max(self.total, 1)
        if self.tty and done < self.total and now - self.last < 0.25:
            return
        if not self.tty and tenth == self.tenth:
            return
        self.last, self.tenth = now, tenth
        rate = done / max(now - self.start, 1e-9)
        left = (self.total - done) / rate if rate > 0 else 0
        line = (
            f"{self.label}: {done / GiB:6.2f} / {self.total / GiB:.2f} GiB  {rate / 1e9:5.2f} GB/s"
            f"  {'done in' if done >= self.total else 'left'} {now - self.start if done >= self.total else left:5.0f} s"
        )
        sys.stderr.write(("\r" + line + ("\n" if done >= self.total else "")) if self.tty else line + "\n")
        sys.stderr.flush()


def write_model(path: Path, plan: list[dict], seed: int, alignment: int, threads: int) -> np.ndarray:
    """The GGUF at path (through path + '.partial'); returns the sums [layers, experts, 3]."""
    import gguf

    layers = sorted({t["layer"] for t in plan})
    sums = np.zeros((len(layers), NUM_EXPERTS, 3), np.uint64)
    w = gguf.GGUFWriter(None, ARCH)
    if alignment != gguf.GGUF_DEFAULT_ALIGNMENT:
        w.add_custom_alignment(alignment)
    w.add_block_count(NUM_LAYERS)
    w.add_expert_count(NUM_EXPERTS)
    w.add_expert_used_count(TOP_K)
    w.add_string(f"{ARCH}.description", "random bytes in DeepSeek V4 Flash's mixed q2/q4 expert layout")
    for t in plan:
        w.add_tensor_info(t["name"], t["shape"], np.dtype(np.uint8), int(np.prod(t["shape"])), raw_dtype=t["qtype"])
    partial = path.with_name(path.name + ".partial")
    total = sum(int(np.prod(t["shape"])) for t in plan)
    progress = Progress(f"writing {path.name}", total)
    try:
        w.write_header_to_file(partial)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        f = w.fout[0]
        f.write(b"\0" * (-f.tell() % alignment))
        offsets = {}
        pieces = []
        for t in plan:
            per = max(1, PIECE // (t["shape"][1] * t["shape"][2]))
            pieces += [(t, e, min(per, NUM_EXPERTS - e)) for e in range(0, NUM_EXPERTS, per)]
        done = flushed = 0
        fd = f.fileno()
        with ThreadPoolExecutor(threads) as pool:
            queue = collections.deque()
            todo = iter(pieces)
            for item in todo:  # keep threads * 2 pieces in the making, write them in order
                queue.append((item, pool.submit(make_piece, seed, *item)))
                if len(queue) < threads * 2:
                    continue
                done, flushed = _write_next(f, fd, queue, offsets, sums, layers, done, flushed, alignment, progress)
            while queue:
                done, flushed = _write_next(f, fd, queue, offsets, sums, layers, done, flushed, alignment, progress)
        f.flush()
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        w.close()
        _check_offsets(partial, plan, offsets)
        os.replace(partial, path)
    except BaseException:
        w.close()
        partial.unlink(missing_ok=True)
        raise
    return sums


def _write_next(f, fd, queue, offsets, sums, layers, done, flushed, alignment, progress):
    (t, first, count), future = queue.popleft()
    data, piece_sums = future.result()
    if first == 0:
        f.write(b"\0" * (-f.tell() % alignment))  # each tensor starts aligned (ggml pads the one before)
        offsets[t["name"]] = f.tell()
    f.write(memoryview(data).cast("B"))
    sums[layers.index(t["layer"]), first : first + count, t["part"]] = piece_sums
    done += data.nbytes
    if done - flushed >= FLUSH:  # to the disk and out of the page cache, so the engine reads the disk
        f.flush()
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        flushed = done
    progress(done)
    return done, flushed


def _check_offsets(path: Path, plan: list[dict], offsets: dict) -> None:
    """Where the gguf package's reader finds each tensor is where its bytes were written."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    found = {t.name: int(t.data_offset) for t in reader.tensors}
    del reader
    for t in plan:
        if found.get(t["name"]) != offsets[t["name"]]:
            raise RuntimeError(f"{t['name']}: written at {offsets[t['name']]}, the reader finds {found.get(t['name'])}")


def hash_ids(position: int, layer: int, k: int) -> list[int]:
    """k distinct experts from (position, layer): the stand-in for ds4's hash-routed layers 0-2."""
    out: list[int] = []
    x = (position * 0x9E3779B97F4A7C15 + layer * 0xBF58476D1CE4E5B9 + 1) & (2**64 - 1)
    while len(out) < k:
        x = (x * 6364136223846793005 + 1442695040888963407) & (2**64 - 1)
        e = (x >> 33) % NUM_EXPERTS
        if e not in out:
            out.append(int(e))
    return out


def routing(layers: list[int], traces: list[str], prompt_tokens: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(prompt [P, L, k], decode [T, L, k]) int32 for the model layers ``layers``."""
    from expcache_bench.traces import list_traces, load_decode_trace, load_prefill_trace

    names = [t.name for t in list_traces() if t.kind == "decode"] if traces == ["all"] else traces
    decode = []
    for name in names:
        trace = load_decode_trace(name)
        for t in range(trace.num_tokens):
            pos = int(trace.positions[t])
            decode.append(
                [
                    trace.layer_ids(layer)[t] if layer >= FIRST_ROUTED_LAYER else hash_ids(pos, layer, TOP_K)
                    for layer in layers
                ]
            )
    decode = np.asarray(decode, np.int32)[: tokens or None]
    prompt = load_prefill_trace("pod12_prefill_eval")[0]
    if prompt_tokens > prompt.num_prefill_tokens:
        raise SystemExit(f"--prompt-tokens: the bundled prompt has {prompt.num_prefill_tokens} tokens")
    pre = np.stack([prompt.layer_ids(layer)[:prompt_tokens] for layer in layers], axis=1).astype(np.int32)
    return pre, decode


def write_routing(path: Path, layers: list[int], prompt: np.ndarray, decode: np.ndarray) -> None:
    header = np.array([VERSION, len(layers), TOP_K, len(prompt), len(decode), NUM_EXPERTS, *layers], "<i4")
    with open(path, "wb") as f:
        f.write(ROUTING_MAGIC + header.tobytes() + prompt.astype("<i4").tobytes() + decode.astype("<i4").tobytes())


def write_sums(path: Path, layers: list[int], sums: np.ndarray) -> None:
    header = np.array([VERSION, len(layers), NUM_EXPERTS, *layers], "<i4")
    with open(path, "wb") as f:
        f.write(SUMS_MAGIC + header.tobytes() + sums.astype("<u8").tobytes())


def read_routing(path: Path) -> tuple[list[int], np.ndarray, np.ndarray]:
    """(layers, prompt [P, L, k], decode [T, L, k]) from a routing.bin."""
    raw = np.fromfile(path, "<i4")
    if raw[:1].tobytes() != ROUTING_MAGIC or raw[1] != VERSION:
        raise ValueError(f"{path}: not a routing file of version {VERSION}")
    _, layers, k, prompt, tokens, _ = raw[1:7].tolist()
    body = raw[7 + layers :]
    split = prompt * layers * k
    return (
        raw[7 : 7 + layers].tolist(),
        body[:split].reshape(prompt, layers, k),
        body[split:].reshape(tokens, layers, k),
    )


def read_sums(path: Path) -> tuple[list[int], np.ndarray]:
    """(layers, sums [L, E, 3] uint64) from a model.gguf.sums."""
    raw = np.fromfile(path, np.uint8)
    header = raw[4:16].view("<i4").tolist()
    if raw[:4].tobytes() != SUMS_MAGIC or header[0] != VERSION:
        raise ValueError(f"{path}: not a sums file of version {VERSION}")
    layers, experts = header[1:]
    start = 16 + 4 * layers
    return raw[16:start].view("<i4").tolist(), raw[start:].view("<u8").reshape(layers, experts, 3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("out", type=Path, help="the folder to write model.gguf, model.gguf.sums and routing.bin into")
    ap.add_argument(
        "--layers", type=parse_layers, default=list(range(NUM_LAYERS)), help="model layers, e.g. 35-42 (default 0-42)"
    )
    ap.add_argument(
        "--scale", type=int, default=1, help="divide every matrix's rows by this (a power of two up to 2048)"
    )
    ap.add_argument(
        "--trace", nargs="+", default=["all"], help="bundled decode traces, or all (default: the seven, 863 tokens)"
    )
    ap.add_argument("--tokens", type=int, default=0, help="keep the first N decode tokens (default all)")
    ap.add_argument("--prompt-tokens", type=int, default=16, help="prefill tokens (default 16)")
    ap.add_argument("--alignment", type=int, default=32, help="the GGUF's data alignment (default 32, ggml's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1), help="threads making bytes")
    args = ap.parse_args(argv)
    if args.scale < 1 or N_FF % args.scale:
        ap.error(f"--scale must divide {N_FF} (a power of two up to {N_FF}), got {args.scale}")
    if args.alignment < 1 or args.alignment & (args.alignment - 1):
        ap.error("--alignment must be a power of two")

    plan = tensor_plan(args.layers, args.scale)
    prompt, decode = routing(args.layers, args.trace, args.prompt_tokens, args.tokens)
    expert_bytes = sum(int(np.prod(t["shape"])) for t in plan)
    need = expert_bytes + len(plan) * args.alignment + (1 << 20) + (prompt.nbytes + decode.nbytes)
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.out / "model.gguf"
    freed = model.stat().st_size if model.exists() else 0
    free = shutil.disk_usage(args.out).free + freed
    if need > free:
        print(
            f"prepare: {args.out} has {free / GiB:.2f} GiB free, the model needs {need / GiB:.2f} GiB", file=sys.stderr
        )
        return 1
    q4 = [layer for layer in args.layers if layer_quant(layer) == "q4"]
    print(
        f"prepare: {len(args.layers)} layers ({len(q4)} q4), {expert_bytes / GiB:.3f} GiB of experts"
        f" (scale 1/{args.scale}), {len(decode)} decode tokens, {len(prompt)} prompt tokens -> {args.out}"
    )
    t0 = time.monotonic()
    sums = write_model(model, plan, args.seed, args.alignment, max(1, args.threads))
    write_sums(args.out / "model.gguf.sums", args.layers, sums)
    write_routing(args.out / "routing.bin", args.layers, prompt, decode)
    print(f"prepare: wrote {model} ({model.stat().st_size / GiB:.3f} GiB) in {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
