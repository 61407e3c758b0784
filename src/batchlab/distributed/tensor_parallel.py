"""Tensor parallelism (Shoeybi et al. 2019, Megatron-LM) on DTensor: ``parallelize_module`` over the tp mesh.

Per transformer block: attention's q/k/v column-wise (each rank whole heads), its output projection row-wise, the
MLP's gate/up column-wise and down row-wise, so a block costs one all-reduce in forward and one in backward per
row-wise layer.  With sequence parallelism (Korthikanti et al. 2022) the norms run under ``SequenceParallel`` on
this rank's slice of the sequence, the row-wise outputs are reduce-scattered to that slice (``Shard(1)``) and the
attention / MLP inputs all-gathered from it, as torchtitan's ``parallelize_llama`` plans it; the dropouts after
the row-wise layers then see the sequence slice too.  The embedding, final norm and LM head stay replicated
(whole on every tensor-parallel rank; their gradients come out equal on every rank).

The built-in GPT fuses q, k and v into one ``qkv`` weight: its rows are reordered before sharding so that rank r's
contiguous slice is ``[q heads of r; k heads of r; v heads of r]`` (the model reads its local head count from the
width of that slice).  Hugging Face Llama-family models (separate q/k/v projections) take the same plan under their
own names (their attention infers its local head count from the projection's width); sequence parallelism is
planned for the built-in GPT only.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from batchlab.config import ConfigError, ModelSpec
from batchlab.measure.shards import local_shard


def _styles():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    return Replicate, Shard, ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput


def qkv_order(spec: ModelSpec, tp: int) -> torch.Tensor:
    """Row permutation of the fused qkv weight ``[q; k; v]`` that makes rank r's contiguous 1/tp slice hold its own
    whole heads ``[q_r; k_r; v_r]``."""
    d = spec.head_dim
    q, kv = spec.heads * d, spec.kv_heads * d
    rows = []
    for r in range(tp):
        for start, width in ((0, q), (q, kv), (q + kv, kv)):
            part = width // tp
            rows.append(torch.arange(start + r * part, start + (r + 1) * part))
    return torch.cat(rows)


@torch.no_grad()
def reorder_qkv(block: nn.Module, spec: ModelSpec, tp: int) -> None:
    order = qkv_order(spec, tp)
    lin = block.attn.qkv
    lin.weight.data = lin.weight.data[order].contiguous()
    if lin.bias is not None:
        lin.bias.data = lin.bias.data[order].contiguous()


def block_plan(names: dict[str, list[str]], sp: bool) -> dict:
    """The plan of one block; ``names``: its column-wise / row-wise linears, norms, attention and MLP modules."""
    Replicate, Shard, Colwise, Rowwise, SequenceParallel, PrepareModuleInput = _styles()
    plan: dict = {n: Colwise() for n in names["colwise"]}
    out = dict(output_layouts=Shard(1)) if sp else {}
    plan.update({n: Rowwise(**out) for n in names["rowwise"]})
    if sp:
        plan.update({n: SequenceParallel() for n in names["norms"]})
        plan[names["attention"]] = PrepareModuleInput(input_layouts=(Shard(1), None),
                                                      desired_input_layouts=(Replicate(), None),
                                                      use_local_output=True)
        plan[names["mlp"]] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                use_local_output=True)
    return plan


def _gpt_names(block: nn.Module) -> dict[str, list[str]]:
    col = ["attn.qkv", "mlp.up"] + (["mlp.gate"] if hasattr(block.mlp, "gate") else [])
    return dict(colwise=col, rowwise=["attn.proj", "mlp.down"], norms=["norm1", "norm2"], attention="attn", mlp="mlp")


def vocab_parallel(spec: ModelSpec, tp: int) -> bool:
    """Embedding and LM head split over the vocabulary where it divides evenly (else they stay replicated)."""
    return spec.vocab % tp == 0


def boundary_plan(module: nn.Module, first_block: str | None, sp: bool, vocab: bool) -> dict:
    """The model's (or a stage's) ends.  ``vocab``: the embedding row-wise over the vocabulary (its output
    all-reduced whole), the LM head column-wise over it with its logits left sharded on the vocabulary (a DTensor,
    ``Shard(-1)``) for the loss to run under ``loss_parallel()`` (``loss_context``), as torchtitan's
    ``parallelize_llama`` plans its output layer with loss parallelism on.
    ``sp``: the embedding's output sliced to this rank's part of the sequence before the first block (no
    communication), the final norm on the slice, the head's input gathered."""
    Replicate, Shard, Colwise, Rowwise, SequenceParallel, PrepareModuleInput = _styles()
    plan: dict = {}
    if hasattr(module, "embed"):
        if vocab:
            plan["embed"] = Rowwise(input_layouts=Replicate(), output_layouts=Replicate())
        if sp and first_block is not None:
            plan[first_block] = PrepareModuleInput(input_layouts=(Replicate(), None),
                                                   desired_input_layouts=(Shard(1), None), use_local_output=True)
    if hasattr(module, "head"):
        if sp:
            plan["norm_f"] = SequenceParallel()
        if vocab:
            plan["head"] = Colwise(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Shard(-1),
                                   use_local_output=False)
        elif sp:
            plan["head"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                              use_local_output=True)
    return plan


def loss_context(cfg):
    """``loss_parallel()`` where the measured engine splits the LM head over the vocabulary (the built-in GPT, tp
    dividing the vocabulary): cross-entropy on each rank's vocabulary shard of the logits, its max, sum-exp and
    target logit all-reduced (torch/distributed/tensor/parallel/loss.py; Megatron's vocab-parallel cross entropy),
    forward and backward inside it; else nothing (the logits are whole on every rank)."""
    import contextlib

    if not cfg.vocab_parallel:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def shard_block(block: nn.Module, spec: ModelSpec, tp_mesh, sp: bool) -> None:
    """Shard one built-in GPT block over ``tp_mesh`` (its qkv rows reordered first: whole heads per rank)."""
    from torch.distributed.tensor.parallel import parallelize_module

    reorder_qkv(block, spec, tp_mesh.size())
    parallelize_module(block, tp_mesh, block_plan(_gpt_names(block), sp))


HF_COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
HF_ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def shard_hf_layer(layer: nn.Module, tp_mesh) -> None:
    """Shard one Hugging Face Llama-family decoder layer (separate q/k/v, SwiGLU MLP) over ``tp_mesh``: its
    attention views q/k/v as ``(-1, head_dim)``, so it runs on its local heads as it is."""
    from torch.distributed.tensor.parallel import parallelize_module

    names = {n for n, _ in layer.named_modules()}
    missing = [n for n in HF_COLWISE + HF_ROWWISE if n not in names]
    if missing:
        raise ConfigError("tp", f"{type(layer).__name__} has no {missing[0]}: measured tensor parallelism takes the "
                                "built-in GPT or a Llama-family Hugging Face model (q/k/v/o_proj, gate/up/down_proj)")
    parallelize_module(layer, tp_mesh, block_plan(dict(colwise=list(HF_COLWISE), rowwise=list(HF_ROWWISE)), False))


def shard_hf_boundaries(model: nn.Module, spec: ModelSpec, tp_mesh) -> None:
    """A Hugging Face causal LM's token embedding and LM head over the vocabulary (``boundary_plan``, as for the
    built-in GPT) where tp divides it: the logits stay sharded for the model's own loss under ``loss_context``."""
    from torch.distributed.tensor.parallel import parallelize_module

    if not vocab_parallel(spec, tp_mesh.size()):
        return
    Replicate, Shard, Colwise, Rowwise, _, _ = _styles()
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    names = {id(m): n for n, m in model.named_modules()}
    if embed is None or head is None or id(embed) not in names or id(head) not in names:
        return
    parallelize_module(model, tp_mesh, {
        names[id(embed)]: Rowwise(input_layouts=Replicate(), output_layouts=Replicate()),
        names[id(head)]: Colwise(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False)})
    if spec.tied_embeddings:
        head.weight = embed.weight


def shard_boundaries(module: nn.Module, spec: ModelSpec, sp: bool, tp_mesh) -> None:
    """The model's (or a pipeline stage's) ends (``boundary_plan``); a tied head re-tied to the sharded embedding
    (each took its own DTensor parameter; both are the vocabulary's row shard of this rank)."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan = boundary_plan(module, "blocks.0" if len(module.blocks) else None, sp, vocab_parallel(spec, tp_mesh.size()))
    if plan:
        parallelize_module(module, tp_mesh, plan)
    if spec.tied_embeddings and hasattr(module, "embed") and hasattr(module, "head"):
        module.head.weight = module.embed.weight


def keep_gradient_placements(module: nn.Module) -> None:
    """Every sharded parameter's gradient in the parameter's own placement.  The vocabulary-sharded embedding's
    backward gives a replicated (whole) weight gradient: without this it would be kept whole on every rank;
    with it each rank keeps its rows (a local slice, no communication)."""
    from torch.distributed.tensor import DTensor

    def hook(param):
        def to_placement(grad):
            if isinstance(grad, DTensor) and grad.placements != param.placements:
                return grad.redistribute(param.device_mesh, param.placements)
            return grad
        return to_placement

    for p in module.parameters():
        if isinstance(p, DTensor) and p.requires_grad:
            p.register_hook(hook(p))


# -- gradient norm and data-parallel reduction over sharded parameters




@torch.no_grad()
def clip_grad_norm(params, max_norm: float, group=None, skip=frozenset()) -> torch.Tensor:
    """``clip_grad_norm_`` over parameters that are DTensors (tensor- and / or FSDP-sharded, each on its own
    mesh) or plain replicated tensors: each sharded gradient's squared local norm summed over the mesh dimensions
    it is sharded on, replicated ones counted once; ``group``: the pipeline group, whose stages hold different
    parameters, summed over it too; ``skip``: ids of parameters another stage counts).  Every rank gets the same
    total norm and scales its local shards by it."""
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    counted = [p.grad for p in params if id(p) not in skip]
    sums: dict[tuple, torch.Tensor] = {}
    meshes: dict[tuple, object] = {}
    for g in counted:
        placements = getattr(g, "placements", ())
        dims = tuple(i for i, pl in enumerate(placements) if pl.is_shard())
        key = (id(g.device_mesh), dims) if placements else (None, ())
        local = local_shard(g).detach().float().pow(2).sum()
        sums[key] = sums.get(key, 0) + local
        if placements:
            meshes[key] = g.device_mesh
    # on the gradients' device: NCCL reduces device tensors only, and the local sums live there
    total = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else None)
    for key, value in sums.items():
        value = torch.as_tensor(value, dtype=torch.float32)
        for dim in key[1]:
            dist.all_reduce(value, group=meshes[key].get_group(dim))
        total += value
    if group is not None:
        dist.all_reduce(total, group=group)
    norm = total.sqrt()
    # clamped, not branched on, as torch.nn.utils.clip_grad_norm_ does: no value read (a fake-tensor trace runs it)
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        local_shard(g).mul_(coef)
    return norm


@torch.no_grad()
def all_reduce_gradients(params, group, size: int) -> None:
    """Data parallelism without DDP's buckets: every gradient (this rank's shard of it) averaged over ``group``
    once per update, after the last micro-batch's backward."""
    for p in params:
        if p.grad is not None:
            g = local_shard(p.grad)
            dist.all_reduce(g, group=group)
            g.div_(size)
