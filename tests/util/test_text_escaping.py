"""User text reaches four renderers; each shows it literally.  References: CommonMark as markdown-it-py
renders it (raw HTML allowed, as GitHub-like viewers do), rich's own markup parser, matplotlib's mathtext
parser, the HTML the report writes.  Also: a report that cannot be written leaves no file behind."""
from __future__ import annotations

import errno
import os

import pytest
from markdown_it import MarkdownIt
from rich.console import Console

from batchlab.config import ConfigError
from batchlab.experiment.compare import run
from batchlab.report import write_report
from batchlab.report.document import notebook_markdown
from batchlab.util.text import for_html, for_markdown, for_mathtext, for_rich
from fake_measure import FakeMeasure, plan_for

PAYLOADS = ["<script>alert(1)</script>", "<img src=x onerror=alert(1)>", "[/oops]", "[bold]x[/bold]",
            r"$\foo{$", "$x$", "a|b", "# not a heading", "1. not a list", "*not em* _not em_ `not code`",
            "[link](javascript:alert(1))", "![i](x.png)", "[a][b]", "[x]: javascript:alert(1)", "<http://x.y>",
            "&amp; stays &amp;", "micro_batch", "[allocator]"]
md = MarkdownIt("commonmark", {"html": True})


def plain(rendered_html: str) -> str:
    """Text content of markdown-it's HTML (entities decoded) — what a reader sees."""
    import html
    import re

    return html.unescape(re.sub(r"<[^>]+>", "", rendered_html)).strip()


@pytest.mark.parametrize("text", PAYLOADS)
def test_markdown_shows_the_text_literally_and_no_tag(text):
    out = md.render(for_markdown(text))
    assert plain(out) == text, out
    assert "<script" not in out and "<img" not in out and "<a " not in out and "<em>" not in out
    assert out.startswith("<p>"), out  # never a heading or list


def test_a_reference_definition_in_one_field_links_nothing_in_another():
    out = md.render(for_markdown("[x]: javascript:alert(1)") + "\n\n" + for_markdown("see [x]"))
    assert "<a " not in out and "javascript:alert(1)" in plain(out)


@pytest.mark.parametrize("text", PAYLOADS)
def test_rich_markup_shows_the_text_literally(text):
    console = Console(record=True, width=200)
    console.print(f"[bold]label[/] {for_rich(text)}")
    assert console.export_text().strip() == f"label {text}"


@pytest.mark.parametrize("text", PAYLOADS)
def test_mathtext_is_never_parsed(text):
    from matplotlib.mathtext import MathTextParser  # noqa: F401 - the parser the Agg backend uses
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    t = ax.set_title(for_mathtext(text))
    fig.canvas.draw()  # raises ValueError on bad mathtext
    assert t._preprocess_math(t.get_text())[0] == text  # shown as typed (\$ -> $), not as math
    plt.close(fig)


def test_html_escape_covers_attributes():
    assert for_html("<a href='x' onclick=\"y\">&") == "&lt;a href=&#x27;x&#x27; onclick=&quot;y&quot;&gt;&amp;"


@pytest.fixture(scope="module")
def hostile():
    note = "<script>alert(1)</script> <img src=x onerror=alert(1)> [/oops] $\\foo{$"
    p = plan_for("model_source=builtin:[/oops]$\\foo{$<script>", "memory=up", note=note)
    rec = run(p, measure=FakeMeasure((p.sides.a, p.sides.b)), verify=False)
    return rec.with_(notebook_id=7)


@pytest.fixture(scope="module")
def figures_once():
    """The report's charts (matplotlib: ~1 s a write) rendered once per distinct input for the module's three
    writes of one record: the same record renders the same bytes, and what is under test is the text in them and
    what a failed write leaves behind."""
    from batchlab.report import document

    def once(fn):
        done = {}

        def call(*args):
            key = repr(args)
            if key not in done:
                done[key] = fn(*args)
            return done[key]
        return call

    with pytest.MonkeyPatch.context() as mp:
        for name in ("figures", "_timeline_png", "_pair_svg"):
            mp.setattr(document, name, once(getattr(document, name)))
        yield


def test_a_report_of_hostile_text_renders_everywhere(hostile, tmp_path, figures_once):
    md_path, html_path = write_report(hostile, tmp_path)
    text = md_path.read_text()
    rendered = md.render(text)
    assert "<script" not in rendered and "<img src=x" not in rendered
    assert "[/oops]$\\foo{$<script>" in plain(rendered)  # the variable, shown as typed
    page = html_path.read_text()
    assert "<script" not in page and "onerror=alert" not in page.replace("onerror=alert(1)&gt;", "")
    assert "&lt;script&gt;" in page
    exported = md.render(notebook_markdown([hostile]))
    assert "<script" not in exported and "<img src=x" not in exported


def test_the_terminal_renderer_prints_hostile_text(hostile):
    from batchlab.cli.render_experiment import render

    console = Console(record=True, width=250)
    render(console, hostile)
    out = console.export_text()
    assert "[/oops]" in out and "<script>alert(1)</script>" in out


def test_a_report_that_cannot_be_written_leaves_no_file(hostile, tmp_path, monkeypatch, figures_once):
    real = os.fsync
    calls = []

    def full(fd):  # the third file finds the disk full
        calls.append(fd)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(ConfigError) as e:
        write_report(hostile, tmp_path / "r")
    assert e.value.field == "report" and "No space left on device" in str(e.value)
    assert list((tmp_path / "r").iterdir()) == []

    def read_only(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "ro"))

    monkeypatch.setattr("tempfile.mkstemp", read_only)
    with pytest.raises(ConfigError, match="Permission denied"):
        write_report(hostile, tmp_path / "ro")
    assert list((tmp_path / "ro").iterdir()) == []
