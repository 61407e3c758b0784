"""Terminal rendering of an observed run (``notebook show``) and of ``notebook diff``."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from batchlab.util.text import for_rich as esc
from rich.table import Table

from batchlab.experiment.observed_diff import BAND_METHOD, ObservedDiff
from batchlab.cli.render_experiment import diagnosis, factors, verdict_table
from batchlab.report import format_value as value


def _error(e: float | None) -> str:
    return f"{e:+.1%}" if e is not None else "-"


def figures_table(r: dict[str, Any]) -> Table:
    """figure | observed | how | formula | error (observed vs formula)."""
    t = Table(show_header=True, header_style="bold", title="observed (nothing controlled)")
    for col in ("figure", "observed", "how", "formula", "error"):
        t.add_column(col, justify="left" if col in ("figure", "how") else "right")
    for f in r["figures"]:
        t.add_row(esc(f["name"]), value(f["observed"], f["unit"]), f["provenance"],
                  value(f["predicted"], f["unit"]), _error(f["error"]))
    return t


def render_observed(out: Console, r: dict[str, Any], notebook_path: Path | None = None) -> None:
    s = r["settings"]
    out.print(f"[bold]observed run[/] ({esc(r['source'])})   notebook #{r.get('notebook_id')}")
    ac = {True: "on (recompute in backward)", False: "off", None: "not detectable"}[s["gradient_checkpointing"]]
    out.print(f"model {esc(s['model'])}, seq {s['seq'] or '-'}, precision {s['precision']}, activation "
              f"checkpointing {ac}, device {s['device']}, optimizer {s['optimizer'] or '-'}")
    out.print(esc(r["global_batch_text"]))
    out.print(figures_table(r))
    if r["prediction_note"]:
        out.print(f"[dim]{esc(r['prediction_note'])}[/]")
    for u in r["unmapped"]:
        out.print(f"[yellow]not mapped:[/] {esc(u)}")
    for w in r["warnings"]:
        out.print(f"[yellow]warning:[/] {esc(w)}")
    factors(out, r["factors"])
    if notebook_path is not None:
        out.print(f"notebook: {esc(notebook_path)}")


def render_diff(out: Console, diff: ObservedDiff) -> None:
    d = diff.to_dict()
    changes = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in d["changes"].items()) or "nothing"
    ga, gb = d["global_batch"]
    out.print(f"[bold]notebook diff[/] #{d['a_id']} (A) vs #{d['b_id']} (B)   variable: {esc(d['variable'])}")
    out.print(f"changed: {esc(changes)}   global batch A {ga}, B {gb}")
    out.print(verdict_table(diff))
    out.print(f"[dim]band: {BAND_METHOD}; {diff.pairs} timed update pair(s)[/]")
    diagnosis(out, diff)
    for n in diff.notes[1:]:
        out.print(f"[dim]{esc(n)}[/]")
    out.print("scope: two observed runs, not interleaved; one process each says nothing about cluster communication")
