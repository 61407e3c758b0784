"""Why an observation may have gone against a prediction: the usual suspects, checked in a fixed order.

Each check says what it looked at and what it found; ``flagged`` marks the ones that could explain the
contradiction.  Torch-free: it reads Measurements only.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Callable

from batchlab.config import RunConfig
from batchlab.experiment.protocol import Rounds
from batchlab.experiment.record import Check
from batchlab.formula.plausible import ratio_text
from batchlab.measure.result import NOISY_SPREAD, Measurement
from batchlab.config.phase import Phase

WARMUP_LEAK = 1.5  # first timed update slower than this x the median: warmup may still be in the window
DATA_SHARE = 0.10  # data-loading share of the update above which it dilutes compute effects
SHORT_WINDOW_S = 0.5  # timed seconds per process below which scheduler noise dominates
SMALL_MATMUL_TOKENS = 512  # rows of (b*s) x h x h matmuls under which a larger batch gains little
SMALL_HIDDEN = 512
SYNC_MISMATCH = 0.25  # per-phase sum vs update time on an asynchronous device


@dataclass
class Context:
    a: RunConfig
    b: RunConfig
    rounds: Rounds
    warmup: int
    steps: int

    def ok(self, side: str) -> list[Measurement]:
        return [m for m in self.rounds.side(side) if m is not None and m.ok]

    def timed(self, side: str) -> list[Measurement]:
        return [m for m in self.ok(side) if m.time is not None and m.time.samples]


def _per_side(ctx: Context, fn: Callable[[list[Measurement]], float | None]) -> dict[str, float | None]:
    return {s: fn(ctx.timed(s)) if ctx.timed(s) else None for s in "ab"}


def _fmt(values: dict[str, float | None], pattern: str) -> str:
    return ", ".join(f"{s.upper()} {pattern.format(v) if v is not None else 'n/a'}" for s, v in values.items())


def check_warmup(ctx: Context) -> Check:
    def leak(ms):
        return max(m.time.samples[0] / m.time.update_seconds_median for m in ms)

    worst = _per_side(ctx, leak)
    flagged = any(v is not None and v > WARMUP_LEAK for v in worst.values())
    return Check("warmup", "Is warmup inside the timed window?",
                 f"{ctx.warmup} warmup update(s) excluded in every process; first timed update / median, worst "
                 f"round: {_fmt(worst, '{:.2f}x')}" + (f" (> {WARMUP_LEAK}x: warm-up effects remain)" if flagged else ""),
                 flagged)


def check_spread(ctx: Context, time_band: tuple[float, float] | None) -> Check:
    spread = _per_side(ctx, lambda ms: statistics.median(m.time.spread for m in ms))
    noisy = any(v is not None and v > NOISY_SPREAD for v in spread.values())
    band_text, wide = "no paired time ratios", False
    if time_band is not None:
        lo, hi = time_band
        wide = lo <= 1.0 <= hi
        band_text = f"paired update-time ratios {lo:.3g}-{hi:.3g}" + (" (includes 1.0)" if wide else "")
    return Check("spread", "Is the timing spread too wide?",
                 f"IQR/median of update time within a process: {_fmt(spread, '{:.0%}')}; {band_text}",
                 noisy or wide)


def check_data_share(ctx: Context) -> Check:
    def share(ms):
        return statistics.median(m.time.phase_seconds.get("data", 0.0) / max(sum(m.time.phase_seconds.values()), 1e-12)
                                 for m in ms if m.time.phase_seconds) if any(m.time.phase_seconds for m in ms) else None

    shares = _per_side(ctx, share)
    flagged = any(v is not None and v > DATA_SHARE for v in shares.values())
    return Check("data_loading", "Does data loading take a large share of the update?",
                 f"data phase share of the update (per-phase split, wall-clock): {_fmt(shares, '{:.1%}')}", flagged)


def check_sync(ctx: Context) -> Check:
    devices = {m.environment.get("torch_device", "cpu") for s in "ab" for m in ctx.ok(s)}
    if all(str(d).startswith("cpu") for d in devices):
        return Check("synchronisation", "Is a device synchronisation missing around the clock?",
                     "CPU runs synchronously; the harness also calls the device synchroniser before every clock "
                     "read (measure.clock.timed)", False)

    def mismatch(ms):
        return max(abs(sum(m.time.phase_seconds.values()) / m.time.update_seconds_median - 1.0)
                   for m in ms if m.time.phase_seconds) if any(m.time.phase_seconds for m in ms) else None

    worst = _per_side(ctx, mismatch)
    flagged = any(v is not None and v > SYNC_MISMATCH for v in worst.values())
    return Check("synchronisation", "Is a device synchronisation missing around the clock?",
                 f"{', '.join(sorted(map(str, devices)))}: the harness synchronises before every clock read; "
                 f"synchronised per-phase sum vs update time differs by {_fmt(worst, '{:.0%}')}", flagged)


def check_window(ctx: Context) -> Check:
    window = _per_side(ctx, lambda ms: statistics.median(sum(m.time.samples) for m in ms))
    flagged = ctx.steps < 5 or any(v is not None and v < SHORT_WINDOW_S for v in window.values())
    return Check("window", "Is the timed window too short?",
                 f"{ctx.steps} timed updates per process; timed seconds per process: {_fmt(window, '{:.3g} s')}"
                 + (f" (under {SHORT_WINDOW_S} s or fewer than 5 updates: scheduler noise weighs heavily; "
                    "more --steps)" if flagged else ""), flagged)


def check_peak_phase(ctx: Context, formula_phase: dict[str, str | None]) -> Check:
    phases = {s: next((m.memory.peak_phase for m in ctx.ok(s) if m.memory is not None), None) for s in "ab"}
    flagged = Phase.OPTIMIZER in phases.values()
    formula = ", ".join(f"{s.upper()} {p or 'n/a'}" for s, p in formula_phase.items())
    return Check("peak_phase", "Does the peak sit in the optimizer step, so the micro-batch barely moves it?",
                 f"measured peak phase (allocator): A {phases['a'] or 'n/a'}, B {phases['b'] or 'n/a'}; "
                 f"formula: {formula}"
                 + ("; at the optimizer step the activations are already freed, so parameters, gradients and "
                    "optimizer state decide the peak" if flagged else ""), flagged)


def check_kernel_size(ctx: Context) -> Check:
    tokens = {s: c.micro_batch * c.seq for s, c in (("a", ctx.a), ("b", ctx.b))}
    hidden = ctx.a.model.hidden
    flagged = hidden < SMALL_HIDDEN or min(tokens.values()) < SMALL_MATMUL_TOKENS
    return Check("kernel_size", "Are the kernels too small to gain from a larger batch?",
                 f"tokens per micro-batch (b x s): A {tokens['a']}, B {tokens['b']}; hidden {hidden}: the largest "
                 f"matmuls are ({max(tokens.values())} x {hidden}) x ({hidden} x {ctx.a.model.ffn})"
                 + ("; matmuls this small are dominated by per-op overhead, which does not shrink per token with "
                    "a larger batch the way it does on big kernels" if flagged else ""), flagged)


TIME_METRICS = {"update_time", "tokens_per_second", "time_to_budget"}
MEMORY_CHECKS = {"peak_phase"}


def _relevant(check: Check, ctx: Context, contradicted: set[str]) -> bool:
    """A check can explain only contradictions of its own kind (time or memory), and the kernel-size check
    only a change of the tokens per micro-batch."""
    if check.name in MEMORY_CHECKS:
        return "peak_memory" in contradicted
    if check.name == "kernel_size" and ctx.a.micro_batch * ctx.a.seq == ctx.b.micro_batch * ctx.b.seq:
        return False
    return bool(contradicted & TIME_METRICS)


def diagnose(ctx: Context, time_band: tuple[float, float] | None, formula_phase: dict[str, str | None],
             contradicted: set[str] | None = None) -> list[Check]:
    """All checks, in the order the issue gives them; ``contradicted``: the metrics that went against a
    prediction (None: all), so a check that cannot explain any of them is reported but not flagged."""
    if not (ctx.timed("a") and ctx.timed("b")):
        return [Check("measured", "Were both sides measured?",
                      "no timed run on one side (out of memory or failed); nothing further to check", True)]
    checks = [check_warmup(ctx), check_spread(ctx, time_band), check_data_share(ctx), check_sync(ctx),
              check_window(ctx), check_peak_phase(ctx, formula_phase), check_kernel_size(ctx)]
    if contradicted is None:
        return checks
    return [Check(c.name, c.question, c.found + " (cannot explain the contradictions here)", False)
            if c.flagged and not _relevant(c, ctx, contradicted) else c for c in checks]


def time_model_checks(attribution: Mapping[str, Any] | None) -> list[Check]:
    """What the formula's per-op time model attributes the predicted update-time change to (a statement of the
    model, not a check of the run: never flagged); ``attribution``: formula.attribution.Attribution.to_dict()."""
    if not attribution:
        return []
    return [Check("time_model", "What does the time model attribute the update-time change to?",
                  attribution["text"], False)]


ABSOLUTE_TOLERANCE = 0.25  # issue 16: an absolute update time within 25% of the measured one after calibration


def _outside(at_calibration: float, at_probe: float, measured: float, err) -> float:
    """How far ``measured`` lies outside the range of a side's two predicted times (0 inside it)."""
    if min(at_calibration, at_probe) <= measured <= max(at_calibration, at_probe):
        return 0.0
    return min(abs(err(at_calibration, measured)), abs(err(at_probe, measured)))


def time_model_absolute(formula: tuple[float, float], measured: tuple[float, float],
                        speed: Mapping[str, Any] | None = None) -> Check:
    """The formula's absolute update times (s) beside the measured medians; where the host speed was probed
    (``compare.side_speeds``: the speed probe's time over its calibration's), the formula at that speed too, since
    rates calibrated at one speed price the other in proportion.  Flagged when the formula misses by more than
    ``ABSOLUTE_TOLERANCE`` outside the range between the two speeds' figures (the calibration's figure alone where
    none was probed): the probe bounds how far the host moved, it does not correct for it (docs/cpu.md), so a side
    whose measured time lies between them, or within tolerance of either, is not a miss of the time model's."""
    from batchlab.util.units import fmt_seconds as sec

    (fa, fb), (ma, mb) = formula, measured
    err = lambda p, m: p / m - 1  # noqa: E731
    found = (f"formula A {sec(fa)}, B {sec(fb)} against measured (wall-clock) A {sec(ma)}, B {sec(mb)} "
             f"({err(fa, ma):+.0%}, {err(fb, mb):+.0%}) at the calibration's speed")
    worst = max(abs(err(fa, ma)), abs(err(fb, mb)))
    if speed:
        sa, sb = speed["a"], speed["b"]
        found += (f"; the host speed probe took x{sa:.2f} (A) and x{sb:.2f} (B) its calibration time, so at the "
                  f"probed speed: A {sec(fa * sa)}, B {sec(fb * sb)} ({err(fa * sa, ma):+.0%}, "
                  f"{err(fb * sb, mb):+.0%}); the speed the updates ran at is taken to lie between (the probe "
                  "runs beside them, not during)")
        worst = max(_outside(fa, fa * sa, ma, err), _outside(fb, fb * sb, mb, err))
        if max(sa, 1 / sa, sb, 1 / sb) > 1 + ABSOLUTE_TOLERANCE:  # the band is wider than the check's tolerance
            found += (f"; the host moved by more than the check's own {ABSOLUTE_TOLERANCE:.0%}, so a time inside "
                      "that band says little of the time model (recalibrate on a quiet machine)")
    broken = ratio_text(fa, ma) or ratio_text(fb, mb)
    if broken:  # the ratios compare measures stand; its predicted times do not
        found = f"{broken}. {found}"
    return Check("time_model_absolute", "How close is the time model's absolute update time?", found,
                 worst > ABSOLUTE_TOLERANCE)
