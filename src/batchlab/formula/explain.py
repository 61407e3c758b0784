"""`batchlab explain`: the mechanisms behind each knob, with the user's own numbers (formula)."""
from __future__ import annotations

from batchlab.config import ACMode, Keep, RunConfig, apply_change
from batchlab.formula import Calibrations, estimate
from batchlab.units import fmt_bytes, fmt_seconds


def _delta(cfg: RunConfig, name: str, value, calibrations: Calibrations | None) -> str:
    a = estimate(cfg, calibrations)
    try:
        b = estimate(apply_change(cfg, name, value, Keep.GLOBAL_BATCH), calibrations)
    except ValueError as e:  # the change is not possible for this config (e.g. global batch not divisible)
        return f"(not possible here: {e})"
    return (f"peak {fmt_bytes(a.memory.peak_bytes)} → {fmt_bytes(b.memory.peak_bytes)}, update "
            f"{fmt_seconds(a.time.update_seconds)} → {fmt_seconds(b.time.update_seconds)}")


def explain_lines(cfg: RunConfig, calibrations: Calibrations | None = None) -> list[str]:
    """``calibrations`` as for ``estimate``."""
    e = estimate(cfg, calibrations)
    m = e.memory
    lines = [
        "[bold]Global batch[/bold] (sequences per optimizer update)",
        f"  {cfg.global_batch_text()}",
        "",
        "[bold]Micro-batch[/bold]: sequences in one forward/backward on one rank. Activations grow with it "
        f"(now {fmt_bytes(m.activations_bytes)} kept for backward); larger kernels may run more efficiently.",
    ]
    lines += [
        f"  doubling it at a fixed global batch (accum halves): {_delta(cfg, 'micro_batch', cfg.micro_batch * 2, calibrations)}",
        "[bold]Gradient accumulation[/bold]: micro-batches whose gradients are summed before one optimizer step. "
        "It does not keep several micro-batches' activations at once; it lengthens the update, and with DDP "
        "all-reduces once per update (no_sync on the others). It can change loss scaling, scheduler steps "
        "and clipping semantics if the loop is written carelessly.",
        f"  doubling it (global batch doubles): {_delta(cfg, 'accum', cfg.accum * 2, calibrations)}",
        f"[bold]Data parallelism[/bold] (DP = {cfg.dp}): each rank holds a model copy (ZeRO-{cfg.zero}) and a "
        "share of the batch; gradients are all-reduced once per update "
        f"({fmt_bytes(e.time.allreduce_bytes)}, {fmt_seconds(e.time.allreduce_seconds)} by the ring model).",
        "[bold]Activation checkpointing[/bold] (--ac, now "
        f"{cfg.ac}): keep only some tensors in forward and recompute the rest during backward — less memory, "
        f"more compute, inside one training step. Recompute now adds "
        f"{e.flops.hardware_flops_per_update / e.flops.model_flops_per_update - 1:.0%} FLOPs.",
    ]
    if cfg.ac.mode is ACMode.NONE:
        lines.append(f"  turning it on (full): {_delta(cfg, 'ac', 'full', calibrations)}")
    lines += [
        "[bold]Training checkpoint[/bold] — a different thing with a similar name: the file written to disk so "
        f"training can resume after a failure (weights + optimizer state, {fmt_bytes(e.training_checkpoint_bytes)} "
        "here). It does not change step memory or speed.",
        "",
        f"[dim]All figures: formula. Peak {fmt_bytes(m.peak_bytes)} in {m.peak_phase}. "
        "Measure with `batchlab measure`, compare one change with `batchlab compare`.[/dim]",
    ]
    return lines
