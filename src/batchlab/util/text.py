"""User text made safe for each renderer, in one place.  Any string a person typed (a note, a variable, a
model name or path, a change value) can reach a terminal (rich markup), a figure (matplotlib mathtext), a
Markdown report and an HTML page; unescaped, ``[/oops]`` crashes rich, ``$\\foo{$`` crashes matplotlib and
``<script>`` runs in a Markdown viewer.  Each function returns text that the renderer shows literally.
Pure Python (rich is imported only by ``for_rich``)."""
from __future__ import annotations

import html
import re
from typing import Any

# CommonMark punctuation that starts markup inside a line (code, emphasis, table cells); "_" only where it
# can open or close emphasis (at a word edge), so micro_batch stays readable in the source.
_MD_SPECIAL = re.compile(r"([\\`*|~])")
# "]" only where it closes a link or image ("](url)", "][ref]") or a reference definition ("]: url");
# a plain "[allocator]" stays as written
_MD_LINK_CLOSE = re.compile(r"\](?=[(\[:])")
_MD_UNDERSCORE = re.compile(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")
_MD_BLOCK_START = re.compile(r"^(\s*)(?:(>|#(?=#*(?:\s|$))|[+\-](?=\s|$))|(\d+)([.)])(?=\s|$))")


def for_rich(text: Any) -> str:
    """Rich console markup: ``[`` that could open a tag is escaped."""
    from rich.markup import escape

    return escape(str(text))


def for_mathtext(text: Any) -> str:
    """A matplotlib label, title or tick: an unescaped ``$`` pair would be parsed as mathtext."""
    return str(text).replace("$", r"\$")


def for_html(text: Any) -> str:
    """HTML text or a quoted attribute value."""
    return html.escape(str(text), quote=True)


def for_markdown(text: Any) -> str:
    """Markdown text (a paragraph, a list item or a table cell): raw HTML becomes entities, markup characters
    are backslash-escaped, a leading ``#``/``-``/``1.`` cannot start a block, newlines become spaces."""
    # "<" opens raw HTML and "&" an entity; ">" is harmless inside a line (a leading one is escaped below)
    s = str(text).replace("&", "&amp;").replace("<", "&lt;").replace("\r", " ").replace("\n", " ")
    s = _MD_SPECIAL.sub(r"\\\1", s)
    s = _MD_LINK_CLOSE.sub(r"\\]", _MD_UNDERSCORE.sub(r"\\_", s))
    return _MD_BLOCK_START.sub(lambda m: m.group(1) + (f"\\{m.group(2)}" if m.group(2) else f"{m.group(3)}\\{m.group(4)}"), s)


# where --verbose output points for the full citations of device figures and calibrations
SOURCES_POINTER = "sources: batchlab docs, Sources page"


def print_assumptions(out: Any, items: Any, title: str = "assumptions", note: str = "") -> None:
    """--verbose's assumptions on a rich console ``out``: a bold title (and ``note`` after it), each item shown
    literally, then where their sources are."""
    out.print(f"[bold]{for_rich(title)}[/]" + (f" {for_rich(note)}" if note else ""))
    for a in items:
        out.print(f"- {a}", markup=False, highlight=False)
    out.print(f"[dim]{SOURCES_POINTER}[/]")
