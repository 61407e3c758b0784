"""``batchlab fit``: micro-batch, accumulation and activation checkpointing for a fixed global batch."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from batchlab.cli.base import app
from batchlab.cli.common import (CommandLine, Verbose, console, fail, print_json, searches_layouts, takes_ac_auto,
                                  with_config, with_goal_profile)
from batchlab.config import Backend, ConfigError, ModelSource, RunConfig
from batchlab.formula import compiled_note

PANEL = "Fit"


@app.command("fit", short_help="Pick micro-batch, accumulation, activation checkpointing (and, with --world-size, the DP x TP x PP layout) for a target global batch.")
@with_config
@takes_ac_auto
@searches_layouts
def fit_command(
    cfg: RunConfig,
    as_json: bool,
    line: CommandLine,
    global_tokens: Annotated[Optional[int], typer.Option(help="Target global batch in tokens (instead of --global-batch in sequences); must be a multiple of --seq.", rich_help_panel=PANEL)] = None,
    tokens: Annotated[float, typer.Option(help="Token budget of the training run: options are ranked by predicted time to it.", rich_help_panel=PANEL)] = 1e9,
    margin: Annotated[float, typer.Option(help="Safety margin: fraction of the device memory (or --memory-budget) kept free.", rich_help_panel=PANEL)] = 0.10,
    world_size: Annotated[Optional[int], typer.Option(help="Search the parallel layout too: every DP x TP x PP of this many devices (TP within one node; DP divides the global batch; --tp/--pp typed are held; --sequence-parallel: only TP > 1; --pp-virtual N: only PP > 1), with the micro-batch and checkpointing of each.", rich_help_panel=PANEL)] = None,
    allow_zero: Annotated[bool, typer.Option("--allow-zero", help="Also try ZeRO stages from --zero up to 3 over the DP ranks (DP > 1); an engine typed with --sharding holds its own stage.", rich_help_panel=PANEL)] = False,
    min_micro_tokens: Annotated[int, typer.Option(help="A 'reasonable' micro-batch has at least this many tokens (or is the whole per-rank batch); below it activation checkpointing that allows a larger one is preferred.", rich_help_panel=PANEL)] = 4096,
    verify: Annotated[Optional[bool], typer.Option("--verify/--no-verify", help="Measure the recommendation in a fresh subprocess (default: on when --device is this machine's: cpu, local, or the catalogue entry of the GPU here).", rich_help_panel=PANEL)] = None,
    search: Annotated[bool, typer.Option("--search", help="Find the largest micro-batch that fits by measurement (seeded by the formula, at most ceil(log2(max)) + 2 isolated trials).", rich_help_panel=PANEL)] = False,
    after_oom: Annotated[bool, typer.Option("--after-oom", help="The config given (--micro-batch, --accum, --ac, ...) ran out of memory: print the ordered changes with formula figures (first, when the model states alone exceed the memory, that figure and what helps: sharding over N devices, a smaller optimizer state, CPU offload). Exit 0 when a listed change fits, 1 when none does.", rich_help_panel=PANEL)] = False,
    top: Annotated[int, typer.Option(help="Rows in the alternatives table (>= 1).", rich_help_panel=PANEL)] = 8,
    timeout: Annotated[Optional[float], typer.Option(help="Seconds before one measurement trial is killed (recorded as failed).", rich_help_panel=PANEL)] = None,
    plan_out: Annotated[Optional[str], typer.Option(help="With --ac auto: where to write the plan (JSON; default ./batchlab-ac-plan.json); pass it back as --ac plan:FILE.", rich_help_panel=PANEL)] = None,
    plot: Annotated[Optional[str], typer.Option(help="With --ac auto: write the memory/time frontier as a PNG here.", rich_help_panel=PANEL)] = None,
    report: Annotated[Optional[str], typer.Option(help="Write fit-report.md and a self-contained fit-report.html into this directory: the target and global batch, the budget, the pick and its measurement; with --ac auto the plan per layer, the best preset, the model solved and the memory/time frontier (table and plot).", rich_help_panel=PANEL)] = None,
    verbose: Verbose = False,
):
    """Pick micro-batch, gradient accumulation and activation checkpointing for a target global batch: predict
    by formula, confirm by measurement, search in few trials only when needed.  The global batch never changes:
    accum = global / (micro-batch x DP).  Knobs typed explicitly (--micro-batch, --ac, --zero, --precision)
    are held as given and the rest searched (--allow-zero searches ZeRO stages from --zero up).  --ac auto plans
    activation checkpointing per layer: the least predicted update time whose predicted peak fits, measured to
    prove it.  Exit 0 with a choice, 1 when nothing fits (with what would), 2 for bad input."""
    from batchlab.advise import Goal
    from batchlab.advise.plan import KNOBS, check_capacity
    if top < 1:
        fail(f"top: must be >= 1, got {top}")
    held = line.typed & set(KNOBS) - ({"zero"} if allow_zero else set())
    if "sharding" in line.typed:  # the engine typed implements one ZeRO stage: it holds it
        held |= {"zero"}
        if allow_zero:
            typer.echo(f"warning: ignored: --allow-zero: --sharding {cfg.parallel.engine} runs ZeRO-{cfg.zero} only", err=True)
    try:
        if report and not after_oom:
            from batchlab.report.fit_document import check_dir

            check_dir(report)
        if plan_out is not None and Path(plan_out).is_dir():  # refused before any planning or measuring
            raise ConfigError("plan_out", f"{plan_out} is a directory; give a file, e.g. "
                                          f"{Path(plan_out) / 'plan.json'}")
        base = _target(cfg, global_tokens, line.typed)
        if (note := compiled_note(cfg)) is not None:  # the planner's figures are the formula's
            typer.echo(f"warning: {note}; fit plans with them and confirms by measuring the compiled run", err=True)
        if world_size is not None and (after_oom or line.ac_auto):
            raise ConfigError("world_size", "searches layouts for fit's plan; --ac auto and --after-oom plan one "
                                            "layout: give it with --dp / --tp / --pp instead")
        if world_size is not None and "dp" in line.typed:
            raise ConfigError("world_size", "gives the devices and fit derives DP = world / (TP x PP): drop --dp")
        goal = Goal(base, tokens=tokens, margin=margin, allow_zero=allow_zero, min_micro_tokens=min_micro_tokens,
                    held=frozenset(held), world=world_size, sequence_parallel=line.sequence_parallel,
                    pp_virtual=line.pp_virtual, tp_overlap=line.tp_overlap)
        goal = with_goal_profile(goal, after_oom)  # the layer terms of every policy it evaluates
        if after_oom:
            if report:
                typer.echo("warning: ignored: --report: it reports a fit, not --after-oom's advice", err=True)
            raise typer.Exit(_after_oom(goal, as_json))
        check_capacity(goal)
        if line.ac_auto:
            raise typer.Exit(_auto(goal, verify, timeout, as_json, plan_out, plot, report, verbose))
        if plan_out or plot:
            typer.echo("warning: ignored: --plan-out/--plot: they go with --ac auto", err=True)
        out = console()
        if not as_json:  # the header before any trial runs
            from batchlab.advise.render import header

            header(out, goal)
        result = _fit(goal, verify, search, timeout, as_json)
        paths = _write_report(result, report, verify, goal)
    except ConfigError as e:
        fail(str(e))
    if as_json:
        print_json(result.to_dict())
    else:
        from batchlab.advise.render import fit_report

        fit_report(out, result, top, with_header=False, verbose=verbose)
    _say_written(paths, as_json)
    if result.exit_code:
        raise typer.Exit(result.exit_code)


def _auto(goal, verify: bool | None, timeout: float | None, as_json: bool, plan_out: str | None,
          plot: str | None, report_dir: str | None, verbose: bool = False) -> int:
    """fit --ac auto: plan, prove by a run, print; the exit code."""
    from batchlab.advise import isolated_measure
    from batchlab.advise.acfit import ATTEMPTS, fit_auto
    from batchlab.advise.acplan import check_budget, layer_models
    from batchlab.advise.render import trial_line

    models = layer_models(goal)
    check_budget(goal, models.values())  # a bad budget is exit 2 before any output
    out = console()
    if not as_json:
        from batchlab.advise.render import header

        header(out, goal)
    measure = isolated_measure(goal.capacity_bytes, timeout)
    shown = (lambda t, i: out.print(trial_line(t, i, ATTEMPTS))) if not as_json else None
    given = verify
    verify = _local(goal) if verify is None else verify
    report = fit_auto(goal, verify=verify, measure=measure, plan_out=plan_out, on_trial=shown, models=models)
    if plot and report.ac_plan is not None and report.ac_plan.frontier:
        from batchlab.report.fit_document import frontier_figure
        from batchlab.util.files import write_all

        write_all({Path(plot): frontier_figure(report.ac_plan).png}, "plot")
    paths = _write_report(report, report_dir, given, goal)
    if as_json:
        print_json(report.to_dict())
        _say_written(paths, as_json)
        return report.exit_code
    from batchlab.advise.render_acplan import acplan_view, acplan_outcome

    acplan_view(out, report.ac_plan)
    acplan_outcome(out, report)
    if verbose:  # fit's full report of the chosen configuration: its candidate, settings for other stacks
        from batchlab.advise.render import fit_report

        fit_report(out, report, 3, with_header=False, verbose=True)
    if plot:
        out.print(f"frontier plot: {plot}", markup=False, highlight=False)
    _say_written(paths, as_json)
    return report.exit_code


def _write_report(result, report_dir: str | None, verify: bool | None, goal) -> list[Path]:
    """fit --report DIR: the Markdown and HTML report of ``result`` (advise.FitReport); the paths written."""
    if report_dir is None:
        return []
    from batchlab.report.fit_document import write_fit_report

    if verify is False:
        why = "--no-verify was given"
    elif result.final is None and result.verification is None:
        why = "nothing was chosen to measure"
    else:
        why = (f"the device {goal.base.device} is not this machine's (fit measures only on a local device; "
               "--verify to measure anyway)")
    return write_fit_report(result, report_dir, unmeasured=why)


def _say_written(paths: list[Path], as_json: bool) -> None:
    """Where the report went: on stderr under --json (stdout holds the JSON alone)."""
    for p in paths:
        if as_json:
            typer.echo(f"report: {p}", err=True)
        else:
            console().print(f"report: {p}", markup=False, highlight=False)


def _local(goal) -> bool:
    """Whether the device is this machine's own, where fit measures (no torch import to find out)."""
    from batchlab.config import local_device

    return goal.base.device_spec.backend is Backend.CPU or goal.base.device == local_device()


def _target(cfg: RunConfig, global_tokens: int | None, typed: frozenset[str]) -> RunConfig:
    if global_tokens is None:
        return cfg
    if typed & {"global_batch", "accum"}:
        raise ConfigError("global_tokens", "give the target once: --global-tokens or --global-batch/--accum")
    if global_tokens <= 0 or global_tokens % cfg.seq:
        raise ConfigError("global_tokens", f"{global_tokens} is not a positive multiple of seq ({cfg.seq})")
    return cfg.with_global_batch(global_tokens // cfg.seq, 1)


def _fit(goal, verify: bool | None, search: bool, timeout: float | None, as_json: bool):
    from batchlab.advise import fit, isolated_measure, max_trials
    from batchlab.advise.render import trial_line
    from batchlab.cli.progress import progress

    if verify is None:
        verify = _local(goal)
    if search and "micro_batch" in goal.held:
        typer.echo("warning: ignored: --search: the micro-batch is held as given (--micro-batch); it is only "
                   "verified", err=True)
    factory = goal.base.model_kind is ModelSource.FACTORY  # its candidates are traced: seconds, not milliseconds
    if not (verify or search):
        if not factory:
            return fit(goal, verify=False)
        with progress("fit", "tracing", quiet=as_json) as bar:
            shown = (lambda done, total, label: bar(done, total, f"tracing {label}")) if bar is not None else None
            return fit(goal, verify=False, progress=shown)
    held = "micro_batch" in goal.held
    budget = 1 if held else max_trials(goal.per_rank)
    isolated = isolated_measure(goal.capacity_bytes, timeout)
    with progress("fit", "measuring", total=budget, quiet=as_json) as bar:
        count = [0]

        def measure(cfg):
            nonlocal budget
            count[0] += 1
            if not held:  # the search's budget is the measured layout's: with --world-size the pick's DP, not the base's
                budget = max_trials(cfg.global_batch // cfg.dp)
            if bar is not None:
                bar(count[0] - 1, budget, f"trial {count[0]} of at most {budget}: micro-batch {cfg.micro_batch} x "
                                          f"accum {cfg.accum}, {cfg.ac}")
            t = isolated(cfg)
            if bar is not None:
                bar.log(trial_line(t, count[0], budget))
            return t

        def tracing(done: int, total: int, label: str) -> None:
            bar(0, budget, f"before the trials: tracing {label}")

        return fit(goal, verify=verify, search=search, measure=measure,
                   progress=tracing if factory and bar is not None else None)


def _after_oom(goal, as_json: bool) -> int:
    """Print the advice; the exit code: 0 when a listed change fits, 1 when none does."""
    from batchlab.advise import oom_advice
    from batchlab.advise.plan import candidate
    from batchlab.advise.states import states_verdict
    from batchlab.config import to_jsonable

    now = candidate(goal.base, goal.tokens)
    items = oom_advice(goal)
    code = 0 if any(a.fits for a in items) else 1
    if as_json:
        print_json({"config": goal.base.to_dict(), "global_batch": goal.global_batch, "formula": to_jsonable(now),
                    "capacity_bytes": goal.capacity_bytes, "usable_bytes": goal.usable_bytes,
                    "model_states": to_jsonable(states_verdict(goal)), "advice": to_jsonable(items),
                    "any_change_fits": code == 0})
        return code
    from batchlab.advise.render import after_oom

    after_oom(console(), goal, now, items)
    return code
