"""The documentation's reference pages are generated from the code and complete: every command's every option in
the CLI reference, every config field in the files reference, every catalogue device on the sources page.

CI builds the whole site (`mkdocs build --strict`); these check the generators themselves, in a second."""
from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

DOCS = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists()) / "docs"


def _generator():
    pytest.importorskip("mkdocs")
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_reference", module)
    spec.loader.exec_module(module)
    return module


def _commands(command, path=()):
    yield path, command
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from _commands(sub, (*path, name))


def test_the_cli_reference_shows_every_option_of_every_command():
    docs = pytest.importorskip("mkdocs_click._docs")
    from batchlab.cli import click_command

    text = "\n".join(docs.make_command_docs("batchlab", click_command, depth=1, style="plain"))
    checked = 0
    for path, command in _commands(click_command):
        assert f"batchlab {' '.join(path)}".strip() in text, path
        for param in command.params:
            for opt in param.opts:
                if opt.startswith("--"):
                    assert opt in text, f"batchlab {' '.join(path)} {opt} is missing from the CLI reference"
                    checked += 1
    assert checked > 100  # every command's config flags: the walk really saw the options


def test_the_files_reference_lists_every_config_field():
    from batchlab.config import Assumptions, ModelSpec, RunConfig

    page = _generator().files_page()
    for cls in (RunConfig, ModelSpec, Assumptions):
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in page, f"{cls.__name__}.{f.name} is missing from the files reference"


def test_the_json_reference_is_a_real_estimate_and_the_records_fields():
    from batchlab.config import RunConfig
    from batchlab.formula import estimate

    page = _generator().json_page()
    for key in estimate(RunConfig()).to_dict()["memory"]:
        assert f"  {key}:" in page, key
    assert "| `peak_bytes` |" in page and "| `schema` |" in page  # Timeline's and Record's fields


def test_the_sources_page_has_a_section_per_catalogue_device():
    from batchlab.config import DEVICES

    sections = _generator().device_sections()
    assert all(f"## {name}\n" in sections for name in DEVICES if name != "cpu")


def test_the_cli_reference_summarises_each_command_in_a_complete_sentence():
    """mkdocs-click lists each command with the first line of its short help (or help): a sentence, not a cut."""
    docs = pytest.importorskip("mkdocs_click._docs")
    from batchlab.cli import click_command

    text = "\n".join(docs.make_command_docs("batchlab", click_command, depth=1, style="plain",
                                            list_subcommands=True))
    summaries = [line for line in text.splitlines() if line.startswith("- *")]
    assert len(summaries) >= 7, summaries
    for line in summaries:
        summary = line.split("*: ", 1)[1]
        assert summary.endswith(".") and summary.count("(") == summary.count(")"), line
