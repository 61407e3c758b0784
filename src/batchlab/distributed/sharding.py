"""Which PyTorch engine runs each ZeRO stage, and how it accumulates gradients.  Torch-free.

The stage (``RunConfig.zero``) picks one of PyTorch's own engines (Rajbhandari et al. 2019, ZeRO):

- 0  ``ddp``           DistributedDataParallel, ``no_sync()`` on all but the last micro-batch
- 1  ``zero1``         DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer`` (optimizer state sharded)
- 2  ``fsdp-grad-op``  FSDP2 ``fully_shard(reshard_after_forward=False)``: gathered parameters kept to backward
- 3  ``fsdp``          FSDP2 ``fully_shard(reshard_after_forward=True)``: gathered again in backward

FSDP2 is applied per transformer block, then on the root (as torchtitan does); every group uses the same
``reshard_after_forward``, so a ZeRO-3 root is re-gathered at the start of backward too.
"""
from __future__ import annotations

from dataclasses import dataclass

SHARDING_NAMES = {"ddp": 0, "zero1": 1, "fsdp-grad-op": 2, "fsdp": 3}

# FSDP2 accumulation, the choice batchlab makes (and why): gradients are reduce-scattered after every
# micro-batch (set_requires_gradient_sync stays True), so each rank only ever holds its gradient shard
# (ZeRO-2/3's memory promise).  The alternative, set_requires_gradient_sync(False) on non-final
# micro-batches, saves accum-1 reduce-scatters but keeps the whole unsharded gradient on every rank until
# the last micro-batch: formula.sharding.traffic(cfg, sync_every_micro_batch=False) and
# formula.sharding.unsharded_gradient_bytes give its cost.  set_reshard_after_backward stays True: the
# parameters are gathered again in the next micro-batch's forward.
FSDP_ACCUMULATION = ("reduce-scatter after every micro-batch (set_requires_gradient_sync(True) throughout), "
                     "set_reshard_after_backward(True)")
DDP_ACCUMULATION = "no_sync() on all but the last micro-batch: one all-reduce per update"


@dataclass(frozen=True)
class EngineInfo:
    stage: int
    name: str  # ddp | zero1 | fsdp-grad-op | fsdp
    engine: str  # the PyTorch API, as a user would write it
    accumulation: str  # what happens to gradients between micro-batches


def engine_info(zero: int) -> EngineInfo:
    if zero == 0:
        return EngineInfo(0, "ddp", "DistributedDataParallel(gradient_as_bucket_view=True)", DDP_ACCUMULATION)
    if zero == 1:
        return EngineInfo(1, "zero1", "DDP(gradient_as_bucket_view=True) + ZeroRedundancyOptimizer",
                          DDP_ACCUMULATION + "; the optimizer shard owners broadcast updated parameters after step")
    return EngineInfo(zero, "fsdp-grad-op" if zero == 2 else "fsdp",
                      f"FSDP2 fully_shard per block + root, reshard_after_forward={zero == 3}", FSDP_ACCUMULATION)


def parse_sharding(text: str) -> int:
    """``--sharding`` spelling (ddp, zero1, fsdp-grad-op, fsdp) to the ZeRO stage; ConfigError otherwise."""
    from batchlab.config import ConfigError

    key = str(text).strip().lower().replace("_", "-")
    if key not in SHARDING_NAMES:
        raise ConfigError("sharding", f"must be one of {', '.join(SHARDING_NAMES)}, got {text!r}")
    return SHARDING_NAMES[key]
