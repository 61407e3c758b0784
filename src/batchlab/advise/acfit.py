"""``fit --ac auto`` end to end: plan (advise/acplan.py), write the plan file, prove it by a run.

The run: the plan measured as fit measures any pick (one isolated update, allocator peak).  It holds when the
measured peak is within the budget and within ``TOLERANCE`` of the plan's predicted peak; a plan measured
above the budget is replaced by the plan for the budget less the excess, up to ``ATTEMPTS`` plans.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from batchlab.advise.acmodel import LayerModel
from batchlab.advise.acplan import ACPlan, layer_models, next_budget, per_layer_of, plan_ac
from batchlab.advise.fit import FitReport, isolated_measure
from batchlab.advise.plan import FitPlan, Goal, assumptions, candidate
from batchlab.advise.search import NO_ANSWER, MeasureFn, Trial
from batchlab.cache.calibrations import load_all
from batchlab.config import ConfigError
from batchlab.config.layerplan import use
from batchlab.util.files import write_atomic
from batchlab.util.units import fmt_bytes, relative_to

TOLERANCE = 0.03  # measured peak vs the plan's predicted peak
ATTEMPTS = 3
DEFAULT_FILE = "batchlab-ac-plan.json"


def write_plan(p: ACPlan, path: str | Path) -> str:
    c = p.chosen
    assert c is not None and p.config is not None
    layers = p.config.model.layers
    # one policy per layer whatever was picked (a preset too): the file reads back as --ac plan:FILE
    data = {"ac": c.ac, "per_layer": per_layer_of(p.config), "layers": layers,
            "model": p.config.model.name, "model_source": p.config.model_source, "seq": p.config.seq,
            "micro_batch": c.micro_batch, "accum": p.config.accum, "precision": str(p.config.precision),
            "budget_bytes": p.budget_bytes, "predicted_peak_bytes": c.peak_bytes,
            "predicted_allocated_bytes": c.allocated_bytes,
            "predicted_update_seconds": c.update_seconds, "model_solved": p.model, "provenance": p.provenance,
            "use": f"--ac {use(path)}"}
    write_atomic(Path(path), json.dumps(data, indent=1) + "\n", "plan_out")
    return str(path)


def _report(goal: Goal, p: ACPlan) -> FitReport:
    """The fit report of a plan: its one candidate (formula), as fit reports any pick."""
    cals = load_all()
    if p.config is None:
        return FitReport(FitPlan(goal, (), (), None, p.notes[0] if p.notes else "no plan fits", ()), ac_plan=p)
    cand = candidate(p.config, goal.tokens, cals)
    why = (f"least predicted update time among per-layer plans within {fmt_bytes(p.budget_bytes)} "
           f"(micro-batch searched jointly unless held); model: {p.model}")
    fp = FitPlan(goal, (cand,), (cand,), cand, why, assumptions(goal, ()))
    return FitReport(fp, final=p.config, source=f"{p.provenance} (activation-checkpointing plan)", ac_plan=p)


@dataclass(frozen=True)
class PlanCheck:
    """A measured trial against a plan.  A trial's peak is allocated tensor bytes: ``error`` compares it with
    the plan's allocated bytes, and ``fits`` adds the allocator slack the prediction holds (on CUDA the
    reserved view; on CPU none) before comparing with the budget."""

    error: float | None  # (planned - measured) / measured; None without a measured peak
    fits: bool  # the trial ran and its peak, slack added, is within the budget
    close: bool  # |error| <= TOLERANCE


def check(t: Trial, planned: int | None, slack: int, budget: int) -> PlanCheck:
    """``planned``: the plan's predicted allocated bytes (None: no prediction to hold it against)."""
    err = relative_to(planned, t.peak_bytes) if planned is not None and t.peak_bytes else None
    fits = t.fits and t.peak_bytes is not None and t.peak_bytes + slack <= budget
    return PlanCheck(err, fits, err is not None and abs(err) <= TOLERANCE)


def fit_auto(goal: Goal, *, verify: bool, measure: MeasureFn | None = None, plan_out: str | None = None,
             on_trial: Callable[[Trial, int], None] | None = None,
             models: dict[int, LayerModel] | None = None) -> FitReport:
    """Plan, measure, fall back; ``models``: ``acplan.layer_models(goal)`` where the caller built them (the
    same models serve every fallback's budget)."""
    budget = goal.usable_bytes
    models = layer_models(goal) if models is None else models
    p = plan_ac(goal, budget, models=models)
    report = _report(goal, p)
    if p.config is None:
        return report
    if verify:
        base = measure or isolated_measure(goal.capacity_bytes)
        for attempt in range(ATTEMPTS):
            t = base(p.config)
            if on_trial is not None:
                on_trial(t, attempt + 1)
            assert p.chosen is not None
            held = check(t, p.chosen.allocated, p.chosen.slack, goal.usable_bytes)
            report.verification = t
            if t.outcome in NO_ANSWER:  # a timeout or a crash says nothing of the plan's memory
                report.final, report.source = None, f"measurement {t.outcome}"
                report.notes.append(f"measuring plan {p.chosen.ac} {t.outcome}: {t.detail}")
                return report
            if held.fits:
                report.source = f"{p.provenance} (activation-checkpointing plan), confirmed by measurement"
                if not held.close:
                    report.notes.append(f"measured peak {fmt_bytes(t.peak_bytes or 0)} [allocator] is more than "
                                        f"{TOLERANCE:.0%} from the plan's {fmt_bytes(p.chosen.allocated)} "
                                        f"[{p.provenance}]")
                break
            report.notes.append(f"plan {p.chosen.ac} measured {t.outcome}"
                                + (f", peak {fmt_bytes(t.peak_bytes)} [allocator]" if t.peak_bytes else "")
                                + f" against {fmt_bytes(goal.usable_bytes)}: falling back to the next plan")
            measured = t.peak_bytes + p.chosen.slack if t.peak_bytes else p.chosen.peak_bytes * 2
            budget = next_budget(budget, p.chosen.peak_bytes, measured)  # both in the reserved view
            frontier = p.frontier
            p = plan_ac(goal, budget, models=models)
            p.frontier = p.frontier or frontier
            if p.config is None:
                report.final, report.source = None, "measured: no plan fits"
                return report
            notes = report.notes
            report = _report(goal, p)
            report.notes = notes
        else:
            report.final, report.source = None, f"measured: {ATTEMPTS} plans above the budget"
    if report.final is not None:
        try:
            p.file = write_plan(p, plan_out or DEFAULT_FILE)
        except ConfigError as e:  # the plan and its measurement are still reported; only the file is missing
            report.notes.append(f"the plan file was not written: {e}" + ("" if plan_out else
                                                                          "; --plan-out PATH writes it elsewhere"))
    return report
