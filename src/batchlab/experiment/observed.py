"""An observed run: the user's own training (HF Trainer, Lightning, a plain loop) as the notebook keeps it.

Nothing is controlled: batchlab only watched.  The record holds what the framework said (``Settings``), the
RunConfig it maps to where it maps (and what did not map), every figure with its provenance and the
formula's value for the same configuration beside it, the uncontrolled factors, and the global-batch line.
Torch-free (the callbacks and ``batchlab.observe`` build it from a Measurement).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from batchlab.config import RunConfig, Choice, config_from_dict
from batchlab import host
from batchlab.measure.result import Measurement, measurement_from_dict, measurement_to_dict
from batchlab.measure.versus import broken_time_model, formula_estimate, rows
from batchlab.experiment.record import now
from batchlab.util.units import fmt_bytes, fmt_seconds, relative_to

KIND = "observed"
NOISY_SPREAD = 0.10  # IQR/median of update time above which timing is noisy (as measure.session)
SCHEMA_VERSION = 1


class Source(Choice):
    TRANSFORMERS = "transformers"  # batchlab.integrations.transformers.BatchlabCallback
    LIGHTNING = "lightning"  # batchlab.integrations.lightning.BatchlabCallback
    LOOP = "loop"  # batchlab.observe around the user's own loop


class _Flat:
    """to_dict / from_dict for a frozen dataclass of plain values (keys it does not know are skipped)."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


@dataclass(frozen=True)
class Settings(_Flat):
    """The configuration as the framework reported it (its own spelling), before any mapping."""

    micro_batch: int | None  # per-device batch of one forward/backward (sequences or samples)
    accum: int | None  # micro-batches per optimizer update
    world_size: int  # data-parallel processes
    precision: str = "unknown"  # e.g. "fp32", "bf16-mixed" (framework's name)
    gradient_checkpointing: bool | None = None  # activation checkpointing (recompute), not a file checkpoint
    checkpoint_every: int = 1  # with gradient_checkpointing: every n-th layer from the first (HF every_n_layers)
    seq: int | None = None  # tokens per sequence, when the inputs are token sequences
    model: str = ""  # class and shape, e.g. "GPT2LMHeadModel (2 layers, hidden 64)"
    device: str = "cpu"
    optimizer: str = ""

    @property
    def global_batch(self) -> int | None:
        if self.micro_batch is None or self.accum is None:
            return None
        return self.micro_batch * self.accum * self.world_size

    def global_batch_text(self) -> str:
        if self.global_batch is None:
            return "global batch = micro-batch x accum x DP: not known (micro-batch or accumulation not reported)"
        return (f"global batch = micro-batch x accum x DP = {self.micro_batch} x {self.accum} x {self.world_size} "
                f"= {self.global_batch}" + (f" sequences ({self.global_batch * self.seq:,} tokens per update)"
                                            if self.seq else " samples"))


@dataclass(frozen=True)
class Figure(_Flat):
    """One observed figure and, where the formula has one for the same RunConfig, its prediction."""

    name: str
    unit: str  # bytes | seconds | tokens/s | samples/s | phase
    observed: float | str | None
    provenance: str  # allocator | wall-clock (the live-storage tracker counts as allocator on CPU)
    predicted: float | str | None = None
    predicted_provenance: str = "formula"

    @property
    def error(self) -> float | None:
        """(observed - predicted) / predicted: +0.10 means the run took 10% more than the formula said."""
        return relative_to(self.observed, self.predicted)

    def to_dict(self) -> dict[str, Any]:
        return super().to_dict() | {"error": self.error}


@dataclass(frozen=True)
class ObservedRecord:
    source: Source
    settings: Settings
    measurement: Measurement
    figures: tuple[Figure, ...]
    run_config: RunConfig | None  # None: the framework's configuration did not map (see ``unmapped``)
    unmapped: tuple[str, ...] = ()  # what could not be mapped to a RunConfig, and why
    factors: dict[str, Any] = field(default_factory=dict)  # uncontrolled: load, busy processes, CPU MHz
    prediction_note: str = ""  # why there is no formula prediction, when there is none
    warnings: tuple[str, ...] = ()
    note: str = ""
    created_at: str = ""
    notebook_id: int | None = None  # set when read back from a notebook
    kind: str = KIND
    schema_version: int = SCHEMA_VERSION

    @property
    def global_batch(self) -> int | None:
        return self.settings.global_batch

    def figure(self, name: str) -> Figure | None:
        return next((f for f in self.figures if f.name == name), None)

    def short(self) -> str:
        """One line for ``notebook list``."""
        mem, t = self.figure("peak memory"), self.figure("update time (median)")
        parts = [f"global batch {self.global_batch}" if self.global_batch is not None else "global batch ?"]
        if mem is not None:
            parts.append(f"memory {fmt_bytes(mem.observed)} ({mem.provenance})")
        if t is not None:
            parts.append(f"{fmt_seconds(t.observed)}/update (wall-clock)")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "schema_version": self.schema_version, "source": self.source.value,
                "created_at": self.created_at, "notebook_id": self.notebook_id, "note": self.note, "settings": self.settings.to_dict(),
                "global_batch": self.global_batch, "global_batch_text": self.settings.global_batch_text(),
                "run_config": self.run_config.to_dict() if self.run_config is not None else None,
                "unmapped": list(self.unmapped), "figures": [f.to_dict() for f in self.figures],
                "prediction_note": self.prediction_note, "factors": self.factors,
                "measurement": measurement_to_dict(self.measurement), "warnings": list(self.warnings),
                "short": self.short()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ObservedRecord":
        if d.get("kind") != KIND:
            raise ValueError(f"not an observed record (kind {d.get('kind')!r})")
        if d.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"observed record schema {d.get('schema_version')!r}; this batchlab reads {SCHEMA_VERSION}")
        return cls(source=Source(d["source"]), settings=Settings.from_dict(d["settings"]),
                   measurement=measurement_from_dict(d["measurement"]),
                   figures=tuple(Figure.from_dict(f) for f in d["figures"]),
                   run_config=config_from_dict(d["run_config"]) if d.get("run_config") else None,
                   unmapped=tuple(d.get("unmapped", ())), factors=d.get("factors") or {},
                   prediction_note=d.get("prediction_note", ""), warnings=tuple(d.get("warnings", ())),
                   note=d.get("note", ""), created_at=d.get("created_at", ""),
                   notebook_id=d.get("notebook_id"))


def _figures(m: Measurement, settings: Settings, cfg: RunConfig | None,
             predict: bool) -> tuple[tuple[Figure, ...], str, str | None]:
    """(the figures, why there is no prediction, the warning of a broken time model or None)."""
    est, why = formula_estimate(cfg) if (predict and cfg is not None) else (None, "")
    if cfg is None and predict:
        why = "no formula prediction: the configuration did not map to a RunConfig (see unmapped)"
    elif not predict:
        why = "no formula prediction (predict=False)"
    beside = rows(m, est)
    out = [Figure(r.figure, r.unit, r.measured, r.measured_provenance, r.formula) for r in beside]
    if m.time is not None and m.time.samples and settings.global_batch is not None:
        # samples (sequences) per second over all ranks: the global batch over the median update time
        out.append(Figure("samples/s", "samples/s", settings.global_batch / m.time.update_seconds_median,
                          m.time.provenance))
    for phase, s in sorted((m.time.phase_seconds if m.time is not None else {}).items()):
        out.append(Figure(f"phase {phase} (median)", "seconds", s, m.time.provenance))
    return tuple(out), why or "", broken_time_model(beside)


def build(source: Source, settings: Settings, m: Measurement, cfg: RunConfig | None, unmapped: list[str],
          factors: dict[str, Any], predict: bool = True, note: str = "", created_at: str = "") -> ObservedRecord:
    figures, why, broken = _figures(m, settings, cfg, predict)
    warnings = list(m.warnings) + ([broken] if broken else [])
    if m.time is not None and m.time.samples and m.time.spread > NOISY_SPREAD:
        warnings.append(f"timing is noisy: IQR/median of the timed updates {m.time.spread:.0%} (> {NOISY_SPREAD:.0%}); "
                        "see the uncontrolled factors")
    if settings.world_size > 1:
        warnings.append("memory and time are one rank's (rank 0 in the notebook); the gradient all-reduce is inside "
                        "the update time but was not measured separately")
    else:
        warnings.append("one process: says nothing about cluster communication")
    return ObservedRecord(source=source, settings=settings, measurement=m, figures=figures, run_config=cfg,
                          unmapped=tuple(unmapped), factors=factors, prediction_note=why,
                          warnings=tuple(warnings), note=note, created_at=created_at)


def loop_settings(cfg: RunConfig | None, global_batch: int | None, model: str, device: str,
                  optimizer: str) -> tuple[Settings, list[str]]:
    """A plain loop reports nothing itself: its Settings come from the RunConfig given to observe()."""
    if cfg is not None:
        return Settings(micro_batch=cfg.micro_batch, accum=cfg.accum, world_size=cfg.dp, precision=cfg.precision.value,
                        gradient_checkpointing=cfg.ac.recomputes, seq=cfg.seq,
                        model=f"{model} ({cfg.model.name})", device=device, optimizer=optimizer), []
    why = (f"global batch {global_batch} given without its split" if global_batch is not None else
           "no config given") + ": pass config=RunConfig(...) for micro-batch x accum x DP and the formula's prediction"
    return Settings(micro_batch=None, accum=None, world_size=1, model=model, device=device, optimizer=optimizer), [why]


def finish(source: Source, settings: Settings, m: Measurement, cfg: RunConfig | None, unmapped: list[str],
           before: host.LoadSampler, notebook=None, predict: bool = True, note: str = "") -> tuple[ObservedRecord, int | None]:
    """The record of a run watched since ``before`` (factors read now), written to ``notebook`` when given."""
    t = m.time
    noise = {"update_time_spread": t.spread if t is not None and t.samples else None,
             "timed_updates": len(t.samples) if t is not None else 0,
             "rule": "IQR / median of the timed updates; above 0.10 the timing is noisy"}
    m = replace(m, global_batch=settings.global_batch if settings.global_batch is not None else m.global_batch,
                config=cfg.to_dict() if cfg is not None else {})
    record = build(source, settings, m, cfg, unmapped, host.uncontrolled(before, noise, note),
                   predict=predict, note=note, created_at=now())
    return record, (save(record, notebook) if notebook is not None else None)


def save(record: ObservedRecord, notebook) -> int:
    """Write ``record`` to ``notebook`` (an ``experiment.notebook.Notebook``); returns its notebook id."""
    return notebook.add(record)

