"""Experiment reports: Markdown + PNGs and a self-contained HTML page, every figure labelled with how its
numbers were obtained, global batch = micro x accum x DP printed for both sides."""
from __future__ import annotations

import base64
import re

import pytest

from batchlab.experiment.compare import run
from batchlab.report import write_report
from batchlab.report.plots import figures
from fake_measure import FakeMeasure, plan_for

PROVENANCE = {"formula", "trace", "allocator", "wall-clock"}
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def measured():
    p = plan_for("ac=none:full", "memory=down,time=down", note="quiet")
    rec = run(p, measure=FakeMeasure((p.sides.a, p.sides.b), peak=(4000, 1000), times=((1.0, 1.5),) * 3),
              verify=False)
    return rec.with_(notebook_id=5)


@pytest.fixture(scope="module")
def written(measured, tmp_path_factory):
    """``measured``'s report written once (markdown, html, PNGs) for the tests that read its files."""
    folder = tmp_path_factory.mktemp("report")
    return write_report(measured, folder), folder


def test_every_figure_names_its_provenance(measured):
    figs = figures(measured)
    assert [f.name for f in figs] == ["memory", "time", "ratios", "phases"]
    for f in figs:
        assert f.sources and set(f.sources) <= PROVENANCE and f.png.startswith(PNG)
    by = {f.name: f for f in figs}
    assert by["memory"].sources == ("allocator", "formula") and by["phases"].sources == ("wall-clock",)


def test_markdown_and_html_are_written_with_labels_and_global_batch(written):
    paths, folder = written
    assert [p.name for p in paths] == ["experiment-5.md", "experiment-5.html"]
    md = paths[0].read_text()
    for side in ("A", "B"):
        assert f"- {side}: global batch = micro-batch x accum x DP = 2 x 2 x 1 = 4 sequences" in md
    images = re.findall(r"!\[Figure \d+: [^]]+\]\(([^)]+)\)", md)
    assert images == [f"experiment-5-{n}.png" for n in ("memory", "time", "ratios", "phases")]
    for name in images:
        assert (folder / name).read_bytes().startswith(PNG)
    captions = re.findall(r"\*Figure \d+ — [^[]+\[([^]]+)\]", md)
    assert len(captions) == 4 and all(set(c.split(" / ")) <= PROVENANCE for c in captions)
    assert "| update time | 1.00 s | 1.50 s | 1.5 | 1.5 – 1.5 | ↑ up | ↓ down (missed) |" in md
    assert "## Diagnosis" in md and "you predicted update_time down, observed up" in md
    page = paths[1].read_text()
    assert "global batch = micro-batch x accum x DP = 2 x 2 x 1 = 4" in page
    # self-contained: every image inline, nothing fetched from elsewhere
    srcs = re.findall(r"src='([^']+)'", page)
    assert len(srcs) == 4 and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert base64.b64decode(srcs[0].split(",", 1)[1]).startswith(PNG)
    assert not re.search(r"(href|src)=['\"]?https?:", page) and "<script" not in page
    assert len(re.findall(r"<figcaption>Figure \d+ — [^<]+<span class='src'>\[[a-z/ -]+\]</span>", page)) == 4


def test_a_formula_only_report_says_it_is_a_derivation(tmp_path):
    p = plan_for("ac=none:full", formula_only=True)
    rec = run(p)
    figs = figures(rec)
    assert all(f.sources == ("formula",) for f in figs)
    md = write_report(rec, tmp_path)[0].read_text()
    assert "formula only — a paper derivation, nothing measured" in md
    assert "## Formula derivation (not an observation)" in md and "| metric | A (formula) |" in md


def test_the_report_draws_both_timelines_on_one_axis(written):
    (md_path, page_path), folder = written
    md, page = md_path.read_text(), page_path.read_text()
    assert "## Memory over one update, A and B on one axis" in md
    assert "A: ac=none: peak 3.91 KiB in forward 1 [allocator: fake]" in md
    assert "B: ac=full: peak 1000 B in forward 1 [allocator: fake]" in md
    assert "![Memory over one update, A and B](experiment-5-timeline.png)" in md
    assert (folder / "experiment-5-timeline.png").read_bytes().startswith(PNG)
    # inline SVG (text kept as text): both sides' labels, their provenance and the formula's phase markers
    svg = re.search(r"<figure class='timeline'>(<svg.*?</svg>)", page, re.S).group(1)
    for text in ("A: ac=none: live total [allocator]", "B: ac=full: live total [allocator]",
                 "A: ac=none: formula phase peaks [formula]", "formula backward",
                 "A: ac=none peak 3.91 KiB (forward 1)"):
        assert text in svg, text


def test_a_record_without_timelines_says_why(measured, tmp_path):
    md = write_report(measured.with_(timelines={}), tmp_path)[0].read_text()
    assert "No memory timeline for side A and B" in md and "timeline.png" not in md
