"""`batchlab explain`: the mechanisms behind each knob, with the user's own numbers (formula).

Plain text (no terminal markup): the CLI styles the titles, ``--json`` prints the same strings.  The
sections answer the four self-check questions of the course brief this tool grew from: how micro-batch and
global batch relate, why activation checkpointing saves memory but costs compute, which timings accumulation
moves at a fixed global batch, and what a local comparison cannot support (``cannot_support``: the same
scope rules compare uses, given by the caller so that the formula side imports nothing of the experiment).
"""
from __future__ import annotations

from dataclasses import dataclass

from batchlab.config import ConfigError, Keep, RunConfig, apply_change
from batchlab.formula import Calibrations, Estimate, estimate
from batchlab.formula.vary import direction
from batchlab.util.units import fmt_bytes, fmt_seconds


@dataclass(frozen=True)
class Section:
    title: str
    lines: tuple[str, ...]

    def to_dict(self) -> dict:
        return {"title": self.title, "lines": list(self.lines)}


def _changed(cfg: RunConfig, name: str, value, keep: Keep, cal: Calibrations | None) -> Estimate | str:
    """The estimate with one change, or why the change is not possible for this config."""
    try:
        return estimate(apply_change(cfg, name, value, keep), cal)
    except ConfigError as e:
        return f"not possible here ({e})"


def _moves(a: Estimate, b: Estimate | str) -> str:
    if isinstance(b, str):
        return b
    c = b.config
    return (f"{c.micro_batch} x {c.accum} x {c.dp} = global batch {c.global_batch}; "
            f"peak {fmt_bytes(a.memory.peak_bytes)} → {fmt_bytes(b.memory.peak_bytes)}, "
            f"activations {fmt_bytes(a.memory.activations_bytes)} → {fmt_bytes(b.memory.activations_bytes)}, "
            f"update {fmt_seconds(a.time.update_seconds)} → {fmt_seconds(b.time.update_seconds)}")


def _peak_moves(a: Estimate, b: Estimate) -> str:
    d = direction(a.memory.peak_bytes, b.memory.peak_bytes)
    return {"same": "stays about the same", "up": "rises", "down": "falls"}[d]


def _time_ratio(a: Estimate, b: Estimate) -> str:
    return f"x{b.time.update_seconds / a.time.update_seconds:.2f}"


def _not_possible(reason: str, odd: int, what: str) -> str:
    """A change that cannot be made, as one sentence: why, and (when ``odd`` is) what it would need."""
    need = f"; halving the {what} needs an even one (now {odd})" if odd % 2 else ""
    return f"{reason}{need}."


def _batch(cfg: RunConfig, e: Estimate, cal: Calibrations | None) -> Section:
    mb, k = cfg.micro_batch, cfg.accum
    fixed_global = _changed(cfg, "micro_batch", mb * 2, Keep.GLOBAL_BATCH, cal)
    fixed_accum = _changed(cfg, "micro_batch", mb * 2, Keep.ACCUM, cal)
    return Section("1. Micro-batch and global batch", (
        cfg.global_batch_text(),
        f"The micro-batch ({mb}) is the sequences in one forward/backward on one rank; its activations "
        f"({fmt_bytes(e.memory.activations_bytes)} kept for backward) grow with it; larger kernels may run "
        "more efficiently. The global batch is what one optimizer update sees.",
        f"  micro-batch {mb} → {mb * 2} at a fixed global batch (accum re-derived): "
        + (_not_possible(fixed_global, k, "accum") if isinstance(fixed_global, str)
           else f"{_moves(e, fixed_global)}."),
        f"  micro-batch {mb} → {mb * 2} at a fixed accum: "
        + (f"{fixed_accum}." if isinstance(fixed_accum, str) else
           f"{_moves(e, fixed_accum)} — the global batch doubles, so the learning rate and schedule may need to "
           "change too."),
    ))


def _accumulation(cfg: RunConfig, e: Estimate, cal: Calibrations | None) -> Section:
    k = cfg.accum
    more_data = _changed(cfg, "accum", k * 2, Keep.ACCUM, cal)
    same_data = _changed(cfg, "accum", k * 2, Keep.GLOBAL_BATCH, cal)
    a = f"  (a) accum {k} → {k * 2} at a fixed micro-batch {cfg.micro_batch}: "
    b = f"  (b) accum {k} → {k * 2} at a fixed global batch {cfg.global_batch}: "
    return Section("Gradient accumulation: two readings of \"doubling it\"", (
        "Micro-batches whose gradients are summed before one optimizer step; only one micro-batch's "
        "activations are live at a time." if cfg.pp == 1 else _pipeline_accumulation(cfg, e),
        a + (f"{more_data}." if isinstance(more_data, str) else
             f"{_moves(e, more_data)}. The global batch doubles; the peak {_peak_moves(e, more_data)}; the update "
             f"takes {_time_ratio(e, more_data)} as long (twice the sequences); the optimizer sees twice the data "
             "per step, so learning rate, warmup and schedule length (in updates) may need to change."),
        b + (_not_possible(same_data, cfg.micro_batch, "micro-batch") if isinstance(same_data, str) else
             f"{_moves(e, same_data)}. The micro-batch halves, so the peak {_peak_moves(e, same_data)}; the same "
             "data takes twice as many forward/backward passes of smaller kernels (more per-op overhead): the "
             f"update takes {_time_ratio(e, same_data)} as long; the optimizer sees the same global batch."),
    ))


def _pipeline_accumulation(cfg: RunConfig, e: Estimate) -> str:
    """What accum means under a pipeline: the micro-batches of one flush, which set the bubble and what a stage
    holds."""
    lay, k = cfg.parallel, cfg.accum
    first = lay.in_flight(0, k)
    return (f"Under a {lay.pp}-stage pipeline ({lay.schedule.value}) accum = {k} is the micro-batches of one pipeline "
            f"flush: the pipeline idles (p - 1) micro-batch times at its start and end, a bubble of "
            f"{lay.bubble_fraction(k):.1%} of the update ((p-1)/(v·m+p-1) = {lay.pp - 1}/({lay.chunks}·{k}+{lay.pp - 1}); "
            f"{e.time.bubble_seconds * 1e3:,.1f} ms here), smaller the more micro-batches per update; GPipe and 1F1B "
            "leave the same bubble, (p-1)/(m+p-1), and interleaving v chunks per rank divides it by v (Narayanan et "
            f"al. 2021, arXiv 2104.04473); the first stage holds {first:g} micro-batches' activations at its high "
            "point " + {"gpipe": "(GPipe: all of them, growing with accum).",
                        "1f1b": "(1F1B: at most p, whatever accum)."}.get(
                lay.schedule.value, "(interleaved: its warm-up chunk-forwards, (p-1)·2 + (v-1)·p + 1 on the first "
                                    "stage, each 1/v of its layers)."))


def _timings(cfg: RunConfig, e: Estimate) -> Section:
    t, k = e.time, cfg.accum
    comm = (f"the gradient all-reduce ({fmt_bytes(t.allreduce_bytes)}, {fmt_seconds(t.allreduce_seconds)} by the "
            "ring model) stays once per update when the loop uses DDP no_sync() on the other micro-batches; "
            f"without it, it would run {k} times" if cfg.dp > 1 else
            "one rank here: no gradient all-reduce; with DP > 1 it runs once per update under DDP no_sync()")
    return Section("3. What accumulation changes at a fixed global batch (timings)", (
        f"  forward/backward passes per update = accum = {k}, each "
        f"{fmt_seconds(t.compute_seconds_per_micro_batch)} of which {fmt_seconds(t.overhead_seconds_per_micro_batch)} "
        f"per-op overhead (dispatch/launch): compute per update {fmt_seconds(t.compute_seconds)}; "
        "more, smaller passes pay that overhead more often",
        f"  {comm}",
        f"  the optimizer step ({fmt_seconds(t.optimizer_seconds)}) runs once per update, whatever accum is",
        f"  {k} data-loader fetches per update; the loss is divided by accum, the LR scheduler, gradient "
        "clipping and fp16 loss scaling step once per update, not per micro-batch (a loop that steps them "
        "per micro-batch changes the training)",
    ))


def _checkpointing(cfg: RunConfig, e: Estimate, cal: Calibrations | None) -> Section:
    f = e.flops
    lines = [
        f"Activation checkpointing (--ac, now {cfg.ac}) keeps only some tensors in forward (e.g. each layer's "
        "input) and recomputes the rest during backward: less memory held between forward and backward, "
        "one more forward of the wrapped layers in compute, inside one training step. Recompute now adds "
        f"{f.hardware_flops_per_update / f.model_flops_per_update - 1:.0%} FLOPs.",
    ]
    if cfg.ac.budget is not None:
        lines.append(f"  {cfg.ac}: no layer is wrapped; torch.compile's partitioner recomputes within each compiled "
                     f"graph, keeping at most {cfg.ac.budget:g} of what it would save beyond the graph's inputs; the "
                     "FLOPs above do not count that recompute.")
    if not cfg.ac.recomputes:
        full = _changed(cfg, "ac", "full", Keep.GLOBAL_BATCH, cal)
        extra = (f", FLOPs +{full.flops.hardware_flops_per_update / f.hardware_flops_per_update - 1:.0%}"
                 if not isinstance(full, str) else "")
        lines.append(f"  turning it on (full): {_moves(e, full)}{extra}.")
    lines.append(f"Training checkpoint — a different thing with a similar name: the file written to disk so "
                 f"training can resume after a failure (weights + optimizer state, "
                 f"{fmt_bytes(e.training_checkpoint_bytes)} here). It does not change step memory or speed.")
    return Section("2. Why activation checkpointing saves memory but costs compute", tuple(lines))


def _data_parallel(cfg: RunConfig, e: Estimate) -> Section:
    return Section(f"Data parallelism (DP = {cfg.dp})", (
        f"Each rank holds a model copy (ZeRO-{cfg.parallel.stage}) and a share of the batch; gradients are all-reduced "
        f"once per update ({fmt_bytes(e.time.allreduce_bytes)}, {fmt_seconds(e.time.allreduce_seconds)} by "
        "the ring model).",
    ))


def explain_sections(cfg: RunConfig, calibrations: Calibrations | None = None,
                     cannot_support: list[str] | tuple[str, ...] = ()) -> list[Section]:
    """``calibrations`` as for ``estimate``; ``cannot_support``: what a local comparison of this config
    cannot support (experiment.scope), the answer to the fourth question."""
    e = estimate(cfg, calibrations)
    out = [_batch(cfg, e, calibrations), _accumulation(cfg, e, calibrations), _checkpointing(cfg, e, calibrations),
           _timings(cfg, e), _data_parallel(cfg, e)]
    if cannot_support:
        out.append(Section("4. What a local comparison cannot support for production",
                           tuple(f"  - {s}" for s in cannot_support)))
    out.append(Section("How these figures were obtained", (
        f"All figures: formula. Peak {fmt_bytes(e.memory.peak_bytes)} in {e.memory.peak_phase}. "
        "Measure with `batchlab measure`, compare one change with `batchlab compare`.",)))
    return out


