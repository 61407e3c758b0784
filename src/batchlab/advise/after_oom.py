"""After an out-of-memory: the ordered list of changes, each with formula figures for this config and what it
keeps and changes for the training run.  Also, when nothing fits at all, what would (ZeRO, devices, seq)."""
from __future__ import annotations

from dataclasses import dataclass

from batchlab.advise.plan import KNOB_FLAGS, Candidate, Goal, candidate, derived, divisors, policies, recommended
from batchlab.advise.states import fewest_devices
from batchlab.config import Applied, ConfigError, Precision, RunConfig

SAME_MATH = "global batch, micro-batch, gradients (recompute is bitwise-equal with the RNG state preserved)"


@dataclass(frozen=True)
class Advice:
    change: str  # what to do, in words
    config: RunConfig | None  # the changed config (None: not applicable here)
    figures: Candidate | None  # formula figures for it
    fits: bool  # predicted peak within the safety margin
    compute_change: float | None  # relative change in hardware FLOPs per update (recompute)
    time_change: float | None  # relative change in predicted update time
    stays: str
    changes: str
    provenance: str = "formula"


def _advice(goal: Goal, now: Candidate, change: str, cfg: RunConfig | None, stays: str, changes: str) -> Advice:
    if cfg is None:
        return Advice(change, None, None, False, None, None, stays, changes)
    c = candidate(cfg, goal.tokens)
    return Advice(change, cfg, c, c.peak_bytes <= goal.usable_bytes,
                  c.hardware_flops_per_update / now.hardware_flops_per_update - 1,
                  c.update_seconds / now.update_seconds - 1, stays, changes)


def _smaller_micro(goal: Goal, now: Candidate) -> list[Advice]:
    cfg = now.config
    per_rank = cfg.global_batch // cfg.dp
    lower = [d for d in divisors(per_rank) if d < cfg.micro_batch]
    if not lower:
        return [_advice(goal, now, "halve the micro-batch", None, "",
                        "not possible: the micro-batch is already 1")]
    half = max(d for d in lower if d <= cfg.micro_batch // 2)
    out = [_micro_advice(goal, now, half, "halve the micro-batch, double accumulation")]
    fitting = [d for d in lower if candidate(cfg.with_global_batch(cfg.global_batch, d), goal.tokens).peak_bytes
               <= goal.usable_bytes]
    if fitting and max(fitting) < half:
        out.append(_micro_advice(goal, now, max(fitting), "largest micro-batch that fits, accumulation to match"))
    return out


def _micro_advice(goal: Goal, now: Candidate, mb: int, title: str) -> Advice:
    cfg = now.config.with_global_batch(now.config.global_batch, mb)
    return _advice(goal, now, f"{title}: micro-batch {now.config.micro_batch} -> {mb}, accum {now.config.accum} -> "
                              f"{cfg.accum}", cfg,
                   f"global batch {cfg.global_batch} sequences, tokens per update, learning-rate schedule, results",
                   f"{cfg.accum} micro-steps per update instead of {now.config.accum}: smaller kernels, usually "
                   "slower per token on GPUs (not in the formula's time)")


def _checkpointing(goal: Goal, now: Candidate) -> list[Advice]:
    cfg = now.config
    order = [p for p in policies(cfg.model.layers) if p.recomputes]
    out = []
    for p in order:
        if str(p) == str(cfg.ac) or _less_or_equal_recompute(p, cfg):
            continue
        out.append(_advice(goal, now, f"activation checkpointing {cfg.ac} -> {p}", cfg.replace(ac=p), SAME_MATH,
                           "more compute per update (recomputed forward during backward)"))
    return out


def _less_or_equal_recompute(p, cfg: RunConfig) -> bool:
    single = cfg.ac.simplified().single
    if single is not None and single.applied is Applied.WHOLE_BLOCK:  # a plan of full layers only is full
        return True
    if p.every_k and cfg.ac.every_k:
        return p.every >= cfg.ac.every  # every:K with a larger K wraps fewer layers
    return False


def _precision(goal: Goal, now: Candidate) -> list[Advice]:
    cfg = now.config
    if cfg.precision is not Precision.FP32:
        return []
    return [_advice(goal, now, "bf16 mixed precision instead of fp32", cfg.replace(precision="bf16-mixed"),
                    "global batch, fp32 master weights and optimizer state",
                    "numerics: matmuls and activations in bf16 (8-bit mantissa); check the loss curve")]


def _sharding(goal: Goal, now: Candidate) -> list[Advice]:
    cfg = now.config
    if cfg.dp == 1:
        return [_advice(goal, now, "ZeRO-1/2/3 or FSDP sharding", None, "",
                        "not applicable with DP = 1: sharding splits model states across data-parallel ranks")]
    names = {1: "ZeRO-1 (optimizer state sharded)", 2: "ZeRO-2 (+ gradients; FSDP SHARD_GRAD_OP)",
             3: "ZeRO-3 (+ parameters; FSDP FULL_SHARD)"}
    return [_advice(goal, now, names[z], cfg.replace(zero=z),
                    "global batch, the math of the update",
                    "more communication per update" if z == 3 else "a reduce-scatter instead of an all-reduce")
            for z in range(cfg.zero + 1, 4)]


def _shorter_sequence(goal: Goal, now: Candidate) -> list[Advice]:
    cfg = now.config
    if cfg.seq < 2:
        return []
    try:
        shorter = cfg.replace(seq=cfg.seq // 2)
    except ConfigError:
        return []
    return [_advice(goal, now, f"shorter sequences: {cfg.seq} -> {shorter.seq} tokens", shorter,
                    f"global batch {cfg.global_batch} sequences, micro-batch, accumulation",
                    f"the context trained on halves; tokens per update halve ({cfg.tokens_per_update:,} -> "
                    f"{shorter.tokens_per_update:,}) unless the global batch doubles")]


def oom_advice(goal: Goal) -> list[Advice]:
    """The ordered changes for ``goal.base`` (the config that ran out of memory)."""
    now = candidate(goal.base, goal.tokens)
    return (_smaller_micro(goal, now) + _checkpointing(goal, now) + _precision(goal, now)
            + _sharding(goal, now) + _shorter_sequence(goal, now))


def advised_configs(goal: Goal) -> list[RunConfig]:
    """A config of each change ``oom_advice`` can propose that reads other layer terms than goal.base (the AC
    policies, bf16 autocast instead of fp32, the ZeRO stages above, the halved sequence; a smaller micro-batch
    reads the same), for the CLI to have an hf: model's layer profile cover them first."""
    cfg = goal.base
    changes = [dict(ac=p) for p in policies(cfg.model.layers)]
    changes += [dict(precision=Precision.BF16_MIXED)] if cfg.precision is Precision.FP32 else []
    changes += [dict(zero=z) for z in range(cfg.zero + 1, 4)] if cfg.dp > 1 else []
    changes += [dict(seq=cfg.seq // 2)] if cfg.seq >= 2 else []
    return derived(cfg, changes)


@dataclass(frozen=True)
class Remedy:
    """When no policy fits: a change to the goal under which the planner finds a recommendation."""

    change: str
    config: RunConfig
    figures: Candidate
    changes: str


def _planned(goal: Goal) -> Candidate | None:
    try:
        return recommended(goal)
    except ConfigError:  # e.g. still cannot hold the parameters
        return None


def _unheld_remedy(goal: Goal) -> Remedy | None:
    """What the planner finds once the knobs the user held (--ac, --micro-batch) are searched too."""
    held = sorted(goal.held & {"ac", "micro_batch"})
    if not held:
        return None
    c = _planned(goal.released(goal.base, *held, allow_zero=goal.allow_zero))
    if c is None:
        return None
    given = ", ".join(f"{KNOB_FLAGS[k]} {getattr(goal.base, k)}" for k in held)
    return Remedy(f"without holding {given}", c.config, c, "fit searches what you fixed")


def _zero_remedy(goal: Goal) -> Remedy | None:
    if goal.base.dp == 1:
        return None
    for z in range(goal.base.zero + 1, 4):
        c = _planned(goal.released(goal.base.replace(zero=z), "zero"))
        if c is not None:
            return Remedy(f"ZeRO-{z} across the {goal.base.dp} DP ranks", c.config, c,
                          "model states sharded; more communication" if z == 3 else "model states sharded")
    return None


def _devices_remedy(goal: Goal) -> Remedy | None:
    base, gb = goal.base, goal.global_batch
    found = [c for z in sorted({base.zero, 1, 2, 3}) if (c := fewest_devices(goal, z, base.dp + 1)) is not None]
    if not found:
        return None
    c = min(found, key=lambda c: (c.config.dp, c.config.zero))
    dp, z = c.config.dp, c.config.zero
    return Remedy(f"{dp} devices instead of {base.dp}" + (f", ZeRO-{z}" if z else ""), c.config, c,
                  f"same global batch {gb}: {gb // dp} sequences per rank per update")


def _sequence_remedy(goal: Goal) -> Remedy | None:
    seq = goal.base.seq // 2
    while seq >= 1:
        c = _planned(goal.released(goal.base.replace(seq=seq), allow_zero=goal.allow_zero))
        if c is not None:
            return Remedy(f"sequences of {seq} tokens instead of {goal.base.seq}", c.config, c,
                          "shorter context; fewer tokens per update unless the global batch grows")
        seq //= 2
    return None


def what_would_fit(goal: Goal) -> list[Remedy]:
    found = (_unheld_remedy(goal), _zero_remedy(goal), _devices_remedy(goal), _sequence_remedy(goal))
    return [r for r in found if r is not None]
