"""The terminal view of ``fit --ac auto``: the plan, the model solved, the memory/time frontier (<= ~15 lines)."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from batchlab.advise.acplan import ACPlan, Point
from batchlab.config.layerplan import use as plan_use
from batchlab.util.text import for_rich as escape
from batchlab.util.units import fmt_bytes, fmt_seconds

ROWS = 11  # frontier rows shown (the chosen plan always among them); --json has them all


def frontier_cells(q: Point, chosen: Point | None, budget: int) -> list[str]:
    """One frontier row: chosen mark, kind, ac, the budget a plan was solved for, peak, update, fits."""
    mark = "*" if chosen is not None and (q.ac, q.micro_batch) == (chosen.ac, chosen.micro_batch) else ""
    return [mark, q.kind, q.ac, fmt_bytes(q.budget_bytes) if q.budget_bytes else "-", fmt_bytes(q.peak_bytes),
            fmt_seconds(q.update_seconds), "yes" if q.peak_bytes <= budget else "no"]


def acplan_view(out: Console, p: ACPlan) -> None:
    c = p.chosen
    if c is None:
        out.print(f"activation-checkpointing plan: none fits {fmt_bytes(p.budget_bytes)}; " + "; ".join(p.notes),
                  markup=False, highlight=False)
        return
    out.print(f"[bold]activation-checkpointing plan[/] (micro-batch {c.micro_batch}): --ac {c.ac}   predicted peak "
              f"{fmt_bytes(c.peak_bytes)} within {fmt_bytes(p.budget_bytes)}, update {fmt_seconds(c.update_seconds)} "
              f"({p.provenance})" + (f"; written to {escape(p.file)} (use --ac {escape(plan_use(p.file))})"
                                     if p.file else ""))
    if p.best_preset is not None:
        b = p.best_preset
        out.print(f"best preset within the budget: {b.ac} at micro-batch {b.micro_batch}, "
                  f"{fmt_seconds(b.update_seconds)} ({p.provenance}; {c.update_seconds / b.update_seconds - 1:+.1%} for "
                  "the plan)")
    out.print(f"[dim]model solved: {p.model}[/]")
    t = Table(title=f"memory/time frontier at micro-batch {c.micro_batch} ({p.provenance})", title_justify="left",
              box=None, pad_edge=False)
    for col in ("", "kind", "ac", "solved for", "peak", "update", "fits"):
        t.add_column(col)
    rows = sorted(p.frontier, key=lambda q: (q.peak_bytes, q.kind))
    mine = [q for q in rows if (q.ac, q.micro_batch) == (c.ac, c.micro_batch)]
    shown = rows[:ROWS] if mine and mine[0] in rows[:ROWS] else rows[:ROWS - 1] + mine[:1]
    for pt in sorted(shown, key=lambda q: (q.peak_bytes, q.kind)):
        t.add_row(*frontier_cells(pt, c, p.budget_bytes))
    out.print(t)


def acplan_outcome(out: Console, report) -> None:
    """The measurement that proves the plan (or not), the notes and the chosen configuration (advise.FitReport)."""
    from batchlab.advise.acfit import check

    p, t = report.ac_plan, report.verification
    if t is not None and p.chosen is not None:
        slack = p.chosen.slack
        held = check(t, p.chosen.allocated, slack, p.budget_bytes)
        out.print(f"measured: {t.outcome}, peak {fmt_bytes(t.peak_bytes) if t.peak_bytes else '-'} allocated "
                  "(allocator)" + (f", plan's prediction {held.error:+.1%} off" if held.error is not None else "")
                  + (f", within the budget {fmt_bytes(p.budget_bytes)}" if held.fits else "")
                  + (f" with the predicted allocator slack {fmt_bytes(slack)}" if slack else ""))
    for n in report.notes + p.notes:
        out.print(f"note: {n}", markup=False, highlight=False)
    if report.final is not None:
        out.print(f"chosen ({report.source}): {report.final.global_batch_text()}, --ac {report.final.ac}",
                  markup=False, highlight=False)
    else:
        out.print(f"nothing chosen: {report.source}")
