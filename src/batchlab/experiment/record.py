"""The experiment record: what ``compare`` returns, the notebook stores and ``compare --json`` prints.

A tree of frozen dataclasses; ``to_dict`` gives the JSON form (the ``compare --json`` contract:
docs/reference/json.md), ``from_dict`` reads it back.  ``schema`` is the record's version: rows written before it existed carry none
and are version 1, which has the same fields as 2; version 3 adds each side's memory timeline.  Older rows
read unchanged (no timelines); a row from a newer batchlab is refused.
The configs, the formula's estimates (``Estimate.to_dict``), semantics and factors stay in their own stored
forms (mappings) — each is typed where it is made.  Torch-free.
"""
from __future__ import annotations

import datetime as dt

from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Mapping

from batchlab.config import ConfigError, Choice
from batchlab.experiment.change import KeepMode
from batchlab.experiment.predict import Direction, Metric
from batchlab.measure.result import Measurement, measurement_from_dict, measurement_to_dict
from batchlab.timeline.data import Timeline

def now() -> str:
    """The local time with its UTC offset, to the second (record timestamps)."""
    return dt.datetime.now(dt.timezone.utc).astimezone().isoformat(timespec="seconds")


# 1: rows without a "schema" field (same fields as 2); 3 adds ``timelines`` (older rows read with none)
SCHEMA_VERSION = 3
SIDES = ("a", "b")


class Kind(Choice):
    MEASURED = "measured"
    FORMULA_ONLY = "formula-only"


class Status(Choice):
    INCOMPLETE = "incomplete"
    COMPLETE = "complete"


def _dir(value: Any) -> Direction | None:
    return Direction(value) if value is not None else None


def _val(d: Direction | None) -> str | None:
    return d.value if d is not None else None


def _frozen(d: Mapping | None) -> Mapping:
    return MappingProxyType(dict(d or {}))


@dataclass(frozen=True)
class FormulaFigures:
    """The formula's value on each side and its ratio B/A (provenance ``formula``)."""
    a: Any = None
    b: Any = None
    ratio: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "ratio": self.ratio, "provenance": "formula"}

    @classmethod
    def from_dict(cls, d: Mapping | None) -> "FormulaFigures":
        d = d or {}
        return cls(d.get("a"), d.get("b"), d.get("ratio"))


@dataclass(frozen=True)
class MetricRecord:
    """One metric's verdict as stored: observed direction, ratio, band, who predicted what and whether it held."""
    observed: Direction | None
    ratio: float | None
    band: tuple[float, float] | None
    predicted_by_user: Direction | None
    predicted_by_formula: Direction | None
    held_user: bool | None
    held_formula: bool | None
    a: Any
    b: Any
    unit: str
    provenance: str
    paired_ratios: tuple[float, ...] = ()
    formula: FormulaFigures = field(default_factory=FormulaFigures)
    note: str = ""
    inconclusive: bool = False  # the side medians and the paired ratios disagree in direction (noise)

    def to_dict(self) -> dict[str, Any]:
        return {"observed": _val(self.observed), "inconclusive": self.inconclusive, "ratio": self.ratio,
                "band": list(self.band) if self.band is not None else None,
                "predicted_by_user": _val(self.predicted_by_user),
                "predicted_by_formula": _val(self.predicted_by_formula),
                "held": {"user": self.held_user, "formula": self.held_formula},
                "a": self.a, "b": self.b, "unit": self.unit, "provenance": self.provenance,
                "paired_ratios": list(self.paired_ratios), "formula": self.formula.to_dict(), "note": self.note}

    @classmethod
    def from_dict(cls, d: Mapping) -> "MetricRecord":
        held = d.get("held") or {}
        band = d.get("band")
        return cls(_dir(d.get("observed")), d.get("ratio"), tuple(band) if band is not None else None,
                   _dir(d.get("predicted_by_user")), _dir(d.get("predicted_by_formula")),
                   held.get("user"), held.get("formula"), d.get("a"), d.get("b"), d["unit"], d["provenance"],
                   tuple(d.get("paired_ratios") or ()), FormulaFigures.from_dict(d.get("formula")),
                   d.get("note", ""), bool(d.get("inconclusive", False)))


@dataclass(frozen=True)
class Predictions:
    user: Mapping[Metric, Direction] = field(default_factory=dict)
    user_source: str = "none"  # flag | prompt | file | none
    formula: Mapping[Metric, Direction | None] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"user": {m.value: d.value for m, d in self.user.items()}, "user_source": self.user_source,
                "formula": {m.value: _val(d) for m, d in self.formula.items()}}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Predictions":
        return cls(_frozen({Metric(k): Direction(v) for k, v in (d.get("user") or {}).items()}),
                   d.get("user_source", "none"),
                   _frozen({Metric(k): _dir(v) for k, v in (d.get("formula") or {}).items()}))


@dataclass(frozen=True)
class FormulaRecord:
    """The formula's estimate of both sides (``Estimate.to_dict`` each) and its prediction per metric."""
    available: bool
    reason: str = ""
    a: Mapping[str, Any] | None = None
    b: Mapping[str, Any] | None = None
    prediction: Mapping[str, Any] = field(default_factory=dict)
    # what the per-op time model attributes the predicted update-time change to (formula.attribution)
    time_attribution: Mapping[str, Any] | None = None

    def side(self, s: str) -> Mapping[str, Any] | None:
        return self.a if s == "a" else self.b

    def figure(self, s: str, part: str, name: str) -> Any:
        """One figure of one side's estimate, e.g. ("a", "memory", "peak_bytes"); None without a formula side."""
        est = self.side(s)
        return est[part].get(name) if est is not None else None

    def to_dict(self) -> dict[str, Any]:
        if not self.available:
            return {"available": False, "reason": self.reason, "provenance": "formula"}
        return {"available": True, "provenance": "formula", "a": dict(self.a or {}), "b": dict(self.b or {}),
                "prediction": dict(self.prediction), "time_attribution": self.time_attribution,
                **({"reason": self.reason} if self.reason else {})}  # why a metric has no prediction

    @classmethod
    def from_dict(cls, d: Mapping) -> "FormulaRecord":
        return cls(bool(d.get("available")), d.get("reason", ""), d.get("a"), d.get("b"), d.get("prediction") or {},
                   d.get("time_attribution"))


@dataclass(frozen=True)
class Contradiction:
    metric: Metric
    who: str  # "you" | "formula"
    predicted: Direction
    observed: Direction

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric.value, "who": self.who, "predicted": self.predicted.value,
                "observed": self.observed.value}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Contradiction":
        return cls(Metric(d["metric"]), d["who"], Direction(d["predicted"]), Direction(d["observed"]))


@dataclass(frozen=True)
class Check:
    """One diagnosis check: the question asked of the measurement, what was found, whether it explains a miss."""
    name: str
    question: str
    found: str
    flagged: bool

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "question": self.question, "found": self.found, "flagged": self.flagged}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Check":
        return cls(d["name"], d["question"], d["found"], bool(d["flagged"]))


@dataclass(frozen=True)
class Diagnosis:
    contradictions: tuple[Contradiction, ...] = ()
    checks: tuple[Check, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"contradictions": [c.to_dict() for c in self.contradictions],
                "checks": [c.to_dict() for c in self.checks]}

    @classmethod
    def from_dict(cls, d: Mapping | None) -> "Diagnosis":
        d = d or {}
        return cls(tuple(Contradiction.from_dict(c) for c in d.get("contradictions") or ()),
                   tuple(Check.from_dict(c) for c in d.get("checks") or ()))


@dataclass(frozen=True)
class Round:
    """One round: side A then side B measured, each in a process of its own; None where a side did not run."""
    a: Measurement | None
    b: Measurement | None
    seconds: tuple[float, ...] = ()

    def side(self, s: str) -> Measurement | None:
        return self.a if s == "a" else self.b

    def to_dict(self) -> dict[str, Any]:
        m = lambda x: measurement_to_dict(x) if x is not None else None  # noqa: E731
        return {"a": m(self.a), "b": m(self.b), "seconds": list(self.seconds)}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Round":
        m = lambda x: measurement_from_dict(x) if x else None  # noqa: E731
        return cls(m(d.get("a")), m(d.get("b")), tuple(d.get("seconds") or ()))


@dataclass(frozen=True)
class Protocol:
    rounds: int
    warmup: int
    steps: int
    threads: int | None
    token_budget: int
    band_method: str
    isolated: bool = True
    order: str = "A B A B ..."
    allocator: str = ""  # the measuring processes' host allocator regime (batchlab.host.regime.describe)

    def to_dict(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "warmup": self.warmup, "steps": self.steps, "isolated": self.isolated,
                "threads": self.threads, "order": self.order, "token_budget": self.token_budget,
                "band_method": self.band_method, "allocator": self.allocator}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Protocol":
        return cls(d["rounds"], d["warmup"], d["steps"], d.get("threads"), d["token_budget"], d["band_method"],
                   d.get("isolated", True), d.get("order", "A B A B ..."), d.get("allocator", ""))


@dataclass(frozen=True)
class Record:
    """One experiment.  ``config``/``sides``: RunConfig.to_dict; ``change``: Sides.to_dict."""
    kind: Kind
    created_at: str
    config: Mapping[str, Any]
    change: Mapping[str, Any]
    keep_mode: KeepMode
    predictions: Predictions
    formula: FormulaRecord
    sides: Mapping[str, Mapping[str, Any]]
    protocol: Protocol
    note: str = ""
    warnings: tuple[str, ...] = ()
    metrics: Mapping[Metric, MetricRecord] = field(default_factory=dict)
    diagnosis: Diagnosis = field(default_factory=Diagnosis)
    semantics: Mapping[str, Any] = field(default_factory=dict)
    scope: tuple[str, ...] = ()
    notebook_id: int | None = None
    verdict: str | None = None
    # formula (never measured): the idle share each side's pipeline schedule leaves and what moved it
    # (formula.pipeline.bubble_change); "" where neither side runs a pipeline
    pipeline_bubble: str = ""
    rounds: tuple[Round, ...] | None = None  # None: nothing measured (formula only, or not finished)
    factors: Mapping[str, Any] | None = None
    wall_seconds: float | None = None
    finished_at: str | None = None
    status: Status | None = None
    interrupted: str | None = None
    # side -> memory over one update of that side's first measured round (stored compacted: timeline.data.compact)
    timelines: Mapping[str, Timeline] = field(default_factory=dict)
    schema: int = SCHEMA_VERSION

    @property
    def formula_only(self) -> bool:
        return self.kind is Kind.FORMULA_ONLY

    def with_(self, **changes: Any) -> "Record":
        """A new record with ``changes`` (the record itself is never modified)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = {"schema": self.schema, "kind": self.kind.value, "created_at": self.created_at,
               "config": dict(self.config), "change": dict(self.change), "keep_mode": self.keep_mode.value,
               "predictions": self.predictions.to_dict(), "formula": self.formula.to_dict(),
               "sides": {s: dict(self.sides[s]) for s in SIDES}, "protocol": self.protocol.to_dict(),
               "note": self.note, "warnings": list(self.warnings),
               "metrics": {m.value: v.to_dict() for m, v in self.metrics.items()},
               "diagnosis": self.diagnosis.to_dict(), "semantics": dict(self.semantics),
               "scope": list(self.scope), "notebook_id": self.notebook_id}
        optional = {"verdict": self.verdict, "factors": dict(self.factors) if self.factors is not None else None,
                    "rounds": [r.to_dict() for r in self.rounds] if self.rounds is not None else None,
                    "wall_seconds": self.wall_seconds, "finished_at": self.finished_at,
                    "status": self.status.value if self.status is not None else None,
                    "interrupted": self.interrupted,
                    "pipeline_bubble": {"text": self.pipeline_bubble, "provenance": "formula"}
                    if self.pipeline_bubble else None,
                    "timelines": {s: t.to_dict() for s, t in self.timelines.items()} or None}
        out.update({k: v for k, v in optional.items() if v is not None})
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Record":
        schema = d.get("schema", 1)
        if not isinstance(schema, int) or not 1 <= schema <= SCHEMA_VERSION:
            raise ConfigError("notebook", f"experiment record schema {schema!r} is not one this batchlab reads "
                                          f"(1 to {SCHEMA_VERSION}); upgrade batchlab to read it")
        rounds = d.get("rounds")
        verdict, bubble = d.get("verdict"), (d.get("pipeline_bubble") or {}).get("text", "")
        if verdict and not bubble and "; the bubble " in verdict:  # stored before the clause had a field of its own
            verdict, _, rest = verdict.partition("; the bubble ")
            bubble = "the bubble " + rest
        return cls(
            kind=Kind(d["kind"]), created_at=d.get("created_at", ""), config=_frozen(d["config"]),
            change=_frozen(d["change"]), keep_mode=KeepMode(d["keep_mode"]),
            predictions=Predictions.from_dict(d.get("predictions") or {}),
            formula=FormulaRecord.from_dict(d.get("formula") or {}),
            sides=_frozen({s: _frozen(d["sides"][s]) for s in SIDES}), protocol=Protocol.from_dict(d["protocol"]),
            note=d.get("note") or "", warnings=tuple(d.get("warnings") or ()),
            metrics=_frozen({Metric(k): MetricRecord.from_dict(v) for k, v in (d.get("metrics") or {}).items()}),
            diagnosis=Diagnosis.from_dict(d.get("diagnosis")), semantics=_frozen(d.get("semantics")),
            scope=tuple(d.get("scope") or ()), notebook_id=d.get("notebook_id"), verdict=verdict,
            pipeline_bubble=bubble,
            rounds=tuple(Round.from_dict(r) for r in rounds) if rounds is not None else None,
            factors=d.get("factors"), wall_seconds=d.get("wall_seconds"), finished_at=d.get("finished_at"),
            status=Status(d["status"]) if d.get("status") else None, interrupted=d.get("interrupted"),
            timelines=_frozen({s: Timeline.from_dict(t) for s, t in (d.get("timelines") or {}).items()}),
            schema=SCHEMA_VERSION)
