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


def test_the_readme_says_which_torch_build_the_pin_gives():
    """The pin takes the tested version; on Linux x86-64 PyPI's plain wheel is the CUDA build, so the README names
    PyTorch's CPU index for the CPU build rather than promising that the pin is a CPU wheel."""
    text = README.read_text()
    assert "pins the CPU wheel" not in text
    assert "CUDA build" in text and "--index-url https://download.pytorch.org/whl/cpu" in text


def test_what_the_guides_commands_write_is_ignored_by_git():
    """Running the README's and the how-to guides' commands in a checkout leaves `git status` clean: every output
    they name (--report DIR, --plan-out FILE, --plot FILE, fit's default plan file) is in .gitignore."""
    import shutil
    import subprocess

    root = README.parent
    if shutil.which("git") is None or not (root / ".git").exists():
        import pytest

        pytest.skip("not a git checkout")
    blocks = [b for page in [README, *sorted((root / "docs").rglob("*.md"))]
              for b in re.findall(r"```(?:bash|console)\n(.*?)```", page.read_text(), re.S)]
    outputs = {m for b in blocks for m in re.findall(r"--(?:report|plan-out|plot) ([^\s-]\S*)", b)}
    assert {"report", "fit-report/", "plan.json", "frontier.png"} <= outputs, outputs
    for path in sorted(outputs | {"batchlab-ac-plan.json"}):
        probe = path.rstrip("/") + ("/index.html" if path.endswith("/") or "." not in path else "")
        ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", probe], cwd=root).returncode == 0
        assert ignored, f"{path} (written by a documented command) is not in .gitignore"
