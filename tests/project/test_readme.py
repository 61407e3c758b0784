"""The README's Python API example runs as written (the first ```python block: calculator + a measurement).
The module list is on docs/architecture.md (tests/project/test_structure.py checks it)."""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_python_api_example_runs():
    block = re.search(r"### Python API\n\n```python\n(.*?)```", README.read_text(), re.S).group(1)
    assert "from batchlab.run import measure" in block
    out = io.StringIO()
    namespace: dict = {}
    with contextlib.redirect_stdout(out):
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 — our own README
    first, second = out.getvalue().splitlines()
    # 7B, bf16-mixed, ZeRO-1 over 8 ranks, full AC: tens of GiB per rank; global batch 1 x 64 x 8 = 512
    assert 10 * 2**30 < int(first.split()[0]) < 80 * 2**30 and "= 512 sequences" in first
    m = namespace["m"]
    assert m.outcome.value == "ok" and second.endswith("True")
    assert m.timeline.peak_bytes == m.memory.peak_bytes  # both steady-state updates of one trainer
