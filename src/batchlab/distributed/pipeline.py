"""Pipeline parallelism on ``torch.distributed.pipelining``: the built-in GPT (or a Llama-family Hugging Face causal
LM, ``hf_stage.py``) cut into stages of consecutive blocks.

Each stage is a module built by hand from the model's own parts (``Stage``): the first holds the embedding, the last
the final norm and the LM head, every one its blocks (``Layout.stage_layers``).  Under an interleaved schedule a rank
holds ``virtual`` of them (chunk j of rank r is stage j·pp + r).  Each is wrapped in a ``PipelineStage`` (shapes given,
not inferred) and the rank's stages run under the schedule class of ``cfg.pp_schedule`` with the update's
``accum`` micro-batches; the loss (summed token cross-entropy over the update's useful-token count, as the harness
normalises it) is computed on the last stage.  One optimizer step per update after the schedule's ``step()``.

Tied embeddings (the LM head reading the embedding's weight): the first and the last stage each keep the weight and
their gradients are summed over the pipeline group before the step (Megatron-LM's embedding group), so both copies
take the same step.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from batchlab.config import ModelSource, PositionKind, RunConfig
from batchlab.measure.shards import local_shard
from batchlab.models.gpt import GPT, rope_tables


class Stage(nn.Module):
    """Blocks ``layers`` of ``model``, with the embedding when ``first``, the final norm and head when ``last``."""

    def __init__(self, model: GPT, layers: tuple[int, ...], first: bool, last: bool, seq: int):
        super().__init__()
        self.spec, self.seq = model.spec, seq
        if first:
            self.embed, self.pos, self.drop = model.embed, model.pos, model.drop
        self.blocks = nn.ModuleList(model.blocks[i] for i in layers)
        if last:
            self.norm_f, self.head = model.norm_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "embed"):
            tokens = x
            x = self.embed(tokens)
            if self.pos is not None:
                x = x + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
            x = self.drop(x)
        rope = None if self.spec.position is PositionKind.LEARNED else rope_tables(self.seq, self.spec.head_dim,
                                                                                   device=x.device)
        for block in self.blocks:
            x = block(x, rope)
        if hasattr(self, "head"):
            x = self.head(self.norm_f(x))
        return x


def stage_indices(cfg: RunConfig, pp_rank: int) -> list[int]:
    """The pipeline stages rank ``pp_rank`` holds: one, or ``virtual`` of them (r, r + pp, ...)."""
    layout = cfg.parallel
    return [j * layout.pp + pp_rank for j in range(layout.chunks)]


def split(model: nn.Module, cfg: RunConfig, pp_rank: int) -> list[tuple[int, nn.Module]]:
    """(stage index, stage module) of every stage rank ``pp_rank`` holds: ``Stage`` of the built-in GPT, ``HFStage``
    of a Llama-family Hugging Face model (a ConfigError naming ``pp`` for other classes)."""
    layout = cfg.parallel
    if cfg.model_kind is ModelSource.HF:
        from batchlab.distributed.hf_stage import HFStage, check_llama_like

        check_llama_like(model)
        make = lambda part, first, last: HFStage(model, part, first, last)  # noqa: E731
    else:
        make = lambda part, first, last: Stage(model, part, first, last, cfg.seq)  # noqa: E731
    layers = layout.stage_layers(cfg.model.layers, pp_rank)
    per = len(layers) // layout.chunks
    count = layout.pp * layout.chunks
    out = []
    for j, index in enumerate(stage_indices(cfg, pp_rank)):
        out.append((index, make(layers[j * per:(j + 1) * per], index == 0, index == count - 1)))
    return out


def local_layers(cfg: RunConfig, pp_rank: int) -> tuple[int, ...]:
    return cfg.parallel.stage_layers(cfg.model.layers, pp_rank) if cfg.parallel.pipelined else tuple(
        range(cfg.model.layers))


def schedule(cfg: RunConfig, stages: list, loss_fn):
    """The schedule class of ``cfg.pp_schedule`` (its ``.api`` name) over this rank's PipelineStages."""
    import torch.distributed.pipelining as pipelining

    spec = cfg.parallel.schedule_spec
    cls = getattr(pipelining, spec.api)
    # scale_grads=False: the loss is already normalised by the update's useful tokens (as the harness does)
    if spec.virtual:
        return cls(stages, n_microbatches=cfg.accum, loss_fn=loss_fn, scale_grads=False)
    return cls(stages[0], n_microbatches=cfg.accum, loss_fn=loss_fn, scale_grads=False)


def pipeline_stages(cfg: RunConfig, modules: list[tuple[int, nn.Module]], device: torch.device, group,
                    activation_dtype: torch.dtype):
    """``PipelineStage`` per (index, module), with the activation shapes given (micro-batch, this rank's sequence
    slice under sequence parallelism, hidden; the last stage's logits): no inference pass before the first step."""
    from torch.distributed.pipelining import PipelineStage

    count = cfg.parallel.pp * cfg.parallel.chunks
    b, s, h = cfg.micro_batch, cfg.seq, cfg.model.hidden
    local_s = s // cfg.tp if cfg.sequence_parallel else s
    # requires_grad: what the stage's metadata says activations and their gradients do (sent back in backward)
    hidden = torch.empty(b, local_s, h, dtype=activation_dtype, device=device, requires_grad=True)
    out = []
    for index, module in modules:
        inp = torch.zeros(b, s, dtype=torch.long, device=device) if index == 0 else hidden
        outp = torch.empty(b, s, cfg.model.vocab, dtype=activation_dtype, device=device,
                           requires_grad=True) if index == count - 1 else hidden
        out.append(PipelineStage(module, index, count, device, input_args=(inp,), output_args=(outp,), group=group))
    return out


def receive_buffers(stages) -> list[torch.Tensor]:
    """The buffers each PipelineStage allocates once and receives into at every step: per micro-batch, the
    activations from the previous stage and the gradients from the next (``_RecvInfo.buffer``; the root input and
    the last stage's loss have none).  They outlive the update, as parameters do."""
    out = []
    for st in stages:
        for infos in list(st.args_recv_info.values()) + list(st.grad_recv_info.values()):
            out += [i.buffer for i in infos if getattr(i, "buffer", None) is not None and not i.is_root_arg]
    return out


def token_loss(output: torch.Tensor, target: torch.Tensor, norm: float) -> torch.Tensor:
    """The last stage's loss of one micro-batch: summed token cross-entropy over the update's normaliser."""
    loss = F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), target.reshape(-1), ignore_index=-100,
                           reduction="sum")
    return loss / norm


def marking(stage, listener_of):
    """Tell the update's phase listener when a stage runs a micro-batch's forward or backward."""
    for name, phase in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward")):
        original = getattr(stage, name)

        @functools.wraps(original)
        def wrapped(*args, _original=original, _phase=phase, **kwargs):
            listener_of().mark(_phase)
            return _original(*args, **kwargs)

        setattr(stage, name, wrapped)


@torch.no_grad()
def sum_tied(grad: torch.Tensor | None, like: torch.Tensor, group) -> None:
    """Sum the tied embedding / head gradient over the pipeline group, in place (zeros from stages holding
    neither end: ``like`` gives their shape)."""
    local = local_shard(grad) if grad is not None else torch.zeros_like(like)
    dist.all_reduce(local, group=group)
