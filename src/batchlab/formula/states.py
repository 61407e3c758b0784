"""Model states per rank: weights, master copy, gradients and optimizer state (no torch).

Rajbhandari et al. 2019 (ZeRO, sec. 3 and 5): stage k shards optimizer state, + gradients, + parameters over the
data-parallel ranks; what a rank holds before that sharding is its pipeline stage's tensor-parallel slice
(formula/ranks.py): the whole replica without a layout.
"""
from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass

from batchlab.config import Precision, RunConfig, optimizer_spec
from batchlab.formula.params import count, tensor_shapes
from batchlab.formula.ranks import RankShare, shares

F32 = 4


@dataclass(frozen=True)
class ModelStates:
    """Bytes per rank for weights, gradients and optimizer state (Rajbhandari et al. 2019, ZeRO, sec. 3)."""

    parameters: int  # weights as the forward uses them (bf16 working copies under autocast)
    master: int  # fp32 weights the optimizer updates (mixed precision only; else 0)
    gradients: int
    optimizer: int


def optimizer_state_bytes(cfg: RunConfig, state_bytes: int | None = None) -> int:
    """The whole model's optimizer state, unsharded: the catalogue entry's state tensors (config/optimizers.py)
    over the model's parameter shapes, in the weights' dtype (``state_bytes``: another element size), or the
    user's bytes per parameter (``--optimizer-bytes``) where given."""
    if cfg.assumptions.optimizer_bytes_per_param is not None:
        return int(count(cfg.model).total * cfg.assumptions.optimizer_bytes_per_param)
    if optimizer_spec(cfg.optimizer).blockwise is not None:  # 8-bit states: their own element sizes
        return _quantized_bytes(cfg.model, cfg.optimizer)
    if state_bytes is None:
        state_bytes = 2 if cfg.precision is Precision.BF16 else F32  # state lives in the weights' dtype
    return state_bytes * _state_elements(cfg.model, cfg.optimizer)


def rank_optimizer_bytes(cfg: RunConfig, n: int, state_bytes: int | None = None) -> int:
    """The optimizer state of ``n`` of the model's parameters (a rank's share), in whole bytes: the whole model's
    state exactly where ``n`` is all of it (a factored state is not a whole number of bytes per parameter)."""
    return optimizer_state_bytes(cfg, state_bytes) * n // max(count(cfg.model).total, 1)


@functools.lru_cache(maxsize=64)  # asked by every estimate; a sum over every parameter tensor
def _state_elements(m, kind) -> int:
    # a factored state (Adafactor's) reads the shapes of batchlab's GPT at the model's dimensions
    return optimizer_spec(kind).model_state_elements(count(m).total, Counter(tensor_shapes(m)))


@functools.lru_cache(maxsize=64)
def _quantized_bytes(m, kind) -> int:
    q = optimizer_spec(kind).blockwise
    return sum(k * q.device_bytes(math.prod(shape)) for shape, k in Counter(tensor_shapes(m)).items())


def heaviest(cfg: RunConfig) -> RankShare:
    """The stage whose ranks hold the most parameters (the first, on a tie)."""
    return max(shares(cfg), key=lambda s: (s.params, -s.stage))


def model_states(cfg: RunConfig, rank: RankShare | None = None) -> ModelStates:
    """``rank``: the pipeline stage's share (formula/ranks.py); default the stage holding the most parameters."""
    rank = rank or heaviest(cfg)
    if cfg.precision is Precision.BF16_FSDP:
        return fsdp_mixed_states(cfg, rank)
    if cfg.parallel.engine_spec.megatron:
        return megatron_states(cfg, rank)
    n, spec, dp = rank.params, cfg.parallel.engine_spec, cfg.dp
    shard = lambda on: dp if on else 1  # noqa: E731 — a ZeRO stage that shards this state divides it over DP
    weight_bytes = 2 if cfg.precision is Precision.BF16 else F32
    opt = rank_optimizer_bytes(cfg, n) // shard(spec.shards_optimizer)
    grads = n * weight_bytes // shard(spec.shards_gradients)
    if cfg.precision.mixed and spec.shards_optimizer:
        # ZeRO's mixed precision (Rajbhandari et al. 2019, sec. 3.1: 2 + 2 + 12 bytes per parameter): 16-bit
        # weights and gradients are what the ranks hold; the fp32 master copy is optimizer state, sharded
        return ModelStates(parameters=2 * n // shard(spec.shards_parameters), master=F32 * n // shard(spec.shards_optimizer),
                           gradients=2 * n // shard(spec.shards_gradients), optimizer=opt)
    if cfg.precision.mixed:  # autocast keeps fp32 weights and makes 16-bit working copies per forward
        return ModelStates(parameters=2 * n, master=F32 * n, gradients=grads, optimizer=opt)
    return ModelStates(parameters=weight_bytes * n // shard(spec.shards_parameters), master=0, gradients=grads,
                       optimizer=opt)


def megatron_states(cfg: RunConfig, rank: RankShare | None = None) -> ModelStates:
    """Megatron-Core's mixed precision (Megatron-LM README, "Distributed Optimizer": bytes per parameter 18 or
    6 + 12/d for bf16 params with fp32 grads, 20 or 4 + 16/d for fp16 params and grads, 16 or 8 + 8/d in fp32,
    without or with the distributed optimizer over d data-parallel ranks): the model trains its 16-bit weights;
    the DDP's contiguous gradient buffer is fp32 under bf16 (--accumulate-allreduce-grads-in-fp32) and 16-bit
    under fp16, whose fp32 main gradients the optimizer keeps with the fp32 main params and the optimizer state
    (sharded over DP by the distributed optimizer)."""
    rank = rank or heaviest(cfg)
    n, d = rank.params, cfg.dp if cfg.parallel.engine_spec.shards_optimizer else 1
    opt = rank_optimizer_bytes(cfg, n, F32) // d  # fp32 whatever the weights' dtype
    if cfg.precision is Precision.FP32:
        return ModelStates(parameters=F32 * n, master=0, gradients=F32 * n, optimizer=opt)
    if cfg.precision is Precision.FP16_MIXED:
        return ModelStates(parameters=2 * n, master=F32 * n // d, gradients=2 * n + F32 * n // d, optimizer=opt)
    return ModelStates(parameters=2 * n, master=F32 * n // d, gradients=F32 * n, optimizer=opt)


def fsdp_mixed_states(cfg: RunConfig, rank: RankShare | None = None) -> ModelStates:
    """FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): the fp32 parameters are the master
    copy (sharded at stage >= 3), fp32 gradients and Adam state sharded as the stage says; the bf16 working
    weights exist only for the blocks being gathered: the current and the prefetched block, and the root
    group (embedding, final norm, LM head), which FSDP2 does not reshard after forward (_fsdp_api.py docs)."""
    rank = rank or heaviest(cfg)
    spec, dp, n = cfg.parallel.engine_spec, cfg.dp, rank.params
    shard = lambda on: dp if on else 1  # noqa: E731
    outside = n - rank.per_layer * len(rank.layers)
    gathered = 2 * (2 * rank.per_layer + outside) if spec.shards_parameters else 2 * n
    return ModelStates(parameters=gathered, master=F32 * n // shard(spec.shards_optimizer),
                       gradients=F32 * n // shard(spec.shards_gradients),
                       optimizer=rank_optimizer_bytes(cfg, n) // shard(spec.shards_optimizer))
