"""When the model states alone (weights + gradients + optimizer state) do not fit one rank's memory.

No micro-batch, checkpointing policy or sequence length can help then: activations are not the problem.
What does: sharding the states over more devices (ZeRO-1/2/3, FSDP; the smallest device count that fits,
by formula), a smaller optimizer state (``--optimizer-bytes``: 8-bit Adam keeps 2 bytes per parameter),
or CPU offload (named only: host memory and transfer time are outside what batchlab predicts or measures).
Torch-free.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from batchlab.advise.plan import Candidate, Goal, candidate
from batchlab.calibrate import load_all
from batchlab.config import RunConfig
from batchlab.formula import Calibrations
from batchlab.formula.memory import model_states

MAX_DEVICES = 1 << 16  # the sharding search stops here
EIGHT_BIT_ADAM = 2.0  # bytes per parameter: m and v at 1 byte each (bitsandbytes AdamW8bit, Dettmers et al. 2022)
OFFLOAD = ("CPU offload (DeepSpeed ZeRO-Offload offload_optimizer / offload_param, FSDP2 "
           "fully_shard(..., offload_policy=CPUOffloadPolicy())) keeps optimizer state and master weights in host "
           "memory: outside what batchlab predicts or measures (host memory, PCIe transfer time per update)")


@dataclass(frozen=True)
class ShardOption:
    """ZeRO stage ``zero`` over ``devices`` ranks: the smallest count whose predicted peak fits."""

    zero: int
    devices: int
    states_bytes: int  # per rank
    figures: Candidate  # the per-rank shape kept: micro-batch and accumulation as given


@dataclass(frozen=True)
class OptimizerOption:
    bytes_per_param: float
    name: str
    figures: Candidate
    fits: bool


@dataclass(frozen=True)
class StatesVerdict:
    """The model states per rank against the usable memory, and what would make them fit [formula]."""

    states_bytes: int
    parameters_bytes: int
    master_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    capacity_bytes: int
    usable_bytes: int
    sharding: tuple[ShardOption, ...]
    optimizer: tuple[OptimizerOption, ...]
    max_optimizer_bytes_per_param: float | None  # the largest optimizer state that fits (None: not even none)
    offload: str = OFFLOAD
    provenance: str = "formula"


def states_bytes(cfg: RunConfig) -> int:
    s = model_states(cfg)
    return s.parameters + s.master + s.gradients + s.optimizer


def _fits(cfg: RunConfig, goal: Goal, cals: Calibrations) -> Candidate | None:
    c = candidate(cfg, goal.tokens, cals)
    return c if c.peak_bytes <= goal.usable_bytes else None


def _smallest_devices(goal: Goal, zero: int, cals: Calibrations) -> ShardOption | None:
    """Bisection over the device count (the per-rank peak falls as states shard; activations stay)."""
    base = goal.base
    lo = base.dp if zero > base.zero else base.dp + 1  # lo may fit: then it is the answer
    lo = max(lo, 2)
    hi = lo
    while _fits(base.replace(dp=hi, zero=zero), goal, cals) is None:
        if hi >= MAX_DEVICES:
            return None
        lo, hi = hi + 1, hi * 2
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits(base.replace(dp=mid, zero=zero), goal, cals) is None:
            lo = mid + 1
        else:
            hi = mid
    cfg = _keep_global_batch(base.replace(dp=hi, zero=zero), goal.global_batch)
    return ShardOption(zero, hi, states_bytes(cfg), candidate(cfg, goal.tokens, cals))


def _keep_global_batch(cfg: RunConfig, global_batch: int) -> RunConfig:
    """The same global batch over more ranks when they divide it (micro-batch at most the one given: the
    activations then do not grow, so it still fits); else the per-rank shape as given."""
    if global_batch % cfg.dp:
        return cfg
    per_rank = global_batch // cfg.dp
    micro = max(d for d in range(1, min(cfg.micro_batch, per_rank) + 1) if per_rank % d == 0)
    return cfg.replace(micro_batch=micro, accum=per_rank // micro)


def _max_optimizer_bytes(goal: Goal, cals: Calibrations) -> float | None:
    """The peak grows linearly with the optimizer's bytes per parameter (the state is live in every phase)."""
    at = lambda b: candidate(goal.base.replace(optimizer_bytes_per_param=b), goal.tokens, cals).peak_bytes  # noqa: E731
    p0, p1 = at(0.0), at(1.0)
    if p0 > goal.usable_bytes:
        return None
    b = math.floor((goal.usable_bytes - p0) / max(p1 - p0, 1) * 10) / 10
    while b > 0 and at(b) > goal.usable_bytes:  # rounding, or a phase where it is not linear
        b = round(b - 0.1, 1)
    return b


def states_verdict(goal: Goal, cals: Calibrations | None = None) -> StatesVerdict | None:
    """None when the model states fit ``goal.usable_bytes``; else the figure and what helps."""
    base = goal.base
    s = model_states(base)
    total = s.parameters + s.master + s.gradients + s.optimizer
    if total <= goal.usable_bytes:
        return None
    cals = load_all() if cals is None else cals
    shards = tuple(o for z in range(max(base.zero, 1), 4) if (o := _smallest_devices(goal, z, cals)) is not None)
    opts = []
    for b, name in ((EIGHT_BIT_ADAM, "8-bit Adam (bitsandbytes AdamW8bit): --optimizer-bytes 2"),
                    (0.0, "no optimizer state (plain SGD): --optimizer sgd")):
        c = candidate(base.replace(optimizer_bytes_per_param=b), goal.tokens, cals)
        opts.append(OptimizerOption(b, name, c, c.peak_bytes <= goal.usable_bytes))
    return StatesVerdict(total, s.parameters, s.master, s.gradients, s.optimizer, goal.capacity_bytes,
                         goal.usable_bytes, shards, tuple(opts), _max_optimizer_bytes(goal, cals))

