"""The golden path: plan by formula, confirm by measurement, search only when needed, advise after an OOM."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from batchlab.advise.after_oom import Advice, Remedy, oom_advice, what_would_fit
from batchlab.advise.candidate import option_key
from batchlab.advise.plan import Goal, FitPlan, Progress, divisors, plan
from batchlab.advise.states import StatesVerdict, states_verdict
from batchlab.advise.search import (NO_ANSWER, MeasureFn, SearchResult, Trial, search_largest,
                                    trial_from_measurement)
from batchlab.config import ModelSource, RunConfig, to_jsonable
from batchlab.util.units import relative_to


@dataclass
class FitReport:
    plan: FitPlan
    final: RunConfig | None = None  # the recommendation after any measurement; None: nothing fits
    source: str = "formula"  # how the final micro-batch was decided
    verification: Trial | None = None  # the plan's recommendation, measured
    search: SearchResult | None = None
    advice: list[Advice] = field(default_factory=list)  # when the recommendation ran out of memory
    remedies: list[Remedy] = field(default_factory=list)  # when the formula finds nothing that fits
    states: StatesVerdict | None = None  # when the model states alone exceed the memory per rank
    notes: list[str] = field(default_factory=list)
    ac_plan: Any = None  # advise.acplan.ACPlan: fit --ac auto's per-layer plan and its frontier

    @property
    def exit_code(self) -> int:
        return 0 if self.final is not None else 1

    def predicted_peak(self, cfg: RunConfig) -> int | None:
        """Predicted peak (formula, or trace for a factory) of an evaluated candidate with cfg's micro-batch, policy and ZeRO stage."""
        for c in self.plan.candidates:
            if c.key == option_key(cfg) and c.config.micro_batch == cfg.micro_batch:
                return c.peak_bytes
        return None

    def limits(self) -> dict[str, Any] | None:
        """The formula's predicted limit beside the measured one, with the peak error at the measured limit."""
        if self.search is None or self.plan.recommended is None:
            return None
        rec = self.plan.recommended.config
        out: dict[str, Any] = {"policy": str(rec.ac), "zero": rec.zero,
                               "predicted_limit": self.plan.predicted_limit(rec),
                               "measured_limit": self.search.limit, "trials": self.search.trial_count,
                               "trial_budget": self.search.budget}
        t = self.search.trial(self.search.limit)
        if t is not None and t.peak_bytes:
            predicted = self.predicted_peak(rec.with_global_batch(rec.global_batch, t.micro_batch))
            out.update(predicted_peak_bytes=predicted, measured_peak_bytes=t.peak_bytes,
                       peak_error=relative_to(predicted, t.peak_bytes))
        return out

    def to_dict(self) -> dict[str, Any]:
        from batchlab.advise.snippets import all_snippets

        p = self.plan
        return {"global_batch": p.goal.global_batch, "tokens_per_update": p.goal.base.tokens_per_update,
                "capacity_bytes": p.goal.capacity_bytes, "usable_bytes": p.goal.usable_bytes,
                "margin": p.goal.margin, "token_budget": p.goal.tokens, "held": sorted(p.goal.held),
                "searched": list(p.goal.searched), "model_states": to_jsonable(self.states),
                "predictor": p.predictor, "recommended_by_formula": to_jsonable(p.recommended), "reason": p.reason,
                "alternatives": to_jsonable(list(p.ranked)), "candidates_evaluated": len(p.candidates),
                "assumptions": list(p.assumptions), "final": to_jsonable(self.final), "source": self.source,
                "verification": to_jsonable(self.verification), "search": to_jsonable(self.search),
                "limits": self.limits(), "oom_advice": to_jsonable(self.advice),
                "what_would_fit": to_jsonable(self.remedies), "notes": self.notes,
                "snippets": all_snippets(self.final) if self.final is not None else None,
                "plan": self.ac_plan.to_dict() if self.ac_plan is not None else None}


def isolated_measure(capacity_bytes: int, timeout_s: float | None = None) -> MeasureFn:
    """measure(cfg) -> Trial in a fresh subprocess (memory only: one warm-up update, one tracked update)."""
    from batchlab.measure import MeasureOptions
    from batchlab.run import measure as run

    opts = MeasureOptions(warmup=1, steps=1, timing=False, isolate=True, timeout_s=timeout_s)
    return lambda cfg: trial_from_measurement(cfg, run(cfg, opts), capacity_bytes)


def _within_margin(t: Trial, goal: Goal) -> bool:
    return t.fits and t.peak_bytes is not None and t.peak_bytes <= goal.usable_bytes


def _after_search(report: FitReport, s: SearchResult, goal: Goal, rec: RunConfig) -> None:
    """The measured limit if it leaves the margin, else the next smaller micro-batch (it fits: peaks grow
    with the micro-batch)."""
    if s.limit is None:
        report.final, report.source = None, "measured: no micro-batch fits"
        report.notes.append(f"no micro-batch fits by measurement with activation checkpointing {rec.ac}")
        return
    t = s.trial(s.limit)
    chosen = s.limit
    if not _within_margin(t, goal):
        below = [d for d in divisors(goal.per_rank) if d < s.limit]
        if below:
            chosen = below[-1]
            report.notes.append(f"micro-batch {s.limit} fits by measurement but leaves less than the "
                                f"{goal.margin:.0%} margin; one step below it is recommended")
        else:
            report.notes.append(f"micro-batch {s.limit} fits by measurement but leaves less than the "
                                f"{goal.margin:.0%} margin")
    report.final = rec.with_global_batch(rec.global_batch, chosen)
    report.source = f"measured (search seeded by the {report.plan.predictor})"


def fit(goal: Goal, *, verify: bool, search: bool = False, measure: MeasureFn | None = None,
        on_trial: Callable[[Trial], None] | None = None, progress: Progress | None = None) -> FitReport:
    """Plan; with ``verify`` measure the recommendation; search when it does not fit (or ``search``).
    ``progress``: the plan's, per candidate evaluated."""
    p = plan(goal, progress)
    report = FitReport(p)
    if p.recommended is None:
        if goal.base.model_kind is not ModelSource.FACTORY:  # both search the model's shape, unknown for a factory
            report.states = states_verdict(goal)
            report.remedies = what_would_fit(goal)
        return report
    rec = p.recommended.config
    report.final = rec
    if not (verify or search):
        return report
    goal = goal.at_layout(rec)  # measuring searches the micro-batch of the layout chosen
    base = measure or isolated_measure(goal.capacity_bytes)

    def measured(cfg: RunConfig) -> Trial:
        t = base(cfg)
        if on_trial is not None:
            on_trial(t)
        return t

    first = measured(rec)
    report.verification = first
    if first.outcome in NO_ANSWER:  # not a memory answer: searching would only repeat the failure
        report.final, report.source = None, f"measurement {first.outcome}"
        report.notes.append(f"measuring the recommendation {first.outcome}: {first.detail}")
        return report
    if first.out_of_memory and goal.base.model_kind is not ModelSource.FACTORY:
        report.advice = oom_advice(dataclasses.replace(goal, base=rec))
    if _within_margin(first, goal) and (not search or "micro_batch" in goal.held):
        report.source = f"{p.predictor}, confirmed by measurement"
        return report
    if "micro_batch" in goal.held:  # nothing to search: the user fixed it
        if first.fits:
            report.source = f"{p.predictor}, confirmed by measurement"
            report.notes.append(f"micro-batch {rec.micro_batch} (held as given) fits by measurement but leaves less "
                                f"than the {goal.margin:.0%} margin")
        else:
            report.final, report.source = None, "measured: the micro-batch held (--micro-batch) does not fit"
            report.notes.append(f"micro-batch {rec.micro_batch} was held as given; measured: {first.outcome}")
        return report
    s = search_largest(rec, measured, p.predicted_limit(rec), known=[first])
    report.search = s
    _after_search(report, s, goal, rec)
    return report
