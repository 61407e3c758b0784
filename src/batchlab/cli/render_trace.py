"""A trace for people (rich) and for scripts (JSON), with the formula's figures beside it.

formula error = (formula - trace) / trace: the trace ran the model's own code, so it is the reference;
a large error means the formula's transformer does not describe this model.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from batchlab.util.text import for_rich as escape
from rich.table import Table
from rich.tree import Tree

from batchlab.config import to_jsonable
from batchlab.formula.opcost import breakdown_text
from batchlab.trace.result import ModuleNode, TraceEstimate
from batchlab.util.units import fmt_bytes, fmt_count, fmt_difference, fmt_seconds, relative_to

# the formula's parts at the peak a live-storage tracker counts as activations on a pipeline stage
PIPELINE_ACTIVATIONS = ("activations", "receive buffers", "stage outputs", "gradient sends")
# |formula error| above this on peak or activations prints a warning
FORMULA_WARN = 0.10


@dataclass
class Comparison:
    figure: str
    unit: str  # bytes | FLOP | phase
    trace: int | str
    formula: int | float | str | None

    @property
    def formula_error(self) -> float | None:
        """(formula - trace) / trace."""
        return relative_to(self.formula, self.trace)

    def to_dict(self) -> dict[str, Any]:
        return {"figure": self.figure, "unit": self.unit, "trace": self.trace, "formula": self.formula,
                "formula_error": self.formula_error}


def comparisons(trace: TraceEstimate, est=None) -> list[Comparison]:
    """The trace's figures beside the formula's (``est`` None: no formula for this model)."""
    m, f = trace.memory, trace.flops
    fm, ff = (est.memory, est.flops) if est is not None else (None, None)
    par = trace.config.get("parallel", {})
    ranked = par.get("tp", 1) > 1 or par.get("pp", 1) > 1  # one rank's shard and stage traced: its own work
    if ranked:  # the formula's FLOPs and time are the world's update, the trace's one rank's
        ff = None

    def of(part, name: str):
        return getattr(part, name) if part is not None else None

    # a pipeline interleaves forwards and backwards: what backward will read is compared where the peak is
    # (the formula's stage parts, receive buffers and sends, are what the tracker counts as activations)
    acts = (Comparison("activations at the peak", "bytes", m.breakdown.get("activations", 0),
                       sum(fm.at_peak.get(k, 0) for k in PIPELINE_ACTIVATIONS) if fm is not None else None)
            if par.get("pp", 1) > 1 else
            Comparison("activations (last micro-batch)", "bytes", m.activations_bytes, of(fm, "activations_bytes")))
    return [
        # the trace counts tensor bytes; the formula's peak_bytes adds its allocator margin on top
        Comparison("peak tensor bytes", "bytes", m.peak_bytes, of(fm, "peak_tensor_bytes")),
        Comparison("peak phase", "phase", m.peak_phase, of(fm, "peak_phase")),
        acts,
        # kept between updates: the fp32 master copy under mixed precision, else the weights
        Comparison("weights kept between updates", "bytes", m.parameters_bytes,
                   (fm.master_bytes or fm.parameters_bytes) if fm is not None else None),
        Comparison("gradients", "bytes", m.gradients_bytes, of(fm, "gradients_bytes")),
        Comparison("optimizer state", "bytes", m.optimizer_bytes, of(fm, "optimizer_bytes")),
        Comparison("forward FLOPs", "FLOP", f.forward, None),
        Comparison("backward FLOPs", "FLOP", f.backward, None),
        Comparison("recompute FLOPs", "FLOP", f.recompute, None),
        Comparison("model FLOPs per update", "FLOP", f.model_flops_per_update, of(ff, "model_flops_per_update")),
        Comparison("hardware FLOPs per update", "FLOP", f.hardware_flops_per_update,
                   of(ff, "hardware_flops_per_update")),
    ] + ([Comparison("update time, per-op model (one rank, no comm)", "seconds", trace.time.seconds,
                     est.time.ops.seconds if est is not None and est.time.ops is not None and not ranked else None)]
         if trace.time is not None else [])


def trace_to_json(trace: TraceEstimate, formula_est=None, formula_note: str | None = None) -> dict[str, Any]:
    """The trace as JSON-ready values (for ``print_json``), with the formula comparison when given.
    The timeline's samples are left out (``--timeline FILE.json`` writes them)."""
    out = to_jsonable(dataclasses.replace(trace, timeline=None))
    out.pop("timeline")
    out["comparison"] = [c.to_dict() for c in comparisons(trace, formula_est)]
    out["formula_note"] = formula_note
    return out


def _value(c: Comparison, v) -> str:
    if v is None:
        return "-"
    if c.unit == "bytes":
        return fmt_bytes(v)
    if c.unit == "FLOP":
        return fmt_count(v, "FLOP")
    if c.unit == "seconds":
        return fmt_seconds(v)
    return str(v)


def render_trace(trace: TraceEstimate, formula_est, console: Console, formula_note: str | None = None,
                 verbose: bool = False) -> None:
    """Print the trace: figures beside the formula's, the breakdown at the peak, notes, and the tree;
    ``verbose``: the time model's rates and their source too."""
    cfg = trace.config
    traced = trace.traced or f"{cfg['model_source']} ({cfg['model']['name']})"
    console.print(f"[bold]batchlab estimate --trace[/]  {escape(traced)}: one "
                  f"steady-state update on fake tensors, {trace.traced_device} kernels, traced in "
                  f"{trace.trace_seconds:.1f} s")
    console.print(f"global batch = micro-batch x accum x DP = {cfg['micro_batch']} x {cfg['accum']} x {cfg['dp']} "
                  f"= {trace.counted.update_text(trace.global_batch, trace.tokens_per_update)}")
    console.print(f"activation checkpointing: {cfg['ac']}   precision: {cfg['precision']}   "
                  f"optimizer: {cfg['optimizer']}   seq: {cfg['seq']}")
    if trace.kv_cache is not None:
        kv = getattr(formula_est, "kv_cache", None)
        said = kv is not None and kv.text.startswith(f"KV cache: {'on' if trace.kv_cache else 'off'}")
        console.print(escape(kv.text if said else f"KV cache: {'on' if trace.kv_cache else 'off'} (the traced model's "
                             "config.use_cache)"), highlight=False)
    rows = comparisons(trace, formula_est)
    table = Table(show_header=True, header_style="bold")
    for col in ("figure", "trace", "formula", "formula vs trace"):
        table.add_column(col, justify="left" if col == "figure" else "right")
    for c in rows:
        table.add_row(c.figure, _value(c, c.trace), _value(c, c.formula), fmt_difference(c.formula_error, c.unit, c.trace, c.formula))
    console.print(table)
    m = trace.memory
    parts = "  ".join(f"{k} {fmt_bytes(v)}" for k, v in m.breakdown.items() if v)
    console.print(f"at the peak ({m.peak_phase}, trace): {parts}")
    verdict = "fits" if m.fits else "does NOT fit"
    source = {"replay": "allocator: the trace replayed through the caching allocator",
              "formula": "formula/allocator.py's caching-allocator model",
              "none": "CPU: no caching allocator"}.get(m.margin_source, "assumption")
    console.print(f"{verdict}: peak {fmt_bytes(m.peak_bytes)} + allocator margin {fmt_bytes(m.margin_bytes)} "
                  f"({source}) vs {fmt_bytes(m.capacity_bytes)} on {cfg['device']}")
    if trace.time is not None:
        console.print(escape(breakdown_text(trace.time)), highlight=False)
        if verbose:
            console.print(f"[dim]{escape(trace.time_model)}[/]")
        else:
            console.print("[dim]--verbose: the time model's per-kernel rates and their source[/]")
    _warn_formula(rows, console)
    for note in ([formula_note] if formula_note else []) + trace.notes:
        console.print(f"[dim]note: {escape(note)}[/]")
    _warned(trace.warnings, console, verbose)
    if trace.tree is not None:
        console.print(render_tree(trace.tree))


def _warned(warnings: list[str], console: Console, verbose: bool) -> None:
    """The warnings the traced code raised, kept off the terminal while it ran: one line, or each with --verbose."""
    if not warnings:
        return
    if not verbose:
        console.print(f"[dim]note: {len(warnings)} distinct warning(s) from the traced code kept off the terminal "
                      f"(first: {escape(warnings[0][:80])}); --verbose lists them[/]")
        return
    for w in warnings:
        console.print(f"[dim]traced code warned: {escape(w)}[/]")


def _warn_formula(rows: list[Comparison], console: Console) -> None:
    off = [c for c in rows if c.unit == "bytes" and c.figure.startswith(("peak", "activations"))
           and c.formula_error is not None and abs(c.formula_error) > FORMULA_WARN]
    if off:
        what = ", ".join(f"{c.figure} {c.formula_error:+.0%}" for c in off)
        console.print(f"[yellow]warning:[/] the formula does not describe this model well ({what}); "
                      "the trace ran its own code")


# ------------------------------------------------------------------------------------------ tree

def _signature(node: ModuleNode, prefix: str) -> tuple:
    """What makes two sibling subtrees the same, names taken relative to their own root."""
    rel = node.name[len(prefix):]
    return (rel, node.kind, node.self_bytes, node.total_bytes, node.recomputed,
            tuple(_signature(c, node.name) for c in node.children))


def _groups(children: list[ModuleNode]) -> list[list[ModuleNode]]:
    """Consecutive numbered siblings with identical subtrees (a layer stack) become one group."""
    out: list[list[ModuleNode]] = []
    for c in children:
        prev = out[-1][-1] if out else None
        if (prev is not None and re.search(r"\.\d+$|^\d+$", c.name) and re.search(r"\.\d+$|^\d+$", prev.name)
                and c.name.rpartition(".")[0] == prev.name.rpartition(".")[0]
                and _signature(c, c.name)[1:] == _signature(prev, prev.name)[1:]):
            out[-1].append(c)
        else:
            out.append([c])
    return out


def _label(group: list[ModuleNode]) -> str:
    node = group[0]
    name = node.name.rpartition(".")[2] if node.name else node.kind
    if len(group) > 1:
        last = group[-1].name.rpartition(".")[2]
        name = f"{name}-{last} (x{len(group)}, each)"
    kind = f" [dim]{node.kind}[/]" if node.kind and node.name else ""
    ac = f" [cyan]{node.recomputed} recompute[/]" if node.recomputed else ""
    shown = any(c.total_bytes for c in node.children)
    own = f" (own {fmt_bytes(node.self_bytes)})" if shown and node.self_bytes else ""
    return f"{name}{kind}{ac}  {fmt_bytes(node.total_bytes)}{own}"


def _add(tree: Tree, node: ModuleNode) -> None:
    for group in _groups([c for c in node.children if c.total_bytes]):
        branch = tree.add(_label(group))
        _add(branch, group[0])


def render_tree(root: ModuleNode) -> Tree:
    """Bytes each module's forward leaves held for backward (trace); identical layers shown once."""
    tree = Tree(f"[bold]kept for backward, by the module that created it (trace)[/]: {_label([root])}")
    _add(tree, root)
    return tree


def show(cfg, tree: bool = False, as_json: bool = False, console: Console | None = None,
         timeline: str | None = None, verbose: bool = False) -> TraceEstimate:
    """What ``batchlab estimate --trace [--tree] [--json] [--timeline FILE]`` prints: the trace beside the
    formula; with ``timeline``, the update's memory timeline written to that file too."""
    from batchlab.cli.common import print_json
    from batchlab.cli.progress import progress
    from batchlab.measure.versus import formula_estimate
    from batchlab.trace import estimate

    from batchlab.cache.calibrations import load_all

    if timeline:
        from batchlab.timeline.output import check_path, write

        check_path(timeline)  # a wrong suffix fails before the trace runs
    with progress("trace", f"one update of {cfg.model.name} on fake tensors (nothing allocated)", quiet=as_json):
        trace = estimate(cfg, tree=tree, timeline=bool(timeline), calibrations=load_all())
    if timeline:
        write(trace.timeline, timeline)
        (Console(stderr=True) if as_json else console or Console()).print(
            f"memory timeline \\[trace] written to {escape(str(timeline))}")
    est, note = formula_estimate(cfg)
    if as_json:
        print_json(trace_to_json(trace, est, note))
    else:
        render_trace(trace, est, console or Console(), note, verbose)
    return trace
