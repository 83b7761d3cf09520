"""The benchmark's command-line options, each defined once as an :class:`Option` and listed by
every mode that takes it (the mode's ``OPTIONS``; the command line builds its parsers from those
lists), with the value parsers they use, the options every mode on a :class:`~expcache_bench.Bench`
shares (:data:`BENCH`), and what a mode's ``check`` raises (:class:`UsageError`).

Nothing here loads libexpcache or cuda-python at import, so every --help works on a fresh clone.
Help texts are plain text: they are read in a terminal.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
from typing import Optional

from pyexpcache._errors import ExpcacheError
from pyexpcache.budget import resolve_budget
from pyexpcache.cache import ExpertCache
from pyexpcache.gguf import layout_from_gguf
from pyexpcache.layout import (
    FIRST_ROUTED_LAYER,
    NUM_LAYERS,
    PRESETS,
    TOP_K as DEFAULT_TOP_K,
    LayerSpec,
    LayoutFileError,
    ModelLayout,
)
from pyexpcache.source import HostSource

from .file_source import SOURCES
from .traces.synthetic import is_deepseek_v4_flash_shaped
from .workload import DEFAULT_TRACES, decode_trace


class UsageError(Exception):
    """A command line that cannot run: printed as one line, status 2 (as argparse does)."""


class NotAvailable(Exception):
    """What a run needs is not on this machine (a CUDA device): printed as one line, status 1."""


# -- what a run needs ------------------------------------------------------------------------


def has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package is missing
        return False


def has_cuda_python() -> bool:
    return has_module("cuda.bindings") or has_module("cuda.cudart")


def need(ok: bool, what: str, extra: str) -> None:
    """UsageError naming the pip extra that installs what is missing, unless ``ok``."""
    if not ok:
        raise UsageError(f"{what}; install it with: pip install 'expcache[{extra}]'")


def host_memory_available() -> Optional[int]:
    """Bytes of host memory a run may take: the kernel's MemAvailable, at most a cgroup v2
    memory limit (a container's); None where neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/proc/self/cgroup") as f:
            group = next(line.strip()[3:] for line in f if line.startswith("0::"))
        with open(os.path.join("/sys/fs/cgroup", group.lstrip("/"), "memory.max")) as f:
            limit = f.read().strip()
        if limit != "max":
            found.append(int(limit))
    except (OSError, ValueError, StopIteration):
        pass
    return min(found) if found else None


def check_cache_setting(option: str, keyword: str, value: int) -> None:
    """Let the library judge a cache setting before the run (its ranges are its own): a cache of
    one tiny expert on the host backend is made with it."""
    layout = ModelLayout((LayerSpec(1, 256, 256, 256),))
    with HostSource(layout) as source:
        try:
            ExpertCache(layout, source, budget_experts=1, backend="host", log_level=0, **{keyword: value}).close()
        except ExpcacheError as exc:
            raise UsageError(f"{option}: {exc.message.removeprefix('expcache_create: ')}") from None


# -- --layout ---------------------------------------------------------------------------------

LAYOUT_FORMS = (
    'a preset name, a layout file (.json with "layers"), a Hugging Face config.json or the model '
    "folder holding it (CONFIG.json:TYPE for another type, e.g. config.json:Q4_K), or a GGUF file (.gguf)"
)


def layout_kind(text: str) -> tuple[str, str, Optional[str]]:
    """What --layout names, as (kind, preset name or path, type): kind ``"preset"``, ``"file"``
    (a layout file: JSON with "layers"), ``"hf"`` (JSON with "model_type" or "architectures", or
    a folder holding such a config.json; a ``:TYPE`` suffix gives its experts' type) or
    ``"gguf"`` (a .gguf name or the GGUF magic). ValueError naming the forms otherwise."""
    if text in PRESETS:
        return "preset", text, None
    path, quant = text, None
    if not os.path.exists(text) and ":" in text and os.path.exists(text.rpartition(":")[0]):
        path, _, quant = text.rpartition(":")
    if not os.path.exists(path):
        what = "no such file" if os.sep in text or text.endswith((".json", ".gguf")) else "not a preset or a file"
        raise ValueError(f"{text}: {what}; --layout takes {LAYOUT_FORMS}; the presets are {', '.join(PRESETS)}")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"{path}: a folder without a config.json; --layout takes {LAYOUT_FORMS}")
        path = os.path.join(path, "config.json")
    try:
        with open(path, "rb") as f:
            head = f.read(4)
            gguf = head == b"GGUF" or path.endswith(".gguf")
            # JSON is read whole (at most 64 MiB; a layout or a config is a few KiB), anything else not.
            data = f.read(64 << 20) if not gguf and head.lstrip()[:1] in (b"{", b"") else b""
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror})") from None
    kind = "gguf" if gguf else None
    if kind is None:
        try:
            obj = json.loads(head + data)
        except (ValueError, UnicodeDecodeError):
            obj = None
        if isinstance(obj, dict) and "layers" in obj:
            kind = "file"
        elif isinstance(obj, dict) and ("model_type" in obj or "architectures" in obj):
            kind = "hf"
        else:
            found = (
                'JSON without a "layers" list, "model_type" or "architectures"'
                if obj is not None
                else "neither JSON nor a GGUF file"
            )
            raise ValueError(f"{path}: {found}; --layout takes {LAYOUT_FORMS}")
    if quant is not None and kind != "hf":
        raise ValueError(
            f"{text}: a :TYPE suffix applies to a Hugging Face config.json only; {path} is "
            f"{'a GGUF file' if kind == 'gguf' else 'a layout file, which gives its own types'}"
        )
    return kind, path, quant


def layout_argument(text: str) -> str:
    """--layout's type: the text, once :func:`layout_kind` knows what it names."""
    try:
        layout_kind(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


@functools.lru_cache(maxsize=8)
def model_layout(text: str):
    """The full-size layout --layout names (:func:`layout_kind`), read once per command (cached
    by the text); UsageError naming the option and what is wrong with the file."""
    try:
        kind, path, quant = layout_kind(text)
    except ValueError as exc:
        raise UsageError(f"--layout {exc}") from None
    try:
        if kind == "preset":
            return ModelLayout.preset(path)
        if kind == "file":
            return ModelLayout.from_json(path)
        if kind == "hf":
            return ModelLayout.from_hf_config(path, quant)
        need(has_module("gguf"), f"--layout {text}: a GGUF file's layout needs the gguf package", "gguf")
        return layout_from_gguf(path)
    except (LayoutFileError, ValueError, OSError) as exc:
        message = str(exc).removeprefix(f"{path}: ")
        raise UsageError(f"--layout {text}: {message}") from None


def _power_of_two_dividing(layout) -> int:
    """The largest power of two (at most 65536) that divides every part size of ``layout``."""
    sizes = [b for s in layout.layers if s for b in s.class_key]
    return min([1 << 16] + [b & -b for b in sizes])


#: The modes that take experts of any number of parts: the variants table and the engine model
#: (the C loop serves them by slot id: select_slots, batch_prepare_slots and the bank's checksum of
#: every part; not the compact loads of ``nocache``, a variant skipped, nor ``--split``), the graph
#: loop (the device select and the bank's checksum by slot, and the same C loop) and the
#: simulator's curve.
PARTS_MODES = ("variants", "engine", "graph", "curve")


def generated_layout(args, scale: int):
    """The --layout at ``scale``, less the layers --layers leaves out."""
    layout = model_layout(args.layout)
    other = sorted({len(s.class_key) for s in layout.layers if s and len(s.class_key) != 3})
    # The mode's name; the flag spelling's is the one its options choose (cli sets chosen_mode).
    mode = getattr(args, "mode", None) or getattr(args, "chosen_mode", None)
    if other and mode not in PARTS_MODES:
        raise UsageError(
            f"--layout {args.layout}: its experts have {', '.join(map(str, other))} parts (a quantized "
            "checkpoint's weights and scales, or biases); this mode's loops serve experts of three parts "
            "(they hand out three pointers per expert): `expcache bench` (the variants table), `engine` and "
            "`graph` serve it by slot id, or give its checkpoint's quantization as one GGUF type (CONFIG.json:TYPE)"
        )
    if other and mode == "engine" and getattr(args, "split", False):
        raise UsageError(
            f"--layout {args.layout}: its experts have {', '.join(map(str, other))} parts, and the split select "
            "(--split) hands out three pointers per expert: drop --split (the engine model serves them by slot id)"
        )
    try:
        layout = layout.scaled(scale) if scale != 1 else layout
    except ValueError as exc:
        most = _power_of_two_dividing(layout)
        default = "" if getattr(args, "scale", None) else " (the default on the host backend)"
        raise UsageError(
            f"--scale {scale}{default}: {exc}; use a power of two up to {most}" + (", e.g. 256" if most >= 256 else "")
        ) from None
    if args.layers is None:
        return layout
    return ModelLayout(
        tuple(s if i in args.layers else None for i, s in enumerate(layout.layers)),
        name=f"{layout.name}[layers {args.layers[0]}..{args.layers[-1]}]",
    )


# -- value parsers ---------------------------------------------------------------------------


def gib(option: str, minimum_exclusive: bool):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or (minimum_exclusive and value == 0) or value > 1e6:
            raise argparse.ArgumentTypeError(
                f"{option} must be a finite number of GiB {'>' if minimum_exclusive else '>='} 0 (at most 1e6), "
                f"got {text!r}"
            )
        return value

    return parse


def fraction(option: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not 0 < value <= 1:  # NaN fails too
            raise argparse.ArgumentTypeError(f"{option} must be a number F with 0 < F <= 1, got {text!r}")
        return value

    return parse


def whole(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text!r}")
        return value

    return parse


def layers(text: str) -> list[int]:
    """Layer numbers and ranges: 3-42, 5,7,9, 3-10,40."""
    out: list[int] = []
    try:
        for part in (p.strip() for p in text.split(",")):
            first, dash, last = part.partition("-")
            if part:
                lo, hi = int(first), int(last if dash else first)
                if not 0 <= lo <= hi:
                    raise ValueError
                out.extend(range(lo, hi + 1))
    except ValueError:
        out = []
    if not out:
        raise argparse.ArgumentTypeError(f"expected layer numbers like 3-42 or 5,7,9, got {text!r}")
    return sorted(set(out))


def ranges(numbers: list[int]) -> str:
    """Sorted numbers as --layers spells them: [3, 4, 5, 9] is 3-5,9."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def thread_counts(text: str) -> list[int]:
    try:
        counts = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 0:
        raise argparse.ArgumentTypeError(f"expected a comma list of thread counts such as 1,4,8, got {text!r}")
    return counts


def csv(choices):
    """A comma list of ``choices`` (a sequence; empty: anything), or of what ``choices()`` returns
    when it is callable: called only when a value is parsed, so a list read from the library
    leaves --help free of it."""

    def parse(text: str) -> list[str]:
        try:
            allowed = choices() if callable(choices) else choices
        except (ImportError, OSError) as exc:  # the library, for a list read from it: one line, as argparse's
            raise argparse.ArgumentTypeError(str(exc)) from None
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if allowed and t not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(allowed)}; got {text!r}")
        return items

    return parse


def sizes(text: str) -> list[int]:
    """A comma list of byte sizes: 262144, 256K, 1M."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20}
    out = []
    for item in (t.strip().upper().removesuffix("IB").removesuffix("B") for t in text.split(",")):
        number, unit = (item[:-1], item[-1]) if item[-1:] in ("K", "M") else (item, "")
        try:
            value = int(float(number) * units[unit])
        except ValueError:
            value = 0
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a comma list of sizes such as 256K,1M; got {text!r}")
        out.append(value)
    return out


def size(text: str) -> int:
    parsed = sizes(text)
    if len(parsed) != 1:
        raise argparse.ArgumentTypeError(f"expected one size such as 512K; got {text!r}")
    return parsed[0]


def nonnegative_us(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of µs, got {text!r}") from None
    if not 0 <= value <= 1e6:
        raise argparse.ArgumentTypeError(f"must be in [0, 1e6] µs, got {text}")
    return value


# -- options ---------------------------------------------------------------------------------


class Option:
    """One command-line option: ``argparse`` arguments, defined once. A mode lists the options it
    takes; an option is *given* when its value differs from its default."""

    def __init__(self, *flags: str, selects: Optional[dict] = None, **kwargs):
        self.flags = flags
        self.kwargs = kwargs
        # {value: mode name}: an option whose value chooses among modes (--loop torch, --loop graph).
        self.selects = selects

    @property
    def dest(self) -> str:
        return self.kwargs.get("dest") or self.flags[0].lstrip("-").replace("-", "_")

    @property
    def default(self):
        return self.kwargs.get("default", False if self.kwargs.get("action") == "store_true" else None)

    def add_to(self, parser, hidden: bool = False) -> None:
        """The option in ``parser``; ``hidden``: parsed but left out of the help (a deprecated spelling)."""
        parser.add_argument(*self.flags, **(dict(self.kwargs, help=argparse.SUPPRESS) if hidden else self.kwargs))

    def given(self, args) -> bool:
        return getattr(args, self.dest, self.default) != self.default

    def chooses(self, args, mode: str) -> bool:
        """Whether the option, as given, chooses ``mode`` (any given value does, unless the
        option's values choose among modes)."""
        if not self.given(args):
            return False
        return self.selects is None or self.selects.get(getattr(args, self.dest)) == mode

    def spelled_for(self, mode: str) -> str:
        """The option as it is given to choose ``mode``: --devices, --loop torch, --loop graph."""
        if self.selects:
            return " or ".join(f"{self.flags[0]} {value}" for value, m in self.selects.items() if m == mode)
        return self.spelled

    @property
    def spelled(self) -> str:
        """The option as it is given to choose a mode: --devices, --loop torch (its one other choice)."""
        choices = self.kwargs.get("choices")
        others = [c for c in choices if c != self.default] if choices else []
        return f"{self.flags[0]} {others[0]}" if len(others) == 1 else self.flags[0]

    def __repr__(self) -> str:
        return f"Option({self.flags[0]})"


LAYOUT = Option(
    "--layout",
    default="mixed",
    type=layout_argument,
    metavar="NAME|FILE",
    help="the model's routed experts: a preset (" + ", ".join(PRESETS) + "; default mixed: DeepSeek V4 "
    "Flash q2-q4), a layout file (.json with a layers list: docs/models.md), a Hugging Face "
    "config.json (CONFIG.json:TYPE for another type, e.g. config.json:Q4_K) or a model folder "
    "holding one, or a GGUF file (its layout only; --gguf serves its bytes)",
)
GGUF = Option(
    "--gguf",
    metavar="MODEL.gguf",
    help="use a GGUF model file's experts instead of a generated layout; its layers and experts must match the traces",
)
GGUF_READS = Option(
    "--gguf-reads",
    choices=("mmap", "file"),
    default="mmap",
    help="with --gguf: copy misses from a mapping of the file (pageable) or read them from the file "
    "(pread; see --file-reads)",
)


class _Flatten(argparse.Action):
    """nargs="+" of values that are lists (a comma list each): one list of their items."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, [item for value in values for item in value])


TRACES = Option(
    "--traces",
    type=csv(None),
    nargs="+",
    action=_Flatten,
    default=list(DEFAULT_TRACES),
    metavar="TRACE",
    help="the decode traces, several after --traces or in a comma list: routing-trace files of any model "
    "in the generic format (*.jsonl, *.csv or *.npz, each optionally .gz: docs/traces.md), bundled "
    "traces by name, route-CSV paths (*.route.csv), or synthetic:TOKENS[:SEED] (of the layout's MoE "
    "layers and experts, --top-k per token; default: the seven bundled traces)",
)
BUDGET = Option(
    "--budget-gib",
    type=gib("--budget-gib", True),
    default=None,
    help="expert cache budget in GiB (default 12, unless --budget-fraction)",
)
BUDGET_FRACTION = Option(
    "--budget-fraction",
    type=fraction("--budget-fraction"),
    default=None,
    metavar="F",
    help="expert cache budget as a fraction F of the bytes of every expert of the layout, "
    "0 < F <= 1 (instead of --budget-gib)",
)
TOP_K = Option(
    "--top-k",
    type=whole(1),
    default=None,
    metavar="K",
    help="experts per token of the synthetic:TOKENS traces, at most half the layout's experts per layer "
    f"(default: a Hugging Face config's num_experts_per_tok, else {DEFAULT_TOP_K}, DeepSeek V4 "
    "Flash's)",
)
RESERVE = Option(
    "--reserve-gib", type=gib("--reserve-gib", False), default=None, help="device memory kept free (default 1 GiB)"
)
BACKEND = Option(
    "--backend",
    default="auto",
    choices=("auto", "host", "cuda"),
    help="auto: the GPU when the CUDA build of the library and a device are usable, else the host "
    "backend (host memory with an emulated capacity); cuda needs cuda-python (the [cuda] extra)",
)
DEVICE = Option("--device", type=whole(0), default=0, help="CUDA device ordinal (default 0)")
SOURCE = Option(
    "--source",
    choices=SOURCES,
    default=None,
    help="where the generated experts are served from: pinned or pageable host memory, or a file written "
    "with them in --file-dir (as a model streamed from SSD), mapped (mmap) or read with pread (file: "
    "--file-reads); the run then also measures the disk's read rate (default: pinned on the GPU, "
    "pageable on the host)",
)
FILE_DIR = Option(
    "--file-dir",
    default=None,
    metavar="DIR",
    help="folder for the file a file source's experts are written to, removed after the run; it needs "
    "room for them (default: the system's temporary folder)",
)
PLACEMENT = Option(
    "--placement",
    choices=("expert", "tensor"),
    default="expert",
    help="host placement of the generated source: each expert's parts together (default, as an "
    "engine stages experts in pinned memory) or one tensor per part (as in a GGUF)",
)
LAYERS = Option(
    "--layers",
    type=layers,
    default=None,
    help=f"MoE layers to keep, e.g. 3-10 or 5,7,9 (default: all; the bundled traces have layers "
    f"{FIRST_ROUTED_LAYER}-{NUM_LAYERS - 1})",
)
SCALE = Option(
    "--scale",
    type=whole(1),
    default=None,
    help="divide expert sizes and the budget by this, a power of two up to 65536 (default: 1 on the GPU, "
    "256 on the host); the generated experts must fit in host memory",
)
COPY_THREADS = Option(
    "--copy-threads",
    type=whole(0),
    default=None,
    help="threads staging pageable and file misses (default: the cores less 4, 2 to 12)",
)
STAGING_CHUNK = Option(
    "--staging-chunk",
    type=size,
    default=None,
    help="largest staging piece one thread fills and one transfer moves, e.g. 1M (default 512K)",
)
PREFETCH_PIECE = Option(
    "--prefetch-piece",
    type=size,
    default=None,
    metavar="SIZE",
    help="most prefetch bytes in flight at once, what a demand miss shares the link with, "
    "e.g. 1M (default 4M; a multiple of 4K in 4K..64M)",
)
FILE_READS = Option(
    "--file-reads",
    choices=("direct", "buffered"),
    default="direct",
    help="how misses read a file (--source file, --gguf-reads file): with O_DIRECT, from the disk "
    "(default), or buffered, through the page cache",
)
HOST_BUDGET = Option(
    "--host-budget-gib",
    type=gib("--host-budget-gib", False),
    default=None,
    metavar="GIB",
    help="a host pool of GIB GiB (divided by --scale, as the budget is) of pinned host RAM between a "
    "pageable or file source and the device cache: the device's misses read the source only when the "
    "pool misses too; the report adds the pool's hit rate beside the device's (default: no pool)",
)
LAYER_COMPUTE_US = Option(
    "--layer-compute-us",
    type=nonnegative_us,
    default=None,
    metavar="N",
    help="N µs of non-expert work per layer (a GPU kernel that only takes time) before the "
    "layer's select, as attention at batch 1 would be (default 0)",
)
PLOT = Option(
    "--plot",
    metavar="FILE.png",
    help="plot hit rate vs budget for LRU, OppClassLRU and Belady (needs matplotlib: the [plot] extra)",
)
JSON = Option(
    "--json",
    metavar="FILE",
    help="also write the reports as JSON (a list, one per table), rewritten after "
    "each one (an interrupted run keeps those it finished)",
)
QUIET = Option("--quiet", action="store_true", help="no progress bar or notices")

#: The options of every mode that runs on a Bench: its layout, source, backend, budget and
#: cache settings, and the traces it replays.
BENCH = (
    LAYOUT,
    GGUF,
    GGUF_READS,
    TRACES,
    TOP_K,
    BUDGET,
    BUDGET_FRACTION,
    RESERVE,
    BACKEND,
    DEVICE,
    SOURCE,
    FILE_DIR,
    PLACEMENT,
    LAYERS,
    SCALE,
    COPY_THREADS,
    STAGING_CHUNK,
    PREFETCH_PIECE,
    FILE_READS,
    HOST_BUDGET,
)
#: What every mode writes: --json, and --quiet for the progress bar.
OUTPUT = (JSON, QUIET)
#: The options that are output files, opened before a run (the mode finds them in ``args.outputs``).
FILES = (JSON, PLOT)

# The bench options that are ExpertCache settings: (option, ExpertCache keyword).
CACHE_SETTINGS = (
    (COPY_THREADS, "copy_threads"),
    (STAGING_CHUNK, "staging_chunk_bytes"),
    (PREFETCH_PIECE, "prefetch_piece_bytes"),
)


def _config_top_k(text: str) -> Optional[int]:
    """The experts per token a Hugging Face config.json that --layout names gives
    (``num_experts_per_tok``, or ``experts_per_token``; under ``text_config`` for a multimodal
    wrapper), or None (another kind of --layout, or no such key)."""
    kind, path, _ = layout_kind(text)
    if kind != "hf":
        return None
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    for where in (config, config.get("text_config")):
        for key in ("num_experts_per_tok", "experts_per_token"):
            value = where.get(key) if isinstance(where, dict) else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def synthetic_traces(args) -> None:
    """Make --traces' synthetic:TOKENS[:SEED] traces now, shaped by the model's layout (--layout's,
    or --gguf's; before --layers): its MoE layers and experts per layer, and --top-k experts per
    token (default: a Hugging Face config's num_experts_per_tok, else 6); ``args.traces`` then
    holds each trace made in its spec's place (a mode's ``check`` calls this, before the command
    line loads the traces). UsageError for a top-k above half the layout's experts per layer
    (fresh draws skip the previous token's), naming the option, and for --top-k without a
    synthetic trace."""
    traces = list(getattr(args, "traces", None) or [])
    synthetic = [t for t in traces if isinstance(t, str) and t.startswith("synthetic:")]
    k = getattr(args, "top_k", None)
    if not synthetic:
        if k is not None:
            raise UsageError(
                f"{TOP_K.flags[0]} applies to synthetic:TOKENS traces (a recorded trace has its own k), "
                "and --traces has none"
            )
        return
    if getattr(args, "gguf", None):
        layout = layout_from_gguf(args.gguf)
    else:
        layout = model_layout(args.layout)
    experts = min(layout[i].num_experts for i in layout.moe_layers)
    most = experts // 2
    if k is None:
        from_config = (
            None if getattr(args, "gguf", None) or is_deepseek_v4_flash_shaped(layout) else _config_top_k(args.layout)
        )
        default = (
            f"the config's num_experts_per_tok of {from_config}"
            if from_config is not None
            else f"the default top-k of {DEFAULT_TOP_K}"
        )
        k = DEFAULT_TOP_K if from_config is None else from_config
        if not 1 <= k <= most:
            raise UsageError(
                f"--traces {synthetic[0]}: layout {layout.name} has {experts} experts per layer, too few "
                f"for {default}: give {TOP_K.flags[0]} K, 1 <= K <= {most}"
            )
    elif not 1 <= k <= most:
        raise UsageError(
            f"{TOP_K.flags[0]} {k}: layout {layout.name} has {experts} experts per layer: "
            f"1 <= K <= {most} (fresh draws skip the previous token's experts)"
        )
    args.traces = [decode_trace(t, layout, k) if t in synthetic else t for t in traces]


def check_budget(args) -> None:
    """UsageError when both --budget-gib and --budget-fraction are given."""
    if getattr(args, "budget_gib", None) is not None and getattr(args, "budget_fraction", None) is not None:
        raise UsageError("--budget-gib and --budget-fraction are mutually exclusive: give one")


def budget_bytes(args, layout, scale: int) -> int:
    """The cache budget the options give for ``layout`` (its sizes already divided by ``scale``):
    --budget-fraction of its experts' bytes, or --budget-gib (default 12) divided by ``scale``
    (:func:`~pyexpcache.budget.resolve_budget`). UsageError for both, or for a budget that
    rounds to 0 bytes (naming the option and the smallest value of it that holds an expert)."""
    check_budget(args)
    gib = args.budget_gib
    try:
        return resolve_budget(
            layout,
            None if gib is None else gib * (1 << 30),
            args.budget_fraction,
            scale=scale,
            names=(BUDGET.flags[0], BUDGET_FRACTION.flags[0]),
            bytes_unit=1 << 30,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def cache_options(args, scale: int = 1) -> dict:
    """The ExpertCache settings the options give (the Bench's ``cache_options``); --host-budget-gib
    divided by ``scale`` (the layout's sizes were)."""
    options = {"file_reads": args.file_reads}
    for option, keyword in CACHE_SETTINGS:
        if getattr(args, option.dest) is not None:
            options[keyword] = getattr(args, option.dest)
    host = getattr(args, HOST_BUDGET.dest, None)
    if host:
        options["host_budget_bytes"] = int(host * (1 << 30)) // scale
    return options
