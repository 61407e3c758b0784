"""Find the largest micro-batch that fits by measurement, seeded by the formula, in few isolated trials.

The candidates are the divisors of the per-rank batch (global / DP), so accumulation is re-derived and the
global batch never drifts.  Fitting is assumed monotone in the micro-batch (peak memory grows with it).
Order of trials: the formula's predicted limit, then its neighbour on the side the result points to (the
formula is usually right to within one step), then bisection of what is left.  That is at most
2 + ceil(log2(candidates - 1)) trials, within the budget ceil(log2(max micro-batch)) + 2.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

from batchlab.config import RunConfig, Choice
from batchlab.measure.result import TIMED_OUT_DETAIL, Measurement, Outcome


class TrialOutcome(Choice):
    """A measurement's Outcome, refined for the search: a SIGKILL is the kernel's OOM killer, and a run
    that completed above the capacity does not fit either."""
    OK = "ok"
    OOM = "oom"
    OOM_BUDGET = "oom (budget)"
    OOM_KILLED = "oom (killed)"
    FAILED = "failed"
    TIMED_OUT = "timed out"  # killed at --timeout: says nothing about memory
    OVER_CAPACITY = "over capacity"


OUT_OF_MEMORY = {TrialOutcome.OOM, TrialOutcome.OOM_BUDGET, TrialOutcome.OOM_KILLED, TrialOutcome.OVER_CAPACITY}
NO_ANSWER = {TrialOutcome.FAILED, TrialOutcome.TIMED_OUT}  # the run ended before it could say whether it fits


@dataclass(frozen=True)
class Trial:
    """One measured configuration: does it fit?  ``peak_bytes`` has provenance ``allocator``."""

    micro_batch: int
    accum: int
    fits: bool
    outcome: TrialOutcome
    peak_bytes: int | None = None
    peak_phase: str | None = None
    detail: str = ""
    provenance: str = "allocator"

    @property
    def out_of_memory(self) -> bool:
        return self.outcome in OUT_OF_MEMORY


# measure(cfg) -> Trial: the real one runs an isolated subprocess; tests pass a deterministic fake.
MeasureFn = Callable[[RunConfig], Trial]


def trial_from_measurement(cfg: RunConfig, m: Measurement, capacity_bytes: int) -> Trial:
    """A measurement as a search data point.  A worker killed by SIGKILL is the kernel's OOM killer (the
    runner's diagnosis); a run that completes but peaks above the capacity does not fit either."""
    peak = m.memory.peak_bytes if m.memory is not None else None
    phase = m.memory.peak_phase if m.memory is not None else m.oom_phase
    outcome = TrialOutcome(m.outcome.value)
    if m.outcome is Outcome.FAILED and m.outcome_detail.startswith(TIMED_OUT_DETAIL):
        outcome = TrialOutcome.TIMED_OUT
    elif m.outcome is Outcome.FAILED and "SIGKILL" in m.outcome_detail:
        outcome = TrialOutcome.OOM_KILLED
    elif m.outcome is Outcome.OK and peak is not None and peak > capacity_bytes:
        outcome = TrialOutcome.OVER_CAPACITY
    return Trial(cfg.micro_batch, cfg.accum, outcome is TrialOutcome.OK, outcome, peak, phase, m.outcome_detail)


def max_trials(per_rank: int) -> int:
    return math.ceil(math.log2(per_rank)) + 2


@dataclass
class SearchResult:
    candidates: tuple[int, ...]  # micro-batches searched over (divisors of the per-rank batch)
    seed: int | None  # the formula's predicted limit the search started from
    trials: list[Trial] = field(default_factory=list)  # in the order they ran (a verification first)
    limit: int | None = None  # largest micro-batch that fits by measurement
    budget: int = 0  # the trial budget, ceil(log2(max)) + 2

    @property
    def trial_count(self) -> int:
        return len(self.trials)

    def trial(self, micro_batch: int | None) -> Trial | None:
        return next((t for t in self.trials if t.micro_batch == micro_batch), None)


class _Bounds:
    """Index of the largest known fit and the smallest known failure among the sorted candidates."""

    def __init__(self, n: int):
        self.fit, self.fail = -1, n

    def record(self, index: int, fits: bool) -> None:
        if fits:
            self.fit = max(self.fit, index)
        else:
            self.fail = min(self.fail, index)

    @property
    def open(self) -> bool:
        return self.fail - self.fit > 1

    def clamp(self, index: int) -> int:
        return min(max(index, self.fit + 1), self.fail - 1)


def _seed_index(cands: list[int], seed: int | None) -> int:
    if seed is None:
        return 0  # the formula says nothing fits: start at the smallest
    return max(i for i, c in enumerate(cands) if c <= seed) if seed >= cands[0] else 0


def _next_index(bounds: _Bounds, seed_index: int, tried: int, last_fit: bool | None) -> int:
    if tried == 0:
        return bounds.clamp(seed_index)
    if tried == 1:
        return bounds.clamp(bounds.fit + 1 if last_fit else bounds.fail - 1)
    return (bounds.fit + bounds.fail) // 2


def search_largest(base: RunConfig, measure: MeasureFn, seed: int | None,
                   known: Iterable[Trial] = ()) -> SearchResult:
    """Largest micro-batch (divisor of global / DP) that fits by measurement; ``base`` gives everything else.

    ``seed``: the formula's predicted limit.  ``known``: trials already run for this policy (a verification
    of the recommendation); they count towards the trial budget.
    """
    from batchlab.advise.plan import divisors

    per_rank = base.global_batch // base.dp
    cands = divisors(per_rank)
    result = SearchResult(tuple(cands), seed, budget=max_trials(per_rank))
    bounds = _Bounds(len(cands))
    for t in known:
        result.trials.append(t)
        if t.micro_batch in cands:
            bounds.record(cands.index(t.micro_batch), t.fits)
    tried, last = 0, None
    seed_index = _seed_index(cands, seed)
    while bounds.open:
        i = _next_index(bounds, seed_index, tried, last)
        mb = cands[i]
        t = measure(base.with_global_batch(base.global_batch, mb))
        result.trials.append(t)
        bounds.record(i, t.fits)
        tried, last = tried + 1, t.fits
    result.limit = cands[bounds.fit] if bounds.fit >= 0 else None
    return result


def exhaustive(base: RunConfig, measure: MeasureFn) -> SearchResult:
    """Every candidate measured (the reference the search must agree with; benchmarks and tests)."""
    from batchlab.advise.plan import divisors

    per_rank = base.global_batch // base.dp
    cands = divisors(per_rank)
    result = SearchResult(tuple(cands), None, budget=len(cands))
    for mb in cands:
        result.trials.append(measure(base.with_global_batch(base.global_batch, mb)))
    fitting = [t.micro_batch for t in result.trials if t.fits]
    result.limit = max(fitting) if fitting else None
    return result
