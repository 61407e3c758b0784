"""Every `batchlab ...` command the README shows in a ```bash or ```console block runs as printed and exits 0.

The commands are read from the README at collection time, so a command added there is tested without editing
this file.  Calculator commands run one by one; the commands that measure (compare) and those that read the
notebook they fill run in the README's order in one notebook, as a reader would type them.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
README = ROOT / "README.md"
NEEDS_THE_NOTEBOOK = ("compare", "notebook", "measure")  # measure: a real run, as slow as a compare side


def readme_commands(text: str) -> list[list[str]]:
    """The argument lists of every `batchlab` (or `.venv/bin/batchlab`) command in the shell blocks, in order;
    a line's `&&`-joined commands count one by one.  In a ```console block only the `$ ` lines are commands (the
    rest is what they print)."""
    out = []
    for kind, block in re.findall(r"```(bash|console|shell|sh)\n(.*?)```", text, re.S):
        for line in block.splitlines():
            line = line.strip()
            if kind == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            for part in line.split("&&"):
                words = shlex.split(part)
                if words and (words[0] == "batchlab" or words[0].endswith("/batchlab")):
                    out.append(words[1:])
    return out


COMMANDS = readme_commands(README.read_text())
QUICK = [c for c in COMMANDS if c[0] not in NEEDS_THE_NOTEBOOK]
# a command shown twice (the main job, then its tour) runs once
IN_ORDER = [c for i, c in enumerate(COMMANDS) if c[0] in NEEDS_THE_NOTEBOOK and c not in COMMANDS[:i]]
# what is asserted is that a command parses, runs to the end and fills the notebook the next ones read, not its
# figures: a measuring command runs one timed update after one warm-up per process (half its wall time), unless
# the README gives these itself
FEWER_UPDATES = {"--steps": "1", "--warmup": "1"}


def fewer_updates(args: list[str]) -> list[str]:
    if args[0] not in ("compare", "measure"):
        return args
    return args + [w for flag, n in FEWER_UPDATES.items() if flag not in args for w in (flag, n)]


def run(args: list[str], cwd: Path, monkeypatch) -> None:
    from batchlab.cli import app

    monkeypatch.chdir(cwd)
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, f"batchlab {shlex.join(args)} exited {r.exit_code}:\n{r.output[-2000:]}\n{r.exception!r}"


def test_the_readme_shows_the_commands_of_its_tours():
    # the extraction finds what the README promises: the main job, the three calculator tours, the notebook
    firsts = [c[0] for c in COMMANDS]
    assert {"compare", "estimate", "fit", "notebook"} <= set(firsts)
    assert any("--vary" in " ".join(c) for c in COMMANDS)
    assert any(c[:1] == ["compare"] and "ac=none:full" in " ".join(c) for c in COMMANDS)


@pytest.mark.parametrize("args", QUICK, ids=[" ".join(c)[:60] for c in QUICK])
def test_a_calculator_command_runs_as_printed(args, tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHLAB_NOTEBOOK", str(tmp_path / "lab.sqlite"))
    run(args, tmp_path, monkeypatch)


@pytest.mark.slow
def test_the_measuring_and_notebook_commands_run_in_the_readmes_order(tmp_path, monkeypatch):
    """compare measures for real (both sides in processes of their own); the notebook commands read its records
    (`notebook show 1` is the first compare's)."""
    monkeypatch.setenv("BATCHLAB_NOTEBOOK", str(tmp_path / "lab.sqlite"))
    for args in IN_ORDER:
        run(fewer_updates(args), tmp_path, monkeypatch)
    if any(c[:2] == ["notebook", "show"] and "--report" in c for c in IN_ORDER):
        assert list(tmp_path.rglob("experiment-*.html")), "the report the README asks for was not written"


def test_ci_runs_exactly_the_readmes_test_command():
    """The second of the README's two commands is what CI runs, character for character."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    shown = [line for line in README.read_text().splitlines() if "-m pytest" in line and "pip install" in line]
    assert len(shown) == 1 and shown[0] in ci, (shown, ci)
    assert "set -euo pipefail" in ci
    # the site is built by a test of that run (tests/project/test_site_builds.py): a failing test skips no build
    assert "def test_the_site_builds_strict" in (ROOT / "tests" / "project" / "test_site_builds.py").read_text()
