"""The harness Trainer on PyTorch's own data-parallel engines, one per ZeRO stage (see sharding.py).

- ZeRO-0: ``DDP(gradient_as_bucket_view=True)``.
- ZeRO-1: the same DDP with ``ZeroRedundancyOptimizer`` (optimizer state sharded over the ranks; after its
  step each shard's owner broadcasts the updated parameters).
- ZeRO-2 / 3: FSDP2 ``fully_shard`` on every transformer block (the activation-checkpoint wrapper, when the
  policy wraps it, is what is sharded: checkpointing runs inside the FSDP unit, as torchtitan does), then on
  the root; ``reshard_after_forward`` False (2) or True (3); ``MixedPrecisionPolicy(param_dtype=16-bit,
  reduce_dtype=fp32)`` under mixed precision.

Every engine builds the model the same way (seeded, then built, then the Trainer reseeds), so the initial
weights and dropout masks are the same whatever the stage: that is what the semantics check relies on.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from batchlab.config import Precision, RunConfig
from batchlab.distributed import comm
from batchlab.distributed.sharding import engine_info
from batchlab.measure.harness import Trainer, optimizer_class
from batchlab.measure.shards import local_shards
from batchlab.models import build_workload

_HALF = {Precision.BF16_MIXED: torch.bfloat16, Precision.FP16_MIXED: torch.float16}


def zero_optimizer(cfg: RunConfig, params) -> torch.optim.Optimizer:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    cls, kwargs = optimizer_class(cfg)
    return ZeroRedundancyOptimizer(list(params), optimizer_class=cls, **kwargs)


def fsdp_units(cfg: RunConfig, mesh, units, reshard: bool) -> None:
    """FSDP2 ``fully_shard`` on each unit in turn over ``mesh`` (each block, then the root that holds them):
    ``reshard`` after forward (ZeRO-3), and under mixed precision 16-bit parameters in compute with the gradients
    reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw: dict = dict(mesh=mesh, reshard_after_forward=reshard)
    if cfg.precision in _HALF:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=_HALF[cfg.precision], reduce_dtype=torch.float32)
    for unit in units:
        fully_shard(unit, **kw)


def _fsdp_wrap(cfg: RunConfig, device: torch.device, world: int, blocks: nn.ModuleList | None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def wrap(model: nn.Module) -> nn.Module:
        # the mesh holds real rank numbers, also when the trace builds the model on fake tensors
        with unset_fake_temporarily():
            mesh = init_device_mesh(device.type, (world,))
        fsdp_units(cfg, mesh, [*(blocks if blocks is not None else ()), model],
                   cfg.parallel.engine_spec.reshards_after_forward)
        return model

    return wrap


def _gradient_sync_off(model: nn.Module) -> nn.Module:
    """Give an FSDP2 root the ``no_sync()`` the Trainer uses on non-final micro-batches:
    ``set_requires_gradient_sync(False)`` inside, True again after."""

    @contextlib.contextmanager
    def no_sync():
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    model.no_sync = no_sync
    return model


def build(cfg: RunConfig, device: torch.device, rank: int, world: int, trainer_cls: type[Trainer] = Trainer,
          sync_every_micro_batch: bool = True) -> tuple[Trainer, comm.CommMonitor | None]:
    """The Trainer (``trainer_cls``: the trace's fake-tensor one) on the engine of ``cfg.zero``; the DDP comm
    hook's monitor (None under FSDP2).  ``sync_every_micro_batch=False``: FSDP2 with
    ``set_requires_gradient_sync(False)`` on all but the last micro-batch."""
    torch.manual_seed(cfg.seed)
    workload = build_workload(cfg)
    spec = cfg.parallel.engine_spec  # the engine, also where a fake process group traces DP = 1
    if spec.fsdp:
        wrap = _fsdp_wrap(cfg, device, world, workload.blocks)
        trainer = trainer_cls(cfg, device, workload=workload, rank=rank, world=world,
                              wrap=wrap if sync_every_micro_batch else lambda m: _gradient_sync_off(wrap(m)))
        return trainer, None
    ids = [device.index] if device.type == "cuda" else None
    from torch.nn.parallel import DistributedDataParallel as DDP

    # grads zeroed in place between updates, so they stay views of the buckets (see Trainer.grads_to_none)
    trainer = trainer_cls(cfg, device, workload=workload, rank=rank, world=world, grads_to_none=False,
                          wrap=lambda m: DDP(m, device_ids=ids, gradient_as_bucket_view=True),
                          **(dict(optimizer=zero_optimizer) if spec.shards_optimizer else {}))
    return trainer, comm.register(trainer.model, cuda=device.type == "cuda")


def fsdp_params(model: nn.Module) -> list:
    """FSDP2's per-parameter records (FSDPParam) of every group in ``model``; [] without FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            out += list(group.fsdp_params) if group is not None else []
    return out


def unsharded_buffers(model: nn.Module) -> list[torch.Tensor]:
    """FSDP2's unsharded parameter storages: allocated once, resized to full size while gathered and to
    0 bytes when resharded (no op creates or frees them, so a live-storage tracker must watch them)."""
    return [t for fp in fsdp_params(model) for t in fp.all_gather_outputs]


def unsharded_params(model: nn.Module) -> list[torch.Tensor]:
    """The parameters autograd sees while a group is gathered (their .grad is the unsharded gradient)."""
    return [fp._unsharded_param for fp in fsdp_params(model) if hasattr(fp, "_unsharded_param")]


def shard_bytes(model: nn.Module) -> int:
    """Bytes of this rank's parameter shards (all parameters under DDP)."""
    seen = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in local_shards(model.parameters())}
    return sum(seen.values())


def register_storages(tracker, trainer: Trainer, monitor: comm.CommMonitor | None) -> None:
    """Tell a live-storage tracker what the engine keeps that no op of the update creates."""
    if monitor is not None:
        # DDP's flat buckets exist before the update and outlive it: with gradient_as_bucket_view they are
        # the gradients.  Unregistered, their bytes would never be counted (no op creates them).
        tracker.register(monitor.bucket_buffers, "gradients")
    # FSDP2's unsharded parameters live in storages it resizes (0 bytes when resharded): watched, counted
    # as parameters (working copies) while gathered; their .grad is the unsharded gradient
    tracker.register_resizable(unsharded_buffers(trainer.raw_model), "parameters")
    tracker.watch_gradients(unsharded_params(trainer.raw_model))
    # a pipeline stage's receive buffers (distributed/pipeline.py), allocated at its first step and reused
    tracker.register(getattr(trainer, "receive_buffers", list)(), "activations")


def describe(cfg: RunConfig, sync_every_micro_batch: bool = True) -> dict:
    info = engine_info(cfg.parallel.engine_spec.stage, sync_every_micro_batch)
    return dict(stage=info.stage, name=info.name, engine=info.engine, accumulation=info.accumulation,
                sync_every_micro_batch=sync_every_micro_batch)
