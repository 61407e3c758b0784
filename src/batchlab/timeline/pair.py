"""Two timelines on one axis (A vs B) for compare reports: what a change does to memory over the update.

x is the fraction of each update's ops (the two configs run different numbers of ops), y the live total;
a thinner line of the same colour is what forward created and backward still needs (activations, logits,
recompute): AC none vs full shows the ramp flattening and the recompute bumps, micro-batch 4x1 vs 2x2 the
gradients living across micro-batches.  Peaks marked, the formula's phase peaks as dotted bars; every
provenance in the legend.

The compare record keeps each side's timeline (experiment/record.py ``timelines``); report/document.py
embeds ``pair_svg`` in the HTML and writes ``write_pair_png`` beside the Markdown.
"""
from __future__ import annotations

import io
from pathlib import Path

from batchlab.timeline.data import Timeline, downsample
from batchlab.timeline.style import axis_unit, formula_markers
from batchlab.util.units import fmt_bytes
from batchlab.util.text import for_mathtext

_ACTIVATION_LIKE = ("activations", "logits", "recompute")
PAIR_COLOURS = ("#1f5fa8", "#c4461a")
PNG_WIDTH_PX = 1400


def pair_series(t: Timeline, width: int = 1200) -> tuple[list[float], list[int], list[int]]:
    """(fraction of the update, live total, activation-like bytes) at the kept samples (peak included)."""
    keep = downsample(t, width)
    span = max(t.ops[-1], 1)
    totals = t.totals
    acts = [sum(t.parts.get(c, (0,) * len(t.ops))[i] for c in _ACTIVATION_LIKE) for i in keep]
    return [t.ops[i] / span for i in keep], [totals[i] for i in keep], acts


def pair_figure(a: Timeline, b: Timeline, labels: tuple[str, str] = ("A", "B")):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = (for_mathtext(labels[0]), for_mathtext(labels[1]))  # user values: never parsed as mathtext
    unit, div = axis_unit(a if a.peak_bytes >= b.peak_bytes else b)
    fig, ax = plt.subplots(figsize=(11, 5), dpi=100)  # ~1100 px: legible at a report's width
    for t, label, colour, style in ((a, labels[0], PAIR_COLOURS[0], "-"), (b, labels[1], PAIR_COLOURS[1], "--")):
        x, total, acts = pair_series(t)
        ax.step(x, [v / div for v in total], where="post", color=colour, ls=style, lw=1.6,
                label=f"{label}: live total [{t.provenance}]")
        ax.step(x, [v / div for v in acts], where="post", color=colour, ls=style, lw=0.8, alpha=0.7,
                label=f"{label}: activations + logits + recompute")
        _formula_marks(ax, t, label, colour, div)
        px = t.peak_op / max(t.ops[-1], 1)
        ax.plot([px], [t.peak_bytes / div], marker="v", color=colour, ms=9)
        ax.annotate(f"{label} peak {fmt_bytes(t.peak_bytes)} ({t.peak_phase.label})",
                    (px, t.peak_bytes / div), textcoords="offset points", xytext=(6, 6), fontsize=9, color=colour)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, max(a.peak_bytes, b.peak_bytes) / div * 1.12)
    ax.set_xlabel("fraction of the update (ops dispatched)")
    ax.set_ylabel(f"live tensor {unit}")
    ax.legend(loc="upper right", fontsize=8)  # late in the update both curves are low
    ax.set_title(f"{labels[0]}: {for_mathtext(a.title)}\n{labels[1]}: {for_mathtext(b.title)}", fontsize=9)
    fig.tight_layout()
    return fig


def _formula_marks(ax, t: Timeline, label: str, colour: str, div: int) -> None:
    """The formula's peak of each phase as a dotted bar over that phase's last span (as on the single chart),
    so the chart shows where the calculator agrees with the drawn curve."""
    span = max(t.ops[-1], 1)
    for i, (phase, value, lo, hi) in enumerate(formula_markers(t)):
        ax.hlines(value / div, lo / span, hi / span, colors=colour, linestyles=":", lw=2.2,
                  label=f"{label}: formula phase peaks [formula]" if i == 0 else None)
        ax.text(hi / span, value / div, f"formula {phase} ", fontsize=7, color=colour, ha="right", va="top")  # below: the peak labels sit above


def _save(fig, target, fmt: str, dpi: float | str = "figure") -> None:
    import matplotlib.pyplot as plt

    fig.savefig(target, format=fmt, dpi=dpi)
    plt.close(fig)


def write_pair_png(a: Timeline, b: Timeline, path: str | Path, labels: tuple[str, str] = ("A", "B")) -> None:
    fig = pair_figure(a, b, labels)
    _save(fig, path, "png", dpi=PNG_WIDTH_PX / fig.get_figwidth())  # the same layout, 1400 px wide


def pair_svg(a: Timeline, b: Timeline, labels: tuple[str, str] = ("A", "B")) -> str:
    """The pair as an inline SVG string (no external resources) for an HTML report."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # text stays text: smaller, selectable
        _save(pair_figure(a, b, labels), buf, "svg")
    text = buf.getvalue()
    return text[text.index("<svg"):]
