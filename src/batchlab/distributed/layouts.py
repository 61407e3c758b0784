"""The harness Trainer for a layout with tensor and / or pipeline parallelism (world = dp x tp x pp ranks).

Built in this order on every rank, from the same seeded model: tensor parallelism on this rank's blocks
(``tensor_parallel.py``), activation checkpointing on the model's layers, the pipeline stages this rank holds
(``pipeline.py``), then the data dimension: FSDP2 ``fully_shard`` per block and per stage on the dp sub-mesh
(``--zero 2/3``, torchtitan's FSDP x TP), or with ``--zero 0`` every gradient (shard) averaged over the dp group
once per update after the last backward (DDP's result without its buckets: DDP does not take DTensor parameters
nor pipeline stages).  ZeroRedundancyOptimizer (``--zero 1``) is not combined with them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from batchlab.config import ModelSource, Precision, RunConfig
from batchlab.distributed import pipeline, tensor_parallel
from batchlab.distributed.engines import fsdp_units
from batchlab.distributed.measurable import applies, check, describe  # noqa: F401 - the worker's entry points
from batchlab.distributed.mesh import RankMesh
from batchlab.measure.harness import Trainer, _NoListener
from batchlab.measure.shards import local_shard
from batchlab.models import Workload, build_workload
from batchlab.models.ac import apply_ac


class ShardedTrainer(Trainer):
    """The Trainer on a TP / PP layout: data and loss normalisation over the dp group, the gradient norm over
    sharded parameters and pipeline stages, the data-parallel all-reduce where no FSDP2 does it."""

    def __init__(self, cfg: RunConfig, device: torch.device, *, mesh: RankMesh, **kwargs):
        self.mesh = mesh
        self.norm_skip: set[int] = set()  # ids of parameters whose gradient another stage counts in the norm
        super().__init__(cfg, device, rank=mesh.coords["dp"], world=cfg.dp, **kwargs)

    def _global_useful(self, local: int) -> int:
        if self.world == 1:
            return local
        t = torch.tensor([local], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, group=self.mesh.group("dp"))
        return int(t.item())

    def update(self, listener=None, micro_batches=None):
        with tensor_parallel.loss_context(self.cfg):  # forward and backward of the vocabulary-parallel loss
            return super().update(listener, micro_batches)

    def reduce_gradients(self) -> None:
        if self.cfg.parallel.dp > 1 and not self.cfg.parallel.fsdp:
            tensor_parallel.all_reduce_gradients(self.raw_model.parameters(), self.mesh.group("dp"), self.world)

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        return tensor_parallel.clip_grad_norm(self.raw_model.parameters(), max_norm, self.mesh.group("pp"),
                                              skip=self.norm_skip)


class PipelineTrainer(ShardedTrainer):
    """One update = one schedule ``step()`` over the update's micro-batches, then the optimizer step."""

    def __init__(self, cfg: RunConfig, device: torch.device, *, stages: list[tuple[int, nn.Module]],
                 tied: torch.Tensor | None, **kwargs):
        super().__init__(cfg, device, **kwargs)
        count = cfg.parallel.pp * cfg.parallel.chunks
        self.first = any(i == 0 for i, _ in stages)
        self.last = any(i == count - 1 for i, _ in stages)
        # tied embeddings: this rank's copy of the weight (as wrapped: FSDP2 replaces parameters), or for a
        # stage holding neither end, a tensor shaped like the first stage's local shard of it
        self.tied, self.tied_like = None, None
        if tied is not None:
            ends = [m.embed.weight for _, m in stages if hasattr(m, "embed")] + [
                m.head.weight for _, m in stages if hasattr(m, "head")]
            self.tied = ends[0] if ends else None
            like = local_shard(tied)
            if cfg.parallel.tensor_parallel and not isinstance(tied, DTensor) and tensor_parallel.vocab_parallel(
                    cfg.model, cfg.tp):  # a stage holding neither end: the vocabulary row shard of this tp rank
                like = like.chunk(cfg.tp)[self.mesh.coords["tp"]]
            if cfg.parallel.fsdp:
                like = like.chunk(cfg.dp)[self.mesh.coords["dp"]]
            self.tied_like = like
        if self.tied is not None and self.last and not self.first:
            self.norm_skip.add(id(self.tied))  # the first stage counts the tied weight's gradient once
        self._norm = 1.0
        self._listener = _NoListener()
        dtype = torch.bfloat16 if cfg.precision is Precision.BF16 else torch.float32
        self.stages = pipeline.pipeline_stages(cfg, stages, device, self.mesh.group("pp"), dtype)
        for st in self.stages:
            pipeline.marking(st, lambda: self._listener)
        self.schedule = pipeline.schedule(cfg, self.stages, lambda out, tgt: pipeline.token_loss(out, tgt, self._norm))

    def receive_buffers(self) -> list[torch.Tensor]:
        return pipeline.receive_buffers(self.stages)

    def reduce_gradients(self) -> None:
        if self.tied_like is not None:
            grad = self.tied.grad if self.tied is not None else None
            pipeline.sum_tied(grad, self.tied_like, self.mesh.group("pp"))
        super().reduce_gradients()

    def update(self, listener=None, micro_batches=None):
        self._listener = listener or _NoListener()
        self._listener.mark("data")
        batches = self.batches()
        tokens = torch.cat([t for t, _ in batches])
        targets = torch.cat([y for _, y in batches])
        del batches  # the schedule splits the whole batch into micro-batch views: one copy of the data, as a loop's
        local_useful = int(self._number((targets != -100).sum()))
        self._norm = self._global_useful(local_useful) / self.world
        losses: list = []
        kwargs = dict(target=targets, losses=losses) if self.last else {}
        args = (tokens,) if self.first else ()
        self._listener.mark("forward")
        with self._autocast(), tensor_parallel.loss_context(self.cfg):
            # return_outputs=False: the losses are what a training step needs; with the default True the last
            # stage's PipelineStage appends every micro-batch's output (the logits) to ``output_chunks`` and keeps
            # them all until the step ends (torch/distributed/pipelining/stage.py, forward_one_chunk)
            self.schedule.step(*args, return_outputs=False, **kwargs)
        # on the rank's device: NCCL reduces device tensors only
        total = torch.tensor([sum(self._number(x.detach()) for x in losses) * self._norm], device=self.device)
        dist.all_reduce(total, group=self.mesh.group("pp"))  # the last stage's loss, on every stage
        self._listener.mark("optimizer")
        result = self._step(float(total), local_useful)
        self._listener.mark("end")
        return result


def _fsdp(cfg: RunConfig, mesh: RankMesh, modules: list[nn.Module], blocks: nn.ModuleList) -> None:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    # outside a fake-tensor trace's mode (a no-op otherwise): FSDP2 x TP combines the two meshes' rank numbers
    # in real tensors; the parameters, fake in a trace, stay fake
    with unset_fake_temporarily():
        for module in modules:
            # a stage's blocks, or the whole model's (FSDP2 units: the activation-checkpoint wrapper where there is one)
            fsdp_units(cfg, mesh.sub("dp"), [*getattr(module, "blocks", blocks), module],
                       cfg.parallel.reshards_after_forward)


def build(cfg: RunConfig, device: torch.device, rank: int, mixin: type | None = None) -> tuple[Trainer, None]:
    """The Trainer of this rank of a TP / PP layout (no DDP comm monitor: gradient traffic is counted, not timed).
    ``mixin``: a class put before the Trainer's own (a trace's: what fake tensors cannot give, their values)."""
    check(cfg)
    layout = cfg.parallel
    mesh = RankMesh.build(layout, rank, device.type)
    torch.manual_seed(cfg.seed)
    workload = build_workload(cfg)
    model, blocks = workload.model, workload.blocks
    pp_rank = mesh.coords["pp"]
    mine = pipeline.local_layers(cfg, pp_rank)
    hf = cfg.model_kind is ModelSource.HF
    if layout.tensor_parallel:
        for i in mine:
            if hf:
                tensor_parallel.shard_hf_layer(blocks[i], mesh.sub("tp"))
            else:
                tensor_parallel.shard_block(blocks[i], cfg.model, mesh.sub("tp"), layout.sequence_parallel)
    wrapped = apply_ac(blocks, cfg.ac)
    stages = pipeline.split(model, cfg, pp_rank) if layout.pipelined else [(0, model)]
    if layout.tensor_parallel and hf:
        tensor_parallel.shard_hf_boundaries(model, cfg.model, mesh.sub("tp"))
    elif layout.tensor_parallel:
        for _, module in stages:
            tensor_parallel.shard_boundaries(module, cfg.model, layout.sequence_parallel, mesh.sub("tp"))
    modules = [m for _, m in stages]
    root = nn.ModuleList(modules) if layout.pipelined else model
    wrap = (lambda m: (_fsdp(cfg, mesh, modules, blocks), m)[1]) if layout.fsdp else None
    wl = Workload(root, None, workload.make_batch, workload.loss_sum, workload.description, workload.counted)
    tied = model.get_output_embeddings().weight if hf else model.head.weight
    tied = tied if cfg.model.tied_embeddings and layout.pipelined else None
    cls = PipelineTrainer if layout.pipelined else ShardedTrainer
    if mixin is not None:
        cls = type(f"{mixin.__name__}{cls.__name__}", (mixin, cls), {})
    extra = dict(stages=stages, tied=tied) if layout.pipelined else {}
    trainer = cls(cfg, device, workload=wl, mesh=mesh, wrap=wrap, **extra)
    trainer.wrapped_layers = [i for i in wrapped if i in mine]
    if layout.tensor_parallel and not layout.fsdp:  # after the Trainer's .to(device), which swaps DTensor parameters
        tensor_parallel.keep_gradient_placements(trainer.raw_model)
    return trainer, None
