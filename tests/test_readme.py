"""README.md's first Python example ("Python in brief") runs as written, in a child process, on any
machine: the host backend, a scaled-down layout, pageable memory, every name defined. (The
examples/ scripts have tests/test_examples.py, which needs PyTorch; this one needs only numpy.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"


def first_python_block(section: str) -> str:
    """The first ```python block under the ``## {section}`` heading of README.md."""
    text = README.read_text()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    block = re.search(r"^```python\n(.*?)^```$", text[start : end if end >= 0 else None], re.S | re.M)
    assert block, f"README.md: no python block under '## {section}'"
    return block.group(1)


def test_python_in_brief_runs_as_written(tmp_path):
    script = tmp_path / "python_in_brief.py"
    script.write_text(first_python_block("Python in brief"))
    # The child imports the package the way this process did; no GPU is needed, so none is shown.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
    )
    assert proc.returncode == 0, f"README.md's 'Python in brief' failed (rc {proc.returncode}):\n{proc.stderr}"
    assert "hit rate" in proc.stdout, proc.stdout
