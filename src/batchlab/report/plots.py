"""Figures of one experiment record (matplotlib, Agg backend, imported only when drawing).

Every figure names the provenance of its numbers (``formula`` / ``trace`` / ``allocator`` / ``wall-clock``)
in its title, in a footer inside the image, and in its caption.
"""
from __future__ import annotations

import io
import statistics
from dataclasses import dataclass
from batchlab.experiment.predict import Metric
from batchlab.experiment.record import Record
from batchlab.measure.result import Outcome
from batchlab.config.phase import UPDATE_PHASES
from batchlab.util.text import for_mathtext


@dataclass(frozen=True)
class Figure:
    name: str
    title: str
    sources: tuple[str, ...]  # provenance labels of the numbers drawn
    caption: str
    png: bytes

    @property
    def label(self) -> str:
        return " / ".join(self.sources)


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buf.getvalue()


def _axes(title: str, sources: tuple[str, ...], size=(6.0, 3.6)):
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    ax.set_title(for_mathtext(f"{title}  [{' / '.join(sources)}]"), fontsize=10)
    # below the tick labels; bbox_inches="tight" keeps it inside the saved image
    fig.text(0.99, -0.06, "sources: " + ", ".join(sources), ha="right", va="top", fontsize=7, color="0.35")
    return fig, ax


def _side_values(record: Record, key: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"a": [], "b": []}
    for r in record.rounds or ():
        for side in "ab":
            m = r.side(side)
            if m is None or m.outcome is not Outcome.OK:
                continue
            if key == "peak" and m.memory is not None:
                out[side].append(m.memory.peak_bytes)
            elif key == "time" and m.time is not None and m.time.samples:
                out[side].append(m.time.update_seconds_median)
    return out


def _inputs(record: Record, kind: str, path: tuple[str, str], provenance: str):
    """Measured values per side, the formula's pair, whether anything was measured, and the sources to label."""
    measured = _side_values(record, kind)
    formula = [record.formula.figure(s, *path) for s in "ab"]
    has_measured = any(measured.values())
    sources = ((provenance,) if has_measured else ()) + (("formula",) if formula[0] is not None else ())
    return measured, formula, has_measured, sources


def memory_figure(record: Record) -> Figure:
    measured, formula, has_measured, sources = _inputs(record, "peak", ("memory", "peak_bytes"), "allocator")
    fig, ax = _axes("Peak memory per update", sources)
    x = [0, 1]
    mib = 2**20
    if has_measured:
        ax.bar([i - 0.2 for i in x], [max(measured[s]) / mib if measured[s] else 0 for s in "ab"], 0.4,
               label="measured (allocator)", color="#4477aa")
    if formula[0] is not None:
        ax.bar([i + (0.2 if has_measured else 0) for i in x], [v / mib for v in formula], 0.4,
               label="formula", color="#cccccc", edgecolor="#555555", hatch="//")
    ax.set_xticks(x, [f"A\n{_side_text(record, 'a')}", f"B\n{_side_text(record, 'b')}"], fontsize=8)
    ax.set_ylabel("MiB")
    ax.legend(fontsize=8)
    return Figure("memory", "Peak memory per update", sources,
                  "Peak memory of one optimizer update for both sides"
                  + (": measured (allocator) beside the formula estimate" if has_measured else ": formula estimate")
                  + ".", _png(fig))


def time_figure(record: Record) -> Figure:
    measured, formula, has_measured, sources = _inputs(record, "time", ("time", "update_seconds"), "wall-clock")
    fig, ax = _axes("Update time", sources)
    for i, s in enumerate("ab"):
        if measured[s]:
            ax.scatter([i] * len(measured[s]), [v * 1e3 for v in measured[s]], color="#4477aa", zorder=3,
                       label="measured per round (wall-clock)" if i == 0 else None)
        if formula[i] is not None:
            ax.hlines(formula[i] * 1e3, i - 0.3, i + 0.3, colors="#aa3377", linestyles="dashed",
                      label="formula" if i == 0 else None)
    ax.set_xticks([0, 1], [f"A\n{_side_text(record, 'a')}", f"B\n{_side_text(record, 'b')}"], fontsize=8)
    ax.set_xlim(-0.6, 1.6)
    ax.set_ylabel("ms per optimizer update")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    return Figure("time", "Update time", sources,
                  "Update time for both sides" + (": the median of each round's timed updates (wall-clock), one "
                                                  "dot per round, beside the formula estimate" if has_measured
                                                  else ": formula estimate") + ".", _png(fig))


def ratio_figure(record: Record) -> Figure | None:
    metrics = record.metrics
    series = [(k, metrics[k]) for k in (Metric.PEAK_MEMORY, Metric.UPDATE_TIME, Metric.TOKENS_PER_SECOND)
              if k in metrics and metrics[k].paired_ratios]
    if not series:
        return None
    sources = ("allocator", "wall-clock", "formula")
    fig, ax = _axes("Paired ratio B/A per round", sources, size=(6.4, 3.6))
    colors = {Metric.PEAK_MEMORY: "#4477aa", Metric.UPDATE_TIME: "#ee6677", Metric.TOKENS_PER_SECOND: "#228833"}
    for j, (k, m) in enumerate(series):
        n = len(m.paired_ratios)
        ax.scatter([j + 0.08 * (i - (n - 1) / 2) for i in range(n)], m.paired_ratios, color=colors[k], zorder=3)
        lo, hi = m.band
        ax.vlines(j, lo, hi, colors=colors[k], linewidth=6, alpha=0.3)
        if m.formula.ratio is not None:
            ax.hlines(m.formula.ratio, j - 0.3, j + 0.3, colors="#555555", linestyles="dashed",
                      label="formula B/A" if j == 0 else None)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(series)), [f"{k.label}\n({m.provenance})" for k, m in series], fontsize=8)
    ax.set_ylabel("B / A")
    ax.legend(fontsize=8)
    return Figure("ratios", "Paired ratio B/A per round", sources,
                  "Each dot is one round's ratio B/A (sides measured back to back); the shaded bar is the noise band "
                  "(min to max over rounds); a band that crosses the black 1.0 line means no effect beyond the noise; "
                  "dashed: the formula's ratio.", _png(fig))


def phase_figure(record: Record) -> Figure | None:
    phases = UPDATE_PHASES
    split: dict[str, dict[str, float]] = {}
    for s in "ab":
        sides = [r.side(s) for r in record.rounds or ()]
        per = [m.time.phase_seconds for m in sides if m is not None and m.time is not None and m.time.phase_seconds]
        if per:
            split[s] = {p: statistics.median(d.get(p, 0.0) for d in per) for p in phases}
    if len(split) < 2:
        return None
    fig, ax = _axes("Update time by phase", ("wall-clock",))
    _stacked(ax, record, {p: [split[s][p] * 1e3 for s in "ab"] for p in phases},
             "ms per optimizer update (median over rounds)")
    return Figure("phases", "Update time by phase", ("wall-clock",),
                  "Per-phase split of one update (median of each round's per-phase medians, wall-clock): data, "
                  "forward, backward (all micro-batches) and the optimizer step.", _png(fig))


def formula_breakdown_figure(record: Record) -> Figure | None:
    if not record.formula.available:
        return None
    at_peak = {s: record.formula.figure(s, "memory", "at_peak") or {} for s in "ab"}
    parts = [k for k in at_peak["a"] if any(at_peak[s].get(k) for s in "ab")]
    fig, ax = _axes("Memory live at the peak", ("formula",))
    _stacked(ax, record, {k: [at_peak[s].get(k, 0) / 2**20 for s in "ab"] for k in parts}, "MiB")
    return Figure("formula-terms", "Memory live at the peak", ("formula",),
                  "What the formula says is live at each side's peak (paper derivation, not a measurement); the "
                  "parts add up to the peak tensor bytes.", _png(fig))


COLORS = ("#4477aa", "#ee6677", "#ccbb44", "#228833", "#66ccee", "#aa3377", "#bbbbbb", "#000000")


def _stacked(ax, record: Record, series: dict[str, list[float]], ylabel: str) -> None:
    """One stacked bar per side (A, B), a segment per series."""
    bottom = [0.0, 0.0]
    for (label, vals), color in zip(series.items(), COLORS):
        ax.bar([0, 1], vals, 0.5, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks([0, 1], [f"A\n{_side_text(record, 'a')}", f"B\n{_side_text(record, 'b')}"], fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)


def figures(record: Record) -> list[Figure]:
    out = [memory_figure(record), time_figure(record), ratio_figure(record), phase_figure(record)]
    if record.formula_only:
        out.append(formula_breakdown_figure(record))
    return [f for f in out if f is not None]


def _side_text(record: Record, side: str) -> str:
    """The changed values and the global batch = micro x accum x DP of one side, for axis labels."""
    c = record.sides[side]
    changed = [f"{ch['field']}={ch[side]}" for ch in record.change["requested"]]
    changed += [f"{k}={v[0 if side == 'a' else 1]}" for k, v in record.change["derived"].items()]
    return for_mathtext(", ".join(changed) + f"\n{c['micro_batch']} x {c['accum']} x {c['dp']} = "
            f"{c['micro_batch'] * c['accum'] * c['dp']}")


def _label_apart(ax, labels: list[tuple[str, float, float]], points, scale: float) -> None:
    """Each (text, x, y) beside its marker; a label whose marker sits within about a label's width (15% of the
    peak span) and 6% of the time span of the one before is set one line lower (presets of equal time and
    nearby peaks would print over each other)."""
    xs = [p.peak_bytes / scale for p in points] or [0.0]
    ys = [p.update_seconds for p in points] or [0.0]
    dx, dy = (max(xs) - min(xs)) or 1.0, (max(ys) - min(ys)) or 1.0
    drop, last = 0, None
    for text, x, y in labels:
        near = last is not None and abs(x - last[0]) < 0.15 * dx and abs(y - last[1]) < 0.06 * dy
        drop = drop + 1 if near else 0
        ax.annotate(text, (x, y), fontsize=7, xytext=(3, 3 - 9 * drop), textcoords="offset points")
        last = (x, y)


def frontier_png(points, budget_bytes: int, chosen=None, provenance: str = "formula") -> bytes:
    """fit --ac auto's memory/time frontier: each budget's best plan and the presets on the same axes.
    ``points``: advise.acplan.Point values."""
    fig, ax = _axes("activation checkpointing: memory vs update time", (provenance,))
    unit, scale = ("GiB", 2**30) if max([budget_bytes, *(p.peak_bytes for p in points)]) >= 4 * 2**30 else ("MiB", 2**20)
    for kind, style in (("plan", dict(marker="o", linestyle="-", color="#4e79a7")),
                        ("preset", dict(marker="s", linestyle="none", color="#e15759"))):
        pts = sorted((p for p in points if p.kind == kind), key=lambda p: (p.peak_bytes, p.update_seconds))
        ax.plot([p.peak_bytes / scale for p in pts], [p.update_seconds for p in pts], label=kind + "s", **style)
        if kind == "preset":
            _label_apart(ax, [(p.ac, p.peak_bytes / scale, p.update_seconds) for p in pts], points, scale)
    if chosen is not None:
        ax.plot([chosen.peak_bytes / scale], [chosen.update_seconds], marker="*", markersize=14, color="#59a14f",
                linestyle="none", label="chosen plan")
    ax.axvline(budget_bytes / scale, color="#bab0ac", linestyle="--", label="budget")
    ax.set_xlabel(f"predicted peak ({unit})")
    ax.set_ylabel("predicted update (s)")
    ax.legend(fontsize=8)
    return _png(fig)
