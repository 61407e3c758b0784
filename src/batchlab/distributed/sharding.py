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


# FSDP2 accumulation, the choice batchlab makes (and why): gradients are reduce-scattered after every
# micro-batch (set_requires_gradient_sync stays True), so each rank only ever holds its gradient shard
# (ZeRO-2/3's memory promise).  The alternative, set_requires_gradient_sync(False) on non-final
# micro-batches, saves accum-1 reduce-scatters but keeps the whole unsharded gradient on every rank until
# the last micro-batch: formula.sharding.traffic(cfg, sync_every_micro_batch=False) and
# formula.sharding.unsharded_gradient_bytes give its cost.  set_reshard_after_backward stays True: the
# parameters are gathered again in the next micro-batch's forward.
FSDP_ACCUMULATION = ("reduce-scatter after every micro-batch (set_requires_gradient_sync(True) throughout), "
                     "set_reshard_after_backward(True)")
FSDP_NO_SYNC = ("set_requires_gradient_sync(False) on all but the last micro-batch: unsharded gradients accumulate "
                "on every rank, one reduce-scatter per update; set_reshard_after_backward(True)")
DDP_ACCUMULATION = "no_sync() on all but the last micro-batch: one all-reduce per update"


@dataclass(frozen=True)
class EngineInfo:
    stage: int
    name: str  # ddp | zero1 | fsdp-grad-op | fsdp
    engine: str  # the PyTorch API, as a user would write it
    accumulation: str  # what happens to gradients between micro-batches


def engine_info(zero: int, sync_every_micro_batch: bool = True) -> EngineInfo:
    if zero == 0:
        return EngineInfo(0, "ddp", "DistributedDataParallel(gradient_as_bucket_view=True)", DDP_ACCUMULATION)
    if zero == 1:
        return EngineInfo(1, "zero1", "DDP(gradient_as_bucket_view=True) + ZeroRedundancyOptimizer",
                          DDP_ACCUMULATION + "; the optimizer shard owners broadcast updated parameters after step")
    return EngineInfo(zero, "fsdp-grad-op" if zero == 2 else "fsdp",
                      f"FSDP2 fully_shard per block + root, reshard_after_forward={zero == 3}",
                      FSDP_ACCUMULATION if sync_every_micro_batch else FSDP_NO_SYNC)


def engine_snippet(cfg) -> str:
    """Runnable PyTorch for ``cfg``'s stage (the engine batchlab measures), with the matching torchtitan,
    accelerate and DeepSpeed settings as comments.  ``model``, ``blocks`` (the repeated layers) and
    ``loader`` are the user's; torchrun sets the process group's environment."""
    z, accum = cfg.parallel.engine_spec.stage, cfg.accum
    half = {"bf16-mixed": "torch.bfloat16", "fp16-mixed": "torch.float16"}.get(cfg.precision.value)
    head = ["import torch, torch.distributed as dist",
            "dist.init_process_group('nccl' if torch.cuda.is_available() else 'gloo')"]
    if z >= 2:
        mp = (f", mp_policy=MixedPrecisionPolicy(param_dtype={half}, reduce_dtype=torch.float32)" if half else "")
        wrap = ["from torch.distributed.device_mesh import init_device_mesh",
                "from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard",
                "mesh = init_device_mesh('cuda' if torch.cuda.is_available() else 'cpu', (dist.get_world_size(),))",
                "for block in blocks:  # one FSDP unit per transformer block, then the root (as torchtitan)",
                f"    fully_shard(block, mesh=mesh, reshard_after_forward={z == 3}{mp})",
                f"fully_shard(model, mesh=mesh, reshard_after_forward={z == 3}{mp})",
                "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)",
                "sync = lambda last: None  # reduce-scatter after every micro-batch: only gradient shards are kept"]
    else:
        wrap = ["from torch.nn.parallel import DistributedDataParallel as DDP",
                "model = DDP(model, gradient_as_bucket_view=True)"]
        wrap += (["from torch.distributed.optim import ZeroRedundancyOptimizer",
                  "optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, "
                  "lr=1e-4, weight_decay=0.1)"] if z == 1 else
                 ["optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)"])
        wrap += ["import contextlib",
                 "sync = lambda last: contextlib.nullcontext() if last else model.no_sync()"]
    loop = [f"accum = {accum}  # global batch = micro-batch {cfg.micro_batch} x accum {accum} x DP {cfg.dp}",
            "for step, micro_batches in enumerate(loader):  # accum micro-batches per update",
            "    for i, (x, y) in enumerate(micro_batches):",
            "        with (sync(i == accum - 1) or contextlib.nullcontext()):",
            "            loss = model(x, y) / accum",
            "            loss.backward()",
            "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
            "    optimizer.step()",
            "    optimizer.zero_grad(set_to_none=True)"]
    other = {0: "torchtitan: data_parallel_replicate_degree=DP; accelerate: DDP; DeepSpeed: zero_optimization.stage 0",
             1: "accelerate/DeepSpeed: zero_optimization.stage 1 (torchtitan has no ZeRO-1)",
             2: "torchtitan: data_parallel_shard_degree=DP, fsdp_reshard_after_forward='never'; accelerate: "
                "fsdp_version 2, reshard_after_forward false; DeepSpeed: zero_optimization.stage 2",
             3: "torchtitan: data_parallel_shard_degree=DP (reshard_after_forward 'default'); accelerate: "
                "fsdp_version 2, reshard_after_forward true; DeepSpeed: zero_optimization.stage 3"}[z]
    if z >= 2:
        head.append("import contextlib")
    return "\n".join(head + wrap + loop + [f"# {other}"]) + "\n"
