"""The timeline as a PNG (matplotlib, Agg): a stacked area by category over op index, phases shaded,
the peak marked with what is live there, the formula's phase peaks and the device capacity."""
from __future__ import annotations

from pathlib import Path

from batchlab.timeline.data import LABELS, Timeline
from batchlab.util.units import fmt_bytes
from batchlab.timeline.style import (COLOURS, PHASE_SHADES, axis_unit, bands, capacity_shown, formula_markers,
                                     overlap_bars, peak_lines, stack)
from batchlab.util.text import for_mathtext

WIDTH_PX = 1400


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, side) = plt.subplots(1, 2, figsize=(WIDTH_PX / 100, 7), dpi=100, width_ratios=(3.2, 1))
    side.axis("off")
    return fig, ax, side


def draw(ax, t: Timeline, side=None) -> None:
    """Draw ``t`` on ``ax`` (y in GiB, or MiB below 1 GiB)."""
    unit, GIB = axis_unit(t)
    xs, parts, _ = stack(t, WIDTH_PX)
    for label, phase, lo, hi in bands(t):
        ax.axvspan(lo, hi, color=PHASE_SHADES.get(phase, "#ffffff"), zorder=0, lw=0)
        if phase in ("forward", "backward", "optimizer"):
            ax.text((lo + hi) / 2, 1.0, label, transform=ax.get_xaxis_transform(), ha="center", va="bottom",
                    fontsize=8, color="#555555")
    for name, lo, hi in overlap_bars(t):
        ax.axvspan(lo, hi, ymin=0.95, ymax=0.99, facecolor="none", hatch="///", edgecolor="#7a5195", zorder=3)
        ax.text((lo + hi) / 2, 0.97, for_mathtext(name), transform=ax.get_xaxis_transform(), ha="center", va="center",
                fontsize=8, color="#7a5195", zorder=6, bbox=dict(fc="white", ec="none", pad=1))
    base = [0.0] * len(xs)
    for c, ys in parts.items():
        top = [b + y / GIB for b, y in zip(base, ys)]
        ax.fill_between(xs, base, top, step="post", color=COLOURS[c], label=LABELS[c], lw=0, zorder=2)
        base = top
    px, pb = t.peak_op, t.peak_bytes / GIB
    ax.axvline(px, color="#222222", lw=0.8, ls=":", zorder=3)
    ax.plot([px], [pb], marker="v", color="#222222", zorder=4)
    where = side if side is not None else ax
    where.text(0.0, 0.62, for_mathtext("\n".join(peak_lines(t) + [""] + list(t.notes))), transform=where.transAxes, va="top",
               ha="left", fontsize=8, family="monospace", zorder=5, wrap=True)
    for phase, value, lo, hi in formula_markers(t):
        ax.hlines(value / GIB, lo, hi, colors="#000000", linestyles="--", lw=1.2, zorder=4)
        ax.text(hi, value / GIB, f" formula {phase} peak", fontsize=7, va="bottom", ha="right", zorder=4)
    if capacity_shown(t):
        ax.axhline(t.capacity_bytes / GIB, color="#c00000", lw=1.2, zorder=4)
        ax.text(xs[0], t.capacity_bytes / GIB, " device capacity", color="#c00000", fontsize=8, va="bottom")
    elif t.capacity_bytes:
        ax.text(0.99, 0.02, f"device capacity {fmt_bytes(t.capacity_bytes)} (above the chart)",
                transform=ax.transAxes, ha="right", fontsize=8, color="#c00000")
    ax.set_xlim(xs[0], max(xs[-1], 1))
    ax.set_ylim(0, max(pb, t.capacity_bytes / GIB if capacity_shown(t) else 0) * 1.08 or 1)
    ax.set_xlabel("op index in the update (aten ops dispatched)" if t.provenance != "allocator-history"
                  else "allocator event index")
    ax.set_ylabel(f"live tensor {unit}")
    handles, labels = ax.get_legend_handles_labels()
    where.legend(handles[::-1], labels[::-1], loc="upper left", fontsize=8, framealpha=0.9,
                 bbox_to_anchor=(0.0, 1.0) if side is not None else None)


def write_png(t: Timeline, path: str | Path) -> None:
    fig, ax, side = _figure()
    draw(ax, t, side)
    fig.suptitle(for_mathtext(f"Memory over one update [{t.provenance}: {t.method}]\n{t.title}"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    import matplotlib.pyplot as plt

    plt.close(fig)
