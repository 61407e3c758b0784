"""The documentation's reference pages are generated from the code and complete: every command's every option in
the CLI reference, every config field in the files reference, every catalogue device on the sources page.

CI builds the whole site (`mkdocs build --strict`); these check the generators themselves, in a second."""
from __future__ import annotations

import dataclasses
import importlib.util
import re
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


def test_the_python_api_page_lists_every_run_config_field():
    """reference/python.md carries the marker the hook fills with RunConfig's fields, types and defaults."""
    from batchlab.config import RunConfig

    gen = _generator()
    marker, build = gen.MARKERS["reference/python.md"]
    assert marker in (DOCS / "reference" / "python.md").read_text()
    table = build()
    for f in dataclasses.fields(RunConfig):
        assert f"| `{f.name}` |" in table, f"RunConfig.{f.name} is missing from the Python API page"
    assert "| `micro_batch` | `int` | `8` |" in table  # type and default from the dataclass


def _mkdocs_yml() -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((DOCS.parent / "mkdocs.yml").read_text())


def _nav_pages(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    items = nav.values() if isinstance(nav, dict) else nav
    return [page for item in items for page in _nav_pages(item)]


def test_the_site_carries_no_python_of_the_docs_folder():
    """The hooks live beside the pages: they and the bytecode Python caches for them stay out of the site."""
    config = _mkdocs_yml()
    excluded = config["exclude_docs"].split()
    assert "__pycache__/" in excluded
    for script in DOCS.rglob("*.py"):
        assert f"/{script.relative_to(DOCS)}" in excluded, script
        assert f"docs/{script.relative_to(DOCS)}" in config["hooks"], script


def test_earlier_records_are_linked_but_not_in_the_navigation():
    config = _mkdocs_yml()
    nav = _nav_pages(config["nav"])
    summary = (DOCS / "accuracy" / "index.md").read_text()
    for page in config["not_in_nav"].split():
        assert page.lstrip("/") not in nav and (DOCS / page.lstrip("/")).exists(), page
        assert f"]({Path(page).name})" in summary, f"{page} is linked from nowhere"
    assert not [p for p in nav if re.search(r"baseline|round|before", p)], nav


def test_chinese_pages_are_marked_lang_zh():
    spec = importlib.util.spec_from_file_location("page_language", DOCS / "page_language.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)

    class Page:
        def __init__(self, src_uri):
            self.file = type("F", (), {"src_uri": src_uri})()

    html = '<!doctype html>\n<html lang="en" class="no-js">\n<head></head>'
    for page in (DOCS / "zh").rglob("*.md"):
        out = hook.on_post_page(html, Page(page.relative_to(DOCS).as_posix()), {})
        assert '<html lang="zh" class="no-js">' in out, page
    assert hook.on_post_page(html, Page("tutorial.md"), {}) == html


@pytest.mark.parametrize("page, prefix", [("tutorial.md", ""), ("zh/tutorial.md", "../"), ("how-to/notebook.md", "../")])
def test_the_report_is_shown_readable_and_linked_at_full_size(page, prefix):
    """The whole report (1280 x 2000 px) shrinks to unreadable text in the page's column: the pages show its top
    (cropped to the content, about as wide as the column) and link the full-size image."""
    import struct

    text = (DOCS / page).read_text()
    assert f"({prefix}img/report-top.png)]({prefix}img/report.png)" in text
    assert not re.search(r"^!\[[^\]]*\]\([./]*img/report\.png\)", text, re.M)  # the whole report is never inlined
    width, height = struct.unpack(">II", (DOCS / "img" / "report-top.png").read_bytes()[16:24])
    assert width <= 1000 and height < 1.2 * width  # shown near its own size: the text stays ~13 px high
