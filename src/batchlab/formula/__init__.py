"""The calculator: memory, FLOPs and time of one optimizer update from the config alone (no torch).

Every figure it returns has provenance "formula".
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from batchlab.config import RunConfig
from batchlab.formula.activations import implementation
from batchlab.formula.flops import FlopsEstimate, flops
from batchlab.formula.memory import (MemoryEstimate, allocator_margin, memory, model_states,
                                     optimizer_bytes_per_param)
from batchlab.formula.params import ParamCount, count
from batchlab.formula.timing import OPS_PER_LAYER, TimeEstimate, timing
from batchlab.units import fmt_bytes, fmt_count, fmt_seconds


@dataclass(frozen=True)
class Estimate:
    config: RunConfig
    params: ParamCount
    memory: MemoryEstimate
    flops: FlopsEstimate
    time: TimeEstimate
    training_checkpoint_bytes: int  # the file saved to disk for recovery (weights + optimizer state), all ranks
    assumptions: tuple[str, ...] = field(default_factory=tuple)
    provenance: str = "formula"

    @property
    def global_batch(self) -> int:
        return self.config.global_batch

    def to_dict(self) -> dict[str, Any]:
        from batchlab.config import to_jsonable

        mem = to_jsonable(self.memory)
        mem.update(fits=self.memory.fits, headroom_bytes=self.memory.headroom_bytes)
        return {"provenance": self.provenance, "config": self.config.to_dict(),
                "global_batch": self.global_batch, "tokens_per_update": self.config.tokens_per_update,
                "parameters": self.params.total, "memory": mem, "flops": to_jsonable(self.flops),
                "time": to_jsonable(self.time), "training_checkpoint_bytes": self.training_checkpoint_bytes,
                "assumptions": list(self.assumptions)}


def training_checkpoint_bytes(cfg: RunConfig) -> int:
    """Weights (fp32 master under mixed precision) + optimizer state, summed over ranks."""
    n = count(cfg.model).total
    weights = 2 if cfg.precision.value == "bf16" else 4
    return int(n * (weights + optimizer_bytes_per_param(cfg)))


def assumptions_text(cfg: RunConfig, t: TimeEstimate) -> tuple[str, ...]:
    a = cfg.assumptions
    dev = cfg.device_spec
    return (
        f"device {dev.name}: {fmt_bytes(dev.memory_bytes)}, peak {fmt_count(dev.peak_flops(cfg.precision), 'FLOP/s')} "
        f"({cfg.precision}), source: {dev.source}"
        + (f"; memory budget {fmt_bytes(cfg.memory_budget)} replaces the device's" if cfg.memory_budget else ""),
        f"compute rate {fmt_count(t.flops_ceiling, 'FLOP/s')} = peak ({t.ceiling_source}) x achievable fraction "
        f"{a.achievable_fraction:g}",
        f"per-op overhead {fmt_seconds(t.overhead_seconds_per_micro_batch)} per micro-batch (~{OPS_PER_LAYER} "
        f"ops per layer; op_overhead_seconds to change)",
        (f"all-reduce: ring over {fmt_count(t.bandwidth_bytes_per_s, 'B/s')}, {a.comm_overlap:.0%} hidden behind backward"
         if cfg.zero < 2 else
         f"collectives of FSDP2 (ZeRO-{cfg.zero}): all-gathers and reduce-scatters of every micro-batch, ring over "
         f"{fmt_count(t.bandwidth_bytes_per_s, 'B/s')}, {a.comm_overlap:.0%} hidden behind compute"),
        (f"allocator margin {a.allocator_margin:.0%} on top of tensor bytes" if allocator_margin(cfg)
         else "no allocator margin on CPU (tensor bytes, as the live-tensor tracker counts them)"),
        f"activations counted from the tensors the {implementation(cfg.model_source, cfg.model).value} layer code keeps "
        "(other code: use --trace)",
    ) + ((f"model {cfg.model_source} comes from a factory the calculator cannot see: these figures are for the "
          f"stand-in shape {cfg.model.name} ({cfg.model.layers} layers, hidden {cfg.model.hidden}); use --trace",)
         if cfg.model_source != "builtin" and not cfg.model_source.startswith("hf:") else ())


def unseen_model(cfg: RunConfig) -> str | None:
    """Why the formula cannot describe cfg's model (a user factory it cannot see into), else None."""
    if cfg.model_source == "builtin" or cfg.model_source.startswith("hf:"):
        return None
    return f"the calculator cannot see inside the factory model {cfg.model_source}"


def estimate(cfg: RunConfig) -> Estimate:
    mem = memory(cfg)
    fl = flops(cfg)
    t = timing(cfg, fl, mem, ceiling=_calibrated_ceiling(cfg))
    return Estimate(cfg, count(cfg.model), mem, fl, t, training_checkpoint_bytes(cfg), assumptions_text(cfg, t))


def _calibrated_ceiling(cfg: RunConfig):
    """Measured FLOP/s and bandwidth for this device, when `batchlab calibrate` has cached them."""
    cal = _load_calibration(cfg.device)
    if cal is None:
        return None
    return cal.matmul_flops(cfg.precision), cal.memory_bytes_per_s, cal.source


@functools.lru_cache(maxsize=None)
def _load_calibration(device: str):
    from batchlab.calibrate import load_cached  # torch-free: reads the cached JSON

    return load_cached(device)


__all__ = ["Estimate", "estimate", "memory", "flops", "timing", "count", "model_states", "MemoryEstimate",
           "FlopsEstimate", "TimeEstimate"]
