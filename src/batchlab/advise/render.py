"""Text output of ``batchlab fit`` (rich).  Every figure names how it was obtained: formula (trace for a factory
model) or allocator."""
from __future__ import annotations


from rich.console import Console
from rich.markup import escape
from rich.table import Table

from batchlab.advise.fit import FitReport
from batchlab.advise.after_oom import Advice, Remedy
from batchlab.advise.plan import KNOB_FLAGS, KNOBS, Candidate, Goal, unfit_options
from batchlab.advise.search import Trial
from batchlab.advise.snippets import printable
from batchlab.advise.states import EIGHT_BIT_ADAM, StatesVerdict, states_verdict
from batchlab.config import ModelSource, RunConfig
from batchlab.util.text import print_assumptions
from batchlab.util.units import fmt_bytes, fmt_seconds, relative_to


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.0%}"


def header(out: Console, goal: Goal) -> None:
    """What fit plans for: model, target global batch, memory per rank, held and searched knobs."""
    b = goal.base
    out.print(f"[bold]batchlab fit[/]  {escape(b.model.name)} ({escape(b.model_source)}), seq {b.seq}, {b.precision}, "
              f"{b.optimizer}, {goal.world or b.parallel.world_size} x {b.device}")
    if goal.world is not None:
        out.print(f"target: global batch {goal.global_batch} sequences ({b.tokens_per_update:,} tokens per update) "
                  f"over {goal.world} devices: layouts DP x TP x PP searched (DP divides the global batch; TP and PP "
                  "do not multiply it)" + "; only TP > 1 (sequence parallelism)" * goal.sequence_parallel
                  + f"; only PP > 1 ({goal.pp_virtual} virtual stages per rank)" * (goal.pp_virtual > 1))
    elif b.model_kind is ModelSource.FACTORY:  # tokens or samples: known once its code is traced
        out.print(f"target: global batch {goal.global_batch} examples over DP {b.dp}: {goal.per_rank} per rank per "
                  "update")
    else:
        out.print(f"target: global batch {goal.global_batch} sequences ({b.tokens_per_update:,} tokens per update) "
                  f"over DP {b.dp}: {goal.per_rank} sequences per rank per update")
    out.print(f"memory per rank: {fmt_bytes(goal.capacity_bytes)}"
              + (" (--memory-budget)" if b.memory_budget is not None else f" ({b.device})")
              + f", safety margin {goal.margin:.0%}: plan within {fmt_bytes(goal.usable_bytes)}")
    out.print(knobs_line(goal), markup=False, highlight=False)


def knobs_line(goal: Goal) -> str:
    """Which knobs were held as given and which the plan searches."""
    b = goal.base
    value = {"micro_batch": lambda: f"{b.micro_batch} (accum {b.accum})", "ac": lambda: str(b.ac),
             "zero": lambda: str(b.zero), "precision": lambda: str(b.precision), "tp": lambda: str(b.tp),
             "pp": lambda: str(b.pp)}
    held = [f"{KNOB_FLAGS[k]} {value[k]()}" for k in KNOBS if k in goal.held and (goal.world or k not in ("tp", "pp"))]
    names = {"micro_batch": "micro-batch (accumulation derived)", "ac": "activation checkpointing",
             "zero": f"ZeRO stage {b.zero}-3", "tp": "tensor-parallel degree", "pp": "pipeline stages"}
    searched = [names[k] for k in goal.searched]
    kept = [f"precision {b.precision}" if "precision" not in goal.held else None,
            f"ZeRO-{b.zero}" if "zero" not in goal.held and "zero" not in goal.searched else None]
    parts = [f"held as given: {', '.join(held)}" if held else "held as given: nothing",
             f"searched: {', '.join(searched) if searched else 'nothing'}"]
    kept = [k for k in kept if k]
    if kept:
        parts.append(f"kept: {', '.join(kept)} (fit does not change precision; --allow-zero searches ZeRO stages)")
    return "; ".join(parts)


SHARDING = {1: "ZeRO-1 (optimizer state sharded: DDP + ZeroRedundancyOptimizer)",
            2: "ZeRO-2 (+ gradients: FSDP2 reshard_after_forward=False)",
            3: "ZeRO-3 (+ parameters: FSDP2 fully_shard, FULL_SHARD)"}


def states_block(out: Console, v: StatesVerdict, goal: Goal) -> None:
    """The model states figure first, then what helps (they fit by none of micro-batch, checkpointing, seq)."""
    out.print(f"[bold red]the model states alone do not fit:[/] {fmt_bytes(v.states_bytes)} per rank \\[formula] "
              f"(weights {fmt_bytes(v.parameters_bytes)}, master weights {fmt_bytes(v.master_bytes)}, gradients "
              f"{fmt_bytes(v.gradients_bytes)}, optimizer state {fmt_bytes(v.optimizer_bytes)}) > "
              f"{fmt_bytes(v.usable_bytes)} usable of {fmt_bytes(v.capacity_bytes)}; no micro-batch, activation "
              "checkpointing or sequence length changes them.")
    out.print("[bold]what does help[/] \\[formula]:")
    for o in v.sharding:
        c = o.figures.config
        out.print(f"- {SHARDING[o.zero]} over {o.devices} devices (the fewest that fit): model states "
                  f"{fmt_bytes(o.states_bytes)} per rank; fit's pick there: micro-batch {c.micro_batch} x accum "
                  f"{c.accum} x DP {c.dp} (same global batch), activation checkpointing {c.ac}, peak "
                  f"{fmt_bytes(o.figures.peak_bytes)}")
    if not v.sharding:
        out.print(f"- no device count dividing the global batch {goal.global_batch} fits with ZeRO")
    for o in v.optimizer:
        out.print(f"- {o.name}, the config given otherwise: peak {fmt_bytes(o.figures.peak_bytes)} -> "
                  f"{'fits' if o.fits else 'does not fit'}")
    if v.max_optimizer_bytes_per_param is None:
        out.print("- a smaller optimizer state cannot help alone: weights and gradients exceed the memory already")
    elif v.max_optimizer_bytes_per_param not in (0.0, EIGHT_BIT_ADAM):
        out.print(f"- any optimizer state of at most {v.max_optimizer_bytes_per_param:g} bytes per parameter fits "
                  f"(--optimizer-bytes {v.max_optimizer_bytes_per_param:g})")
    out.print(f"- {v.offload}", markup=False, highlight=False)


def candidate_line(c: Candidate, goal: Goal) -> str:
    cfg, how, unit = c.config, c.provenance, c.counted.value
    return (f"{cfg.global_batch_text(c.counted)}\n  activation checkpointing {cfg.ac}, ZeRO-{cfg.zero}; predicted peak "
            f"{fmt_bytes(c.peak_bytes)} in {c.peak_phase} \\[{how}], headroom {fmt_bytes(goal.capacity_bytes - c.peak_bytes)}; "
            f"update {fmt_seconds(c.update_seconds)}, {c.tokens_per_second:,.0f} {unit}/s, "
            f"{fmt_seconds(c.time_to_tokens_seconds)} to {goal.tokens:.3g} {unit} \\[{how}]")


def alternatives(report: FitReport, top: int, verbose: bool = True) -> Table:
    p, goal = report.plan, report.plan.goal
    rec = p.recommended
    t = Table(title=f"Largest micro-batch per policy within the margin, fastest first \\[{p.predictor}] "
                    f"({len(p.candidates)} configurations evaluated)", header_style="bold")
    layout = goal.world is not None
    for col in ("", "micro x accum x DP") + (("TP x PP",) if layout else ()) + (
            "act. checkpointing", "ZeRO", "peak", "headroom", "update", f"to {goal.tokens:.3g} {p.counted.value}",
            "vs chosen"):
        t.add_column(col, justify="left" if col in ("", "act. checkpointing") else "right")
    shape = lambda cfg: (f"{cfg.micro_batch} x {cfg.accum} x {cfg.dp}",) + ((f"{cfg.tp} x {cfg.pp}",) if layout else ())  # noqa: E731
    for c in p.ranked[:top]:
        cfg = c.config
        mark = "->" if c is rec else ""
        t.add_row(mark, *shape(cfg), str(cfg.ac), str(cfg.zero),
                  fmt_bytes(c.peak_bytes), fmt_bytes(goal.capacity_bytes - c.peak_bytes), fmt_seconds(c.update_seconds),
                  fmt_seconds(c.time_to_tokens_seconds),
                  _pct(c.time_to_tokens_seconds / rec.time_to_tokens_seconds - 1) if rec else "-")
    for c in unfit_options(p.candidates, p.ranked)[:top if verbose else UNFIT_ROWS]:
        cfg = c.config
        t.add_row("", *shape(cfg), str(cfg.ac), str(cfg.zero),
                  fmt_bytes(c.peak_bytes), fmt_bytes(goal.capacity_bytes - c.peak_bytes), "", "",
                  "over margin", style="dim")
    return t


UNFIT_ROWS = 3  # policies that do not fit, shown by default (--top of them with --verbose)


def trial_line(t: Trial, n: int, budget: int | None = None) -> str:
    peak = f", peak {fmt_bytes(t.peak_bytes)} [{t.provenance}]" if t.peak_bytes is not None else ""
    cap = f"/{budget}" if budget else ""
    detail = f" - {t.detail}" if t.detail and not t.fits else ""
    return f"trial {n}{cap}: micro-batch {t.micro_batch} x accum {t.accum} -> {t.outcome}{peak}{detail}"


def trials_table(report: FitReport) -> Table:
    trials = report.search.trials if report.search else [report.verification]
    t = Table(title="Measured (isolated subprocess each)", header_style="bold")
    how = report.plan.predictor
    for col in ("#", "micro x accum", "outcome", "peak \\[allocator]", f"peak \\[{how}]", f"{how} error"):
        t.add_column(col, justify="left" if col == "outcome" else "right")
    rec = report.plan.recommended.config
    for i, tr in enumerate(trials, 1):
        pred = report.predicted_peak(rec.with_global_batch(rec.global_batch, tr.micro_batch))
        err = relative_to(pred, tr.peak_bytes)
        t.add_row(str(i), f"{tr.micro_batch} x {tr.accum}", tr.outcome, fmt_bytes(tr.peak_bytes), fmt_bytes(pred),
                  _pct(err) if err is None or abs(err) >= 0.005 else f"{err:+.1%}")
    return t


def limits_line(report: FitReport) -> str | None:
    lim = report.limits()
    if lim is None:
        return None
    text = (f"largest micro-batch that fits {fmt_bytes(report.plan.goal.capacity_bytes)} with {lim['policy']}: "
            f"{report.plan.predictor} {lim['predicted_limit']}, measured {lim['measured_limit']} "
            f"({lim['trials']} trials, budget {lim['trial_budget']})")
    if lim.get("peak_error") is not None:
        text += (f"; at micro-batch {lim['measured_limit']} {report.plan.predictor} "
                 f"{fmt_bytes(lim['predicted_peak_bytes'])} vs "
                 f"allocator {fmt_bytes(lim['measured_peak_bytes'])} ({lim['peak_error']:+.1%})")
    return text


def advice_table(items: list[Advice], goal: Goal) -> Table:
    t = Table(title="If it runs out of memory: changes in order \\[formula]", header_style="bold", show_lines=True)
    for col in ("#", "change", "peak", "fits", "compute", "update time", "stays the same / changes"):
        t.add_column(col, justify="right" if col in ("#", "peak", "compute", "update time") else "left")
    for i, a in enumerate(items, 1):
        peak = fmt_bytes(a.figures.peak_bytes) if a.figures else "-"
        fits = "-" if a.config is None else ("yes" if a.fits else "no")
        both = (f"same: {a.stays}\n" if a.stays else "") + f"changes: {a.changes}"
        t.add_row(str(i), a.change, peak, fits, _pct(a.compute_change), _pct(a.time_change), both)
    return t


def remedies(out: Console, items: list[Remedy], goal: Goal, states: StatesVerdict | None = None) -> None:
    if states is not None:
        states_block(out, states, goal)
    out.print("[bold red]nothing fits[/] within the margin with any micro-batch and activation checkpointing policy.")
    if not items:
        out.print("no single change found that fits (ZeRO stage, more devices, shorter sequences): use a smaller "
                  "model or more memory per device")
    for r in items:
        c = r.figures
        out.print(f"- would fit: {r.change}: micro-batch {c.config.micro_batch} x accum {c.config.accum} x DP "
                  f"{c.config.dp}, {c.config.ac}, ZeRO-{c.config.zero}, predicted peak {fmt_bytes(c.peak_bytes)} "
                  f"\\[formula]; {r.changes}")


SETTINGS_HINT = "--verbose: the choice as a config file and for PyTorch, torchtitan, accelerate, HF, Lightning, DeepSpeed"


def snippets(out: Console, cfg: RunConfig) -> None:
    for title, text in printable(cfg):
        out.print(f"[bold]{escape(title)}[/]:")
        out.print(text, markup=False, highlight=False, soft_wrap=True)  # no wrapping inside pasted code


def fit_report(out: Console, report: FitReport, top: int, with_header: bool = True, verbose: bool = True) -> None:
    """``with_header=False``: it was printed before the trials ran.  Without ``verbose``: the settings for
    other stacks and the assumptions are left out (a line says where they are)."""
    p, goal = report.plan, report.plan.goal
    if with_header:
        header(out, goal)
    if p.recommended is None:
        remedies(out, report.remedies, goal, report.states)
        _assumptions(out, p.assumptions, verbose)
        return
    out.print(f"[bold]recommended by the {p.predictor}:[/] {candidate_line(p.recommended, goal)}")
    out.print(f"  why: {p.reason}")
    out.print(alternatives(report, top, verbose))
    if report.verification is not None:
        out.print(trials_table(report))
        line = limits_line(report)
        if line:
            out.print(line)
    for n in report.notes:
        out.print(f"[yellow]note:[/] {escape(n)}")
    if report.advice:
        out.print(advice_table(report.advice, goal))
    if report.final is not None:
        f = report.final
        out.print(f"[bold green]chosen[/] ({report.source}): {f.global_batch_text(p.counted)}, activation "
                  f"checkpointing {f.ac}, ZeRO-{f.zero}")
        if verbose:
            snippets(out, report.final)
        else:
            out.print(f"[dim]{escape(SETTINGS_HINT)}[/]")
    else:
        out.print(f"[bold red]no configuration chosen[/] ({report.source})")
    _assumptions(out, p.assumptions, verbose)


def _assumptions(out: Console, items: tuple[str, ...], verbose: bool = True) -> None:
    if not verbose:
        out.print(f"[dim]--verbose: the {len(items)} assumptions (device sources, time model, margin, ranking)[/]")
        return
    print_assumptions(out, items)


def after_oom(out: Console, goal: Goal, now: Candidate, items: list[Advice]) -> None:
    header(out, goal)
    cfg = now.config
    out.print(f"the run that ran out of memory: {cfg.global_batch_text()}, activation checkpointing {cfg.ac}, "
              f"ZeRO-{cfg.zero}")
    verdict = "fits" if now.peak_bytes <= goal.capacity_bytes else "does not fit"
    out.print(f"formula: peak {fmt_bytes(now.peak_bytes)} in {now.peak_phase} -> {verdict} in "
              f"{fmt_bytes(goal.capacity_bytes)}")
    if now.peak_bytes <= goal.capacity_bytes:
        out.print("[yellow]the formula says it fits:[/] the OOM comes from what it does not count (allocator "
                  "fragmentation, other processes, custom model code); measure with `batchlab measure --isolate`")
    states = states_verdict(goal)
    if states is None:
        out.print(advice_table(items, goal))
    else:
        states_block(out, states, goal)
        out.print(f"the {len(items)} single changes of micro-batch, activation checkpointing, precision and sequence "
                  f"length leave the model states as they are: {sum(a.fits for a in items)} of them fit (--json "
                  "lists them with their figures)")
    if not any(a.fits for a in items):
        out.print("[bold red]nothing fits on this device[/] with a single change, by the formula"
                  + (": the model states are the problem; see what does help above" if states else ""))
