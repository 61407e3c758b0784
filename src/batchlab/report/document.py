"""Reports of experiments: Markdown and a self-contained HTML page (plots embedded as base64 PNG).

Both are rendered from one list of blocks, so they say the same thing.  Every figure names how its numbers
were obtained (``formula`` / ``trace`` / ``allocator`` / ``wall-clock``) in its title, inside the image and
in its caption; every report prints global batch = micro-batch x accum x DP for both sides.
Figures: batchlab.report.plots (matplotlib, imported only when drawing).
"""
from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from batchlab.config import ConfigError
from batchlab.experiment.predict import Direction
from batchlab.experiment.record import Record
from batchlab.report.plots import Figure, figures
from batchlab.util.units import fmt_value
from batchlab.util.text import for_html, for_markdown

HELD = {True: "held", False: "missed", None: "-"}


def direction_text(d: Direction | None) -> str:
    """``↑ up`` / ``↓ down`` / ``≈ same``, or ``-`` when there is none."""
    return f"{d.symbol} {d.value}" if d is not None else "-"


def observed_text(m) -> str:
    """The observed direction of a MetricRecord, or why there is none (noise)."""
    return "? inconclusive (noise)" if m.inconclusive else direction_text(m.observed)


def format_value(v: Any, unit: str) -> str:
    """Display only; the outcome metric shows as fits / OOM."""
    if unit == "outcome" and v is not None:
        return "OOM" if v else "fits"
    return fmt_value(v, unit)


# ------------------------------------------------------------------------------------------ document

def blocks(r: Record) -> list[tuple]:
    """The report as blocks: ("h1"|"h2"|"p", text), ("ul", items), ("table", header, rows), ("figures",),
    ("timeline", a, b, labels)."""
    c = r.change
    status = r.status.value if r.status is not None else "complete"
    out: list[tuple] = [("h1", f"Experiment #{r.notebook_id}: {c['variable']}")]
    out.append(("p", f"{r.created_at} · status {status} · "
                     + ("formula only — a paper derivation, nothing measured" if r.formula_only else "measured")
                     + (f" · wall time {r.wall_seconds:.1f} s" if r.wall_seconds else "")))
    if c.get("confounded"):
        out.append(("p", "CONFOUNDED: more than one field changed; the effects cannot be attributed to one of them."))
    out += _setup_blocks(r)
    out += _verdict_blocks(r)
    out += _diagnosis_blocks(r)
    out += _semantics_blocks(r)
    out.append(("h2", "Scope: what this result cannot support"))
    out.append(("ul", list(r.scope) or ["-"]))
    out += _factor_blocks(r)
    out += timeline_blocks(r)
    out.append(("h2", "Figures"))
    out.append(("figures",))
    return out


def _setup_blocks(r: Record) -> list[tuple]:
    cfg, c = r.config, r.change
    m = cfg["model"]
    out: list[tuple] = [("h2", "Setup")]
    items = [f"{side.upper()}: {c['global_batch_text'][side]}" for side in "ab"]
    items.append(f"keep mode: {r.keep_mode.value}")
    items.append(f"model {m['name']} ({cfg['model_source']}): {m['layers']} layers, hidden {m['hidden']}, heads "
                 f"{m['heads']}, vocab {m['vocab']}; seq {cfg['seq']}, precision {cfg['precision']}, activation "
                 f"checkpointing {cfg['ac']}, optimizer {cfg['optimizer']}, device {cfg['device']}")
    p = r.protocol
    if not r.formula_only:
        items.append(f"protocol: {p.rounds} rounds {p.order}, each side a process of its own, "
                     f"{p.warmup} warmup + {p.steps} timed updates, threads "
                     f"{p.threads or 'torch default'}; token budget {p.token_budget:,}")
    out.append(("ul", items))
    if r.warnings:
        out.append(("ul", [f"warning: {w}" for w in r.warnings]))
    pred = r.predictions
    out.append(("h2", "Predictions (recorded before anything ran)"))
    out.append(("ul", [f"you ({pred.user_source}): "
                       + (", ".join(f"{k.value} {v.value}" for k, v in pred.user.items()) or "none"),
                       "formula: " + (", ".join(f"{k.value} {v.value}" for k, v in pred.formula.items() if v)
                                      or r.formula.reason or "none")]))
    return out


def _verdict_blocks(r: Record) -> list[tuple]:
    if not r.metrics:
        why = f" (interrupted: {r.interrupted})" if r.interrupted else ""
        return [("h2", "Verdict"), ("p", f"No verdict: the experiment did not finish{why}.")]
    rows = []
    for metric, m in r.metrics.items():
        f = m.formula
        f_ratio = f"{f.ratio:.3g}" if f.ratio is not None else "-"
        if r.formula_only:
            rows.append([metric.label_for(m.unit), format_value(f.a, m.unit), format_value(f.b, m.unit), f_ratio,
                         direction_text(m.predicted_by_formula), direction_text(m.predicted_by_user), "formula"])
            continue
        band = m.band
        rows.append([metric.label_for(m.unit), format_value(m.a, m.unit), format_value(m.b, m.unit),
                     f"{m.ratio:.3g}" if m.ratio is not None else "-",
                     f"{band[0]:.3g} – {band[1]:.3g}" if band else "-", observed_text(m),
                     f"{direction_text(m.predicted_by_user)} ({HELD[m.held_user]})" if m.predicted_by_user else "-",
                     f"{direction_text(m.predicted_by_formula)} ({HELD[m.held_formula]})",
                     f_ratio, m.provenance])
    if r.formula_only:
        header = ["metric", "A (formula)", "B (formula)", "B/A", "formula says", "you", "how obtained"]
        return [("h2", "Formula derivation (not an observation)"), ("table", header, rows)] + _bubble_blocks(r)
    header = ["metric", "A (median)", "B (median)", "B/A (paired median)", "band", "observed", "you", "formula",
              "formula B/A", "how obtained"]
    noise = [f"{metric.label}: {m.note}" for metric, m in r.metrics.items() if m.inconclusive]
    return [("h2", "Verdict"), ("table", header, rows), ("p", f"Band: {r.protocol.band_method}.")] + \
        ([("ul", noise)] if noise else []) + _bubble_blocks(r)


def _bubble_blocks(r: Record) -> list[tuple]:
    return [("p", f"Pipeline (formula): {r.pipeline_bubble}.")] if r.pipeline_bubble else []


def _diagnosis_blocks(r: Record) -> list[tuple]:
    d = r.diagnosis
    if not d.contradictions:
        return []
    items = [f"{c.who} predicted {c.metric.value} {c.predicted.value}, observed {c.observed.value}"
             for c in d.contradictions]
    rows = [[str(i), c.question, "yes" if c.flagged else "no", c.found] for i, c in enumerate(d.checks, 1)]
    return [("h2", "Diagnosis"), ("ul", items), ("table", ["#", "check", "could explain it", "found"], rows)]


def _semantics_blocks(r: Record) -> list[tuple]:
    s = r.semantics
    if not s:
        return []
    rows = [[i["name"], "yes" if i["touched"] else "no", i["why"], i["verified"] or "-"] for i in s["items"]]
    out = [("h2", "Training semantics"), ("table", ["semantics", "touched", "why", "verified by the harness"], rows)]
    check = s.get("gradient_check") or {}
    if check:
        out.append(("p", f"Gradient check ({check.get('kind')}): {check.get('detail')}"))
    return out


def _factor_blocks(r: Record) -> list[tuple]:
    f = r.factors or {}
    if not f:
        return []
    load = f.get("load_average") or {}
    busy = f.get("busy_processes") or {}
    noise = f.get("timing_noise") or {}
    spread = noise.get("update_time_iqr_over_median") or {}
    band = noise.get("paired_time_ratio_band")
    noise_text = ("update time IQR/median within a process: "
                  + ", ".join(f"{k.upper()} {v:.0%}" for k, v in spread.items() if v is not None)
                  + (f"; paired update-time ratios {band[0]:.3g} – {band[1]:.3g}" if band else "")) if spread else "not measured"
    items = [f"load average before {load.get('before')}, after {load.get('after')} ({f.get('cpu_count')} CPUs)",
             f"other processes' CPU use during the run: {(f.get('other_cpu') or {}).get('cores', 'n/a')} cores "
             "(machine-wide busy time minus this experiment's)",
             f"other busy processes (sampled during the run): {busy.get('count', 0)} "
             + ", ".join(f"{p['name']} (pid {p['pid']}, {p['cpu_share']:.0%})" for p in busy.get("top", [])),
             f"CPU frequency (MHz) before {(f.get('cpu_mhz') or {}).get('before')}, after "
             f"{(f.get('cpu_mhz') or {}).get('after')}",
             f"timing noise: {noise_text}"]
    if f.get("note"):
        items.append(f"note: {f['note']}")
    return [("h2", "Uncontrolled factors"), ("ul", items)]


def side_labels(r: Record) -> tuple[str, str]:
    """``("A: micro_batch=1, accum=8", "B: micro_batch=2, accum=4")``: the requested and derived fields."""
    c = r.change
    values = {side: [f"{x['field']}={x[side]}" for x in c["requested"]]
              + [f"{k}={v[i]}" for k, v in c["derived"].items()] for i, side in enumerate("ab")}
    return f"A: {', '.join(values['a'])}", f"B: {', '.join(values['b'])}"


def timeline_blocks(r: Record) -> list[tuple]:
    """Both sides' memory timelines on one axis: ("timeline", a, b, labels), or why there is none."""
    if r.formula_only:
        return []
    out: list[tuple] = [("h2", "Memory over one update, A and B on one axis")]
    missing = [s.upper() for s in "ab" if s not in r.timelines]
    if missing:
        return out + [("p", f"No memory timeline for side {' and '.join(missing)}: each side's is recorded in its "
                            "first measured round (not by a run that failed or ran out of memory, nor by DDP "
                            "ranks, nor by records written before schema 3).")]
    a, b = r.timelines["a"], r.timelines["b"]
    peaks = "; ".join(f"{label}: peak {fmt_value(t.peak_bytes, 'bytes')} in {t.peak_phase.label} "
                      f"[{t.provenance}: {t.method}]" for label, t in zip(side_labels(r), (a, b)))
    return out + [("p", "Live tensor bytes over one steady-state update of each side (x: fraction of the "
                        "update's ops), recorded in the measuring process after warmup; the thin line is "
                        "what forward made and backward still needs (activations, logits, recompute), the "
                        f"dotted bars the formula's phase peaks. {peaks}."),
                  ("timeline", a, b, side_labels(r))]


# ------------------------------------------------------------------------------------------ writers

def _md_cell(text: Any) -> str:
    return for_markdown(text)


def to_markdown(bl: list[tuple], figs: list[Figure], image_names: dict[str, str]) -> str:
    lines: list[str] = []
    for b in bl:
        kind = b[0]
        if kind == "h1":
            lines += [f"# {for_markdown(b[1])}", ""]
        elif kind == "h2":
            lines += [f"## {for_markdown(b[1])}", ""]
        elif kind == "p":
            lines += [for_markdown(b[1]), ""]
        elif kind == "ul":
            lines += [f"- {for_markdown(item)}" for item in b[1]] + [""]
        elif kind == "table":
            lines.append("| " + " | ".join(map(_md_cell, b[1])) + " |")
            lines.append("|" + "---|" * len(b[1]))
            lines += ["| " + " | ".join(map(_md_cell, row)) + " |" for row in b[2]]
            lines.append("")
        elif kind == "timeline" and "timeline" in image_names:
            lines += [f"![Memory over one update, A and B]({image_names['timeline']})", ""]
        elif kind == "figures":
            for i, f in enumerate(figs, 1):
                t, lab, cap = (for_markdown(x) for x in (f.title, f.label, f.caption))
                lines += [f"![Figure {i}: {t} ({lab})]({image_names[f.name]})", "",
                          f"*Figure {i} — {t} [{lab}]: {cap}*", ""]
    return "\n".join(lines)


CSS = ("body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#222}"
       "table{border-collapse:collapse;margin:.5rem 0}td,th{border:1px solid #ccc;padding:.25rem .5rem;"
       "font-size:.9rem;vertical-align:top}th{background:#f3f3f3}figure{margin:1rem 0}"
       "figcaption{font-size:.85rem;color:#444}.src{font-weight:bold}.timeline svg{width:100%;height:auto}")


def to_html(bl: list[tuple], figs: list[Figure]) -> str:
    e = for_html
    title = next((b[1] for b in bl if b[0] == "h1"), "batchlab experiment")
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title><style>{CSS}</style>"
             "</head><body>"]
    for b in bl:
        kind = b[0]
        if kind in ("h1", "h2", "p"):
            parts.append(f"<{kind}>{e(b[1])}</{kind}>")
        elif kind == "ul":
            parts.append("<ul>" + "".join(f"<li>{e(str(i))}</li>" for i in b[1]) + "</ul>")
        elif kind == "table":
            head = "".join(f"<th>{e(str(h))}</th>" for h in b[1])
            body = "".join("<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in row) + "</tr>" for row in b[2])
            parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        elif kind == "timeline":
            parts.append(f"<figure class='timeline'>{_pair_svg(b)}</figure>")
        elif kind == "figures":
            for i, f in enumerate(figs, 1):
                data = base64.b64encode(f.png).decode("ascii")
                parts.append(f"<figure><img alt='{e(f.title)} ({e(f.label)})' src='data:image/png;base64,{data}'>"
                             f"<figcaption>Figure {i} — {e(f.title)} <span class='src'>[{e(f.label)}]</span>: "
                             f"{e(f.caption)}</figcaption></figure>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _pair_svg(block: tuple) -> str:
    from batchlab.timeline.pair import pair_svg

    return pair_svg(block[1], block[2], block[3])


def _timeline_png(bl: list[tuple]) -> bytes | None:
    """The pair chart beside the Markdown (PNG bytes, written with the rest), when the report has one."""
    block = next((b for b in bl if b[0] == "timeline"), None)
    if block is None:
        return None
    import io

    from batchlab.timeline.pair import write_pair_png

    buf = io.BytesIO()
    write_pair_png(block[1], block[2], buf, block[3])  # savefig takes a file object as well as a path
    return buf.getvalue()


def write_report(record: Record, out_dir: str | Path) -> list[Path]:
    """experiment-<id>.md (+ its PNG figures) and experiment-<id>.html (self-contained) in ``out_dir``."""
    from batchlab.util.files import write_all

    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError("report", f"cannot create the directory {out}: {e.strerror or e}") from None
    stem = f"experiment-{record.notebook_id or 'unsaved'}"
    figs = figures(record)
    names = {f.name: f"{stem}-{f.name}.png" for f in figs}
    bl = blocks(record)
    pngs = {out / names[f.name]: f.png for f in figs}
    timeline = _timeline_png(bl)
    if timeline is not None:
        names["timeline"] = f"{stem}-timeline.png"
        pngs[out / names["timeline"]] = timeline
    md, page = out / f"{stem}.md", out / f"{stem}.html"
    # all files or none: a read-only directory or a full disk leaves no 0-byte PNG behind
    write_all({**pngs, md: to_markdown(bl, figs, names), page: to_html(bl, figs)}, "report")
    return [md, page]


def notebook_markdown(records: list[Record]) -> str:
    """``notebook export --format md``: a summary table, then every experiment's report text (no figures)."""
    lines = ["# batchlab lab notebook", "", "| id | date | status | kind | variable | keep | verdict |",
             "|---|---|---|---|---|---|---|"]
    for r in records:
        status = r.status.value if r.status is not None else None
        lines.append("| " + " | ".join(_md_cell(x) for x in (r.notebook_id, r.created_at, status, r.kind.value,
                                                            r.change["variable"], r.keep_mode.value,
                                                            r.verdict or "")) + " |")
    lines.append("")
    for r in records:
        bl = [b for b in blocks(r) if b[0] not in ("figures", "timeline") and b != ("h2", "Figures")]
        text = to_markdown(bl, [], {})
        # one level down: each experiment is a section of the notebook
        lines.append("\n".join(("#" + line) if line.startswith("#") else line for line in text.splitlines()))
        lines.append("")
    return "\n".join(lines)
