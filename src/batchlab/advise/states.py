"""When the model states alone (weights + gradients + optimizer state) do not fit one rank's memory.

No micro-batch, checkpointing policy or sequence length can help then: activations are not the problem.
What does: sharding the states over more devices (ZeRO-1/2/3, FSDP; the fewest devices for which fit's
plan finds a configuration, by formula), a smaller optimizer state (``--optimizer-bytes``: 8-bit Adam keeps 2 bytes per parameter),
or CPU offload (named only: host memory and transfer time are outside what batchlab predicts or measures).
Torch-free.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from batchlab.advise.plan import Candidate, Goal, candidate, divisors, recommended
from batchlab.cache.calibrations import load_all
from batchlab.config import ConfigError, RunConfig
from batchlab.formula import Calibrations
from batchlab.formula.memory import model_states

EIGHT_BIT_ADAM = 2.0  # bytes per parameter: m and v at 1 byte each (bitsandbytes AdamW8bit, Dettmers et al. 2022)
OFFLOAD = ("CPU offload (DeepSpeed ZeRO-Offload offload_optimizer / offload_param, FSDP2 "
           "fully_shard(..., offload_policy=CPUOffloadPolicy())) keeps optimizer state and master weights in host "
           "memory: outside what batchlab predicts or measures (host memory, PCIe transfer time per update)")


@dataclass(frozen=True)
class ShardOption:
    """ZeRO stage ``zero`` over ``devices`` ranks: the fewest for which fit's plan finds a configuration."""

    zero: int
    devices: int
    states_bytes: int  # per rank
    figures: Candidate  # fit's recommendation there (same global batch)


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


def fewest_devices(goal: Goal, zero: int, start: int) -> Candidate | None:
    """fit's recommendation over the fewest ranks (at least ``start``, multiples of the DP given, dividing the
    global batch so that it stays) at ZeRO stage ``zero``; the goal's held knobs stay held."""
    base, gb = goal.base, goal.global_batch
    for dp in (d for d in divisors(gb) if d >= start and d % base.dp == 0):
        cfg = base.replace(dp=dp, zero=zero, micro_batch=1, accum=gb // dp)
        try:
            rec = recommended(goal.released(cfg, "zero", "micro_batch"))
        except ConfigError:  # the parameters alone still do not fit
            continue
        if rec is not None:
            return rec
    return None


def _sharding(goal: Goal) -> tuple[ShardOption, ...]:
    out = []
    for z in range(max(goal.base.zero, 1), 4):
        c = fewest_devices(goal, z, goal.base.dp if z > goal.base.zero else goal.base.dp + 1)
        if c is not None:
            out.append(ShardOption(z, c.config.dp, states_bytes(c.config), c))
    return tuple(out)


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
    opts = []
    for b, name in ((EIGHT_BIT_ADAM, "8-bit Adam (bitsandbytes AdamW8bit): --optimizer-bytes 2"),
                    (0.0, "no optimizer state (plain SGD): --optimizer sgd")):
        c = candidate(base.replace(optimizer_bytes_per_param=b), goal.tokens, cals)
        opts.append(OptimizerOption(b, name, c, c.peak_bytes <= goal.usable_bytes))
    return StatesVerdict(total, s.parameters, s.master, s.gradients, s.optimizer, goal.capacity_bytes,
                         goal.usable_bytes, _sharding(goal), tuple(opts), _max_optimizer_bytes(goal, cals))

