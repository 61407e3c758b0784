"""``batchlab measure``: train the model under a config for real and report what the run did.

No ``from __future__ import annotations`` here: with_config rebuilds the signature from these parameters,
and typer needs the Annotated objects (help) themselves, not their strings.
"""

import statistics
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from batchlab.cli.base import app
from batchlab.util.text import print_assumptions
from batchlab.cli.common import (CommandLine, Verbose, console, fail, print_json, with_config,
                                  with_goal_profile, with_layer_profile)
from batchlab.cli.sources import device_line
from batchlab.config import ConfigError, RunConfig
from batchlab.distributed.launcher import Launcher
from batchlab.measure.options import MeasureOptions
from batchlab.measure.result import Measurement, Outcome, compile_text, measurement_to_dict
from batchlab.measure.versus import FigureRow, broken_time_model, formula_estimate, rows
from batchlab.util.units import fmt_bytes, fmt_difference, fmt_seconds, fmt_value, plural


@app.command("measure", short_help="Train the config for real and measure peak memory, update time and tokens/s.")
@with_config
def measure(
    cfg: RunConfig,
    as_json: bool,
    line: CommandLine,
    warmup: Annotated[int, typer.Option(help="Untimed updates first (>= 1: the first update is never timed).")] = 2,
    steps: Annotated[int, typer.Option(help="Timed updates (median, IQR, min/max over them).")] = 5,
    isolate: Annotated[bool, typer.Option("--isolate/--no-isolate", help="Run in a fresh subprocess, so a kernel OOM-kill or a crash becomes a recorded failure.")] = False,
    timeout: Annotated[Optional[float], typer.Option(help="With --isolate: seconds before the run is killed and recorded as failed.")] = None,
    torch_device: Annotated[Optional[str], typer.Option(help="Local torch device (cpu, cuda, cuda:1, mps); default: the backend of --device.")] = None,
    memory: Annotated[bool, typer.Option("--memory/--no-memory", help="Take the memory update.")] = True,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Progress bar on stderr (only on a terminal).")] = True,
    nproc: Annotated[Optional[int], typer.Option(help="Ranks on this node, each on the config's engine (DDP, ZeRO-1, FSDP2, with --tp / --pp their tensor and pipeline split; gloo on CPU, nccl on CUDA); --nproc x --nnodes must equal the world size dp x tp x pp (--dp is derived when not given). Default: the world size.", rich_help_panel="Data parallel (torchrun)")] = None,
    launcher: Annotated[Optional[Launcher], typer.Option(help="How the ranks start: fork (one node on CPU: forks of a process that imported torch once; the default there) or torchrun (fresh interpreters, the default for CUDA and several nodes).", rich_help_panel="Data parallel (torchrun)")] = None,
    nnodes: Annotated[Optional[int], typer.Option(help="torchrun --nnodes (multi-node).", rich_help_panel="Data parallel (torchrun)")] = None,
    node_rank: Annotated[Optional[int], typer.Option(help="torchrun --node-rank.", rich_help_panel="Data parallel (torchrun)")] = None,
    rdzv_endpoint: Annotated[Optional[str], typer.Option(help="torchrun --rdzv-endpoint host:port (multi-node).", rich_help_panel="Data parallel (torchrun)")] = None,
    calibrate: Annotated[bool, typer.Option("--calibrate/--no-calibrate", help="On CPU, calibrate the time model once (cached per CPU, torch version and thread count; only the parts the config needs: about 10 s for fp32 on one process, about 20 s for every part) so the formula's update time uses measured rates.")] = True,
    timeline: Annotated[Optional[str], typer.Option(help="Also record one more untimed update after warmup as a memory timeline, in the measuring process (isolated with --isolate; live-storage tracker on CPU, allocator history on CUDA), and write it to FILE.png, FILE.html or FILE.json.", metavar="FILE")] = None,
    verbose: Verbose = False,
):
    """Train the model under the config for real: peak memory (allocator), update time (wall-clock), useful
    tokens/s, or the out-of-memory phase; each figure beside the formula estimate.  Exit 0 when a result
    (ok or oom) was recorded, 1 when the run failed, 2 for a bad config."""
    from batchlab.run import measure as run

    if timeout is not None and not isolate and nproc is None and nnodes is None:
        typer.echo("warning: ignored: --timeout applies to --isolate (or --nproc) runs", err=True)
    if launcher is not None and nproc is None and nnodes is None:
        typer.echo("warning: ignored: --launcher applies to --nproc runs", err=True)
    try:
        if timeline:
            from batchlab.timeline.output import check_path

            check_path(timeline)  # a wrong suffix fails before the run
        opts = MeasureOptions(warmup=warmup, steps=steps, isolate=isolate, memory=memory, timeout_s=timeout,
                              torch_device=torch_device, timeline=bool(timeline))
        cfg = with_layer_profile(cfg)  # the formula's figures beside the measurement: the model's own layer terms
        if nproc is not None or nnodes is not None:
            from batchlab.distributed import launch
            from batchlab.distributed.launcher import torchrun_args

            from batchlab.cli.progress import progress as display

            cfg = dp_from_world(cfg, nproc, nnodes, line.typed)
            with display("measure", f"{cfg.parallel.world_size} ranks", quiet=as_json or not progress):
                m = launch(cfg, opts, nproc, torchrun_args(nnodes, node_rank, rdzv_endpoint), launcher=launcher)
        else:
            m = _run_with_progress(run, cfg, opts, progress and not as_json)
    except ConfigError as e:
        fail(str(e))
    from batchlab.distributed import is_primary

    if not is_primary():  # `torchrun -m batchlab measure`: rank 0 prints for all
        return
    _calibrate_note(cfg, calibrate, as_json)
    est, note = formula_estimate(cfg)
    figures = rows(m, est)
    oom = m.outcome in (Outcome.OOM, Outcome.OOM_BUDGET)
    if as_json:
        payload = measurement_to_dict(m)
        payload.pop("timeline", None)  # its samples go to the --timeline FILE
        payload["comparison"] = [r.to_dict() for r in figures]
        payload["formula_note"] = note
        if oom:
            payload["oom_advice"] = _oom_advice(cfg, as_json=True)
        print_json(payload)
    else:
        _render(cfg, m, figures, note, est, verbose)
        if oom:
            _oom_advice(cfg, as_json=False)
    if timeline:
        _timeline(m, timeline, as_json)
    if m.outcome is Outcome.FAILED:
        raise typer.Exit(1)


def _calibrate_note(cfg: RunConfig, enabled: bool, as_json: bool) -> None:
    from batchlab.calibrate import auto

    line = auto(cfg.device, threads=None, enabled=enabled, cfgs=(cfg,))
    if line and not as_json:
        typer.echo(line, err=True)


def dp_from_world(cfg: RunConfig, nproc: Optional[int], nnodes: Optional[int], typed: frozenset) -> RunConfig:
    """The DP size is the world size --nproc x --nnodes: derived when --dp was not given (the global batch
    kept when --global-batch was typed, else accum kept); a typed --dp that contradicts it is refused."""
    if nproc is None:
        return cfg
    world = nproc * (nnodes or 1)
    if cfg.parallel.world_size == world:
        return cfg
    per = cfg.tp * cfg.pp  # ranks of one model replica
    if world % per:
        raise ConfigError("nproc", f"the world size --nproc x --nnodes = {world} is not a multiple of tp x pp = {per}")
    dp = world // per
    if "dp" in typed or cfg.dp != 1:  # typed, or set by --config FILE
        raise ConfigError("dp", f"{cfg.dp} contradicts the world size --nproc x --nnodes = {nproc} x {nnodes or 1} "
                                f"= {world}" + (f" over tp x pp = {per}" if per > 1 else "")
                                + "; omit --dp (it is derived) or make them agree")
    if "global_batch" in typed:
        return cfg.replace(dp=dp).with_global_batch(cfg.global_batch)
    return cfg.replace(dp=dp)


def _timeline(m: Measurement, path: str, as_json: bool) -> None:
    from batchlab.timeline.output import write

    if m.timeline is None:
        why = (f"the run ended {m.outcome.value}, no update to record" if m.outcome is not Outcome.OK else
               "the DDP ranks do not record one (`batchlab estimate --trace --timeline` draws one rank)")
        typer.echo(f"warning: ignored: --timeline: {why}", err=True)
        return
    try:
        write(m.timeline, path)
    except ConfigError as e:
        fail(str(e))
    Console(stderr=as_json).print(f"memory timeline \\[{escape(m.timeline.provenance)}] written to {escape(path)}")


def _oom_advice(cfg: RunConfig, as_json: bool):
    """After an out-of-memory outcome: the same ordered advice as `batchlab fit --after-oom`."""
    from batchlab.advise import Goal, oom_advice
    from batchlab.config import to_jsonable

    goal = with_goal_profile(Goal(cfg), after_oom=True)  # the layer terms of every change it proposes
    if as_json:
        return to_jsonable(oom_advice(goal))
    from batchlab.advise.plan import candidate
    from batchlab.advise.render import after_oom

    after_oom(console(), goal, candidate(goal.base, goal.tokens), oom_advice(goal))


def _run_with_progress(run, cfg: RunConfig, opts: MeasureOptions, show: bool) -> Measurement:
    from batchlab.cli.progress import progress
    from batchlab.distributed import is_primary

    with progress("measure", "starting", quiet=not (show and is_primary()), counted=True) as bar:
        return run(cfg, opts, progress=bar)


def _value(row: FigureRow, value) -> str:
    return fmt_value(value, row.unit)


def _render(cfg: RunConfig, m: Measurement, figures: list[FigureRow], note: str | None, est=None,
            verbose: bool = False) -> None:
    out = console()
    env = m.environment
    # text from outside (model names, exception messages) is escaped: "[enforce fail ...]" is not markup
    threads = env.get("threads")
    threads = plural(threads, "thread") if isinstance(threads, (int, float)) else "? threads"
    where = escape(f"{env.get('torch_device', '?')} ({env.get('device_name', '?')}, {threads})")
    out.print(f"[bold]batchlab measure[/]  {escape(str(env.get('model', cfg.model_source)))} on {where}, "
              f"torch {env.get('torch', '?')}"
              + (f", isolated subprocess ({env.get('worker', 'fresh process')})" if env.get("isolated") else ""))
    out.print(cfg.global_batch_text(m.counted))
    out.print(f"activation checkpointing: {cfg.ac}   precision: {cfg.precision}   data: {cfg.data}")
    _render_kv_cache(out, env.get("kv_cache"), est)
    style = {"ok": "green", "failed": "red"}.get(m.outcome.value, "yellow")
    out.print(f"outcome: [{style}]{escape(m.outcome.value)}[/]"
              + (f" - {escape(m.outcome_detail)}" if m.outcome_detail else ""))
    if figures:
        table = Table(show_header=True, header_style="bold")
        for col in ("figure", "measured", "how", "formula", "difference"):
            table.add_column(col, justify="left" if col in ("figure", "how") else "right")
        for r in figures:
            table.add_row(r.figure, _value(r, r.measured), r.measured_provenance,
                          _value(r, r.formula) if r.formula is not None else "-", fmt_difference(r.relative_difference, r.unit, r.measured, r.formula))
        out.print(table)
    _render_details(out, m, verbose, est)
    if note:
        out.print(f"[dim]{escape(note)}[/]")
    for w in m.warnings + ([broken] if (broken := broken_time_model(figures)) else []):
        out.print(f"[yellow]warning:[/] {escape(w)}")
    _render_sources(out, cfg, est, verbose)


def _render_kv_cache(out: Console, built: bool | None, est) -> None:
    """The KV cache the measured model really built (its config's use_cache), with the formula's line on the flag
    that turns it the other way."""
    if built is None:
        return
    text = est.kv_cache.text if est is not None and est.kv_cache is not None else ""
    same = text.startswith(f"KV cache: {'on' if built else 'off'}")
    out.print(escape(text if same else f"KV cache: {'on' if built else 'off'} (the model's config.use_cache, as built)"),
              highlight=False)


def _render_sources(out: Console, cfg: RunConfig, est, verbose: bool) -> None:
    """The formula column's inputs: short names by default; its assumptions in full with ``verbose``."""
    if est is None:
        return
    t = est.time
    out.print(escape(device_line(cfg, t.ceiling_source, "formula inputs")),
              highlight=False)
    if not verbose:
        out.print("[dim]--verbose: CPU time, allocator and page faults, the formula's assumptions and sources[/]")
        return
    print_assumptions(out, est.assumptions, "formula assumptions")


def _render_details(out: Console, m: Measurement, verbose: bool = False, est=None) -> None:
    t = m.time
    if t is not None and t.samples:
        split = "  ".join(f"{k} {fmt_seconds(v)}" for k, v in t.phase_seconds.items())
        out.print(f"update time over {len(t.samples)} timed updates after {t.warmup} warmup (wall-clock): "
                  f"min {fmt_seconds(t.update_seconds_min)}, max {fmt_seconds(t.update_seconds_max)}, "
                  f"IQR/median {t.spread:.1%}")
        if split:
            out.print(f"per phase (median, wall-clock): {split}")
        if t.cpu_seconds and verbose:
            med = statistics.median(t.cpu_seconds)
            out.print("process CPU time per update (median, all threads; the process clock, read beside the "
                      f"wall-clock one): {fmt_seconds(med)}")
    if "allocator" in m.environment and verbose:  # host pages mapped afresh per update cost CPU time (batchlab.host.regime)
        faults = m.environment.get("page_faults_per_update")
        out.print(escape(m.environment["allocator"])
                  + (f"; {faults:,.0f} page faults per timed update" if isinstance(faults, (int, float)) else ""))
    if (compiled := compile_text(m.environment)) is not None:
        out.print(escape(compiled), highlight=False)
    if m.memory is not None and m.memory.breakdown:
        parts = "  ".join(f"{k} {fmt_bytes(v)}" for k, v in m.memory.breakdown.items() if v)
        how = (f"{m.memory.provenance}: {m.memory.method}" if verbose or compiled is not None
               else m.memory.provenance)
        out.print(f"memory at the peak ({how}): {parts}")
    from batchlab.cli.render_dp import lines as dp_lines
    from batchlab.cli.render_dp import rank_lines

    # each pipeline stage's own tensor peak (the allocator's margin aside: the ranks' column is tensor bytes)
    formula_peaks = ({r.stage: r.peak_bytes - r.parts.get("allocator", 0) for r in est.memory.ranks}
                     or {0: est.memory.peak_tensor_bytes}) if est is not None else None
    for line in rank_lines(m, formula_peaks):
        out.print(escape(line), highlight=False)

    for line in dp_lines(m, verbose):
        out.print(line)

