"""One candidate configuration of a plan and its figures: the formula's, or a factory's traced update."""
from __future__ import annotations

from dataclasses import dataclass

from batchlab.cache.calibrations import load_all
from batchlab.config import Counted, ModelSource, RunConfig
from batchlab.formula import Calibrations, estimate


@dataclass(frozen=True)
class Candidate:
    """One configuration and its formula figures (provenance ``formula``)."""

    config: RunConfig
    peak_bytes: int
    peak_phase: str
    update_seconds: float
    tokens_per_second: float
    time_to_tokens_seconds: float
    hardware_flops_per_update: float
    provenance: str = "formula"  # or "trace": a factory's own code on fake tensors
    counted: Counted = Counted.TOKENS  # what tokens_per_second counts (samples for a per-sample factory)

    @property
    def key(self) -> tuple[str, int, int, int, int]:
        return option_key(self.config)


def option_key(cfg: RunConfig) -> tuple[str, int, int, int, int]:
    """What a plan's row stands for: the policy, the ZeRO stage and the layout (the micro-batch aside)."""
    return str(cfg.ac), cfg.zero, cfg.dp, cfg.tp, cfg.pp


def candidate(cfg: RunConfig, tokens: float, calibrations: Calibrations | None = None) -> Candidate:
    """``calibrations``: the cached ceilings (``calibrate.load_all()``), read here when not given.  A factory
    model is traced (the formula cannot see inside its code); every other model gets the formula."""
    cals = load_all() if calibrations is None else calibrations
    if cfg.model_kind is ModelSource.FACTORY:
        return traced_candidate(cfg, tokens, cals)
    est = estimate(cfg, cals)
    return Candidate(cfg, est.memory.peak_bytes, est.memory.peak_phase, est.time.update_seconds,
                     est.time.tokens_per_second, est.time.time_to_tokens(tokens),
                     est.flops.hardware_flops_per_update)


def traced_candidate(cfg: RunConfig, tokens: float, calibrations: Calibrations) -> Candidate:
    """One steady-state update of the factory's code on fake tensors: its peak, and the per-op time model over
    the ops it ran (one rank, no communication).  ``tokens``: the budget, in what the model counts."""
    from batchlab.trace import estimate as trace  # torch and the user's module: a factory needs both anyway

    t = trace(cfg, calibrations=calibrations)
    per_second = t.tokens_per_update / t.time.seconds
    return Candidate(cfg, t.memory.peak_bytes, t.memory.peak_phase, t.time.seconds, per_second, tokens / per_second,
                     t.flops.hardware_flops_per_update, provenance="trace", counted=t.counted)
