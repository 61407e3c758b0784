"""Per metric: observed direction, ratio B/A, noise band from the paired rounds, and whether each prediction held.

Noise band: the range (lowest, highest) of the per-round paired ratios B_i / A_i.  Each round measures both
sides back to back, so what moves the machine between rounds cancels inside a pair; the range over rounds is
the spread that is left.  With 3 rounds it is the whole sample, so it is wide on purpose: ``same`` whenever
the band reaches 1.0.  The ratio is the median of the paired ratios; the side figures A and B are the medians
over rounds of each side.  When those two statistics point opposite ways (B/A of the medians below 1, the
median paired ratio above, or the reverse) the verdict is "inconclusive", never a direction.  Memory is deterministic on CPU (a live
tensor-storage tracker counts bytes), so a difference under MEMORY_SAME_TOLERANCE is ``same`` too.
Torch-free.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from batchlab.config import Counted
from batchlab.experiment.predict import Direction, Metric, direction_of, oom_direction
from batchlab.experiment.protocol import Rounds
from batchlab.experiment.record import Contradiction, FormulaFigures, MetricRecord
from batchlab.measure.result import Measurement, Outcome
from batchlab.util.units import SAME_TOLERANCE

BAND_METHOD = ("range (min, max) of the per-round paired ratios B/A; each round measures A then B, each in a "
               "process of its own (on CPU a fork of a pre-imported one), warmup excluded; B/A = median of the paired ratios; A and B = each side's median "
               "over rounds; inconclusive when B/A of those medians and the paired B/A point opposite ways")
MEMORY_SAME_TOLERANCE = SAME_TOLERANCE
UNITS = {Metric.PEAK_MEMORY: "bytes", Metric.UPDATE_TIME: "seconds", Metric.TOKENS_PER_SECOND: "tokens/s",
         Metric.TIME_TO_BUDGET: "seconds", Metric.OOM: "outcome"}
PROVENANCE = {Metric.PEAK_MEMORY: "allocator", Metric.UPDATE_TIME: "wall-clock",
              Metric.TOKENS_PER_SECOND: "wall-clock", Metric.TIME_TO_BUDGET: "wall-clock", Metric.OOM: "allocator"}


@dataclass(frozen=True)
class Observed:
    """What the paired rounds showed for one metric (before anyone's prediction is set beside it)."""
    a: Any = None  # median over rounds (OOM: whether the side ran out of memory)
    b: Any = None
    ratio: float | None = None
    band: tuple[float, float] | None = None
    paired_ratios: tuple[float, ...] = ()
    direction: Direction | None = None
    note: str = ""
    inconclusive: bool = False  # per-side medians and paired ratios point opposite ways: noise, no direction


def _held(predicted: Direction | None, observed: Direction | None) -> bool | None:
    if predicted is None or observed is None:
        return None
    return predicted is observed


def metric_record(metric: Metric, seen: Observed, user: Direction | None,
                  formula: dict[str, Any] | None, counted: Counted = Counted.TOKENS) -> MetricRecord:
    """The stored verdict of one metric: the observation beside the person's and the formula's prediction
    (throughput in what the model counts: tokens, or samples)."""
    by_formula = formula["direction"] if formula is not None else None
    observed = seen.direction is not None or seen.a is not None
    # a figure's provenance is how it was obtained: nothing measured, nothing labelled allocator / wall-clock
    how = PROVENANCE[metric] if observed else ("formula" if formula is not None else "not measured")
    return MetricRecord(seen.direction, seen.ratio, seen.band, user, by_formula, _held(user, seen.direction),
                        _held(by_formula, seen.direction), seen.a, seen.b,
                        counted.per_second if metric is Metric.TOKENS_PER_SECOND else UNITS[metric], how,
                        seen.paired_ratios, FormulaFigures.from_dict(formula), seen.note, seen.inconclusive)


def round_value(m: Measurement | None, metric: Metric, token_budget: float) -> float | None:
    if m is None or m.outcome is not Outcome.OK:
        return None
    if metric is Metric.PEAK_MEMORY:
        return float(m.memory.peak_bytes) if m.memory is not None else None
    if m.time is None or not m.time.samples:
        return None
    if metric is Metric.UPDATE_TIME:
        return m.time.update_seconds_median
    if metric is Metric.TOKENS_PER_SECOND:
        return m.tokens_per_second
    return token_budget / m.tokens_per_second if m.tokens_per_second else None


def paired_direction(ratios: list[float], metric: Metric) -> tuple[float, tuple[float, float], Direction]:
    """(ratio, band, direction) from the per-round paired ratios B/A."""
    ratio = statistics.median(ratios)
    band = (min(ratios), max(ratios))
    if band[0] <= 1.0 <= band[1]:
        return ratio, band, Direction.SAME
    if metric is Metric.PEAK_MEMORY and abs(ratio - 1.0) < MEMORY_SAME_TOLERANCE:
        return ratio, band, Direction.SAME
    return ratio, band, Direction.UP if band[0] > 1.0 else Direction.DOWN


def _is_oom(m: Measurement | None) -> bool:
    return m is not None and m.outcome in (Outcome.OOM, Outcome.OOM_BUDGET)


def measured_verdict(metric: Metric, rounds: Rounds, token_budget: float) -> Observed:
    if metric is Metric.OOM:
        a_oom, b_oom = any(map(_is_oom, rounds.a)), any(map(_is_oom, rounds.b))
        failed = [s.upper() for s in "ab" if any(m is not None and m.outcome is Outcome.FAILED for m in rounds.side(s))]
        if failed and not (a_oom or b_oom):
            return Observed(note=f"side {', '.join(failed)} failed; OOM not decided")
        return Observed(a=a_oom, b=b_oom, direction=oom_direction(a_oom, b_oom))
    pairs = [(round_value(ma, metric, token_budget), round_value(mb, metric, token_budget))
             for ma, mb in zip(rounds.a, rounds.b)]
    pairs = [(x, y) for x, y in pairs if x is not None and y is not None and x > 0]
    if not pairs:
        return Observed(note="no round with both sides measured")
    ratios = [y / x for x, y in pairs]
    ratio, band, direction = paired_direction(ratios, metric)
    a, b = statistics.median(x for x, _ in pairs), statistics.median(y for _, y in pairs)
    notes = [] if len(pairs) == len(rounds.a) else [f"{len(pairs)} of {len(rounds.a)} rounds had both sides measured"]
    noise = noise_note(a, b, ratio)
    if noise:
        return Observed(a, b, ratio, band, tuple(ratios), None, "; ".join(notes + [noise]), inconclusive=True)
    return Observed(a, b, ratio, band, tuple(ratios), direction, "; ".join(notes))


def noise_note(a: float, b: float, paired: float) -> str:
    """Why the verdict is inconclusive when the per-side medians (B/A of the medians) and the median of the
    paired ratios point opposite ways, else "": the rounds moved more between themselves than the change did."""
    sides, pairs = direction_of(b / a, SAME_TOLERANCE), direction_of(paired, SAME_TOLERANCE)
    if {sides, pairs} != {Direction.UP, Direction.DOWN}:
        return ""
    return (f"inconclusive: noise — the per-side medians give B/A {b / a:.3g} ({sides.value}) but the median "
            f"of the paired ratios is {paired:.3g} ({pairs.value}); the machine moved more between rounds than "
            "the change did: rerun with more --rounds on a quieter machine")


def verdicts(rounds: Rounds | None, user: dict[Metric, Direction], formula: dict[Metric, dict[str, Any]] | None,
             token_budget: float) -> dict[Metric, MetricRecord]:
    """All metrics; ``rounds`` None (formula only): nothing observed, the formula's figures alone."""
    nothing = Observed(note="formula only: nothing measured")
    counted = rounds.counted() if rounds is not None else Counted.TOKENS
    return {metric: metric_record(metric, measured_verdict(metric, rounds, token_budget) if rounds is not None
                                  else nothing, user.get(metric), formula.get(metric) if formula is not None else None,
                                  counted)
            for metric in Metric}


def contradictions(vs: dict[Metric, MetricRecord]) -> list[Contradiction]:
    """Every prediction the observation went against: who predicted what, what was seen."""
    return [Contradiction(metric, who, predicted, v.observed)
            for metric, v in vs.items()
            for who, predicted, held in (("you", v.predicted_by_user, v.held_user),
                                         ("formula", v.predicted_by_formula, v.held_formula))
            if held is False]


def summary(vs: dict[Metric, MetricRecord]) -> str:
    """One line: the verdict of every metric."""
    parts = []
    for metric, v in vs.items():
        if v.observed is None:
            parts.append(f"{metric.label} ? (inconclusive: noise)" if v.inconclusive else f"{metric.label} ?")
            continue
        size = f" x{v.ratio:.3g}" if v.ratio is not None else ""
        held = []
        if v.held_user is not None:
            held.append("you " + ("held" if v.held_user else "missed"))
        if v.held_formula is not None:
            held.append("formula " + ("held" if v.held_formula else "missed"))
        parts.append(f"{metric.label} {v.observed.symbol}{size}" + (f" ({', '.join(held)})" if held else ""))
    return "; ".join(parts)
