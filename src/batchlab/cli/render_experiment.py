"""Terminal rendering of one experiment record (``compare`` and ``notebook show`` print the same)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape as esc
from rich.panel import Panel
from rich.table import Table

from batchlab.experiment.predict import Metric
from batchlab.report import format_value as value

SYMBOL = {"up": "↑ up", "down": "↓ down", "same": "≈ same", None: "-"}
HELD = {True: "[green]held[/]", False: "[red]missed[/]", None: "-"}


def header(out: Console, r: dict[str, Any]) -> None:
    c = r["change"]
    kind = "[yellow]formula only (paper derivation, nothing measured)[/]" if r["kind"] == "formula-only" else "measured"
    nid = r.get("notebook_id")
    out.print(f"[bold]batchlab compare[/]  {c['variable']}   keep: {r['keep_mode']}   {kind}"
              + (f"   notebook #{nid}" if nid is not None else ""))
    if c.get("confounded"):
        out.print("[red]confounded:[/] more than one field changed (--allow-confounded); effects cannot be "
                  "attributed to one of them")
    cfg = r["config"]
    model = cfg["model"]
    out.print(f"model {model['name']} ({esc(cfg['model_source'])}, {model['layers']} layers, hidden {model['hidden']}), "
              f"seq {cfg['seq']}, precision {cfg['precision']}, activation checkpointing {cfg['ac']}, "
              f"device {cfg['device']}")
    for side in "ab":
        out.print(f"  {side.upper()}: {c['global_batch_text'][side]}")
    for w in r.get("warnings", []):
        out.print(f"[yellow]warning:[/] {esc(w)}")
    p = r["predictions"]
    user = ", ".join(f"{k}={v}" for k, v in p["user"].items()) or "none"
    out.print(f"prediction ({p['user_source']}): {user}")


ARROW = {"up": "↑", "down": "↓", "same": "≈", None: "-"}


def _ratio_band(m: dict[str, Any]) -> str:
    if m.get("ratio") is None:
        return "-"
    b = m.get("band")
    return f"{m['ratio']:.3g}" + (f" ({b[0]:.3g}–{b[1]:.3g})" if b else "")


def _judged(predicted: str | None, held: bool | None, ratio: float | None = None) -> str:
    if predicted is None:
        return "-"
    text = f"{ARROW[predicted]} {HELD[held]}" if held is not None else ARROW[predicted]
    return text + (f" {ratio:.3g}" if ratio is not None else "")


def verdict_table(r: dict[str, Any]) -> Table:
    """metric | A | B | B/A (band) | observed | you | formula (its B/A) | how obtained."""
    formula_only = r["kind"] == "formula-only"
    t = Table(show_header=True, header_style="bold", title="formula derivation" if formula_only else "verdict")
    cols = (["metric", "A (formula)", "B (formula)", "B/A", "formula says", "you", "how"] if formula_only else
            ["metric", "A", "B", "B/A (band)", "observed", "you", "formula B/A", "how"])
    for col in cols:
        t.add_column(col, justify="left" if col in ("metric", "how", "observed", "formula says") else "right")
    for name, m in r["metrics"].items():
        label = Metric(name).label
        f = m.get("formula") or {}
        if formula_only:
            t.add_row(label, value(f.get("a"), m["unit"]), value(f.get("b"), m["unit"]),
                      f"{f['ratio']:.3g}" if f.get("ratio") is not None else "-", SYMBOL[m["predicted_by_formula"]],
                      ARROW[m["predicted_by_user"]], "formula")
            continue
        t.add_row(label, value(m["a"], m["unit"]), value(m["b"], m["unit"]), _ratio_band(m), SYMBOL[m["observed"]],
                  _judged(m["predicted_by_user"], m["held"]["user"]),
                  _judged(m["predicted_by_formula"], m["held"]["formula"], f.get("ratio")), m["provenance"])
    return t


def diagnosis(out: Console, r: dict[str, Any]) -> None:
    d = r.get("diagnosis") or {}
    if not d.get("contradictions"):
        return
    lines = [f"{c['who']} predicted {c['metric']} {c['predicted']}, observed {c['observed']}" for c in d["contradictions"]]
    for i, c in enumerate(d.get("checks", []), 1):
        mark = "[yellow]![/]" if c["flagged"] else "[green]ok[/]"
        lines.append(f"{i}. {mark} {esc(c['question'])} {esc(c['found'])}")
    out.print(Panel("\n".join(lines), title="diagnosis (in order)", expand=False))


def semantics(out: Console, r: dict[str, Any]) -> None:
    s = r.get("semantics") or {}
    if not s:
        return
    t = Table(show_header=True, header_style="bold", title="training semantics")
    for col in ("semantics", "touched", "why", "verified by the harness"):
        t.add_column(col)
    for item in s["items"]:
        t.add_row(esc(item["name"]), "yes" if item["touched"] else "no", esc(item["why"]), esc(item["verified"] or "-"))
    out.print(t)
    check = s.get("gradient_check") or {}
    if check and not check.get("ran"):
        out.print(f"[dim]gradient check: {esc(str(check.get('detail')))}[/]")


def scope(out: Console, r: dict[str, Any]) -> None:
    if r.get("scope"):
        out.print(Panel("\n".join(f"- {s}" for s in r["scope"]), title="scope: what this result cannot support",
                        expand=False))


def factors(out: Console, r: dict[str, Any]) -> None:
    f = r.get("factors") or {}
    if not f:
        return
    load = (f.get("load_average") or {}).get("before")
    busy = f.get("busy_processes") or {}
    top = ", ".join(f"{p['name']} {p['cpu_share']:.0%}" for p in busy.get("top", [])[:3])
    mhz = (f.get("cpu_mhz") or {}).get("before")
    noise = (f.get("timing_noise") or {}).get("update_time_iqr_over_median") or {}
    parts = [f"load average {load[0]:.2f} on {f.get('cpu_count')} CPUs" if load else "load average n/a",
             f"{busy.get('count', 0)} other busy process(es)" + (f" ({top})" if top else ""),
             f"CPU {mhz:.0f} MHz" if mhz else "CPU frequency not readable"]
    if noise:
        parts.append("timing IQR/median " + ", ".join(f"{k.upper()} {v:.0%}" for k, v in noise.items() if v is not None))
    out.print("uncontrolled factors: " + "; ".join(parts))
    if f.get("note"):
        out.print(f"note: {esc(f['note'])}")


def render(out: Console, r: dict[str, Any], notebook_path: Path | None = None,
           report_paths: list[Path] | None = None) -> None:
    header(out, r)
    if not r.get("metrics"):
        out.print("[yellow]no verdict: the experiment did not finish[/]")
    else:
        out.print(verdict_table(r))
        if r["kind"] != "formula-only":
            out.print(f"[dim]band: {r['protocol']['band_method']}[/]")
    diagnosis(out, r)
    semantics(out, r)
    scope(out, r)
    factors(out, r)
    status = r.get("status", "complete")
    where = f" in {notebook_path}" if notebook_path else ""
    wall = f"; wall time {r['wall_seconds']:.1f} s" if r.get("wall_seconds") is not None else ""
    out.print(f"notebook: experiment #{r.get('notebook_id')} ({status}){where}{wall}")
    if r.get("interrupted"):
        out.print(f"[yellow]interrupted:[/] {esc(str(r['interrupted']))}")
    for p in report_paths or []:
        out.print(f"report: {p}")


def show_record(record: dict, notebook_path, report_dir, as_json: bool) -> None:
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
        print_json(record)
    else:
        render(console(), record, notebook_path=notebook_path, report_paths=paths)
