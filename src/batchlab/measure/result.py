"""What a measurement returns.  Torch-free, so experiments and the notebook can load results anywhere.

Field names match the calculator's Estimate where the figure is the same (peak_bytes, activations_bytes,
peak_phase, tokens_per_second), so reports line them up without a mapping table.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field, fields, replace
from typing import Any

from batchlab.config import Counted, Choice
from batchlab.config.phase import Phase
from batchlab.timeline.data import Timeline


class Outcome(Choice):
    OK = "ok"
    OOM = "oom"  # the device allocator (or the CPU allocator) refused
    OOM_BUDGET = "oom (budget)"  # tracked tensor bytes exceeded --memory-budget
    FAILED = "failed"  # anything else: exception, kill, timeout; see outcome_detail


TIMED_OUT_DETAIL = "timed out"  # how outcome_detail of a run killed at its timeout begins


@dataclass(frozen=True)
class MeasuredMemory:
    peak_bytes: int
    activations_bytes: int  # created by the last forward, still held when its backward starts
    peak_phase: Phase
    breakdown: dict[str, int] = field(default_factory=dict)  # category -> bytes at the peak
    reserved_bytes: int | None = None  # CUDA caching allocator's reserved peak
    alloc_retries: int | None = None
    oom_count: int | None = None  # CUDA allocator OOMs during the update (caught and retried ones included)
    provenance: str = "allocator"  # CUDA allocator stats, or the live tensor-storage tracker on CPU
    method: str = ""  # "cuda max_memory_allocated" | "live storage tracker"
    per_rank_peak_bytes: list[int] = field(default_factory=list)  # DP > 1: every rank's peak, rank order

    @property
    def rank_spread_bytes(self) -> int:
        """Highest minus lowest rank peak (0 for one rank)."""
        return max(self.per_rank_peak_bytes) - min(self.per_rank_peak_bytes) if self.per_rank_peak_bytes else 0


NOISY_SPREAD = 0.10  # IQR / median of update time above which the timing is flagged as noisy

@dataclass(frozen=True)
class RankFigures:
    """One rank of a multi-rank run: where it sits (its dp / tp / pp coordinates), its own peak (allocator) and
    its own median update time (wall-clock)."""
    rank: int
    dp: int = 0
    tp: int = 0
    pp: int = 0
    peak_bytes: int | None = None
    peak_phase: str | None = None
    update_seconds_median: float | None = None
    parameter_bytes: int | None = None  # this rank's parameter shards
    provenance: str = "allocator"


@dataclass(frozen=True)
class MeasuredTime:
    samples: list[float]  # seconds per measured update (warmup excluded)
    phase_seconds: dict[str, float] = field(default_factory=dict)  # median per phase
    cpu_seconds: list[float] = field(default_factory=list)  # process CPU time per update (CPU runs)
    phase_samples: dict[str, list[float]] = field(default_factory=dict)  # phase -> seconds per update
    warmup: int = 0
    provenance: str = "wall-clock"
    probe_seconds: list[float] = field(default_factory=list)  # CPU: the host speed probe before each update

    @property
    def update_seconds_median(self) -> float:
        return statistics.median(self.samples)

    @property
    def update_seconds_iqr(self) -> float:
        if len(self.samples) < 2:
            return 0.0
        q = statistics.quantiles(self.samples, n=4, method="inclusive")
        return q[2] - q[0]

    @property
    def update_seconds_min(self) -> float:
        return min(self.samples)

    @property
    def update_seconds_max(self) -> float:
        return max(self.samples)

    @property
    def spread(self) -> float:
        """IQR / median: above NOISY_SPREAD the timing is noisy (a warning is printed)."""
        med = self.update_seconds_median
        return self.update_seconds_iqr / med if med > 0 else 0.0

    def noise_warning(self) -> str | None:
        """The warning for a noisy timing, or None."""
        if self.spread <= NOISY_SPREAD:
            return None
        return (f"update time is noisy: IQR/median = {self.spread:.1%} > {NOISY_SPREAD:.0%} over "
                f"{len(self.samples)} updates (other load on the machine? more --steps?)")


@dataclass(frozen=True)
class MeasuredComm:
    """DP > 1: the gradient all-reduce per optimizer update, seen by a DDP communication hook."""

    world_size: int
    backend: str  # gloo | nccl
    calls_per_update: int  # hook calls = DDP buckets all-reduced
    rounds_per_update: int  # backward passes that all-reduced: 1 with no_sync() on all but the last
    bytes_per_update: int  # bucket bytes all-reduced
    seconds: list[float]  # per timed update: wall time with an all-reduce in flight (approximate)
    compute_seconds: list[float]  # per timed update: update time minus all-reduce time
    predicted_seconds: float | None = None  # formula (ring all-reduce), for the config's device
    predicted_bytes: int | None = None  # formula: gradient bytes all-reduced per update
    predicted_bandwidth_bytes_per_s: float | None = None  # formula: the link it assumed
    predicted_provenance: str = "formula"
    gradient_as_bucket_view: bool = True
    provenance: str = "wall-clock (comm hook)"
    scope: str = ""

    @property
    def seconds_median(self) -> float:
        return statistics.median(self.seconds) if self.seconds else 0.0

    @property
    def compute_seconds_median(self) -> float:
        return statistics.median(self.compute_seconds) if self.compute_seconds else 0.0


@dataclass(frozen=True)
class MeasuredTraffic:
    """DP > 1: collective bytes on one rank's process group during one update (the same on every rank),
    per kind (all_gather, reduce_scatter, all_reduce, broadcast), beside the formula's."""

    engine: str  # ddp | zero1 | fsdp-grad-op | fsdp
    api: str  # the PyTorch engine as written
    accumulation: str  # what the engine does with gradients between micro-batches
    per_update: dict[str, int]
    calls_per_update: dict[str, int]
    per_micro_batch: list[dict[str, int]]  # issued during each micro-batch's forward + backward
    outside_micro_batches: dict[str, int]  # issued in the optimizer step (ZeroRedundancyOptimizer's broadcasts)
    bookkeeping_calls: int = 0  # one-element collectives: the global useful-token count, a sharded grad norm
    bookkeeping_bytes: int = 0
    parameter_shard_bytes: int = 0  # this rank's parameter shards (all parameters without FSDP)
    sync_every_micro_batch: bool = True  # FSDP2: reduce-scatter after every micro-batch (else the last only)
    predicted_per_update: dict[str, int] = field(default_factory=dict)  # formula
    predicted_per_micro_batch: list[dict[str, int]] = field(default_factory=list)  # formula
    provenance: str = "counted (c10d ops on the process group)"

    @property
    def matches_formula(self) -> bool:
        return (self.per_update == self.predicted_per_update
                and self.per_micro_batch == self.predicted_per_micro_batch)


@dataclass(frozen=True)
class Measurement:
    config: dict[str, Any]  # RunConfig.to_dict()
    outcome: Outcome
    global_batch: int
    outcome_detail: str = ""
    oom_phase: Phase | None = None
    memory: MeasuredMemory | None = None
    time: MeasuredTime | None = None
    tokens_per_second: float | None = None  # useful (non-padding) tokens, all ranks, per wall-clock second
    useful_tokens_per_update: int | None = None
    environment: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    comm: MeasuredComm | None = None  # DP > 1 only
    traffic: MeasuredTraffic | None = None  # DP > 1 only: every collective, counted
    timeline: Timeline | None = None  # MeasureOptions(timeline=True): memory over one untimed update
    counted: Counted = Counted.TOKENS  # what tokens_per_second counts: samples for a per-sample model
    ranks: list[RankFigures] = field(default_factory=list)  # world > 1: every rank's figures, rank order

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK


def compile_text(environment: dict[str, Any]) -> str | None:
    """The compile line of a compiled run (session's ``environment["compile"]``), None for an eager one."""
    c = environment.get("compile")
    if not c or "compile_seconds" not in c:
        return None
    breaks = c.get("graph_breaks", 0)
    reasons = c.get("graph_break_reasons") or []
    return (f"compile ({c['mode']}, {c['backend']}): {c['compile_seconds']:.1f} s over {c['compilations']} "
            f"compilation(s), first update {c['first_update_seconds']:.2f} s besides compiling (wall-clock, excluded "
            f"from the medians); recompilations during the timed updates: {c.get('recompilations_timed', 0)}; "
            f"graph breaks: {breaks}" + (f" (first: {'; '.join(reasons)})" if reasons else ""))


@dataclass
class Draft:
    """What a measurement has found so far, filled in while it runs (session, observe); ``build`` makes the
    frozen Measurement once, at the end."""
    config: dict[str, Any]
    global_batch: int
    environment: dict[str, Any] = field(default_factory=dict)
    outcome: Outcome = Outcome.OK
    outcome_detail: str = ""
    oom_phase: Phase | None = None
    memory: MeasuredMemory | None = None
    time: MeasuredTime | None = None
    tokens_per_second: float | None = None
    useful_tokens_per_update: int | None = None
    warnings: list[str] = field(default_factory=list)
    comm: MeasuredComm | None = None
    traffic: MeasuredTraffic | None = None
    timeline: Timeline | None = None
    counted: Counted = Counted.TOKENS

    def build(self) -> Measurement:
        return Measurement(self.config, self.outcome, self.global_batch, self.outcome_detail, self.oom_phase,
                           self.memory, self.time, self.tokens_per_second, self.useful_tokens_per_update,
                           dict(self.environment), list(self.warnings), self.comm, self.traffic, self.timeline,
                           self.counted)


# ------------------------------------------------------------------------------------------ JSON
# The one serialised form of a Measurement: the dataclass fields (raw samples included), plus the derived
# figures scripts read (time.update_seconds_median, ...) and a provenance label for every figure.  The
# derived keys are ignored when loading, so the dataclass stays the single source of truth.

FIGURE_PROVENANCE = {"global_batch": "config", "useful_tokens_per_update": "config",
                     "tokens_per_second": "wall-clock"}


def measurement_to_dict(m: Measurement) -> dict[str, Any]:
    from batchlab.config import to_jsonable

    out = to_jsonable(replace(m, timeline=None))
    out["timeline"] = m.timeline.to_dict() if m.timeline is not None else None
    if m.time is not None and m.time.samples:
        t = out["time"]
        t["update_seconds_median"] = m.time.update_seconds_median
        t["update_seconds_iqr"] = m.time.update_seconds_iqr
        t["update_seconds_min"] = m.time.update_seconds_min
        t["update_seconds_max"] = m.time.update_seconds_max
        t["spread"] = m.time.spread
        if m.time.cpu_seconds:
            t["cpu_seconds_median"] = statistics.median(m.time.cpu_seconds)
    provenance = dict(FIGURE_PROVENANCE)
    if m.memory is not None:
        provenance["memory"] = m.memory.provenance
    if m.time is not None:
        provenance["time"] = m.time.provenance
    out["provenance"] = provenance
    return out


def _only_fields(cls, d: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in d.items() if k in names}


def memory_from_dict(d: dict[str, Any]) -> MeasuredMemory:
    return MeasuredMemory(**(_only_fields(MeasuredMemory, d) | {"peak_phase": Phase(d["peak_phase"])}))


def measurement_from_dict(d: dict[str, Any]) -> Measurement:
    """Inverse of measurement_to_dict (derived keys such as update_seconds_median are recomputed)."""
    d = _only_fields(Measurement, d)
    d["outcome"] = Outcome(d["outcome"])
    d["counted"] = Counted(d.get("counted", Counted.TOKENS.value))
    if d.get("oom_phase") is not None:
        d["oom_phase"] = Phase(d["oom_phase"])
    if d.get("memory") is not None:
        d["memory"] = memory_from_dict(d["memory"])
    if d.get("time") is not None:
        d["time"] = MeasuredTime(**_only_fields(MeasuredTime, d["time"]))
    if d.get("comm") is not None:
        d["comm"] = MeasuredComm(**_only_fields(MeasuredComm, d["comm"]))
    if d.get("traffic") is not None:
        d["traffic"] = MeasuredTraffic(**_only_fields(MeasuredTraffic, d["traffic"]))
    d["ranks"] = [RankFigures(**_only_fields(RankFigures, r)) for r in d.get("ranks") or []]
    if d.get("timeline") is not None:
        d["timeline"] = Timeline.from_dict(d["timeline"])
    return Measurement(**d)


def measurement_to_json(m: Measurement, indent: int | None = 2) -> str:
    return json.dumps(measurement_to_dict(m), indent=indent)


def load_measurement(source: str | dict[str, Any]) -> Measurement:
    """A Measurement from its JSON text (or the parsed dict), as printed by ``batchlab measure --json``."""
    return measurement_from_dict(json.loads(source) if isinstance(source, str) else source)
