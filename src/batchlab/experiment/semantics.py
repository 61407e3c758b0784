"""Which training semantics a change touches, and a gradient-equivalence check the harness runs for real.

The check builds both sides at a small size (same model spec, short sequences, CPU, fp32) with
batchlab.measure.harness.Trainer and compares the gradients of one update on the same sequences:
- micro-batch / accumulation / DP split of one global batch: the accumulated gradient must equal the whole
  batch's (the harness divides every micro-batch's summed loss by the update's useful-token count).
  Dropout is off for this check: masks are drawn per micro-batch, so another split draws other masks.
- activation checkpointing: bitwise-equal gradients, dropout on (torch.utils.checkpoint with
  preserve_rng_state=True replays the forward's RNG in the recompute).
- ZeRO stage at DP > 1: both sides' engines (DDP + ZeroRedundancyOptimizer, FSDP2) end with DDP's parameters
  after two updates, on 2 gloo ranks (batchlab.distributed.equivalence.same_parameters_as_ddp).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from batchlab.config import Precision, RunConfig, Choice

SPLIT_TOLERANCE = 1e-5  # fp32 relative gradient difference from summation order alone (DDP vs one process measured at 7e-9 on CPU/gloo, tests/distributed/test_ddp_on_gloo.py checks <= 1e-5)
CHECK_SEQ = 32
MAX_CHECK_PARAMS = 30_000_000  # above this the in-process check would take longer than the experiment


class CheckKind(Choice):
    """Which gradient equivalence a change should keep."""
    SPLIT = "split"  # micro-batch x accum x DP regrouped, same global batch: the same gradient
    AC = "activation checkpointing"  # recompute in backward: the same gradient
    ZERO = "zero stage"  # sharding states over DP ranks: the same parameters as DDP's
    NONE = "none"  # the change alters what is computed


@dataclass(frozen=True)
class Item:
    name: str
    touched: bool
    why: str
    verified: str = ""  # what the harness checked for this semantics, if anything

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GradientCheck:
    kind: CheckKind
    ran: bool
    passed: bool | None = None
    max_abs_diff: float | None = None
    max_rel_diff: float | None = None
    detail: str = ""
    sizes: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"kind": self.kind.value}


def _changed(a: RunConfig, b: RunConfig) -> set[str]:
    return set(a.diff(b))


def touched(a: RunConfig, b: RunConfig) -> list[Item]:
    changed = _changed(a, b)
    gb_moves = a.global_batch != b.global_batch
    tokens_move = a.tokens_per_update != b.tokens_per_update
    split_moves = bool(changed & {"micro_batch", "accum", "dp"})
    fp16 = Precision.FP16_MIXED in (a.precision, b.precision) and "precision" in changed
    ac_moves = "ac" in changed
    dropout = max(a.model.dropout, b.model.dropout)
    return [
        Item("global batch", gb_moves or tokens_move,
             f"{a.global_batch} -> {b.global_batch} sequences, {a.tokens_per_update:,} -> {b.tokens_per_update:,} "
             "tokens per update" if (gb_moves or tokens_move) else
             f"kept at {a.global_batch} sequences ({a.tokens_per_update:,} tokens) per update"),
        Item("learning-rate scaling", gb_moves or tokens_move,
             "the learning rate tuned for one global batch may not suit the other (linear or square-root "
             "scaling rules)" if (gb_moves or tokens_move) else "same global batch: the learning rate stays valid"),
        Item("loss scaling / normalisation", split_moves or fp16,
             ("each micro-batch's summed loss is divided by the whole update's useful-token count, so the "
              "accumulated gradient equals the whole batch's mean" if split_moves else "")
             + ("; " if split_moves and fp16 else "")
             + ("fp16 needs dynamic loss scaling (GradScaler), unscaled before clipping" if fp16 else "")
             or "unchanged"),
        Item("gradient clipping", split_moves or fp16 or "optimizer_in_backward" in changed,
             "the side with optimizer_in_backward steps each parameter as its gradient is made: nothing holds every "
             "gradient, so it does not clip (torchtune refuses clip_grad_norm with optimizer_in_bwd)"
             if "optimizer_in_backward" in changed else
             "clipping runs once per update on the accumulated (and all-reduced) gradient, never per "
             "micro-batch" if split_moves or fp16 else "unchanged: clipped once per update"),
        Item("scheduler step count", gb_moves or tokens_move,
             "the scheduler steps once per update: a fixed token budget takes "
             f"{b.tokens_per_update / a.tokens_per_update:.3g}x fewer updates on B, so warmup and decay "
             "lengths in updates cover different token counts" if (gb_moves or tokens_move) else
             "same updates per token budget"),
        Item("RNG under recompute", ac_moves and dropout > 0,
             f"dropout {dropout:g} inside recomputed layers: the recompute must draw the forward's masks "
             "(preserve_rng_state=True)" if ac_moves and dropout > 0 else
             ("activation checkpointing changes but dropout is off" if ac_moves else "no recompute change")),
        Item("sharding (ZeRO stage)", "zero" in changed,
             f"ZeRO-{a.zero} -> ZeRO-{b.zero}: the same update, with states sharded over the DP ranks (each "
             "engine must end with DDP's parameters)" if "zero" in changed else f"ZeRO-{a.zero} on both"),
        Item("numerics", "precision" in changed or "compile" in changed,
             f"{a.precision} -> {b.precision}: different rounding, gradients are not bitwise comparable"
             if "precision" in changed else
             f"compile {a.compile} -> {b.compile}: compiled kernels fuse and reorder floating-point operations, "
             "gradients agree to rounding, not bitwise" if "compile" in changed else "same precision"),
    ]


def check_kind(a: RunConfig, b: RunConfig) -> CheckKind:
    changed = _changed(a, b)
    if "zero" in changed and min(a.dp, b.dp) > 1:
        return CheckKind.ZERO
    if changed == {"ac"}:
        return CheckKind.AC
    if changed and changed <= {"micro_batch", "accum", "dp"} and a.global_batch == b.global_batch:
        return CheckKind.SPLIT
    return CheckKind.NONE


def _small(cfg: RunConfig, **kw: Any) -> RunConfig:
    return cfg.replace(seq=min(cfg.seq, CHECK_SEQ), device="cpu", memory_budget=None, precision=Precision.FP32, **kw)


def gradient_check(a: RunConfig, b: RunConfig) -> GradientCheck:
    """Run the equivalence check that applies to this change (in this process, on CPU)."""
    kind = check_kind(a, b)
    if kind is CheckKind.NONE:
        return GradientCheck(kind, False, detail="no gradient equivalence applies: the change alters what is "
                                                   "computed (global batch, shapes or numerics)")
    from batchlab.formula.params import count

    if count(a.model).total > MAX_CHECK_PARAMS:
        return GradientCheck(kind, False, detail=f"not run: the model has more than {MAX_CHECK_PARAMS:,} "
                                                 "parameters; run compare with --model tiny to see the check")
    try:
        if kind is CheckKind.ZERO:  # launches its own ranks
            return _zero_check(a, b)
        return _forked(kind, a, b) or _CHECKS[kind](a, b)
    except Exception as e:  # noqa: BLE001 — the check is evidence beside the measurement, not a precondition
        return GradientCheck(kind, False, detail=f"not run: {type(e).__name__}: {e}"[:300])


def _forked(kind: CheckKind, a: RunConfig, b: RunConfig) -> GradientCheck | None:
    """The check in a fork of the measurements' pre-imported process (host/forkcall.py): this process then
    never imports torch or torch._dynamo; None where no such process runs already (a GPU compare, an injected
    measurement: none is started for one check) or no fork can be had."""
    from batchlab.host import forkcall, warm
    from batchlab.measure.runner import child_env

    if warm.server_pid() is None:
        return None
    d = forkcall.call("batchlab.experiment.semantics:check_into",
                      {"kind": kind.value, "a": a.to_dict(), "b": b.to_dict()}, child_env())
    return None if d is None else GradientCheck(**(d | {"kind": CheckKind(d["kind"])}))


def check_into(out, request: dict, parent: int | None = None) -> int:
    """The forked side of ``_forked``: the check's record written to ``out``."""
    import json

    from batchlab.config import config_from_dict
    from batchlab.util.files import write_atomic

    a, b = config_from_dict(request["a"]), config_from_dict(request["b"])
    write_atomic(out, json.dumps(_CHECKS[CheckKind(request["kind"])](a, b).to_dict()))
    return 0


def _split_check(a: RunConfig, b: RunConfig) -> GradientCheck:
    # the smallest global batch both splits can share; DP ranks become extra micro-batches in one process
    g = math.lcm(a.micro_batch * a.dp, b.micro_batch * b.dp)
    sides = [_small(c, dp=1, accum=g // c.micro_batch, dropout=0.0) for c in (a, b)]
    if sides[0] == sides[1]:
        return GradientCheck(CheckKind.SPLIT, False, detail="not run: in one process both sides are the same micro-batch x "
                                                    "accum split; what makes DP equal to it is DDP's all-reduce "
                                                    "average, checked by batchlab's distributed tests "
                                                    "(tests/distributed/test_ddp_on_gloo.py), not here")
    grads = _gradients(sides, torch_seed=None)
    abs_d, rel_d = _diff(*grads)
    split = " vs ".join(f"{c.micro_batch} x {c.accum}" for c in sides)
    passed = rel_d <= SPLIT_TOLERANCE
    return GradientCheck(CheckKind.SPLIT, True, passed, abs_d, rel_d,
                         f"one update of {g} sequences split as micro-batch x accum = {split} (DP ranks as "
                         f"micro-batches, one process); relative gradient difference {rel_d:.2g} "
                         f"{'<=' if passed else '>'} {SPLIT_TOLERANCE:g} (fp32, dropout off)",
                         {"global_batch": g, "seq": sides[0].seq, "a": [sides[0].micro_batch, sides[0].accum],
                          "b": [sides[1].micro_batch, sides[1].accum]})


def _ac_check(a: RunConfig, b: RunConfig) -> GradientCheck:
    mb = min(a.micro_batch, 2)
    sides = [_small(c, micro_batch=mb, accum=1, dp=1) for c in (a, b)]
    grads = _gradients(sides, torch_seed=1234)
    import torch

    abs_d, rel_d = _diff(*grads)
    equal = all(torch.equal(x, y) for x, y in zip(grads[0].values(), grads[1].values()))
    dropout = a.model.dropout
    policies = " vs ".join(str(c.ac) for c in sides)
    return GradientCheck(CheckKind.AC, True, equal, abs_d, rel_d,
                         f"ac {policies}: gradients {'bitwise equal' if equal else f'differ (max {abs_d:.2g})'} "
                         f"with dropout {dropout:g} (fp32, micro-batch {mb}, seq {sides[0].seq})",
                         {"micro_batch": mb, "seq": sides[0].seq, "dropout": dropout})


_CHECKS = {CheckKind.SPLIT: _split_check, CheckKind.AC: _ac_check}  # the checks run in one process


def _zero_check(a: RunConfig, b: RunConfig) -> GradientCheck:
    from batchlab.distributed.equivalence import same_parameters_as_ddp

    # a's shape at a small size on 2 ranks: what the check asserts (each engine's update equals DDP's) does not
    # depend on the world size; the other fields a compare changes are not part of it
    small = _small(a, dp=2, micro_batch=min(a.micro_batch, 2), accum=min(a.accum, 2))
    check = same_parameters_as_ddp(small, small.replace(zero=b.zero))
    worst = max(check.max_abs_difference.values(), default=0.0)
    return GradientCheck(CheckKind.ZERO, True, check.equal, worst, None,
                         f"ZeRO-{a.zero} vs ZeRO-{b.zero}: {check.text} (2 gloo ranks, micro-batch "
                         f"{small.micro_batch} x accum {small.accum}, seq {small.seq})",
                         {"dp": 2, "micro_batch": small.micro_batch, "accum": small.accum, "seq": small.seq})


def _gradients(sides: list[RunConfig], torch_seed: int | None) -> list[dict]:
    import torch

    from batchlab.measure.harness import Trainer

    trainers = [Trainer(c, "cpu") for c in sides]  # same seed: identical initial weights
    g = sides[0].global_batch
    tokens, targets = trainers[0].workload.make_batch(torch.Generator().manual_seed(7), g, sides[0].seq,
                                                      torch.device("cpu"))
    out = []
    for cfg, trainer in zip(sides, trainers):
        mb = cfg.micro_batch
        batches = [(tokens[i:i + mb], targets[i:i + mb]) for i in range(0, g, mb)]
        if torch_seed is not None:
            torch.manual_seed(torch_seed)  # the same dropout stream for both sides
        out.append(trainer.gradients(batches))
    return out


def _diff(x: dict, y: dict) -> tuple[float, float]:
    """Max abs and max relative (norm) difference, parameter by parameter in registration order: a wrapper
    for activation checkpointing renames parameters (blocks.0.block.*) but keeps their order."""
    pairs = list(zip(x.values(), y.values()))
    if len(x) != len(y) or any(a.shape != b.shape for a, b in pairs):
        raise ValueError("the two sides' models have different parameters")
    abs_d = max(float((a - b).abs().max()) for a, b in pairs)
    rel_d = max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in pairs)
    return abs_d, rel_d


VERIFIES = {CheckKind.SPLIT: ("global batch", "loss scaling / normalisation"), CheckKind.AC: ("RNG under recompute",),
            CheckKind.ZERO: ("sharding (ZeRO stage)",)}


def semantics(a: RunConfig, b: RunConfig, run_check: bool = True, why_not: str = "not run (--no-verify)"
              ) -> dict[str, Any]:
    items = touched(a, b)
    check = gradient_check(a, b) if run_check else GradientCheck(check_kind(a, b), False, detail=why_not)
    if check.ran:
        names = VERIFIES[check.kind]
        said = ("verified: " if check.passed else "FAILED: ") + check.detail
        items = [replace(i, verified=said) if i.name in names else i for i in items]
    return {"items": [i.to_dict() for i in items], "gradient_check": check.to_dict()}
