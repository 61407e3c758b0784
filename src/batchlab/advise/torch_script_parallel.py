"""The printed PyTorch script's tensor- and pipeline-parallel parts (``cfg.tp > 1`` or ``cfg.pp > 1``).

World = DP x TP x PP ranks on one ``init_device_mesh`` of shape (PP, DP, TP), row-major (tensor-parallel ranks
adjacent, as Megatron-LM and torchtitan place them).  Built on every rank from the same seeded stand-in, in
batchlab's harness order (distributed/layouts.py): tensor parallelism on the blocks (``parallelize_module`` with
``ColwiseParallel`` / ``RowwiseParallel``, and ``SequenceParallel`` + ``PrepareModuleInput`` with sequence
parallelism), activation checkpointing, the pipeline stages this rank holds (``torch.distributed.pipelining``:
``PipelineStage`` and the schedule class of ``cfg.pp_schedule``, ``accum`` micro-batches per step), then the data
dimension: FSDP2 ``fully_shard`` on the DP sub-mesh at ZeRO-2/3, else every gradient averaged over the DP group
once per update (DDP's result without its buckets: DDP takes no DTensor parameters nor pipeline stages).
Torch-free (this module only writes text); ``torch_script.py`` assembles the script.
"""
from __future__ import annotations

import math

from batchlab.config import Precision, RunConfig
from batchlab.config.engines import TPOverlap


def _fsdp(cfg: RunConfig) -> bool:
    """FSDP2 on the DP dimension: ZeRO-2/3 (DeepSpeed's stages printed as their PyTorch counterpart, as without TP
    and PP)."""
    return cfg.parallel.shards_gradients


def applies(cfg: RunConfig) -> bool:
    return cfg.tp > 1 or cfg.pp > 1


def unsupported(cfg: RunConfig) -> str | None:
    """Why no script is written for ``cfg`` (a comment in its place), or None."""
    if cfg.precision is Precision.FP16_MIXED:
        return ("fp16-mixed's dynamic loss scaling needs one overflow verdict over every tensor and pipeline rank, "
                "which GradScaler does not reach: print this script with --precision bf16-mixed")
    return None


def stand_in_heads(cfg: RunConfig) -> int:
    """The stand-in's heads (of width 16 each): 4, or the least multiple of 4 that TP divides (each tensor-parallel
    rank computes heads / TP whole heads); the same stand-in as TP = 1 wherever TP divides 4."""
    return math.lcm(4, cfg.tp)


def strategy(cfg: RunConfig) -> str:
    layout = cfg.parallel
    parts = []
    if layout.tp > 1:
        parts.append(f"TP {layout.tp}" + (" with sequence parallelism" if layout.sequence_parallel else ""))
    if layout.pp > 1:
        parts.append(f"PP {layout.pp} {layout.schedule.value} ({layout.schedule_spec.api}"
                     + (f", {layout.virtual} stages per rank" if layout.chunks > 1 else "") + ")")
    if layout.dp > 1:
        parts.append(f"DP {layout.dp} as " + ("FSDP2 fully_shard on the DP sub-mesh, reshard_after_forward="
                                              f"{layout.reshards_after_forward}" if _fsdp(cfg) else
                                              "one gradient all-reduce over the DP group per update"))
    note = ("; ZeroRedundancyOptimizer takes no DTensor parameters nor pipeline stages: the optimizer state stays "
            "whole (--zero 2 shards it)" if layout.dp > 1 and cfg.zero == 1 else "")
    if layout.tp_overlap is not TPOverlap.NONE:  # the script runs eagerly: async TP is inductor's pass on CUDA
        note += ("; the TP collectives run plain here: --tp-overlap async is torch.compile's micro-pipeline TP on CUDA "
                 "(torch._inductor.config._micro_pipeline_tp = True, symmetric memory enabled for the TP group)")
    return "; ".join(parts) + note


def imports(cfg: RunConfig) -> list[str]:
    out = ["import gc", "import os", "", "import torch", "import torch.distributed as dist",
           "from torch.distributed.device_mesh import init_device_mesh"]
    if _fsdp(cfg):
        out.append("from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard")
    if cfg.pp > 1:
        out.append(f"from torch.distributed.pipelining import PipelineStage, {cfg.parallel.schedule_spec.api}")
    if cfg.tp > 1:
        styles = "ColwiseParallel, RowwiseParallel, parallelize_module"
        if cfg.sequence_parallel:
            out.append("from torch.distributed.tensor import Replicate, Shard")
            styles = ("ColwiseParallel, PrepareModuleInput, PrepareModuleOutput, RowwiseParallel, SequenceParallel, "
                      "parallelize_module")
        out.append(f"from torch.distributed.tensor.parallel import {styles}")
    return out


def consts(cfg: RunConfig) -> list[str]:
    return [f"TP, PP, VIRTUAL = {cfg.tp}, {cfg.pp}, {cfg.parallel.chunks}  # VIRTUAL: pipeline stages per rank"]


def devices(cfg: RunConfig) -> list[str]:
    return ['dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")  # torchrun sets rank, world',
            "rank = dist.get_rank()",
            "if dist.get_world_size() != DP * TP * PP:",
            '    raise SystemExit(f"this config is for DP x TP x PP = {DP} x {TP} x {PP} = {DP * TP * PP} processes; '
            'launched {dist.get_world_size()}")',
            "if torch.cuda.is_available():",
            '    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))',
            "    torch.cuda.set_device(device)",
            "else:",
            '    device = torch.device("cpu")',
            "# ranks row-major over (pp, dp, tp): tensor-parallel ranks adjacent, the chattiest group on the nearest",
            'mesh = init_device_mesh(device.type, (PP, DP, TP), mesh_dim_names=("pp", "dp", "tp"))',
            'pp_rank, dp_rank, tp_rank = (mesh[n].get_local_rank() for n in ("pp", "dp", "tp"))']


def tensor_parallel(cfg: RunConfig) -> list[str]:
    """Megatron's split of each block (Shoeybi et al. 2019): q, k, v and the MLP's first linear by columns, the
    attention output and the MLP's second linear by rows; with sequence parallelism (Korthikanti et al. 2022) the
    norms on this rank's slice of the sequence, the row-wise outputs reduce-scattered to it, the attention and MLP
    inputs all-gathered from it (torchtitan's plan)."""
    if cfg.tp == 1:
        return []
    sp = cfg.sequence_parallel
    rows = "RowwiseParallel(output_layouts=Shard(1))" if sp else "RowwiseParallel()"
    out = ["# tensor parallelism: each TP rank computes heads / TP whole heads and 1/TP of the MLP; one all-reduce"
           + (" (SP: a reduce-scatter and an all-gather)" if sp else "") + " per row-wise linear in forward and backward",
           "PLAN = {  # the stand-in's module names: yours where you replaced it"]
    if sp:
        gather = ('PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), '
                  'use_local_output=True)')
        out += ['    "norm1": SequenceParallel(), "norm2": SequenceParallel(),  # on this rank\'s slice of the sequence',
                f'    "attn": {gather},', f'    "mlp": {gather},']
    out += ['    "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),',
            f'    "attn.proj": {rows}, "mlp.0": ColwiseParallel(), "mlp.2": {rows},', "}",
            "for block in model.layers:",
            '    parallelize_module(block, mesh["tp"], PLAN)']
    if sp:
        out += ["assert SEQ % TP == 0, (SEQ, TP)  # sequence parallelism: TP equal slices of the sequence",
                "# the blocks' ends: the first block's input cut to this rank's slice of the sequence (no communication),",
                "# the last block's output gathered whole for the head; the embedding and head stay whole on every TP rank",
                'parallelize_module(model.layers[0], mesh["tp"], PrepareModuleInput(input_layouts=(Replicate(),), '
                'desired_input_layouts=(Shard(1),), use_local_output=True))',
                'parallelize_module(model.layers[-1], mesh["tp"], PrepareModuleOutput(output_layouts=Shard(1), '
                'desired_output_layouts=Replicate(), use_local_output=True))']
    else:
        out.append("# the embedding and the head stay whole on every TP rank (equal inputs, equal gradients)")
    return out


_STAGE = '''\
class Stage(torch.nn.Module):
    """Pipeline stage i: blocks i*per .. (i+1)*per - 1 of model.layers, with model.embed on the first stage and
    model.head on the last; its forward is the model's, cut (edit it to match your model's forward)."""

    def __init__(self, model, i, count):
        super().__init__()
        per = len(model.layers) // count
        self.embed = model.embed if i == 0 else None
        self.layers = torch.nn.ModuleList(model.layers[i * per:(i + 1) * per])
        self.head = model.head if i == count - 1 else None

    def forward(self, h):
        if self.embed is not None:
            h = self.embed(h)
        for layer in self.layers:
            h = layer(h)
        return self.head(h.flatten(0, 1)) if self.head is not None else h
'''


def pipeline(cfg: RunConfig) -> list[str]:
    """This rank's stages (interleaved: rank r holds stages r, r + PP, ..., Narayanan et al. 2021 sec. 2.2)."""
    if cfg.pp == 1:
        return ["stages = [model]"]
    return [_STAGE,
            "STAGES = PP * VIRTUAL",
            "assert len(model.layers) % STAGES == 0, (len(model.layers), STAGES)",
            "mine = [j * PP + pp_rank for j in range(VIRTUAL)]  # the stage indices this rank holds",
            "# every rank built the whole model and keeps its stages (a model too big for one device: build it on",
            '# torch.device("meta") and materialise each stage with to_empty + init)',
            "stages = [Stage(model, i, STAGES) for i in mine]",
            "del model"]


def wrap(cfg: RunConfig, half: str | None, optimizer: str) -> list[str]:
    """Precision, FSDP2 on the DP sub-mesh, the PipelineStages and schedule, the optimizer (``optimizer``: its
    constructor with ``PARAMS`` where the parameters go)."""
    layout = cfg.parallel
    out = []
    if cfg.precision is Precision.BF16:
        out += ["for stage in stages:", "    stage.to(torch.bfloat16)  # pure bf16: weights, gradients, optimizer state"]
    out += ["for stage in stages:", "    stage.to(device)"]
    if _fsdp(cfg):
        mp = (f"MixedPrecisionPolicy(param_dtype={half}, reduce_dtype=torch.float32)" if half else
              "MixedPrecisionPolicy()")
        out += [f"mp = {mp}",
                "for stage in stages:  # FSDP2 on the DP sub-mesh (2-D / 3-D mesh): per block, then the stage",
                "    for block in stage.layers:",
                f'        fully_shard(block, mesh=mesh["dp"], mp_policy=mp, '
                f"reshard_after_forward={layout.reshards_after_forward})",
                f'    fully_shard(stage, mesh=mesh["dp"], mp_policy=mp, '
                f"reshard_after_forward={layout.reshards_after_forward})"]
    if layout.pipelined:
        spec = layout.schedule_spec
        out += ["# shapes inferred from the first micro-batch; the loss (already over ACCUM, as the loop without a",
                "# pipeline divides it) on the last stage, scale_grads=False: no second division",
                'pipe = [PipelineStage(s, i, STAGES, device, group=mesh["pp"].get_group()) for s, i in zip(stages, mine)]',
                f"schedule = {spec.api}({'pipe' if spec.virtual else 'pipe[0]'}, n_microbatches=ACCUM, "
                "loss_fn=lambda out, y: loss_fn(out, y) / ACCUM, scale_grads=False)",
                "FIRST, LAST = 0 in mine, STAGES - 1 in mine"]
    params = "[p for s in stages for p in s.parameters()]"
    out.append(f"optimizer = {optimizer.replace('PARAMS', params)}"
               + ("  # after fully_shard: sharded state" if _fsdp(cfg) else ""))
    return out


def loader(cfg: RunConfig) -> list[str]:
    """Every TP and PP rank of one replica reads the same micro-batches (the same seeded order)."""
    if cfg.dp == 1:  # the order of the script without tensor or pipeline ranks
        return ["loader = DataLoader(dataset, batch_size=MICRO_BATCH, shuffle=True, drop_last=True,",
                "                    generator=torch.Generator().manual_seed(0))  # a seeded order, the same on every rank"]
    return ["# DP shares: every TP and PP rank of one replica reads the same micro-batches",
            "sampler = DistributedSampler(dataset, num_replicas=DP, rank=dp_rank, shuffle=True, seed=0, drop_last=True)",
            "sampler.set_epoch(0)  # once per epoch: a new shuffle",
            "loader = DataLoader(dataset, batch_size=MICRO_BATCH, sampler=sampler, drop_last=True)"]


def _reduce(cfg: RunConfig, indent: str) -> list[str]:
    """DP without FSDP2: each gradient (this rank's shard of a DTensor's) averaged over the DP group."""
    if cfg.dp == 1 or _fsdp(cfg):
        return []
    return [indent + line for line in (
        "with torch.no_grad():  # data parallelism: every gradient averaged over the DP group, once per update",
        "    for p in (p for s in stages for p in s.parameters() if p.grad is not None):",
        '        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # a DTensor\'s local shard',
        '        dist.all_reduce(g, group=mesh["dp"].get_group())',
        "        g.div_(DP)")]


def _optimizer_step(cfg: RunConfig, indent: str) -> list[str]:
    return [indent + "optimizer.step()", indent + "optimizer.zero_grad(set_to_none=True)"]


def loop(cfg: RunConfig, half: str | None, step: list[str]) -> list[str]:
    """The training loop; ``step``: forward and backward of one micro-batch without a pipeline (torch_script's)."""
    autocast = half and not _fsdp(cfg)  # FSDP2's MixedPrecisionPolicy casts instead
    printer = "rank == 0" if cfg.pp == 1 else "LAST and dp_rank == 0 and tp_rank == 0"
    if cfg.pp == 1:
        out = ["model = stages[0]", "for step, (x, y) in enumerate(loader):", "    x, y = x.to(device), y.to(device)",
               "    last = (step + 1) % ACCUM == 0  # the last micro-batch of an update"]
        if _fsdp(cfg):
            out += ["    model.set_requires_gradient_sync(last)  # reduce-scatter on the last micro-batch only"]
        out += ["    " + line for line in step] + ["    if last:"] + _reduce(cfg, "        ")
        out += _optimizer_step(cfg, "        ") + [
            f"        if {printer}:",
            '            print(f"update {(step + 1) // ACCUM}: loss {loss.item() * ACCUM:.4f}", flush=True)']
    else:
        out = ["batch = []",
               "for step, (x, y) in enumerate(loader):",
               "    batch.append((x.to(device), y.to(device)))",
               "    if len(batch) < ACCUM:",
               "        continue",
               "    # one update: the schedule splits the ACCUM micro-batches back apart and runs them through the stages",
               "    x, y = torch.cat([b[0] for b in batch]), torch.cat([b[1] for b in batch])",
               "    batch, losses = [], []",
               "    kwargs = dict(target=y, losses=losses) if LAST else {}"]
        run = "schedule.step(*([x] if FIRST else []), return_outputs=False, **kwargs)"
        if autocast:
            out += [f"    with torch.autocast(device.type, dtype={half}):", "        " + run]
        else:
            out += ["    " + run]
        out += _reduce(cfg, "    ") + _optimizer_step(cfg, "    ") + [
            f"    if {printer}:  # the last micro-batch's loss, on the last stage",
            '        print(f"update {(step + 1) // ACCUM}: loss {losses[-1].item() * ACCUM:.4f}", flush=True)',
            "del schedule, pipe"]
    # gloo work held by FSDP2 and the stages: freed while the group lives (docs/cpu.md)
    return out + ["del stages, optimizer", "gc.collect()", "dist.destroy_process_group()"]
