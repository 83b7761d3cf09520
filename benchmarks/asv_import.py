"""Copy a machine's asv results into asv's results folder, dropping the requirements that
benchmarks/asv.conf.json's matrix no longer lists, so that old records continue the graph lines
of the results recorded since (asv keys a line by the environment's parameters, requirements
included). Usage, from the repository root (`make asv-import-h200` runs it):

    python3 benchmarks/asv_import.py SRC_DIR DST_DIR

e.g. benchmarks/results/asv_h200 .asv/results/h200: the H200's record of e754033 was made while
the matrix still listed pytest (asv then imported every module of benchmarks/); without this its
graphs would show as a second line (``pytest`` = "" beside ``pytest`` = null). Nothing else of a
record changes: benchmark names, versions, values.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

CONF = Path(__file__).resolve().parent / "asv.conf.json"


def matrix_requirements(conf: Path = CONF) -> set:
    """The requirement names of the conf's matrix ("req", or the old flat form)."""
    text = re.sub(r"^\s*//.*$", "", conf.read_text(), flags=re.M)  # asv.conf.json allows // comments
    matrix = json.loads(text).get("matrix", {})
    return set(matrix.get("req", matrix))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python3 benchmarks/asv_import.py SRC_DIR DST_DIR", file=sys.stderr)
        return 2
    src, dst = Path(argv[0]), Path(argv[1])
    keep = matrix_requirements()
    dst.mkdir(parents=True, exist_ok=True)
    for path in sorted(src.glob("*.json")):
        data = json.loads(path.read_text())
        if "results" not in data:  # machine.json
            shutil.copy2(path, dst / path.name)
            continue
        dropped = sorted(k for k in data.get("requirements", {}) if k not in keep)
        for key in dropped:
            data["requirements"].pop(key, None)
            data["params"].pop(key, None)
        (dst / path.name).write_text(json.dumps(data))
        print(f"{path} -> {dst / path.name}" + (f" (dropped {', '.join(dropped)})" if dropped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
