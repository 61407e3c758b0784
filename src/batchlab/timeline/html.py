"""The timeline as one self-contained HTML file: inline SVG drawn here, a few lines of script for the hover
(op and live total), no network, no libraries; laid out for a 1400 px wide window."""
from __future__ import annotations

import json

from batchlab.timeline.data import LABELS, Timeline
from batchlab.timeline.style import (COLOURS, PHASE_SHADES, axis_unit, bands, capacity_shown, formula_markers,
                                     overlap_bars, peak_lines, stack, used_categories)
from batchlab.util.units import fmt_bytes
from batchlab.util.text import for_html

W, H, LEFT, RIGHT, TOP, BOTTOM = 1000, 520, 70, 20, 30, 50  # SVG user units (the SVG scales to its box)

_SCRIPT = """
const d = JSON.parse(document.getElementById('tl-data').textContent);
const svg = document.getElementById('tl'), tip = document.getElementById('tip'), cur = document.getElementById('cursor');
svg.addEventListener('mousemove', e => {
  const p = svg.createSVGPoint(); p.x = e.clientX; p.y = e.clientY;
  const x = p.matrixTransform(svg.getScreenCTM().inverse()).x;
  let lo = 0, hi = d.x.length - 1;
  while (lo < hi) { const m = (lo + hi + 1) >> 1; if (d.x[m] <= x) lo = m; else hi = m - 1; }
  cur.setAttribute('x1', d.x[lo]); cur.setAttribute('x2', d.x[lo]); cur.style.display = '';
  tip.textContent = 'op ' + d.op[lo] + ' ' + d.name[lo] + ' (' + d.phase[lo] + '): live ' + d.total[lo];
});
svg.addEventListener('mouseleave', () => { cur.style.display = 'none'; tip.textContent = d.hint; });
"""


def _scales(t: Timeline, xs: list[int]):
    unit, div = axis_unit(t)
    top = max(t.peak_bytes, t.capacity_bytes if capacity_shown(t) else 0) * 1.08 or 1
    x0, x1 = xs[0], max(xs[-1], xs[0] + 1)
    sx = lambda op: LEFT + (op - x0) / (x1 - x0) * (W - LEFT - RIGHT)  # noqa: E731
    sy = lambda b: TOP + (1 - b / top) * (H - TOP - BOTTOM)  # noqa: E731
    return sx, sy, top, unit, div


def _step_path(xs, lows, highs, sx, sy) -> str:
    """A filled band between two step curves (value held until the next sample, as in the recording)."""
    up = []
    for i, (x, h) in enumerate(zip(xs, highs)):
        nxt = xs[i + 1] if i + 1 < len(xs) else x
        up += [f"{sx(x):.1f},{sy(h):.1f}", f"{sx(nxt):.1f},{sy(h):.1f}"]
    down = []
    for i in reversed(range(len(xs))):
        nxt = xs[i + 1] if i + 1 < len(xs) else xs[i]
        down += [f"{sx(nxt):.1f},{sy(lows[i]):.1f}", f"{sx(xs[i]):.1f},{sy(lows[i]):.1f}"]
    return "M" + " L".join(up + down) + " Z"


def _svg(t: Timeline) -> tuple[str, dict]:
    xs, parts, keep = stack(t, 1400)
    sx, sy, top, unit, div = _scales(t, xs)
    out = [f'<svg id="tl" viewBox="0 0 {W} {H}" xmlns="http://www.w3.org/2000/svg" font-family="sans-serif">']
    for label, phase, lo, hi in bands(t):
        out.append(f'<rect x="{sx(lo):.1f}" y="{TOP}" width="{sx(hi) - sx(lo):.1f}" height="{H - TOP - BOTTOM}" '
                   f'fill="{PHASE_SHADES.get(phase, "#fff")}"/>')
        if phase in ("forward", "backward", "optimizer"):
            out.append(f'<text x="{(sx(lo) + sx(hi)) / 2:.1f}" y="{TOP - 8}" font-size="10" fill="#555" '
                       f'text-anchor="middle">{for_html(label)}</text>')
    base = [0] * len(xs)
    for c, ys in parts.items():
        high = [b + y for b, y in zip(base, ys)]
        out.append(f'<path d="{_step_path(xs, base, high, sx, sy)}" fill="{COLOURS[c]}">'
                   f'<title>{for_html(LABELS[c])}</title></path>')
        base = high
    for name, lo, hi in overlap_bars(t):
        out.append(f'<rect x="{sx(lo):.1f}" y="{TOP + 1}" width="{sx(hi) - sx(lo):.1f}" height="13" fill="#7a5195" '
                   f'opacity="0.8"/><text x="{(sx(lo) + sx(hi)) / 2:.1f}" y="{TOP + 11}" font-size="10" '
                   f'fill="#fff" text-anchor="middle">{for_html(name)}</text>')
    for i in range(6):  # y grid and labels
        v = top * i / 5
        out.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{sy(v):.1f}" y2="{sy(v):.1f}" stroke="#0001"/>'
                   f'<text x="{LEFT - 6}" y="{sy(v) + 4:.1f}" font-size="11" text-anchor="end">'
                   f'{v / div:,.1f}</text>')
    out.append(f'<text x="14" y="{(TOP + H - BOTTOM) / 2}" font-size="12" transform="rotate(-90 14 '
               f'{(TOP + H - BOTTOM) / 2})" text-anchor="middle">live tensor {unit}</text>')
    for i in range(6):
        op = xs[0] + (xs[-1] - xs[0]) * i / 5
        out.append(f'<text x="{sx(op):.1f}" y="{H - BOTTOM + 16}" font-size="11" text-anchor="middle">{op:,.0f}</text>')
    out.append(f'<text x="{(LEFT + W - RIGHT) / 2}" y="{H - 12}" font-size="12" text-anchor="middle">op index '
               'in the update</text>')
    for phase, value, lo, hi in formula_markers(t):
        out.append(f'<line x1="{sx(lo):.1f}" x2="{sx(hi):.1f}" y1="{sy(value):.1f}" y2="{sy(value):.1f}" '
                   f'stroke="#000" stroke-dasharray="6 3" stroke-width="1.5"><title>formula {phase} peak '
                   f'{fmt_bytes(value)}</title></line>'
                   f'<text x="{sx(hi) - 2:.1f}" y="{sy(value) - 4:.1f}" font-size="10" text-anchor="end">'
                   f'formula {phase} peak</text>')
    if capacity_shown(t):
        out.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{sy(t.capacity_bytes):.1f}" '
                   f'y2="{sy(t.capacity_bytes):.1f}" stroke="#c00" stroke-width="1.5"/>'
                   f'<text x="{LEFT + 4}" y="{sy(t.capacity_bytes) - 4:.1f}" font-size="11" fill="#c00">'
                   'device capacity</text>')
    px, py = sx(t.peak_op), sy(t.peak_bytes)
    out.append(f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{TOP}" y2="{H - BOTTOM}" stroke="#222" '
               f'stroke-dasharray="2 3"/><path d="M{px - 6:.1f},{py - 10:.1f} L{px + 6:.1f},{py - 10:.1f} '
               f'L{px:.1f},{py:.1f} Z" fill="#222"><title>peak {fmt_bytes(t.peak_bytes)}</title></path>')
    out.append(f'<line id="cursor" x1="0" x2="0" y1="{TOP}" y2="{H - BOTTOM}" stroke="#000" style="display:none"/>')
    out.append("</svg>")
    totals = t.totals
    data = {"x": [round(sx(x), 1) for x in xs], "op": xs, "name": [t.op_names[i] for i in keep],
            "phase": [t.phases[t.phase_of[i]].label for i in keep], "total": [fmt_bytes(totals[i]) for i in keep],
            "hint": "hover over the chart: op and live total"}
    return "\n".join(out), data


def render_html(t: Timeline) -> str:
    svg, data = _svg(t)
    legend = "".join(f'<span class="key"><i style="background:{COLOURS[c]}"></i>{for_html(LABELS[c])}</span>'
                     for c in used_categories(t))
    side = for_html("\n".join(peak_lines(t, modules=8)))
    notes = "".join(f"<li>{for_html(n)}</li>" for n in t.notes)
    blob = json.dumps(data).replace("</", "<\\/")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>batchlab memory timeline</title>
<style>
body {{ font-family: sans-serif; margin: 16px; max-width: 1380px; color: #222; }}
h1 {{ font-size: 18px; margin: 0 0 4px; }} .sub {{ color: #555; font-size: 13px; margin-bottom: 8px; }}
.row {{ display: flex; gap: 16px; align-items: flex-start; }} .chart {{ flex: 1 1 auto; min-width: 0; }}
.chart svg {{ width: 100%; height: auto; display: block; }}
.side {{ flex: 0 0 330px; font-size: 12px; }} pre {{ white-space: pre-wrap; margin: 0; }}
.key {{ display: inline-block; margin-right: 14px; font-size: 12px; }}
.key i {{ display: inline-block; width: 12px; height: 12px; margin-right: 4px; vertical-align: -1px; }}
#tip {{ font-family: monospace; font-size: 12px; height: 18px; margin: 4px 0; }}
</style></head><body>
<h1>Memory over one update</h1>
<div class="sub">{for_html(t.title)}<br>provenance: <b>{for_html(t.provenance)}</b>
 ({for_html(t.method)})</div>
<div>{legend}</div><div id="tip">{data["hint"]}</div>
<div class="row"><div class="chart">{svg}</div>
<div class="side"><b>At the peak</b><pre>{side}</pre><ul>{notes}</ul></div></div>
<script id="tl-data" type="application/json">{blob}</script>
<script>{_SCRIPT}</script>
</body></html>
"""

