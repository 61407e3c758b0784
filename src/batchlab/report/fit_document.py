"""``batchlab fit --report DIR``: fit's answer as Markdown and a self-contained HTML page.

One list of blocks, rendered by report/document.py's writers, so both say the same thing.  Under ``--ac auto``:
the plan per layer, the best preset within the same budget, the model solved, the memory/time frontier (table
and the figure ``--plot`` writes) and the run that proves the plan.  Otherwise: the recommendation, the
alternatives and their measurement.  Every figure names how it was obtained (formula / trace / allocator), and
the report prints global batch = micro-batch x accum x DP.
"""
from __future__ import annotations

from pathlib import Path

from batchlab.advise.acfit import TOLERANCE, check
from batchlab.advise.fit import FitReport
from batchlab.advise.plan import Goal, unfit_options
from batchlab.advise.render import knobs_line
from batchlab.advise.render_acplan import frontier_cells
from batchlab.config import ACPolicy, ConfigError, ModelSource
from batchlab.config.layerplan import runs, use as plan_use
from batchlab.report.document import to_html, to_markdown
from batchlab.report.plots import Figure, frontier_png
from batchlab.util.units import fmt_bytes, fmt_seconds

STEM = "fit-report"


def frontier_figure(p) -> Figure:
    """The memory/time frontier of an ``advise.acplan.ACPlan``: the figure ``fit --plot`` writes."""
    c = p.chosen
    at = f" at micro-batch {c.micro_batch}" if c is not None else ""
    caption = (f"Each budget's best per-layer plan (line) and the preset policies (squares){at} on the same axes, "
               f"predicted peak against predicted update time ({p.provenance}; nothing here is measured); the star "
               f"is the chosen plan, the dashed line the budget {fmt_bytes(p.budget_bytes)}.")
    return Figure("frontier", "Activation checkpointing: memory vs update time", (p.provenance,), caption,
                  frontier_png(p.frontier, p.budget_bytes, c, p.provenance))


def _yes(x: bool | None) -> str:
    return "-" if x is None else "yes" if x else "no"


# ------------------------------------------------------------------------------------------ both kinds

def _head(r: FitReport, title: str) -> list[tuple]:
    goal, b = r.plan.goal, r.plan.goal.base
    counted = r.plan.counted
    unit = "examples" if b.model_kind is ModelSource.FACTORY else "sequences"
    chosen = (f"chosen ({r.source}): {r.final.global_batch_text(counted)}, activation checkpointing {r.final.ac}, "
              f"ZeRO-{r.final.zero}" if r.final is not None else f"nothing chosen: {r.source}")
    return [("h1", f"batchlab fit: {title}"),
            ("p", f"model {b.model.name} ({b.model_source}), seq {b.seq}, precision {b.precision}, optimizer "
                  f"{b.optimizer}, {goal.world or b.parallel.world_size} x {b.device}."),
            ("h2", "Target and budget"),
            ("ul", [(f"target: global batch {goal.global_batch} {unit} over {goal.world} devices, the layout DP x TP x "
                     "PP searched" if goal.world else f"target: global batch {goal.global_batch} {unit} over DP {b.dp} "
                     f"({goal.per_rank} per rank per update)") + "; it never changes: accum = global / (micro-batch x DP)",
                    chosen,
                    f"memory per rank: {fmt_bytes(goal.capacity_bytes)} "
                    + ("(--memory-budget)" if b.memory_budget is not None else f"({b.device})")
                    + f", safety margin {goal.margin:.0%}: planned within {fmt_bytes(goal.usable_bytes)}",
                    knobs_line(goal)])]


def _verification(r: FitReport, planned: int | None, slack: int, budget: int, provenance: str,
                  unmeasured: str) -> list[tuple]:
    """The measured allocator peak against the planned one, or why nothing was measured."""
    out: list[tuple] = [("h2", "Verification by a run")]
    t = r.verification
    if t is None:
        return out + [("p", f"Not measured: {unmeasured}.")]
    held = check(t, planned, slack, budget)
    err = held.error
    rows = [[f"{t.micro_batch} x {t.accum}", t.outcome.value, fmt_bytes(t.peak_bytes), fmt_bytes(planned),
             f"{err:+.1%}" if err is not None else "-", _yes(held.close) if err is not None else "-",
             _yes(held.fits)]]
    header = ["micro-batch x accum", "outcome", "measured peak (allocator)", f"planned ({provenance})",
              "planned vs measured", f"within {TOLERANCE:.0%}", f"within {fmt_bytes(budget)}"]
    note = [("p", f"The measured peak is allocated tensor bytes; the budget check adds the predicted allocator "
                  f"slack {fmt_bytes(slack)} (CUDA's reserved view).")] if slack else []
    return out + [("p", "One isolated update in a fresh process (one warm-up update, then the tracked one)."),
                  ("table", header, rows)] + note


def _notes(r: FitReport, extra: list[str] = ()) -> list[tuple]:
    notes = list(r.notes) + list(extra)
    return [("h2", "Notes"), ("ul", notes)] if notes else []


# ------------------------------------------------------------------------------------------ --ac auto

def _runs(modes: tuple) -> list[list[str]]:
    """Consecutive layers under one policy as one row: ["0-1", "none", "2"]."""
    return [[f"{i}" if n == 1 else f"{i}-{i + n - 1}", mode.value, str(n)] for i, n, mode in runs(modes)]


def _plan_blocks(p, layers: int) -> list[tuple]:
    c, how = p.chosen, p.provenance
    if c is None:
        return [("h2", "Activation-checkpointing plan"), ("p", f"No plan fits {fmt_bytes(p.budget_bytes)}.")]
    modes = ACPolicy.parse(c.ac).layer_modes(layers)
    use = f" Written to {p.file}; pass it back as --ac {plan_use(p.file)}." if p.file else ""
    items = [f"predicted peak {fmt_bytes(c.peak_bytes)} [{how}] within the budget {fmt_bytes(p.budget_bytes)}"
             + (f" (allocated tensors {fmt_bytes(c.allocated)} [{how}] + allocator slack {fmt_bytes(c.slack)})"
                if c.slack else ""),
             f"predicted update time {fmt_seconds(c.update_seconds)} [{how}]"]
    return [("h2", "Activation-checkpointing plan"),
            ("p", f"--ac {c.ac} at micro-batch {c.micro_batch}: the least predicted update time whose predicted "
                  f"peak fits.{use}"),
            ("table", ["layers (bottom first)", "policy", "count"], _runs(modes)), ("ul", items)]


def _preset_blocks(p) -> list[tuple]:
    b, c, how = p.best_preset, p.chosen, p.provenance
    out: list[tuple] = [("h2", "Best preset within the budget")]
    if b is None:
        return out + [("p", f"No preset policy fits {fmt_bytes(p.budget_bytes)} at any micro-batch searched.")]
    text = (f"{b.ac} at micro-batch {b.micro_batch}: peak {fmt_bytes(b.peak_bytes)}, update "
            f"{fmt_seconds(b.update_seconds)} [{how}].")
    if c is not None:
        d = c.update_seconds - b.update_seconds
        text += (f" The plan's update is {fmt_seconds(abs(d))} {'faster' if d < 0 else 'slower' if d else 'apart'}"
                 f" ({c.update_seconds / b.update_seconds - 1:+.1%}) [{how}].")
    return out + [("p", text)]


def _frontier_blocks(p) -> list[tuple]:
    c = p.chosen
    rows = [frontier_cells(q, c, p.budget_bytes) for q in sorted(p.frontier, key=lambda q: (q.peak_bytes, q.kind))]
    at = f" at micro-batch {c.micro_batch}" if c is not None else ""
    header = ["", "kind", "ac", "solved for budget", f"peak ({p.provenance})", f"update ({p.provenance})",
              f"fits {fmt_bytes(p.budget_bytes)}"]
    return [("h2", "Memory/time frontier"),
            ("p", f"Each budget's best plan{at}, budgets spread from every layer recomputed to none, beside the "
                  "preset policies; * marks the chosen plan."),
            ("table", header, rows), ("figures",)]


def auto_blocks(r: FitReport, unmeasured: str) -> tuple[list[tuple], list[Figure]]:
    """``fit --ac auto``'s report: blocks and the frontier figure."""
    p = r.ac_plan
    layers = r.plan.goal.base.model.layers if p.config is None else p.config.model.layers
    bl = _head(r, "activation checkpointing planned per layer")
    bl += _plan_blocks(p, layers) + _preset_blocks(p)
    bl += [("h2", "Model solved"), ("p", f"{p.model}. Every predicted figure: {p.provenance}.")]
    figs = [frontier_figure(p)] if p.frontier else []
    bl += _frontier_blocks(p) if p.frontier else []
    c = p.chosen
    bl += _verification(r, c.allocated if c else None, c.slack if c else 0, p.budget_bytes, p.provenance,
                        unmeasured)
    return bl + _notes(r, p.notes), figs


# ------------------------------------------------------------------------------------------ plain fit

def _alternatives(r: FitReport, goal: Goal) -> list[tuple]:
    p, how = r.plan, r.plan.predictor
    def row(c, fits: bool) -> list[str]:
        cfg = c.config
        return ["->" if c is p.recommended else "", f"{cfg.micro_batch} x {cfg.accum} x {cfg.dp}", str(cfg.ac),
                str(cfg.zero), fmt_bytes(c.peak_bytes), fmt_seconds(c.update_seconds),
                fmt_seconds(c.time_to_tokens_seconds), _yes(fits)]

    rows = [row(c, True) for c in p.ranked] + [row(c, False) for c in unfit_options(p.candidates, p.ranked)]
    header = ["", "micro x accum x DP", "activation checkpointing", "ZeRO", f"peak ({how})", f"update ({how})",
              f"to {goal.tokens:.3g} {p.counted.value} ({how})", f"fits {fmt_bytes(goal.usable_bytes)}"]
    return [("h2", "Alternatives"),
            ("p", f"Per policy and ZeRO stage the largest micro-batch within the margin, fastest first, then the "
                  f"smallest micro-batch of each that does not fit ({len(p.candidates)} configurations evaluated)."),
            ("table", header, rows)]


def plain_blocks(r: FitReport, unmeasured: str) -> list[tuple]:
    """fit's report without ``--ac auto``: the recommendation, the alternatives, the measurement."""
    p, goal = r.plan, r.plan.goal
    bl = _head(r, "micro-batch, accumulation and activation checkpointing")
    rec = p.recommended
    bl.append(("h2", "Recommendation by the " + p.predictor))
    if rec is None:
        bl.append(("p", f"Nothing fits: {p.reason}."))
    else:
        bl.append(("p", f"{rec.config.global_batch_text(p.counted)}, activation checkpointing {rec.config.ac}, "
                        f"ZeRO-{rec.config.zero}: {p.reason}."))
        bl.append(("ul", [f"predicted peak {fmt_bytes(rec.peak_bytes)} in {rec.peak_phase} [{rec.provenance}]",
                          f"predicted update time {fmt_seconds(rec.update_seconds)}, "
                          f"{rec.tokens_per_second:,.0f} {p.counted.value}/s [{rec.provenance}]"]))
    bl += _alternatives(r, goal) if p.candidates else []
    bl += _verification(r, rec.peak_bytes if rec else None, 0, goal.usable_bytes, p.predictor, unmeasured)
    if r.search is not None:
        rows = [[str(t.micro_batch), str(t.accum), t.outcome.value, fmt_bytes(t.peak_bytes)] for t in r.search.trials]
        bl += [("p", f"Search by measurement: largest micro-batch that fits {r.search.limit} "
                     f"({r.search.trial_count} trials of at most {r.search.budget})."),
               ("table", ["micro-batch", "accum", "outcome", "peak (allocator)"], rows)]
    bl += [("h2", "Assumptions"), ("ul", list(p.assumptions) or ["-"])]
    return bl + _notes(r)


# ------------------------------------------------------------------------------------------ writer

def check_dir(out_dir: str | Path) -> Path:
    """The report's directory, checked before fit plans or measures anything (it may not exist yet)."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError("report", f"{out} is not a directory")
    return out


def write_fit_report(r: FitReport, out_dir: str | Path, unmeasured: str = "verification was off") -> list[Path]:
    """fit-report.md (+ its PNG figure) and fit-report.html (self-contained) in ``out_dir``.  ``unmeasured``:
    why nothing was measured, said when ``r`` holds no verification."""
    from batchlab.util.files import write_all

    bl, figs = auto_blocks(r, unmeasured) if r.ac_plan is not None else (plain_blocks(r, unmeasured), [])
    out = check_dir(out_dir)
    names = {f.name: f"{STEM}-{f.name}.png" for f in figs}
    md, page = out / f"{STEM}.md", out / f"{STEM}.html"
    files = {out / names[f.name]: f.png for f in figs}
    # all files or none: a read-only directory or a full disk leaves no 0-byte PNG behind
    write_all({**files, md: to_markdown(bl, figs, names), page: to_html(bl, figs)}, "report")
    return [md, page]
