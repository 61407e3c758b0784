"""One controlled experiment, start to end: predictions recorded, both sides measured interleaved, verdicts,
diagnosis, semantics and scope, the notebook row written before and completed after.

    plan = make_plan(cfg, [parse_change("micro_batch=1:2", cfg)], predictions={Metric.PEAK_MEMORY: Direction.UP})
    record = run(plan, Notebook(path))          # an experiment.record.Record; record.to_dict() is `compare --json`
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any

from batchlab.cache.calibrations import probe_reference
from batchlab import host
from batchlab.config import ConfigError, Counted, RunConfig, to_jsonable
from batchlab.experiment import protocol
from batchlab.experiment.change import Change, KeepMode, Sides, build_sides
from batchlab.experiment.diagnosis import Context, diagnose, time_model_checks
from batchlab.experiment.notebook import LeftIncomplete, Notebook
from batchlab.experiment.record import (Diagnosis, FormulaRecord, Kind, Predictions, Protocol, Record, Round, now,
                                        Status)
from batchlab.experiment.predict import Direction, FormulaSide, Metric, compiled_time_prediction, formula_prediction
from batchlab.experiment.protocol import MeasureFn, Progress, Rounds, check_rounds, interleave, prestart, threads_env
from batchlab.experiment.scope import scope
from batchlab.experiment.semantics import semantics
from batchlab.experiment.verdict import BAND_METHOD, contradictions, summary, verdicts
from batchlab.measure import unexpressed
from batchlab.measure.options import MeasureOptions
from batchlab.timeline.data import Timeline, compact

DEFAULT_CHANGE = "micro_batch=1:2"
DEFAULT_TOKEN_BUDGET = 10_000_000  # tokens; the ratio does not depend on it (steady state), the seconds do
# CPU measurements pin one intra-op thread unless told otherwise: on a shared machine more threads than free
# cores make OpenMP workers wait on each other, and the paired ratios scatter with the contention (docs/cpu.md).
DEFAULT_CPU_THREADS = 1


@dataclass(frozen=True)
class ExperimentPlan:
    sides: Sides
    predictions: dict[Metric, Direction] = field(default_factory=dict)
    prediction_source: str = "none"  # flag | prompt | file | none
    rounds: int = 3
    options: MeasureOptions = field(default_factory=lambda: MeasureOptions(isolate=True))
    token_budget: int = DEFAULT_TOKEN_BUDGET
    formula_only: bool = False
    note: str = ""
    threads: int | None = None  # intra-op threads of the measured processes; None: torch's default


def make_plan(base: RunConfig, changes: list[Change], keep: KeepMode | str = KeepMode.GLOBAL_BATCH,
              allow_confounded: bool = False, predictions: dict[Metric, Direction] | None = None,
              prediction_source: str | None = None, rounds: int = 3, warmup: int = 2, steps: int = 5,
              timeout_s: float | None = None, token_budget: int = DEFAULT_TOKEN_BUDGET, formula_only: bool = False,
              note: str = "", torch_device: str | None = None, threads: int | str | None = "auto") -> ExperimentPlan:
    """Validate everything (raises ConfigError naming the field) before anything is run or written."""
    sides = build_sides(base, changes, KeepMode.parse("keep", keep), allow_confounded)
    if not formula_only:
        sides = _measurable(sides, torch_device)
    check_rounds(rounds)
    if isinstance(token_budget, bool) or not isinstance(token_budget, int) or token_budget <= 0:
        raise ConfigError("token_budget", f"must be a whole number of tokens > 0, got {token_budget!r}")
    threads = _threads(threads, sides, torch_device)
    options = MeasureOptions(warmup=warmup, steps=steps, isolate=True, timeout_s=timeout_s, torch_device=torch_device)
    predictions = dict(predictions or {})
    source = prediction_source or ("flag" if predictions else "none")
    return ExperimentPlan(sides, predictions, source, rounds, options, token_budget, formula_only, note or "", threads)


def _measurable(sides: Sides, torch_device: str | None) -> Sides:
    """Refuses two sides a measurement cannot tell apart (one line naming the field); a change the measured runs
    run past beside one they express is said in the record's warnings."""
    same = unexpressed.same_run(sides.a, sides.b, torch_device)
    if same is not None:
        field, why = same
        raise ConfigError(field, f"{why}; both sides would be one measured run: compare it with --formula-only, or "
                                 "change a field the measured run expresses")
    past = unexpressed.reasons(sides.a, sides.b, torch_device)
    said = tuple(f"{n} changes only the formula's side: {past[n]}" for n in sides.a.diff(sides.b) if n in past)
    return replace(sides, warnings=sides.warnings + said) if said else sides


def _threads(threads: int | str | None, sides: Sides, torch_device: str | None) -> int | None:
    """"auto": DEFAULT_CPU_THREADS for a CPU measurement, torch's default elsewhere; 0 or None: torch's default."""
    if threads == "auto":
        on_cpu = (torch_device or sides.a.device_spec.backend.value).startswith("cpu")
        return DEFAULT_CPU_THREADS if on_cpu else None
    if threads is None or threads == 0:
        return None
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise ConfigError("threads", f"must be a whole number >= 1 (0: torch's default), got {threads!r}")
    return threads


def preflight(plan: ExperimentPlan) -> None:
    """User errors the measurement would find only inside its subprocess: found here, before the notebook row."""
    if plan.formula_only:
        return
    for cfg in (plan.sides.a, plan.sides.b):
        if cfg.parallel.world_size > 1:  # layouts and engines no rank runs, the devices the ranks need
            from batchlab.distributed.launcher import check_local

            check_local(cfg, plan.options, cfg.parallel.world_size)
            continue
        if cfg.device_spec.backend.value == "cpu" and cfg.memory_budget is None and plan.options.torch_device is None:
            continue
        from batchlab.measure.device import torch_device
        from batchlab.measure.session import check_budget

        if cfg.dp == 1:
            torch_device(cfg, plan.options.torch_device)
        check_budget(cfg)


FormulaPrediction = dict[Metric, dict[str, Any]]


def _formula(sides: Sides, token_budget: int, threads: int | None = None
             ) -> tuple[FormulaRecord, FormulaPrediction | None]:
    """The formula's estimate of both sides (for the record) and its prediction per metric; ``threads``: the
    measured processes' intra-op threads (the CPU calibration must be the one taken at that count)."""
    from batchlab.cache.calibrations import load_all
    from batchlab.formula import compiled_note, estimate, unseen_model

    if unseen_model(sides.a):  # a factory model: no formula side; the measurement stands alone
        return FormulaRecord(False, reason=f"no formula estimate: {unseen_model(sides.a)}"), None
    compiled = compiled_note(sides.a) or compiled_note(sides.b)
    if compiled:  # its figures would be eager PyTorch's on both sides: no prediction rather than a wrong "same"
        return FormulaRecord(False, reason=f"no formula prediction: {compiled}"), None
    cals = load_all(threads)  # the calibration cache, read here: estimate() is a pure function
    ea, eb = estimate(sides.a, cals), estimate(sides.b, cals)
    pred = formula_prediction(FormulaSide.from_estimate(ea), FormulaSide.from_estimate(eb), token_budget)
    reason = ""
    if sides.a.compile is not sides.b.compile:  # fused kernels priced by a rule (formula/fusion.py): a margin
        pred, reason = compiled_time_prediction(pred)
    if sides.a.ac.budget is not None or sides.b.ac.budget is not None:  # the partitioner's recompute is unpriced
        pred = {m: p for m, p in pred.items() if m in (Metric.PEAK_MEMORY, Metric.OOM)}
        reason = "no formula time prediction: the time model does not price what budget:F recomputes"
    from batchlab.formula.attribution import attribute

    att = attribute(ea.time, eb.time)
    return FormulaRecord(True, reason=reason, a=ea.to_dict(), b=eb.to_dict(),
                         prediction={m.value: to_jsonable(p) for m, p in pred.items()},
                         time_attribution=att.to_dict() if att else None), pred


def initial_record(plan: ExperimentPlan, formula: FormulaRecord, pred: FormulaPrediction | None) -> Record:
    """Everything known before anything runs: the change, both predictions, the formula estimate."""
    s = plan.sides
    o = plan.options
    return Record(
        kind=Kind.FORMULA_ONLY if plan.formula_only else Kind.MEASURED, created_at=now(), config=s.a.to_dict(),
        change=s.to_dict(), keep_mode=s.keep,
        predictions=Predictions(dict(plan.predictions), plan.prediction_source,
                                {m: p["direction"] for m, p in (pred or {}).items()}),
        formula=formula, sides={"a": s.a.to_dict(), "b": s.b.to_dict()},
        protocol=Protocol(0 if plan.formula_only else plan.rounds, o.warmup, o.steps, plan.threads,
                          plan.token_budget, BAND_METHOD, isolated=o.isolate,
                          allocator=host.state(host.measuring_env(dict(os.environ)) if o.isolate else None)),
        note=plan.note, warnings=tuple(s.warnings))


def run(plan: ExperimentPlan, notebook: Notebook | None = None, measure: MeasureFn | None = None,
        progress: Progress | None = None, verify: bool = True) -> Record:
    """Carry the plan out; the notebook row is begun before measuring and completed at the end."""
    preflight(plan)
    t0 = time.perf_counter()
    before = host.LoadSampler().start()  # samples what else uses the CPU until finish() stops it
    if measure is None and not plan.formula_only:
        with threads_env(plan.threads):
            prestart(plan.sides.a, plan.options)  # its imports overlap the formula's work below
    formula, pred = _formula(plan.sides, plan.token_budget, plan.threads)
    record = initial_record(plan, formula, pred)
    exp_id = notebook.begin(record) if notebook is not None else None
    record = record.with_(notebook_id=exp_id)
    try:
        # the gradient check (finish) forks from the measurements' pre-imported process: the same environment
        with threads_env(None if plan.formula_only else plan.threads):
            rounds = None if plan.formula_only else interleave(plan.sides.a, plan.sides.b, plan.rounds, plan.options,
                                                               _timeline_first(measure), progress)
            record = finish(record, plan, rounds, pred, verify, before)
    except ConfigError:
        if notebook is not None and exp_id is not None:
            notebook.discard(exp_id)  # bad input found late: leave nothing behind
        raise
    except BaseException as e:
        if notebook is not None and exp_id is not None:
            marked = notebook.interrupt(exp_id, (f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)[:300])
            if isinstance(e, KeyboardInterrupt):
                raise LeftIncomplete(f"experiment #{exp_id} left incomplete in {notebook.path}"
                                     + ("" if marked else " (the notebook refused to mark it)")) from e
        raise
    finally:
        before.stop()
    record = record.with_(wall_seconds=time.perf_counter() - t0, finished_at=now())
    if notebook is not None and exp_id is not None:
        notebook.complete(exp_id, record)
        record = record.with_(status=Status.COMPLETE)
    return record


def _timeline_first(measure: MeasureFn | None) -> MeasureFn:
    """``measure`` (default: protocol.default_measure, isolated) asked for a memory timeline on each side's
    first call only: one more untimed update in that measuring process; the other rounds are not slowed."""
    seen: list[RunConfig] = []

    def first_with_timeline(cfg: RunConfig, options: MeasureOptions):
        # a compiled CPU side has no tracker timeline (inductor's buffers bypass it: measure/session.py)
        first = cfg not in seen and (cfg.compile.value == "none" or cfg.device_spec.backend.value == "cuda")
        seen.append(cfg)
        return (measure or protocol.default_measure)(cfg, replace(options, timeline=first))
    return first_with_timeline


def _timelines(rounds: Rounds) -> tuple[dict[str, Timeline], tuple[Round, ...]]:
    """Each side's timeline (from its first measurement that has one, compacted for storage) and the rounds
    without timelines, so the record keeps one per side."""
    found: dict[str, Timeline] = {}
    for side in "ab":
        t = next((m.timeline for m in rounds.side(side) if m is not None and m.timeline is not None), None)
        if t is not None:
            found[side] = compact(t)
    bare = lambda m: replace(m, timeline=None) if m is not None else None  # noqa: E731
    return found, tuple(Round(bare(ma), bare(mb), tuple(sec)) for ma, mb, sec in zip(rounds.a, rounds.b,
                                                                                      rounds.seconds))


def finish(record: Record, plan: ExperimentPlan, rounds: Rounds | None, formula_pred: FormulaPrediction | None,
           verify: bool, before: host.LoadSampler) -> Record:
    """The record with verdicts, diagnosis, semantics, scope and factors."""
    s = plan.sides
    vs = verdicts(rounds, plan.predictions, formula_pred, plan.token_budget)
    from batchlab.formula.pipeline import bubble_change

    done: dict[str, Any] = {"metrics": vs, "verdict": ("formula only: " if plan.formula_only else "") + summary(vs),
                            "pipeline_bubble": bubble_change(s.a, s.b)}  # formula: each side's schedule's idle share
    devices: set[str] = set()
    if rounds is not None:
        done["timelines"], done["rounds"] = _timelines(rounds)
        if rounds.counted() is not Counted.TOKENS:  # the sides' global-batch lines were written before either was built
            done["change"] = dict(record.change, global_batch_text={k: c.global_batch_text(rounds.counted())
                                                                    for k, c in (("a", s.a), ("b", s.b))})
        done["warnings"] = record.warnings + tuple(rounds.skipped)
        devices = {str(m.environment.get("torch_device")) for m in rounds.a + rounds.b
                   if m is not None and m.environment.get("torch_device")}
        found = contradictions(vs)
        checks: list = []
        if found:
            ctx = Context(s.a, s.b, rounds, plan.options.warmup, plan.options.steps)
            phase = {k: record.formula.figure(k, "memory", "peak_phase") for k in "ab"}
            checks = diagnose(ctx, vs[Metric.UPDATE_TIME].band, phase, {c.metric.value for c in found})
            checks += time_model_checks(record.formula.time_attribution)
        done["diagnosis"] = Diagnosis(tuple(found), tuple(checks))
    done["semantics"] = semantics(s.a, s.b, run_check=verify and rounds is not None,
                                  why_not="not run: formula only" if rounds is None else "not run (--no-verify)")
    from batchlab.formula.params import count

    done["scope"] = tuple(scope(s.a, s.b, devices, measured=rounds is not None, parameters=count(s.a.model).total))
    done["factors"] = host.uncontrolled(before, _noise(rounds, vs), plan.note)
    speed = side_speeds(rounds, plan.threads)
    if speed:
        done["factors"]["host_speed"] = speed
    return record.with_(**done)


def _noise(rounds: Rounds | None, vs) -> dict[str, Any]:
    if rounds is None:
        return {}
    spread = {}
    for side in "ab":
        values = [m.time.spread for m in rounds.side(side) if m is not None and m.time is not None and m.time.samples]
        spread[side] = statistics.median(values) if values else None
    band = vs[Metric.UPDATE_TIME].band
    return {"update_time_iqr_over_median": spread, "paired_time_ratio_band": list(band) if band else None}


def side_speeds(rounds, threads: int | None) -> dict[str, Any]:
    """Per side, how fast this host ran during the timed updates against its calibration: the median of the
    speed probe read before each update (host/speed.py) over the calibration's (1.3: 30% slower), with the
    reference; {} off CPU, without a calibration that has the probe, or without reads."""
    ref = probe_reference(threads) if rounds is not None else None
    if ref is None:
        return {}
    out = {s: host.speed_factor([x for m in rounds.side(s) if m is not None and m.time is not None for x in m.time.probe_seconds],
                    ref) for s in "ab"}
    if None in out.values():
        return {}
    return {**out, "reference_seconds": ref,
            "how": "a ~6 ms bundle of calibrated kernels (matmul, add, dropout RNG, tiny ops) timed before each "
                   "timed update, median, over its median in the calibration"}
