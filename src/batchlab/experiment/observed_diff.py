"""``batchlab notebook diff ID1 ID2``: two observed runs that differ in one variable, judged as ``compare`` judges.

The verdict, band and diagnosis are compare's (verdict.py, diagnosis.py).  What differs: nothing was
interleaved.  The band pairs the runs' timed updates in order (update i of A with update i of B), so what
moved the machine between the two runs is not cancelled; the record says so.  Memory is one memory update
per run.  Torch-free.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

from batchlab.config import ConfigError
from batchlab.experiment.compare import DEFAULT_TOKEN_BUDGET
from batchlab.experiment.diagnosis import Context, diagnose
from batchlab.experiment.observed import ObservedRecord, Settings
from batchlab.experiment.predict import Direction, FormulaSide, Metric, formula_prediction
from batchlab.experiment.protocol import Rounds
from batchlab.experiment.record import Diagnosis, MetricRecord
from batchlab.experiment.verdict import contradictions, summary, verdicts
from batchlab.measure.result import Measurement
from batchlab.measure.versus import formula_estimate

BAND_METHOD = ("range (min, max) of the ratios B/A of timed update i of run B over timed update i of run A; the "
               "runs were not interleaved, so drift between them (load, clock, thermals) is not cancelled")
# traded against each other at the same global batch: one variable, as compare's --keep global-batch
SPLIT = {"micro_batch", "accum"}
# Settings fields the RunConfig spells differently (compared through the RunConfig when both runs map)
DESCRIPTIVE = {"model", "device", "optimizer", "world_size", "gradient_checkpointing"}


@dataclass(frozen=True)
class ObservedDiff:
    a_id: int
    b_id: int
    variable: str
    changes: dict[str, tuple[Any, Any]]
    global_batch: tuple[int | None, int | None]
    metrics: dict[Metric, MetricRecord]
    verdict: str
    diagnosis: Diagnosis
    pairs: int  # timed updates paired
    notes: tuple[str, ...] = ()
    formula_only = False  # both runs were measured (read by the verdict table, as for a compare record)

    def to_dict(self) -> dict[str, Any]:
        diag = self.diagnosis.to_dict()
        return {"a_id": self.a_id, "b_id": self.b_id, "variable": self.variable,
                "changes": {k: list(v) for k, v in self.changes.items()}, "global_batch": list(self.global_batch),
                "metrics": {m.value: v.to_dict() for m, v in self.metrics.items()}, "verdict": self.verdict,
                "contradictions": diag["contradictions"], "checks": diag["checks"], "pairs": self.pairs,
                "notes": list(self.notes), "band_method": BAND_METHOD}


def differing(a: ObservedRecord, b: ObservedRecord) -> dict[str, tuple[Any, Any]]:
    """{field: (A's, B's)}: the RunConfig's fields when both runs map to one, else the framework Settings."""
    if a.run_config is not None and b.run_config is not None:
        out = a.run_config.diff(b.run_config)
        skip = DESCRIPTIVE
    else:
        out, skip = {}, set()
    for f in fields(Settings):
        va, vb = getattr(a.settings, f.name), getattr(b.settings, f.name)
        if va != vb and f.name not in skip and f.name not in out:
            out[f.name] = (va, vb)
    return out


def variable(changes: dict[str, tuple[Any, Any]], a: ObservedRecord, b: ObservedRecord) -> str:
    if not changes:
        return "none (a repeat: the difference is noise)"
    if len(changes) == 1:
        return next(iter(changes))
    if set(changes) == SPLIT and a.global_batch == b.global_batch:
        return "micro_batch (accum keeps the global batch)"
    listed = "; ".join(f"{k}: {va!r} -> {vb!r}" for k, (va, vb) in changes.items())
    raise ConfigError("ids", f"the two runs differ in {len(changes)} fields ({listed}); notebook diff compares runs "
                             "that differ in one variable")


def _one_update(m: Measurement, i: int) -> Measurement:
    t = m.time
    time = dataclasses.replace(t, samples=[t.samples[i]], cpu_seconds=t.cpu_seconds[i:i + 1],
                               phase_samples={k: v[i:i + 1] for k, v in t.phase_samples.items()},
                               phase_seconds={k: v[i] for k, v in t.phase_samples.items() if len(v) > i})
    tps = m.useful_tokens_per_update / t.samples[i] if m.useful_tokens_per_update else None
    return dataclasses.replace(m, time=time, tokens_per_second=tps)


def paired_rounds(ma: Measurement, mb: Measurement) -> Rounds:
    """One pseudo-round per pair of timed updates (memory repeats: it was measured once per run)."""
    n = min(len(ma.time.samples), len(mb.time.samples)) if ma.time is not None and mb.time is not None else 0
    if n == 0:
        return Rounds(a=[ma], b=[mb])
    return Rounds(a=[_one_update(ma, i) for i in range(n)], b=[_one_update(mb, i) for i in range(n)])


def _formula(a: ObservedRecord, b: ObservedRecord, token_budget: int):
    if a.run_config is None or b.run_config is None:
        return None, {}, "no formula prediction: a run did not map to a RunConfig"
    (ea, why_a), (eb, why_b) = formula_estimate(a.run_config), formula_estimate(b.run_config)
    if ea is None or eb is None:
        return None, {}, why_a or why_b
    phase = {"a": ea.memory.peak_phase, "b": eb.memory.peak_phase}
    return formula_prediction(FormulaSide.from_estimate(ea), FormulaSide.from_estimate(eb), token_budget), phase, ""


def diff(a_id: int, a: ObservedRecord, b_id: int, b: ObservedRecord,
         predictions: dict[Metric, Direction] | None = None, token_budget: int = DEFAULT_TOKEN_BUDGET) -> ObservedDiff:
    changes = differing(a, b)
    var = variable(changes, a, b)
    rounds = paired_rounds(a.measurement, b.measurement)
    pred, phase, why = _formula(a, b, token_budget)
    vs = verdicts(rounds, predictions or {}, pred, token_budget)
    found = contradictions(vs)
    notes = [BAND_METHOD] + ([why] if why else [])
    checks: list = []
    if found and a.run_config is not None and b.run_config is not None:
        # the checks read each run whole (its spread, first timed update, window), not the per-update pairs
        ma, mb = a.measurement, b.measurement
        warmup = ma.time.warmup if ma.time is not None else 0
        ctx = Context(a.run_config, b.run_config, Rounds(a=[ma], b=[mb]), warmup, len(rounds.a))
        checks = diagnose(ctx, vs[Metric.UPDATE_TIME].band, phase, {c.metric.value for c in found})
    elif found:
        notes.append("diagnosis needs both runs mapped to a RunConfig (see each record's unmapped)")
    return ObservedDiff(a_id, b_id, var, changes, (a.global_batch, b.global_batch),
                        dict(vs), summary(vs), Diagnosis(tuple(found), tuple(checks)),
                        len(rounds.a) if a.measurement.time is not None else 0, tuple(notes))


def observed_diff(book, a_id: int, b_id: int, predict: str | None = None) -> ObservedDiff:
    """``notebook diff``: load both rows of ``book`` (a Notebook) and compare them."""
    from batchlab.experiment.predict import parse_predictions

    records = []
    for i in (a_id, b_id):
        d = book.get(i)
        if not isinstance(d, ObservedRecord):
            raise ConfigError("ids", f"#{i} is a {d.kind.value} compare experiment; notebook diff compares observed runs")
        records.append(d)
    return diff(a_id, records[0], b_id, records[1], parse_predictions(predict))
