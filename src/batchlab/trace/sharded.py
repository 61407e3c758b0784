"""One rank's view of a data-parallel run, traced in this one process on fake tensors.

PyTorch's "fake" process-group backend (``torch.testing._internal.distributed.fake_pg``, the one
torchtitan's memory estimator uses) gives a world of ``cfg.dp`` ranks whose collectives do nothing; with
fake tensors nothing is allocated either.  So the real engines run as rank 0 sees them:

- ZeRO-2/3: FSDP2 ``fully_shard`` exactly as the measurement builds it (distributed.engines): parameter,
  gradient and optimizer shards of 1/DP, units gathered and freed by FSDP2's own code;
- ZeRO-1: ZeroRedundancyOptimizer shards the optimizer state over the fake world;
- ZeRO-0/1: DDP itself cannot start on fake tensors (it reads parameter shapes across ranks), so its
  gradient buckets are stood in for by ``.grad`` kept between updates: with ``gradient_as_bucket_view``
  the gradients are the buckets, the same bytes.
What a fake world cannot show: the collectives' time, and anything that depends on values from peers.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from batchlab.config import RunConfig

NOTE_DDP = ("traced rank 0 of {dp} on a fake process group: DDP's gradient buckets stood in for by .grad kept "
            "between updates (gradient_as_bucket_view: the same bytes)")
NOTE_FSDP = "traced rank 0 of {dp} on a fake process group: FSDP2 shards, gathers and frees as on a real run"


@contextlib.contextmanager
def fake_world(world: int):
    """A process group of ``world`` ranks in this process whose collectives do nothing (rank 0's view)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process; trace a DP config alone")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def build(cfg: RunConfig, device: torch.device, trainer_cls) -> tuple[object, list[str]]:
    """Rank 0's trainer on the stage's engine (inside ``fake_world``) and the note saying what was traced."""
    from batchlab.distributed import engines

    spec = cfg.parallel.engine_spec
    if spec.fsdp:
        trainer, _ = engines.build(cfg, device, 0, cfg.dp, trainer_cls=trainer_cls)
        return trainer, [NOTE_FSDP.format(dp=cfg.dp)]
    torch.manual_seed(cfg.seed)
    from batchlab.models import build_workload

    opt = dict(optimizer=engines.zero_optimizer) if spec.shards_optimizer else {}
    trainer = trainer_cls(cfg, device, workload=build_workload(cfg), rank=0, world=cfg.dp, grads_to_none=False, **opt)
    return trainer, [NOTE_DDP.format(dp=cfg.dp)]


def register_storages(tracker, trainer) -> None:
    from batchlab.distributed import engines

    engines.register_storages(tracker, trainer, None)
