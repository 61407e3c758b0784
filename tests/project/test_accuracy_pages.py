"""The accuracy pages speak of the product and render as written: every Markdown list starts after a blank line
(else it renders as one paragraph with literal "- "), in the committed pages and in what benchmarks/published.py
writes; no page names the project's work items ("issue 36", "round-3")."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
ACCURACY = ROOT / "docs" / "accuracy"


def lists_without_a_blank_line(text: str) -> list[str]:
    """Lines that open a list right under a line of text (not a list item, not blank, not in a code block)."""
    out, fenced, prev = [], False, ""
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"- ", line) and prev.strip() and not re.match(r"\s*- |\s{2,}\S", prev):
            out.append(f"{prev!r} -> {line[:60]!r}")
        prev = line
    return out


@pytest.mark.parametrize("page", sorted(ACCURACY.glob("*.md")), ids=lambda p: p.name)
def test_an_accuracy_page_opens_every_list_after_a_blank_line(page):
    assert not lists_without_a_blank_line(page.read_text())


@pytest.mark.parametrize("page", sorted(ACCURACY.glob("*.md")), ids=lambda p: p.name)
def test_an_accuracy_page_speaks_of_the_product_not_of_work_items(page):
    text = re.sub(r"https?://\S+", "", page.read_text())  # other projects' issue links are sources
    found = re.findall(r"\bissue \d+|\bissue's\b|\bround-\d\b|\bround \d\b|\bsessions?\b|\bthe issue\b", text, re.I)
    assert not found, found


def test_published_py_writes_its_summary_lists_after_blank_lines():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import published

    runs = published.load(published.HERE / "published_runs.toml")["run"]
    recorded = published.load_recorded(published.HERE / "published_before.toml",
                                       published.HERE / "published_round3_first.toml")
    text = published.document([published.evaluate(r, recorded) for r in runs])
    assert "all runs:\n\n- " in text
    assert not lists_without_a_blank_line(text)
    assert not re.search(r"issue \d+|round-\d", text, re.I)
