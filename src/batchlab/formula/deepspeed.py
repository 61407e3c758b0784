"""DeepSpeed ZeRO's own buffers on one rank, beyond the model states its stage shards (no torch).

Defaults of ``zero_optimization`` (deepspeed/runtime/zero/config.py, DeepSpeedZeroConfig): reduce_bucket_size and
allgather_bucket_size 5e8 elements, contiguous_gradients on, overlap_comm on at stage 3 only,
stage3_prefetch_bucket_size 5e7 elements, stage3_max_live_parameters 1e9 elements.  What each stage allocates
(runtime/zero/stage_1_and_2.py, stage3.py):
- the reduce bucket (``ipg`` buffer) gradients are copied into before each reduce: reduce_bucket_size elements in
  the gradients' 16-bit dtype whatever the model's size (stage_1_and_2.py ``backward``: ``torch.empty(int(
  self.reduce_bucket_size), ...)``), two of them when overlap_comm double-buffers;
- the fp32 gradient partition the optimizer steps on: 1/DP of the rank's parameters in fp32, built at the step;
  stage 3 builds it one sub-group (sub_group_size, 1e9 elements) at a time and frees it after that sub-group's
  step (stage3.py ``_prepare_fp32_grad_for_sub_group`` / ``_release_sub_group``);
- stage 3: the gathered parameters, replayed over the module trace (formula/deepspeed_gather.py): each step's
  prefetch adds up to stage3_prefetch_bucket_size more while fewer than stage3_max_live_parameters are gathered,
  so the prefetch runs ahead until that limit, and a module fetched on demand comes on top of it.  They replace
  FSDP2's gathered units, which the phases this module dresses price (only the 16-bit partition stays resident).
The sizes are the run's ``--deepspeed`` settings (config/deepspeed.py), DeepSpeed's defaults where not typed.
The all-gather of the updated parameters after a stage-1/2 step writes into the 16-bit weights themselves
(allgather_bucket_size only chunks it): no buffer of its own is counted.
"""
from __future__ import annotations

from batchlab.config import Precision, RunConfig
from batchlab.config.deepspeed import DeepSpeedSettings
from batchlab.formula.deepspeed_gather import gathered
from batchlab.formula.ranks import RankShare, largest_param

F32 = 4


def priced(cfg: RunConfig) -> bool:
    """A DeepSpeed engine over more than one data-parallel rank."""
    lay = cfg.parallel
    return lay.engine_spec.deepspeed and lay.dp > 1


def activation_precision(cfg: RunConfig) -> Precision:
    """The precision a DeepSpeed run's activations are made in: its fp16 / bf16 modes cast the module itself to 16
    bits (runtime/engine.py ``_configure_distributed_model``: ``module.half()`` / ``module.bfloat16()``) and run it
    without autocast (accelerate enables native AMP only outside DeepSpeed), so a mixed run's residual stream, norm
    inputs and saved tensors are 16-bit as a pure-bf16 model's are; the fp32 master and Adam state stay in the
    optimizer (``engine_states``).  Every other engine: the run's precision."""
    if cfg.parallel.engine_spec.deepspeed and cfg.precision.mixed:
        return Precision.BF16  # fp16-mixed too: the same 2-byte widths (no pure-fp16 precision is named)
    return cfg.precision


def _grad_bytes(cfg: RunConfig) -> int:
    """The engine's working dtype, 16 bits unless the run is fp32: its gradients' and gathered parameters'."""
    return F32 if cfg.precision is Precision.FP32 else 2


def resident_buffers(cfg: RunConfig, rank: RankShare) -> dict[str, int]:
    """Buffers held from initialisation through every phase (bytes), by name."""
    if not priced(cfg):
        return {}
    # stage 3 allocates one flat ipg buffer at init (stage3.py ``_setup_for_real_optimizer``: ``torch.empty(
    # self.reduce_bucket_size)`` under contiguous_gradients); stages 1 and 2 one in ``backward``, and a second
    # under overlap_comm ("double buffers to avoid data access conflict"; off by default there)
    ds = settings(cfg)
    copies = 2 if cfg.parallel.engine_spec.stage != 3 and ds.overlap_comm else 1
    return {"deepspeed reduce bucket": copies * ds.reduce_bucket_size * _grad_bytes(cfg)}


def step_buffers(cfg: RunConfig, rank: RankShare) -> dict[str, int]:
    """Buffers of the optimizer step (bytes): the fp32 gradient partition; at stage 3 one sub-group's, cast from a
    flat copy of its 16-bit gradients (``flatten(averaged_gradients[i]).to(fp32)``: both live as the cast runs;
    in fp32 the cast is the copy itself)."""
    if not priced(cfg):
        return {}
    partition = rank.params // cfg.dp
    if cfg.parallel.engine_spec.stage != 3:
        return {"deepspeed fp32 gradient partition": F32 * partition}
    # a sub-group closes at the first parameter that reaches sub_group_size (``_create_fp16_sub_groups``): never
    # smaller than one parameter's partition, however small the size typed
    largest = largest_param(cfg, rank) // cfg.dp  # this rank's: a later stage holds no embedding
    sub = min(max(settings(cfg).sub_group_size, largest), partition)
    flat = _grad_bytes(cfg) if _grad_bytes(cfg) != F32 else 0
    return {"deepspeed fp32 gradient partition": F32 * sub, "deepspeed 16-bit gradient flatten": flat * sub}


def settings(cfg: RunConfig) -> DeepSpeedSettings:
    """The ds_config sizes priced: the typed ones with ``auto`` filled as the HF Trainer fills it."""
    return cfg.deepspeed.resolved(cfg.model.hidden)


def prefetch_buffers(cfg: RunConfig, rank: RankShare) -> dict[str, dict[str, int]]:
    """Stage 3's gathered parameters by phase (bytes): at the loss in forward, their most in backward (the module
    docstring); none at the step."""
    if not priced(cfg) or cfg.parallel.engine_spec.stage != 3:
        return {}
    modes = cfg.ac.layer_modes(cfg.model.layers)  # every:K and per-layer plans recompute some layers only
    recompute = tuple(modes[i].spec.recomputes for i in rank.layers)
    g = gathered(cfg.model, len(rank.layers), recompute, cfg.deepspeed)
    e = _grad_bytes(cfg)
    return {"forward": {"deepspeed live parameters": g.at_loss * e},
            "backward": {"deepspeed live parameters": g.backward * e}}


def engine_states(cfg: RunConfig, rank: RankShare, phases: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Where DeepSpeed's stage 1 and 2 hold other model states than FSDP2's, whose phases price them
    (runtime/zero/stage_1_and_2.py): the 16-bit weights stay whole on every rank in every phase (``bit16_groups_flat``;
    only stage 3 partitions them); stage 2's gradients are a 16-bit partition (``grads_in_partition`` under
    contiguous_gradients), not an fp32 shard; and the step is FusedAdam's multi-tensor kernel over the flat fp32
    partition, in place: no per-tensor temporaries (the fp32 gradient partition is ``step_buffers``').  Stage 3
    keeps, beside the fp32 master partition, the 16-bit partition of the weights (``fp16_partitioned_groups_flat``)
    and a contiguous 16-bit gradient partition allocated at init and held through every phase
    (``grad_partitions_flat_buffer``, gradient_accumulation_dtype: the model's dtype), where FSDP2 keeps fp32
    gradient shards; its step is FusedAdam's over each flat fp32 sub-group, in place."""
    if not priced(cfg):
        return phases
    if cfg.parallel.engine_spec.stage == 3:
        return _stage3_states(cfg, rank, phases)
    weights = rank.params * _grad_bytes(cfg)
    out = {}
    for ph, parts in phases.items():
        parts = dict(parts, parameters=max(parts["parameters"], weights))
        if cfg.parallel.engine_spec.stage == 2 and parts["gradients"]:
            parts["gradients"] = weights // cfg.dp
        if ph == "optimizer":
            parts["temporaries"] = 0
        out[ph] = parts
    return out


def _stage3_states(cfg: RunConfig, rank: RankShare, phases: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Stage 3's model states per phase (``engine_states``): the 16-bit weight partition beside the fp32 master
    (under fp32 the master is that partition itself: stage3.py ``_create_fp32_partitions``), the 16-bit gradient
    partition throughout, no step temporaries.  The gathered parameters are ``prefetch_buffers``', not FSDP2's
    units: the parameters part is the partition alone."""
    partition16 = rank.params * _grad_bytes(cfg) // cfg.dp
    out = {}
    for ph, parts in phases.items():
        parts = dict(parts, gradients=partition16, parameters=partition16)
        if ph == "optimizer":
            parts["temporaries"] = 0
        out[ph] = parts
    return out


def dressed(cfg: RunConfig, rank: RankShare, phases: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """DeepSpeed ZeRO's own buffers, each a part of its own in every phase (0 where it
    is not live): the reduce bucket throughout, stage 3's prefetch in forward and backward, the fp32 gradient
    partition at the step."""
    if not priced(cfg):
        return phases
    phases = engine_states(cfg, rank, phases)
    resident = resident_buffers(cfg, rank)
    walked = prefetch_buffers(cfg, rank)
    live = {"forward": {**resident, **walked.get("forward", {})}, "backward": {**resident, **walked.get("backward", {})},
            "optimizer": {**resident, **step_buffers(cfg, rank)}}
    names = {k for parts in live.values() for k in parts}
    return {ph: dict(parts, **{k: live.get(ph, {}).get(k, 0) for k in sorted(names)}) for ph, parts in phases.items()}
