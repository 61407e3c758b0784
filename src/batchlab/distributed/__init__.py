"""Data-parallel measurement on PyTorch's own stack: torchrun + DistributedDataParallel.

    from batchlab.distributed import launch
    m = launch(cfg, opts, nproc=2)               # cfg.dp == 2: two local ranks, gloo on CPU / nccl on CUDA
    m = launch(cfg, opts, nproc=8, torchrun_args=["--nnodes", "2", "--node-rank", "0",
                                                  "--rdzv-endpoint", "host0:29500", "--rdzv-backend", "c10d"])

``torchrun --nproc-per-node 2 -m batchlab measure --dp 2`` works too: ``batchlab.run.measure``
sees torchrun's environment and runs this process as one rank.

Each rank runs the harness Trainer on the engine of ``cfg.zero`` (``engines.py``): ZeRO-0
``DDP(gradient_as_bucket_view=True)``, ZeRO-1 the same DDP + ZeroRedundancyOptimizer, ZeRO-2/3 FSDP2
``fully_shard`` per block.  Under DDP accumulation runs all but the last micro-batch under ``no_sync()``
(one all-reduce per update); FSDP2 reduce-scatters after every micro-batch (``sharding.py`` says why).  The
loss is normalised by the global useful-token count, each rank draws distinct data.  A communication hook
times DDP's all-reduce (``comm.py``); every collective is counted per micro-batch on the process group
(``traffic.py``) beside the formula's (``formula.sharding``).  ``equivalence.py`` checks that a stage's
parameters equal DDP's.  Importing this package does not import torch.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from batchlab.distributed.merge import SCOPE

if TYPE_CHECKING:
    from batchlab.config import RunConfig
    from batchlab.measure.options import MeasureOptions
    from batchlab.measure.result import Measurement

__all__ = ["SCOPE", "in_torchrun", "is_primary", "launch", "measure_in_torchrun"]


def launch(cfg: "RunConfig", opts: "MeasureOptions | None" = None, nproc: int | None = None,
           torchrun_args=(), timeout_s: float | None = None, launcher=None) -> "Measurement":
    from batchlab.distributed.launcher import launch as _launch

    return _launch(cfg, opts, nproc, torchrun_args, timeout_s, launcher)


launch.__doc__ = "Measure cfg with cfg.dp ranks (forked on one CPU node, else torchrun); see launcher.launch."


def in_torchrun() -> bool:
    """This process is one rank of a torchrun job with more than one rank."""
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def is_primary() -> bool:
    """Rank 0, or not distributed: the one process that prints results."""
    return os.environ.get("RANK", "0") == "0" or not in_torchrun()


def measure_in_torchrun(cfg: "RunConfig", opts: "MeasureOptions | None" = None) -> "Measurement":
    """Run this process as one rank of the torchrun job it is in; every rank returns the merged Measurement."""
    from batchlab.distributed.merge import merge
    from batchlab.distributed.worker import RankSpec, gather, run_rank
    from batchlab.measure.options import MeasureOptions

    import torch.distributed as dist

    opts = opts or MeasureOptions()
    timeout = opts.timeout_s or 600.0
    ours = not dist.is_initialized()  # a group the caller set up is the caller's to close
    ranks = gather(run_rank(RankSpec(cfg.to_dict(), opts.to_dict(), collective_timeout_s=timeout)))
    if ours:
        dist.destroy_process_group()
    return merge(cfg, ranks, dict(launcher="torchrun (external)"))
