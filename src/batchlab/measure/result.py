"""What a measurement returns.  Torch-free, so experiments and the notebook can load results anywhere.

Field names match the calculator's Estimate where the figure is the same (peak_bytes, activations_bytes,
peak_phase, tokens_per_second), so reports line them up without a mapping table.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from batchlab.config import _Choice


class Outcome(_Choice):
    OK = "ok"
    OOM = "oom"  # the device allocator (or the CPU allocator) refused
    OOM_BUDGET = "oom (budget)"  # tracked tensor bytes exceeded --memory-budget
    FAILED = "failed"  # anything else: exception, kill, timeout; see outcome_detail


@dataclass
class MeasuredMemory:
    peak_bytes: int
    activations_bytes: int  # created by the last forward, still held when its backward starts
    peak_phase: str  # data | forward | backward | optimizer
    breakdown: dict[str, int] = field(default_factory=dict)  # category -> bytes at the peak
    reserved_bytes: int | None = None  # CUDA caching allocator's reserved peak
    alloc_retries: int | None = None
    provenance: str = "allocator"  # CUDA allocator stats, or the live tensor-storage tracker on CPU
    method: str = ""  # "cuda max_memory_allocated" | "live storage tracker"


@dataclass
class MeasuredTime:
    samples: list[float]  # seconds per measured update (warmup excluded)
    phase_seconds: dict[str, float] = field(default_factory=dict)  # median per phase
    cpu_seconds: list[float] = field(default_factory=list)  # process CPU time per update (CPU runs)
    warmup: int = 0
    provenance: str = "wall-clock"

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
    def spread(self) -> float:
        """IQR / median: above 0.10 the timing is noisy (a warning is printed)."""
        med = self.update_seconds_median
        return self.update_seconds_iqr / med if med > 0 else 0.0


@dataclass
class Measurement:
    config: dict[str, Any]  # RunConfig.to_dict()
    outcome: Outcome
    global_batch: int
    outcome_detail: str = ""
    oom_phase: str | None = None
    memory: MeasuredMemory | None = None
    time: MeasuredTime | None = None
    tokens_per_second: float | None = None  # useful (non-padding) tokens, all ranks, per wall-clock second
    useful_tokens_per_update: int | None = None
    environment: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK
