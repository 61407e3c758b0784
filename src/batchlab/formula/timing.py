"""Time of one optimizer update: compute, the gradient all-reduce once per update, the optimizer step."""
from __future__ import annotations

from dataclasses import dataclass

from batchlab.config import DataKind, RunConfig
from batchlab.formula.flops import FlopsEstimate
from batchlab.formula.memory import MemoryEstimate


@dataclass(frozen=True)
class TimeEstimate:
    compute_seconds_per_micro_batch: float
    compute_seconds: float  # accum micro-batches
    allreduce_bytes: int  # gradient bytes reduced per update
    allreduce_seconds: float  # ring time, before overlap
    exposed_comm_seconds: float  # the part not hidden behind backward
    optimizer_seconds: float
    update_seconds: float
    tokens_per_second: float  # useful tokens, all ranks
    flops_ceiling: float  # FLOP/s used: peak x achievable fraction
    ceiling_source: str  # datasheet / calibrated / nominal
    bandwidth_bytes_per_s: float  # link used for the all-reduce
    provenance: str = "formula"

    def time_to_tokens(self, tokens: float) -> float:
        return tokens / self.tokens_per_second


def ring_allreduce_seconds(nbytes: float, n: int, bus_bytes_per_s: float) -> float:
    # nccl-tests PERFORMANCE.md: ring all-reduce moves 2(n-1)/n of the buffer over the slowest link.
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bus_bytes_per_s


def useful_fraction(cfg: RunConfig) -> float:
    """Expected non-padding share: padded lengths are uniform in [s/2, s] (models.synthetic_tokens)."""
    if cfg.data is DataKind.FIXED:
        return 1.0
    s = cfg.seq
    return (s // 2 + s) / 2 / s


def timing(cfg: RunConfig, fl: FlopsEstimate, mem: MemoryEstimate, ceiling: tuple[float, float, str] | None = None
           ) -> TimeEstimate:
    """``ceiling``: (FLOP/s, bytes/s, source) measured by ``batchlab calibrate``; else the device datasheet.
    Either way real training reaches only ``achievable_fraction`` of the matmul ceiling."""
    dev = cfg.device_spec
    if ceiling is None:
        peak, hbm, source = dev.peak_flops(cfg.precision), dev.hbm_bytes_per_s, dev.source
    else:
        peak, hbm, source = ceiling
    rate = peak * cfg.assumptions.achievable_fraction
    micro = fl.flops_per_micro_batch / rate
    compute = micro * cfg.accum
    bw = dev.intra_node_bytes_per_s if cfg.dp <= dev.gpus_per_node else dev.inter_node_bytes_per_s
    grad_bytes = mem.gradients_bytes * (cfg.dp if cfg.zero >= 2 else 1)  # full gradient, before sharding
    comm = ring_allreduce_seconds(grad_bytes, cfg.dp, bw)
    if cfg.zero >= 3:  # parameters gathered in forward and again in backward: two more all-gathers
        comm += 2 * (cfg.dp - 1) / cfg.dp * (mem.master_bytes or mem.parameters_bytes) * cfg.dp / bw
    exposed = comm * (1 - cfg.assumptions.comm_overlap)
    # AdamW is bandwidth-bound: read weights, grads, m, v and write weights, m, v (~2x the states)
    opt = 2 * (mem.master_bytes or mem.parameters_bytes) + mem.gradients_bytes + 2 * mem.optimizer_bytes
    opt_s = opt / hbm
    update = compute + exposed + opt_s
    useful = cfg.tokens_per_update * useful_fraction(cfg)
    return TimeEstimate(micro, compute, grad_bytes, comm, exposed, opt_s, update, useful / update, rate, source, bw)
