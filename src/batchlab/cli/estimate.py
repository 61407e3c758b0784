"""`batchlab estimate` (the calculator, and --vary tables) and `batchlab explain`."""
from __future__ import annotations

from typing import Annotated, List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from batchlab.cli.base import app
from batchlab.cli.common import Verbose, console as make_console, print_json, with_config, with_layer_profile
from batchlab.cli.sources import device_line
from batchlab.config import parse_field_value
from batchlab.cache.calibrations import load_all
from batchlab.config import ConfigError, Implementation, Keep, ModelSource, RunConfig
from batchlab.config.devices import device
from batchlab.formula import Estimate, compiled_note, estimate as formula_estimate, implementation_line, overlap, unseen_model
from batchlab.formula.loss import in_graph
from batchlab.util.text import print_assumptions
from batchlab.util.units import SAME_TOLERANCE, fmt_amount, fmt_bytes, fmt_count, fmt_percent, fmt_seconds, plural

PLAIN_ROWS = 60
AC_NOTE = ("Activation checkpointing (--ac) recomputes activations in backward: less memory, more compute, "
           "inside one step. It is not the training checkpoint (the file saved to disk for recovery).")


def _collectives_label(cfg, t) -> str:
    """What the stage's engine sends per update (formula.sharding)."""
    names = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter", "all_reduce": "all-reduce",
             "broadcast": "broadcast"}
    sent = ", ".join(f"{names[k]} {fmt_bytes(v)}" for k, v in t.collective_bytes.items() if v)
    spec = cfg.parallel.engine_spec
    if spec.deepspeed:
        return f"DeepSpeed ZeRO-{spec.stage} collectives per update ({sent})"
    if cfg.parallel.shards_gradients:
        return f"FSDP2 collectives per update{', one reduce-scatter' if cfg.parallel.pipelined else ''} ({sent})"
    if cfg.parallel.stage == 1:  # DDP's gradient all-reduce + ZeroRedundancyOptimizer's broadcasts
        return f"ZeRO-1 all-reduce + broadcasts per update ({sent})"
    return f"gradient all-reduce, once per update ({sent or fmt_bytes(t.allreduce_bytes)})"


PIPELINE_NOTES = {  # a pipeline stage's own parts (formula/pipeline.py, stage_steps.py, interleaved.py)
    "stage outputs": "outputs its PipelineStage keeps for their backward (formula/pipeline.py keeps_outputs)",
    "receive buffers": "one per micro-batch each way (formula/pipeline.py)",
    "gradient sends": "input gradients held in their send (formula/pipeline.py)",
}


def _memory_rows(e: Estimate, verbose: bool) -> list[tuple[str, int | None, str | None, str]]:
    """(label, size, part live at the peak or None, note); by default rows that are zero throughout are left
    out and notes kept short."""
    m, cfg = e.memory, e.config
    layers = m.activations_per_layer_bytes
    rows = [
        ("parameters", m.parameters_bytes, "parameters",
         ("bf16 blocks FSDP2 has gathered (current, prefetched, root) and their gradients" if verbose else
          "gathered bf16 blocks and their gradients") if cfg.precision.value == "bf16-fsdp" else
         "16-bit working copies (autocast)" if m.master_bytes else "weights"),
        ("master weights", m.master_bytes, "master", "fp32, updated by the optimizer" if m.master_bytes else "none (not mixed)"),
        ("gradients", m.gradients_bytes, "gradients", ""),
        ("optimizer state", m.optimizer_bytes, "optimizer", str(cfg.optimizer)),
        ("activations", m.activations_bytes, "activations",
         f"{len(layers)} layers, {fmt_bytes(max(layers))} max per layer, ac={cfg.ac}"),
        ("  of which logits/loss", m.logits_bytes, None, f"kept by the loss (--loss {cfg.loss}"
         + (", in the model's compiled graph)" if in_graph(cfg) else ")")),
        ("recompute working set", None, "recompute", "one layer rebuilt during its backward"),
        ("temporaries", None, "temporaries", "activation gradients, logits, optimizer buffers"),
        ("data", m.data_bytes, "data", "token ids of one update"),
    ]
    shown = {r[2] for r in rows if r[2]}
    ds = f"at {'the --deepspeed' if cfg.deepspeed.typed() else 'DeepSpeed'} sizes (formula/deepspeed.py)"
    # every other part live at some phase gets its row, so the column adds up to allocated
    rows += [(k, None, k, ds if k.startswith("deepspeed") else PIPELINE_NOTES.get(k, "formula/memory.py"))
             for k in m.at_peak if k not in shown]
    if verbose:
        return rows
    return [r for r in rows if r[1] or (r[2] is not None and m.at_peak[r[2]])]


def _memory_table(e: Estimate, verbose: bool = False) -> Table:
    m = e.memory
    t = Table(title="Memory per rank  \\[formula]", show_header=True, header_style="bold")
    for col, justify in (("part", "left"), ("size", "right"), (f"live at the peak ({m.peak_phase})", "right"),
                         ("note", "left")):
        t.add_column(col, justify=justify)
    peak = m.at_peak
    for name, size, part, note in _memory_rows(e, verbose):
        t.add_row(name, fmt_bytes(size) if size is not None else "", fmt_bytes(peak[part]) if part else "", note)
    t.add_row("[bold]allocated[/bold]", "", f"[bold]{fmt_bytes(m.allocated_bytes)}[/bold]",
              "tensor bytes at the peak (max_memory_allocated)")
    _extra_rows(t, m.reserved_parts, "caching allocator (formula/allocator.py)", "caching allocator", verbose)
    t.add_row("[bold]reserved[/bold]", "", f"[bold]{fmt_bytes(m.reserved_bytes)}[/bold]", "max_memory_reserved")
    _extra_rows(t, m.device_parts, "outside the caching allocator", "CUDA context, NCCL", verbose)
    t.add_row("[bold]device view[/bold]", "", f"[bold]{fmt_bytes(m.device_bytes)}[/bold]",
              "what nvidia-smi shows" if not verbose else "what nvidia-smi shows (reserved + context + NCCL)")
    return t


def _extra_rows(t: Table, parts: dict[str, int], note: str, together: str, verbose: bool) -> None:
    """Each part on its row under --verbose; by default one row with their sum."""
    if verbose:
        for why, n in parts.items():
            t.add_row(f"  + {why}", "", fmt_bytes(n), note)
    elif parts:
        t.add_row(f"  + {together}", "", fmt_bytes(sum(parts.values())),
                  f"{plural(len(parts), 'part')} (--verbose names them)")


def _stage_table(e: Estimate) -> Table:
    """One row per pipeline stage (its tensor- and data-parallel ranks hold alike)."""
    m, t = e.memory, e.time
    tab = Table(title="Per pipeline stage (each of its TP and DP ranks alike)  \\[formula]", header_style="bold")
    for col in ("stage", "layers", "in-flight micro-batches", "activations", "peak (reserved)", "micro-batch time"):
        tab.add_column(col, justify="right")
    for r in m.ranks:
        secs = t.stage_seconds[r.stage] if r.stage < len(t.stage_seconds) else None
        mark = "[bold]" if r.peak_bytes == m.peak_bytes else ""
        tab.add_row(f"{r.stage}", f"{r.layers}", f"{r.in_flight:g}", fmt_bytes(r.activations_bytes),
                    f"{mark}{fmt_bytes(r.peak_bytes)}{'[/bold]' if mark else ''}",
                    fmt_seconds(secs) if secs is not None else "")
    return tab


def _verdict(e: Estimate) -> str:
    m = e.memory
    verdict = "fits" if m.fits else "[bold red]OUT OF MEMORY[/]"
    if not m.fits and e.config.model_kind is ModelSource.BUILTIN and e.config.model.impl is not Implementation.BATCHLAB:
        verdict += f" with --impl {e.config.model.impl.value}"  # a verdict on that code's tensors, not the run's
    return (f"[bold]{verdict}[/]: reserved {fmt_bytes(m.reserved_bytes)} vs capacity {fmt_bytes(m.capacity_bytes)} "
            f"per rank, headroom {fmt_bytes(m.headroom_bytes)}  \\[formula]")


def _time_table(e: Estimate, tokens: float | None, price: float | None, currency: str = "USD",
                verbose: bool = False) -> Table:
    t, f, cfg = e.time, e.flops, e.config
    tab = Table(title="Compute and time  \\[formula]", header_style="bold")
    tab.add_column("figure")
    tab.add_column("value", justify="right")
    tab.add_row("FLOPs / update: model (MFU) / hardware (HFU, + recompute)",
                f"{fmt_count(f.model_flops_per_update, 'FLOP')} / {fmt_count(f.hardware_flops_per_update, 'FLOP')}")
    tab.add_row(f"compute per micro-batch (of which per-op overhead {fmt_seconds(t.overhead_seconds_per_micro_batch)})",
                fmt_seconds(t.compute_seconds_per_micro_batch))
    if cfg.accum > 1 or verbose:
        tab.add_row(f"compute per update (× {cfg.accum} micro-batch{'es' if cfg.accum != 1 else ''})",
                    fmt_seconds(t.compute_seconds))
    if cfg.tp > 1:
        kinds = "all-gathers, reduce-scatters and all-reduces" if cfg.sequence_parallel else "all-reduces"
        hidden = "the part the GEMMs do not hide" if overlap.tp_overlapped(cfg) else "not overlapped"
        tab.add_row(f"tensor-parallel {kinds} (TP {cfg.tp}, {hidden})", fmt_seconds(t.tp_comm_seconds))
    if cfg.pp > 1:
        hidden = "the part compute does not hide" if overlap.sends_overlapped(cfg) else "not overlapped"
        tab.add_row(f"pipeline sends (PP {cfg.pp}, {hidden})", fmt_seconds(t.pp_comm_seconds))
        filled = ", the other local ranks use its cores" if t.bubble_fraction and not t.bubble_seconds else ""
        tab.add_row(f"pipeline bubble ({fmt_percent(t.bubble_fraction)} of the update, {cfg.pp_schedule}{filled})",
                    fmt_seconds(t.bubble_seconds))
    if cfg.dp > 1 or verbose:
        tab.add_row(_collectives_label(cfg, t), fmt_seconds(t.allreduce_seconds))
        tab.add_row("  exposed (not overlapped)", fmt_seconds(t.exposed_comm_seconds))
    if cfg.offload_activations:
        from batchlab.formula.offload import host_link_text

        tab.add_row(f"activation offload copies, not hidden ({host_link_text(cfg)})", fmt_seconds(t.offload_seconds))
    tab.add_row("optimizer step", fmt_seconds(t.optimizer_seconds))
    tab.add_row("[bold]update time[/bold]", f"[bold]{fmt_seconds(t.update_seconds)}[/bold]")
    tab.add_row("[bold]useful tokens/s[/bold] (all ranks)", f"[bold]{t.tokens_per_second:,.0f}[/bold]")
    if e.low_peak_time is not None:
        low = cfg.device_spec.peak_low
        peak = device(low).peak_flops_fp8 if cfg.fp8.value != "none" else device(low).peak_flops(cfg.precision)
        tab.add_row(f"  at the low end of the card's peak range ({fmt_count(peak, 'FLOP/s')}"
                    f", {low})",
                    f"{e.low_peak_time.tokens_per_second:,.0f}")
    peak = fmt_count(cfg.device_spec.peak_flops(cfg.precision), "FLOP/s")
    world = cfg.parallel.world_size
    tab.add_row(f"MFU / HFU (FLOPs / update time / peak {peak} × {plural(world, 'rank')})",
                f"{fmt_percent(e.mfu)} / {fmt_percent(e.hfu)}")
    if tokens:
        secs = t.time_to_tokens(tokens)
        tab.add_row(f"time to {fmt_amount(tokens, 'tokens')}", fmt_seconds(secs))
        if price is not None:
            tab.add_row(f"cost at {price:g} {escape(currency)}/device-hour × {plural(world, 'device')}",
                        f"{price * world * secs / 3600:,.2f} {escape(currency)}")
    return tab


def render(e: Estimate, console: Console, tokens: float | None = None, price: float | None = None,
           currency: str = "USD", verbose: bool = False) -> None:
    """The estimate on a screen; ``verbose``: every memory part, the assumptions and the full sources."""
    cfg, t = e.config, e.time
    console.print(f"[bold]{escape(cfg.model.name)}[/bold] ({e.params.total / 1e6:,.1f} M parameters \\[formula]), "
                  f"seq {cfg.seq}, {cfg.precision}{'' if cfg.fp8.value == 'none' else f' + fp8 {cfg.fp8}'}, "
                  f"{cfg.optimizer}{' (stepped in backward)' if cfg.optimizer_in_backward else ''}, ac={cfg.ac}"
                  f"{', activations offloaded' if cfg.offload_activations else ''}, ZeRO-{cfg.zero}, device {cfg.device}")
    console.print(cfg.global_batch_text())
    kv = f"; KV cache {'on' if e.kv_cache.on else 'off'}" if e.kv_cache is not None else ""
    console.print(implementation_line(cfg) + kv, markup=False, highlight=False)
    if e.kv_cache is not None and verbose:  # the line above says on or off
        console.print(e.kv_cache.text, markup=False, highlight=False)
    if unseen_model(cfg):
        console.print(f"[yellow]warning:[/] {escape(unseen_model(cfg))}: the figures below are for the stand-in "
                      f"shape given by the flags; run --trace for your model's own graph")
    console.print(_memory_table(e, verbose))
    if cfg.tp * cfg.pp > 1:
        console.print(f"figures per rank are the most loaded one's: {e.memory.most_loaded}", highlight=False)
        console.print(_stage_table(e))
    console.print(_verdict(e))
    for alt in e.alternatives:
        console.print(f"[yellow]{escape(alt.line())}[/yellow]", highlight=False)
    console.print(_time_table(e, tokens, price, currency, verbose))
    console.print(f"Training checkpoint file on disk: {fmt_bytes(e.training_checkpoint_bytes)} \\[formula] (weights +"
                  " optimizer state; not activation checkpointing)")
    console.print(escape(device_line(cfg, t.ceiling_source)),
                  highlight=False)
    if cfg.parallel.world_size > 1:
        console.print("scope: the communication time is a ring-bandwidth model, not a measurement of your cluster")
    if verbose:
        print_assumptions(console, [*e.assumptions, f"capacity {fmt_bytes(e.memory.capacity_bytes)}: "
                                                    f"{cfg.device_spec.memory_source}"])
    else:
        console.print("[dim]--verbose: every memory part, the assumptions (time model, communication, allocator) "
                      "and full sources[/dim]")


MAX_NOTES = 5  # lines of "not possible" under a --vary table (all of them with --verbose); the rest are counted


def _render_vary(rows, name: str, keep: Keep, console: Console, verbose: bool = False) -> None:
    from batchlab.experiment.predict import Direction
    from batchlab.formula.vary import OUTPUTS

    header = (name, "micro × accum × DP = global", *[label for label, _ in OUTPUTS], "fits")
    fmts = (fmt_bytes, fmt_bytes, fmt_seconds, lambda x: f"{x:,.0f}", lambda x: fmt_count(x, "FLOP"))
    body, notes = [], []
    for r in rows:
        if not r.possible:  # its own line under the table: why, and what would make it possible
            body.append((str(r.value), "not possible", *[""] * len(OUTPUTS), "-"))
            notes.append(f"{name}={r.value}: not possible: {r.why}" + (f"; possible with {r.fix}" if r.fix else ""))
            continue
        c = r.config
        cells = [f"{fmt(get(r.estimate))} {Direction(r.directions[label]).symbol}"
                 for (label, get), fmt in zip(OUTPUTS, fmts)]
        body.append((str(r.value), f"{c.micro_batch} × {c.accum} × {c.dp} = {c.global_batch}", *cells,
                     "yes" if r.estimate.memory.fits else "no"))
    title = (f"--vary {name}  [formula]  (arrows versus the first possible value; ≈ within "
             f"{SAME_TOLERANCE:.0%})")
    if len(body) > PLAIN_ROWS:  # rich's table layout costs milliseconds a row: long sweeps print plain columns
        widths = [max(len(str(row[i])) for row in (header, *body)) for i in range(len(header))]
        console.print(title, markup=False, highlight=False)
        for row in (header, *body):
            console.print("  ".join(str(v).rjust(w) for v, w in zip(row, widths)), markup=False, highlight=False)
    else:
        tab = Table(title=title.replace("[formula]", "\\[formula]"), header_style="bold")
        for col in header:
            tab.add_column(col, justify="right")
        for row in body:
            tab.add_row(escape(row[0]), *row[1:-1], "[red]no[/red]" if row[-1] == "no" else row[-1])  # row[0]: as typed
        console.print(tab)
    shown = len(notes) if verbose else MAX_NOTES
    for note in notes[:shown]:
        console.print(f"[yellow]{escape(note)}[/yellow]", highlight=False)
    if len(notes) > shown:
        console.print(f"[yellow]... and {len(notes) - shown:,} more values not possible (--verbose or --json "
                      "gives every row's why and fix)[/yellow]", highlight=False)
    if keep is Keep.ACCUM and len({r.config.global_batch for r in rows if r.possible}) > 1:
        console.print("[yellow]warning: the global batch changes across rows (--keep accum): learning rate, "
                      "warmup and schedule length may need to change too.[/yellow]")
    first = next((r for r in rows if r.possible), None)
    if verbose and first is not None:
        print_assumptions(console, first.estimate.assumptions,
                          note=f"(of the first possible row, {name}={first.value})")


@app.command(short_help="Predict memory, FLOPs, update time and tokens/s for one configuration (formula, no torch).",
             help="Predict memory, FLOPs, update time and tokens/s for one configuration (formula, no torch). "
                  + AC_NOTE)
@with_config
def estimate(
    cfg: RunConfig,
    vary: Annotated[Optional[List[str]], typer.Option(help="FIELD=v1,v2,...: a one-variable table, e.g. micro_batch=1,2,4,8 (once). Values are separated by commas or by ';'; a plan:... value keeps its commas up to the next ';' or plan:, e.g. ac='none,plan:full*2,none*2'.")] = None,
    keep: Annotated[Keep, typer.Option(help="global-batch: accum re-derived as micro-batch/DP change; accum: global batch changes.")] = Keep.GLOBAL_BATCH,
    tokens: Annotated[Optional[float], typer.Option(help="Token budget for time-to-budget (and cost).")] = None,
    price: Annotated[Optional[float], typer.Option(help="Price per device-hour (in --currency), for the cost to the token budget.")] = None,
    currency: Annotated[str, typer.Option(help="Currency of --price, printed with the cost.")] = "USD",
    trace: Annotated[bool, typer.Option("--trace", help="Also run one steady-state update of the model's own code on fake tensors (nothing allocated): peak, activations and FLOPs of the real graph, beside the formula's with its error.")] = False,
    tree: Annotated[bool, typer.Option("--tree", help="With --trace: bytes each module keeps for backward, as a tree (implies --trace).")] = False,
    timeline: Annotated[Optional[str], typer.Option(help="With --trace: write the update's memory timeline (live bytes by category, phases, the peak) to FILE.png, FILE.html or FILE.json (implies --trace).", metavar="FILE")] = None,
    verbose: Verbose = False,
    as_json: bool = False,
) -> None:
    console = make_console()
    for ignored, why in ((price is not None and not tokens, "--price needs --tokens (the budget it prices)"),
                         ((tokens or price is not None) and (vary or trace or tree or timeline), "--tokens/--price apply to a "
                          "single estimate, not to --vary or --trace"),
                         (keep is Keep.ACCUM and not vary, "--keep applies to --vary")):
        if ignored:
            typer.echo(f"warning: ignored: {why}", err=True)
    if not (trace or tree or timeline):
        compiled = [c for c in [cfg, *([cfg.replace(compile=v) for v in _compile_values(vary)])] if compiled_note(c)]
        if compiled:  # once, whatever the rows
            typer.echo(f"warning: {compiled_note(compiled[0])}", err=True)
    if trace or tree or timeline:
        if vary:
            raise ConfigError("trace", "--trace traces one configuration; drop --vary")
        from batchlab.cli.render_trace import show

        show(with_layer_profile(cfg), tree=tree, as_json=as_json, console=console, timeline=timeline,
             verbose=verbose)
        return
    if vary:
        from batchlab.formula.vary import values_of, varied, vary as vary_rows

        if len(vary) > 1:  # refused, not combined: a --vary table changes exactly one variable
            raise ConfigError("vary", f"given {len(vary)} times ({', '.join(vary)}); one variable per table")
        name, sep, values = vary[0].partition("=")
        if not sep or not values:
            raise ConfigError("vary", "expected FIELD=v1,v2,... or FIELD=a..b, e.g. micro_batch=1,2,4 or accum=1..64")
        field, texts = name.strip().replace("-", "_"), values_of(values)
        for text in texts:  # an unknown field or a value its type refuses: a user error before any cache is read
            parse_field_value(field, text)
        cfg = with_layer_profile(cfg, varied(cfg, field, texts))  # every row's policies, precisions, regimes
        rows = vary_rows(cfg, field, texts, keep, load_all())
        if as_json:
            print_json([r.to_dict() for r in rows])
        else:
            _render_vary(rows, name, keep, console, verbose)
        return
    e = formula_estimate(with_layer_profile(cfg), load_all())
    if as_json:
        d = e.to_dict()
        if tokens:
            d["time"]["time_to_tokens_seconds"] = e.time.time_to_tokens(tokens)
            if price is not None:
                d["time"]["cost_to_tokens"] = price * cfg.parallel.world_size * e.time.time_to_tokens(tokens) / 3600
                d["time"]["cost_currency"] = currency
        print_json(d)
    else:
        render(e, console, tokens, price, currency, verbose)


def _compile_values(vary: list[str] | None) -> list[str]:
    """The compile values a --vary compile=... names (the others' rows are not compiled)."""
    from batchlab.formula.vary import values_of

    name, _, values = (vary or [""])[0].partition("=")
    if name.strip().replace("-", "_") != "compile" or not values:
        return []
    try:
        return [v for v in values_of(values) if str(v).strip().lower() in ("model", "blocks")]
    except ConfigError:
        return []


@app.command(help="Explain, with your numbers, what each knob moves and why.")
@with_config
def explain(cfg: RunConfig, as_json: bool = False) -> None:
    from batchlab.formula.explain import explain_sections

    # with AC none, the checkpointing section's "turning it on (full)" too (formula/explain.py)
    if compiled_note(cfg) is not None:
        typer.echo(f"warning: {compiled_note(cfg)}", err=True)
    cfg = with_layer_profile(cfg, [cfg.replace(ac="full")] if not cfg.ac.recomputes else [])
    sections = explain_sections(cfg, load_all(), local_limits(cfg))
    if as_json:
        print_json({"provenance": "formula", "config": cfg.to_dict(), "sections": [s.to_dict() for s in sections],
                    "lines": [line for s in sections for line in (s.title, *s.lines)]})
        return
    console = make_console()
    for s in sections:
        console.print(s.title, style="bold", markup=False, highlight=False)
        for line in s.lines:
            console.print(line, markup=False, highlight=False)
        console.print()


def local_limits(cfg: RunConfig) -> list[str]:
    """What one comparison of cfg run on this machine could not support: compare's own scope rules."""
    from batchlab import host
    from batchlab.config import Backend
    from batchlab.experiment.scope import scope
    from batchlab.formula.params import count

    here = "cuda" if cfg.device_spec.backend is Backend.CUDA and host.gpu_names() else "cpu"
    return scope(cfg, cfg, {here}, measured=True, parameters=count(cfg.model).total)
