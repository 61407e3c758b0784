"""Time of one optimizer update: compute, the stage's collectives (formula.sharding), the optimizer step."""
from __future__ import annotations

from dataclasses import dataclass, field

from batchlab.config import Backend, DataKind, RunConfig
from batchlab.formula.efficiency import achievable_fraction, bus_bandwidth, exposed_comm_seconds
from batchlab.formula.flops import FlopsEstimate
from batchlab.formula.memory import MemoryEstimate
from batchlab.formula.sharding import collective_seconds, traffic


# Eager PyTorch pays a fixed cost per op (Python dispatch; on GPUs the kernel launch), whatever the batch:
# this is why a larger micro-batch can be faster at the same global batch.  Op counts per forward+backward
# were counted on batchlab's GPT with a TorchDispatchMode (125-195 per layer, 55-80 outside the layers,
# 65-110 more per recomputed layer); the per-op costs are typical figures (CPU: ~4 us measured here;
# CUDA: ~5-10 us launch-bound), override with op_overhead_seconds.
OPS_PER_LAYER, OPS_OUTSIDE, OPS_PER_RECOMPUTED_LAYER = 160, 60, 90
OP_OVERHEAD = {Backend.CPU: 4e-6, Backend.CUDA: 6e-6, Backend.MPS: 10e-6}


def overhead_seconds_per_micro_batch(cfg: RunConfig) -> float:
    ops = OPS_OUTSIDE + cfg.model.layers * OPS_PER_LAYER + OPS_PER_RECOMPUTED_LAYER * (
        len(cfg.ac.wrapped_layers(cfg.model.layers)) + len(cfg.ac.selective_layers(cfg.model.layers)))
    per_op = cfg.assumptions.op_overhead_seconds
    return ops * (OP_OVERHEAD[cfg.device_spec.backend] if per_op is None else per_op)


@dataclass(frozen=True)
class TimeEstimate:
    compute_seconds_per_micro_batch: float  # FLOPs at the achievable rate + per-op overhead
    compute_seconds: float  # accum micro-batches
    allreduce_bytes: int  # gradient bytes reduced per update (all-reduce + reduce-scatter)
    allreduce_seconds: float  # ring time of every collective of the update, before overlap
    exposed_comm_seconds: float  # the part not hidden behind backward
    optimizer_seconds: float
    update_seconds: float
    tokens_per_second: float  # useful tokens, all ranks
    overhead_seconds_per_micro_batch: float  # the per-op part of compute_seconds_per_micro_batch
    flops_ceiling: float  # FLOP/s used: peak x achievable fraction
    ceiling_source: str  # datasheet / calibrated / nominal
    bandwidth_bytes_per_s: float  # link used for the all-reduce
    collective_bytes: dict[str, int] = field(default_factory=dict)  # per update, by kind (formula.sharding)
    achievable_fraction: float = 0.0  # of the ceiling's peak, reached by real kernels
    fraction_source: str = ""  # where the achievable fraction comes from (formula/efficiency.py)
    overlap_source: str = ""  # how the engine hides communication
    provenance: str = "formula"

    def time_to_tokens(self, tokens: float) -> float:
        return tokens / self.tokens_per_second


def ring_allreduce_seconds(nbytes: float, n: int, bus_bytes_per_s: float) -> float:
    # nccl-tests PERFORMANCE.md: ring all-reduce moves 2(n-1)/n of the buffer over the slowest link.
    return collective_seconds("all_reduce", nbytes, n, bus_bytes_per_s)


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
    fraction = achievable_fraction(cfg)
    rate = peak * fraction.value
    overhead = overhead_seconds_per_micro_batch(cfg)
    micro = fl.flops_per_micro_batch / rate + overhead
    compute = micro * cfg.accum
    bw = bus_bandwidth(cfg).value
    # what the stage's engine sends per update: DDP's all-reduce (+ ZeRO-1's broadcasts), FSDP2's all-gathers
    # and reduce-scatters of every micro-batch (formula.sharding); the engine's overlap hides part of it
    sent = traffic(cfg).per_update
    grad_bytes = sent["all_reduce"] + sent["reduce_scatter"]
    comm = sum(collective_seconds(kind, nbytes, cfg.dp, bw) for kind, nbytes in sent.items())
    after_step = collective_seconds("broadcast", sent["broadcast"], cfg.dp, bw)
    hidden = exposed_comm_seconds(cfg, comm, compute, micro, after_step)
    exposed = hidden.value
    # AdamW is bandwidth-bound: read weights, grads, m, v and write weights, m, v (~2x the states)
    opt = 2 * (mem.master_bytes or mem.parameters_bytes) + mem.gradients_bytes + 2 * mem.optimizer_bytes
    opt_s = opt / hbm
    update = compute + exposed + opt_s
    useful = cfg.tokens_per_update * useful_fraction(cfg)
    return TimeEstimate(micro, compute, grad_bytes, comm, exposed, opt_s, update, useful / update, overhead, rate,
                        source, bw, collective_bytes=sent, achievable_fraction=fraction.value,
                        fraction_source=fraction.source, overlap_source=hidden.source)
