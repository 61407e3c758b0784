"""Terminal rendering of one experiment record (``compare`` and ``notebook show`` print the same)."""
from __future__ import annotations

from pathlib import Path

from rich.console import Console
from batchlab.util.text import for_rich as esc
from rich.panel import Panel
from rich.table import Table

from batchlab.util.text import SOURCES_POINTER
from batchlab.experiment.diagnosis import time_model_absolute
from batchlab.experiment.predict import Direction, Metric
from batchlab.experiment.record import Check, MetricRecord, Record
from batchlab.report.document import direction_text, observed_text
from batchlab.report.document import format_value as value

HELD = {True: "[green]held[/]", False: "[red]missed[/]", None: "-"}


def header(out: Console, r: Record) -> None:
    c = r.change
    kind = "[yellow]formula only (paper derivation, nothing measured)[/]" if r.formula_only else "measured"
    nid = r.notebook_id
    out.print(f"[bold]batchlab compare[/]  {esc(c['variable'])}   keep: {r.keep_mode.value}   {kind}"
              + (f"   notebook #{nid}" if nid is not None else ""))
    if c.get("confounded"):
        out.print("[red]confounded:[/] more than one field changed (--allow-confounded); effects cannot be "
                  "attributed to one of them")
    cfg = r.config
    model = cfg["model"]
    out.print(f"model {esc(model['name'])} ({esc(cfg['model_source'])}, {model['layers']} layers, hidden {model['hidden']}), "
              f"seq {cfg['seq']}, precision {cfg['precision']}, activation checkpointing {cfg['ac']}, "
              f"device {cfg['device']}")
    for side in "ab":
        out.print(f"  {side.upper()}: {esc(c['global_batch_text'][side])}")
    for w in r.warnings:
        out.print(f"[yellow]warning:[/] {esc(w)}")
    if not r.formula.available and r.formula.reason:
        out.print(f"[yellow]{esc(r.formula.reason)}[/]")
    p = r.predictions
    if p.user:
        out.print(f"your prediction ({p.user_source}): " + ", ".join(f"{k.value}={v.value}" for k, v in p.user.items()))
    else:
        out.print("your prediction: none written down (--predict memory=up,time=down records one before the run)")


def _arrow(d: Direction | None) -> str:
    return d.symbol if d is not None else "-"


def _ratio_band(m: MetricRecord) -> str:
    if m.ratio is None:
        return "-"
    b = m.band
    return f"{m.ratio:.3g}" + (f" ({b[0]:.3g}–{b[1]:.3g})" if b else "")


def _judged(predicted: Direction | None, held: bool | None, ratio: float | None = None) -> str:
    if predicted is None:
        return "-"
    text = f"{predicted.symbol} {HELD[held]}" if held is not None else predicted.symbol
    return text + (f" {ratio:.3g}" if ratio is not None else "")


def verdict_table(r: Record) -> Table:
    """metric | A | B | B/A (band) | observed | you | formula (its B/A) | how obtained."""
    formula_only = r.formula_only
    t = Table(show_header=True, header_style="bold", title="formula derivation" if formula_only else "verdict")
    cols = (["metric", "A (formula)", "B (formula)", "B/A", "formula says", "you", "how"] if formula_only else
            ["metric", "A (median)", "B (median)", "B/A paired (band)", "observed", "you", "formula B/A", "how"])
    for col in cols:
        t.add_column(col, justify="left" if col in ("metric", "how", "observed", "formula says") else "right")
    for metric, m in r.metrics.items():
        f = m.formula
        if formula_only:
            t.add_row(metric.label_for(m.unit), value(f.a, m.unit), value(f.b, m.unit),
                      f"{f.ratio:.3g}" if f.ratio is not None else "-", direction_text(m.predicted_by_formula),
                      _arrow(m.predicted_by_user), "formula")
            continue
        t.add_row(metric.label_for(m.unit), value(m.a, m.unit), value(m.b, m.unit), _ratio_band(m), observed_text(m),
                  _judged(m.predicted_by_user, m.held_user),
                  _judged(m.predicted_by_formula, m.held_formula, f.ratio), m.provenance)
    return t


def diagnosis(out: Console, r: Record, verbose: bool = True) -> None:
    """The contradicted predictions and the checks in order; by default only the flagged checks (the rest
    counted)."""
    d = r.diagnosis
    if not d.contradictions:
        return
    if verbose:
        lines = [f"{c.who} predicted {c.metric.value} {c.predicted.value}, observed {c.observed.value}"
                 for c in d.contradictions]
    else:  # one line per predictor and observation
        groups = dict.fromkeys((c.who, c.observed) for c in d.contradictions)
        lines = [f"{who} predicted " + ", ".join(f"{c.metric.value} {c.predicted.value}" for c in d.contradictions
                                                 if (c.who, c.observed) == (who, seen)) + f"; observed {seen.value}"
                 for who, seen in groups]
    for i, c in enumerate(d.checks, 1):
        if c.flagged or verbose:
            mark = "[yellow]![/]" if c.flagged else "[green]ok[/]"
            lines.append(f"{i}. {mark} {esc(c.question)} {esc(c.found)}")
    passed = sum(not c.flagged for c in d.checks)
    if passed and not verbose:
        lines.append(f"[green]ok[/] {passed} other checks passed (--verbose lists them)")
    out.print(Panel("\n".join(lines), title="diagnosis (in order)", expand=False))


def semantics_line(s: dict) -> str:
    """The training semantics in one paragraph: which are touched, which the harness verified (✓)."""
    def name(item) -> str:
        return esc(item["name"]) + (" ✓" if item["verified"] else "")

    touched = [name(i) for i in s["items"] if i["touched"]]
    same = [name(i) for i in s["items"] if not i["touched"]]
    return (f"training semantics (✓ checked by the harness): changed: {', '.join(touched) or 'none'}; "
            f"unchanged: {', '.join(same) or 'none'}")


def semantics(out: Console, r: Record, verbose: bool = True) -> None:
    s = r.semantics
    if not s:
        return
    if not verbose:
        out.print(semantics_line(s), highlight=False)
    else:
        _semantics_table(out, s)
    check = s.get("gradient_check") or {}
    if check and not check.get("ran"):
        out.print(f"[dim]gradient check: {esc(str(check.get('detail')))}[/]")


def _semantics_table(out: Console, s: dict) -> None:
    t = Table(show_header=True, header_style="bold", title="training semantics")
    for col in ("semantics", "touched", "why", "verified by the harness"):
        t.add_column(col)
    for item in s["items"]:
        t.add_row(esc(item["name"]), "yes" if item["touched"] else "no", esc(item["why"]), esc(item["verified"] or "-"))
    out.print(t)


def scope(out: Console, r: Record) -> None:
    if r.scope:
        out.print(Panel("\n".join(f"- {esc(s)}" for s in r.scope), title="scope: what this result cannot support",
                        expand=False))


def factors(out: Console, f: dict | None) -> None:
    """The uncontrolled-factors line (load, busy processes, CPU clock, timing noise) of a record's ``factors``."""
    f = f or {}
    if not f:
        return
    load = (f.get("load_average") or {}).get("before")
    busy = f.get("busy_processes") or {}
    top = ", ".join(f"{p['name']} {p['cpu_share']:.0%}" for p in busy.get("top", [])[:3])
    mhz = (f.get("cpu_mhz") or {}).get("before")
    noise = (f.get("timing_noise") or {}).get("update_time_iqr_over_median") or {}
    cores = (f.get("other_cpu") or {}).get("cores")
    count = busy.get("count", 0)
    parts = [f"load average {load[0]:.2f} on {f.get('cpu_count')} CPUs" if load else "load average n/a",
             (f"other processes used {cores:.2g} cores on average during the run" if cores is not None
              else "other processes' CPU use not readable"),
             f"{count} other busy {'process' if count == 1 else 'processes'} (sampled)" + (f": {esc(top)}" if top else ""),
             f"CPU {mhz:.0f} MHz" if mhz else "CPU frequency not readable"]
    if noise:
        parts.append("timing IQR/median " + ", ".join(f"{k.upper()} {v:.0%}" for k, v in noise.items() if v is not None))
    out.print("uncontrolled factors: " + "; ".join(parts))
    if f.get("note"):
        out.print(f"note: {esc(f['note'])}")


def time_model(out: Console, r: Record, verbose: bool = True) -> None:
    """The assumptions of the formula's update-time prediction (its rates and calibration: ``verbose``), and
    its absolute update times beside the measured ones (at the host speed the updates ran at, where probed)."""
    for side in "ab" if verbose else "":
        est = getattr(r.formula, side, None) or {}
        line = next((a for a in est.get("assumptions", ()) if a.startswith("time model:")), None)
        if line:
            out.print(f"[dim]formula {side.upper()}: {esc(line)}[/]")
    check = absolute_check(r)
    if check is None:
        return
    mark = "[yellow]![/]" if check.flagged else "[green]ok[/]"
    out.print(f"{mark} time model, absolute: {esc(check.found if verbose else absolute_short(r))}")


def absolute_short(r: Record) -> str:
    """The formula's absolute update times against the measured medians in one line (at the probed host speed
    where there is one); the calibration-speed figures and the probe's factors are in the verbose line."""
    from batchlab.util.units import fmt_seconds as sec

    t = r.metrics[Metric.UPDATE_TIME]
    fa, fb = (r.formula.figure(s, "time", "update_seconds") for s in "ab")
    speed = (r.factors or {}).get("host_speed")
    where = "calibration's"
    if speed:
        fa, fb, where = fa * speed["a"], fb * speed["b"], "probed host"
    return (f"formula A {sec(fa)} vs {sec(t.a)} wall-clock ({fa / t.a - 1:+.0%}), B {sec(fb)} vs {sec(t.b)} "
            f"({fb / t.b - 1:+.0%}), {where} speed")


def absolute_check(r: Record) -> Check | None:
    """diagnosis.time_model_absolute of a measured record with a formula side; None otherwise."""
    t = r.metrics.get(Metric.UPDATE_TIME)
    fa, fb = (r.formula.figure(s, "time", "update_seconds") for s in "ab")
    if r.formula_only or t is None or None in (t.a, t.b, fa, fb):
        return None
    return time_model_absolute((fa, fb), (t.a, t.b), (r.factors or {}).get("host_speed"))


def compiled(out: Console, r: Record) -> None:
    """Each compiled side's compile line, per round (compilation is untimed; a recompilation is a warning)."""
    from batchlab.measure.result import compile_text

    for rnd in r.rounds or ():
        for side in "ab":
            m = rnd.side(side)
            text = compile_text(m.environment) if m is not None else None
            if text is not None:
                out.print(f"{side.upper()}: {esc(text)}", highlight=False)


def render(out: Console, r: Record, notebook_path: Path | None = None,
           report_paths: list[Path] | None = None, verbose: bool = False) -> None:
    """The record on a screen; ``verbose``: the protocol, the time model's rates and calibration, every
    diagnosis check and the training-semantics table too (--json and the report always hold them)."""
    header(out, r)
    if not r.metrics:
        out.print("[yellow]no verdict: the experiment did not finish[/]")
    else:
        out.print(verdict_table(r))
        if r.pipeline_bubble:  # a pipeline on either side
            out.print(f"pipeline [formula]: {r.pipeline_bubble}", markup=False, highlight=False)
        if not r.formula_only and verbose:
            out.print(f"[dim]band: {esc(r.protocol.band_method)}[/]")
            if r.protocol.allocator:
                out.print(f"[dim]measuring processes' {esc(r.protocol.allocator)}[/]")
        for metric, m in r.metrics.items():
            if m.inconclusive and not r.formula_only:
                out.print(f"[yellow]{metric.label}:[/] {esc(m.note)}")
    compiled(out, r)
    time_model(out, r, verbose)
    diagnosis(out, r, verbose)
    semantics(out, r, verbose)
    scope(out, r)
    factors(out, r.factors)
    if verbose:
        out.print(f"[dim]{SOURCES_POINTER}[/]")
    else:
        parts = ([] if r.formula_only else ["the band's protocol"]) + ["the time model's rates and calibration"] \
            + (["every diagnosis check"] if r.diagnosis.contradictions else []) + ["the semantics table"]
        out.print(f"[dim]--verbose: {', '.join(parts)}[/]")
    status = r.status.value if r.status is not None else "complete"
    where = f" in {notebook_path}" if notebook_path else ""
    wall = f"; wall time {r.wall_seconds:.1f} s" if r.wall_seconds is not None else ""
    out.print(f"notebook: experiment #{r.notebook_id} ({status}){esc(where)}{wall}")
    if r.interrupted:
        out.print(f"[yellow]interrupted:[/] {esc(str(r.interrupted))}")
    for p in report_paths or []:
        out.print(f"report: {esc(p)}")


def show_record(record: Record, notebook_path, report_dir, as_json: bool, verbose: bool = False) -> None:
    """Print one experiment record (JSON or the terminal view), writing its report first when asked."""
    from batchlab.cli.common import console, fail, print_json
    from batchlab.config import ConfigError

    paths = []
    if report_dir is not None:
        from batchlab.report import write_report

        try:
            paths = write_report(record, report_dir)
        except ConfigError as e:
            fail(str(e))
    if as_json:
        print_json(record.to_dict())
    else:
        render(console(), record, notebook_path=notebook_path, report_paths=paths, verbose=verbose)
