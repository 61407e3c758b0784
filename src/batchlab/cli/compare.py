"""``batchlab compare``: one variable changed, the direction predicted first, both sides measured
interleaved, the prediction judged, deviations explained, the whole record kept in the lab notebook."""

import sys
from pathlib import Path
from typing import Annotated, List, Optional

import typer

from batchlab.cli.base import app
from batchlab.cli.common import Verbose, fail, with_config, with_layer_profile
from batchlab.cli.render_experiment import show_record
from batchlab.config import ConfigError, RunConfig
from batchlab.experiment.change import KeepMode, build_sides, parse_change
from batchlab.experiment.compare import DEFAULT_CHANGE, DEFAULT_TOKEN_BUDGET, make_plan, run
from batchlab.experiment.notebook import LeftIncomplete, Notebook
from batchlab.experiment.predict import Direction, Metric, parse_direction, parse_predictions
from batchlab.experiment.record import Record
from batchlab.measure.result import Outcome

EXP = "Experiment"
PROMPTED = (Metric.PEAK_MEMORY, Metric.UPDATE_TIME)


@app.command("compare", short_help="Change one thing, predict its effect, measure both sides interleaved and judge it.")
@with_config
def compare(
    cfg: RunConfig,
    as_json: bool,
    change: Annotated[Optional[List[str]], typer.Option("--change", help="FIELD=A:B, e.g. micro_batch=1:2, ac=none:full, accum=4:8, seq=512:1024, precision=fp32:bf16-mixed, dp=1:2. Field names as in the config (underscores). Default: micro_batch=1:2 with the global batch kept (8 with the default flags: 1 x 8 vs 2 x 4).", rich_help_panel=EXP)] = None,
    experiment: Annotated[Optional[Path], typer.Option("--experiment", "-e", help="An experiment TOML file (config and change tables, keep, predict, rounds ...). Its config table is applied on top of the config flags; explicit --keep/--predict/--rounds/... flags win over the file.", rich_help_panel=EXP)] = None,
    keep: Annotated[Optional[str], typer.Option(help="global-batch (default): a micro-batch or DP change re-derives accum, an accum change re-derives the micro-batch; accum: the global batch changes.", rich_help_panel=EXP)] = None,
    allow_confounded: Annotated[bool, typer.Option("--allow-confounded", help="Allow more than one independent change (the record says it is confounded).", rich_help_panel=EXP)] = False,
    predict: Annotated[Optional[str], typer.Option(help="Your prediction before anything runs: memory=up,time=down (metrics: memory, time, tokens_per_second, time_to_budget, oom; up/down/same). Asked on a terminal when absent; 'none' skips.", rich_help_panel=EXP)] = None,
    rounds: Annotated[Optional[int], typer.Option(help="Interleaved rounds A B A B ... (>= 3) (default 3).", rich_help_panel=EXP)] = None,
    steps: Annotated[Optional[int], typer.Option(help="Timed updates per process (default 5).", rich_help_panel=EXP)] = None,
    warmup: Annotated[Optional[int], typer.Option(help="Untimed updates per process before timing (>= 1) (default 2).", rich_help_panel=EXP)] = None,
    threads: Annotated[Optional[int], typer.Option(help="Intra-op threads of the measured processes (OMP_NUM_THREADS). Default: 1 on CPU (steadier paired ratios on a shared machine), torch's default on GPUs; 0: torch's default.", rich_help_panel=EXP)] = None,
    token_budget: Annotated[Optional[int], typer.Option(help=f"Tokens for 'time to token budget' (default {DEFAULT_TOKEN_BUDGET:,}).", rich_help_panel=EXP)] = None,
    timeout: Annotated[Optional[float], typer.Option(help="Seconds before one measurement process is killed and recorded as failed.", rich_help_panel=EXP)] = None,
    torch_device: Annotated[Optional[str], typer.Option(help="Local torch device (cpu, cuda, cuda:1, mps); default: the backend of --device.", rich_help_panel=EXP)] = None,
    formula_only: Annotated[bool, typer.Option("--formula-only", help="Measure nothing: the formula's derivation for both sides, labelled as such, saved to the notebook.", rich_help_panel=EXP)] = False,
    verify: Annotated[bool, typer.Option("--verify/--no-verify", help="Run the gradient-equivalence check (accumulation split, activation checkpointing) at a small size.", rich_help_panel=EXP)] = True,
    notebook: Annotated[Optional[Path], typer.Option(help="Lab notebook (SQLite) (default: batchlab/notebook.sqlite in the user data directory).", rich_help_panel=EXP)] = None,
    note: Annotated[Optional[str], typer.Option(help="Free text kept with the experiment (what else was going on).", rich_help_panel=EXP)] = None,
    report: Annotated[Optional[Path], typer.Option(help="Write a Markdown and a self-contained HTML report with plots into this directory.", rich_help_panel=EXP)] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Progress bar over the rounds on stderr (only on a terminal).")] = True,
    calibrate: Annotated[bool, typer.Option("--calibrate/--no-calibrate", help="On CPU, calibrate the time model once at the measured thread count (cached; only the parts both sides need: about 10 s for fp32 on one process, about 20 s for every part) so the formula's predicted update-time ratio uses measured rates.")] = True,
    verbose: Verbose = False,
):
    """Change one thing, predict its effect, then measure both sides interleaved (A B A B ..., fresh
    processes, warmup excluded) and get a verdict per metric with a noise band, a diagnosis where a
    prediction failed, the training semantics touched, and what the result cannot say.  Saved to the lab
    notebook.  Exit 0 with a verdict, 1 when a side failed to run, 2 for bad input (nothing written)."""
    try:
        plan = _plan(cfg, change, experiment, keep, allow_confounded, predict, rounds, steps, warmup, threads,
                     token_budget, timeout, torch_device, formula_only, note)
        book = Notebook(notebook)
        _calibrate(plan, calibrate, as_json)
        record = _run(plan, book, verify, progress and not as_json)
    except LeftIncomplete as e:  # Ctrl-C / SIGTERM: say which row stays incomplete; exit 130 (143 for SIGTERM)
        typer.echo(f"interrupted: {e}", err=True)
        raise
    except ConfigError as e:
        fail(str(e), getattr(e, "exit_code", 2))  # a notebook save that failed after measuring: 1
    show_record(record, book.path, report, as_json, verbose)
    if any(m is not None and m.outcome is Outcome.FAILED for r in record.rounds or () for m in (r.a, r.b)):
        raise typer.Exit(1)


def _plan(cfg, change, experiment, keep, allow_confounded, predict, rounds, steps, warmup, threads, token_budget,
          timeout, torch_device, formula_only, note):
    file = None
    if experiment is not None:
        if change:
            raise ConfigError("change", "give --change or --experiment, not both")
        from batchlab.experiment.spec import load

        file = load(experiment, cfg)
        cfg = file.base
    opts = file.options if file else {}
    changes = file.changes if file else [parse_change(c, cfg) for c in (change or [DEFAULT_CHANGE])]
    predictions, source = _predictions(predict, file.predictions if file else None)
    pick = lambda flag, key, default: flag if flag is not None else opts.get(key, default)  # noqa: E731
    keep = keep or (file.keep if file is not None and file.keep is not None else KeepMode.GLOBAL_BATCH)
    allow_confounded = allow_confounded or bool(opts.get("allow_confounded"))
    sides = _sides(cfg, changes, keep, allow_confounded)
    if sides:  # both sides' layer terms (invalid sides: make_plan says why, nothing traced first)
        cfg = with_layer_profile(cfg, sides)
    return make_plan(cfg, changes, keep=keep, allow_confounded=allow_confounded,
                     predictions=predictions, prediction_source=source, rounds=pick(rounds, "rounds", 3),
                     warmup=pick(warmup, "warmup", 2), steps=pick(steps, "steps", 5), timeout_s=timeout,
                     token_budget=pick(token_budget, "token_budget", DEFAULT_TOKEN_BUDGET), formula_only=formula_only,
                     note=pick(note, "note", ""), torch_device=torch_device,
                     threads="auto" if threads is None else threads)


def _sides(cfg, changes, keep, allow_confounded) -> tuple[RunConfig, ...]:
    """Both sides' configs, or none when they are invalid (make_plan then says why)."""
    try:
        sides = build_sides(cfg, changes, KeepMode.parse("keep", keep), allow_confounded)
    except ConfigError:
        return ()
    return sides.a, sides.b


def _predictions(flag: Optional[str], from_file) -> tuple[dict[Metric, Direction], str]:
    if flag is not None:
        p = parse_predictions(flag)
        return p, "flag" if p else "none"
    if from_file is not None:
        return from_file, "file"
    if _interactive():
        return _ask(), "prompt"
    return {}, "none"


def _interactive() -> bool:
    """Prompt only a person at a terminal; never a pipe, a script or CI."""
    return sys.stdin.isatty()


def _ask() -> dict[Metric, Direction]:
    out = {}
    typer.echo("Predict before anything runs (up / down / same; Enter to skip):", err=True)
    for metric in PROMPTED:
        while True:
            answer = typer.prompt(f"  {metric.label}", default="", show_default=False, err=True).strip()
            if not answer:
                break
            try:
                out[metric] = parse_direction(answer, metric.value)
                break
            except ConfigError as e:
                typer.echo(f"  {e}", err=True)
    return out


def _calibrate(plan, enabled: bool, as_json: bool) -> None:
    from batchlab.calibrate import auto
    from batchlab.experiment.compare import preflight

    if plan.formula_only:  # nothing measured: the cached calibration is used if there is one
        return
    preflight(plan)  # a user error the measurement would meet is said before a calibration's tens of seconds
    line = auto(plan.sides.a.device, threads=plan.threads, enabled=enabled, cfgs=(plan.sides.a, plan.sides.b))
    if line and not as_json:
        typer.echo(line, err=True)


def _run(plan, book: Notebook, verify: bool, show: bool) -> Record:
    from batchlab.cli.progress import progress

    with progress("compare", "formula, then side A", 2 * plan.rounds, quiet=not show or plan.formula_only) as bar:
        return run(plan, book, progress=bar, verify=verify)
