"""What both renderers draw, computed once: colours, the downsampled stack, phase bands, the peak's words."""
from __future__ import annotations

from batchlab.timeline.data import CATEGORIES, LABELS, Timeline, downsample
from batchlab.util.units import fmt_bytes

COLOURS = {"parameters": "#4e79a7", "gradients": "#f28e2b", "optimizer": "#76b7b2", "activations": "#e15759",
           "logits": "#b07aa1", "recompute": "#edc948", "temporaries": "#bab0ac", "data": "#59a14f"}
PHASE_SHADES = {"forward": "#e8f0fb", "backward": "#fbeee6", "optimizer": "#eaf5ea", "data": "#f4f4f4",
                "end": "#ffffff"}
FORMULA_PHASES = ("forward", "backward", "optimizer")


def used_categories(t: Timeline) -> list[str]:
    return [c for c in CATEGORIES if any(t.parts.get(c, ()))]


def stack(t: Timeline, width: int) -> tuple[list[int], dict[str, list[int]], list[int]]:
    """(op index, category -> bytes, sample index) at the kept samples; the peak sample is among them."""
    keep = downsample(t, width)
    return ([t.ops[i] for i in keep], {c: [t.parts[c][i] for i in keep] for c in used_categories(t)}, keep)


def bands(t: Timeline) -> list[tuple[str, str, int, int]]:
    """(label, phase, first op, last op) of each phase span that has ops; each band reaches the next one."""
    spans = [p for p in t.phases if p.last_op > p.first_op]
    ends = [q.first_op for q in spans[1:]] + [spans[-1].last_op] if spans else []
    return [(p.label, p.phase, p.first_op, end) for p, end in zip(spans, ends)]


def formula_markers(t: Timeline) -> list[tuple[str, int, int, int]]:
    """(phase, bytes, first op, last op): the formula's peak of each phase over that phase's last span."""
    out = []
    for phase in FORMULA_PHASES:
        spans = [p for p in t.phases if p.phase == phase and p.last_op > p.first_op]
        if phase in t.formula_phase_peaks and spans:
            out.append((phase, t.formula_phase_peaks[phase], spans[-1].first_op, spans[-1].last_op))
    return out


def peak_lines(t: Timeline, modules: int = 4) -> list[str]:
    """What is live at the peak, in words: total, phase, op, the categories, the blocks holding the most."""
    lines = [f"peak {fmt_bytes(t.peak_bytes)} ({t.peak_bytes:,} B) in {t.peak_phase.label}, op {t.peak_op} "
             f"{t.op_names[t.peak_sample]}"]
    lines += [f"  {LABELS[c]}: {fmt_bytes(v)}" for c, v in t.at_peak.items() if v]
    top = sorted(t.at_peak_by_module.items(), key=lambda kv: -sum(kv[1].values()))[:modules]
    if top:
        lines.append("  held by (created there, live at the peak):")
        lines += [f"    {name or '(model)'}: {fmt_bytes(sum(parts.values()))}" for name, parts in top]
    return lines


def capacity_shown(t: Timeline) -> bool:
    """The capacity line is drawn when it would not squash the curve (within 3x the peak)."""
    return 0 < t.capacity_bytes <= 3 * max(t.peak_bytes, 1)


def axis_unit(t: Timeline) -> tuple[str, int]:
    """GiB for a peak of 1 GiB or more, else MiB (display only)."""
    return ("GiB", 2**30) if t.peak_bytes >= 2**30 else ("MiB", 2**20)


def overlap_bars(t: Timeline) -> list[tuple[str, int, int]]:
    """(label, first op, last op) of communication drawn over the phase span it overlaps."""
    spans = {label: (lo, hi) for label, _, lo, hi in bands(t)}
    return [(name, *spans[label]) for name, label in t.overlaps.items() if label in spans]
