"""Model sources the harness and the trace can train: the built-in GPT, Hugging Face configs, user factories.

A Workload is what one training update needs from a model source, whatever it is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from batchlab.config import Counted, DataKind, ModelSource, RunConfig
from batchlab.config.standin import runnable, stand_in_text


# make_batch(generator, micro_batch, seq, device) -> (tokens, targets); targets use -100 for padding.
BatchMaker = Callable[[torch.Generator, int, int, torch.device], tuple[torch.Tensor, torch.Tensor]]
# loss_sum(model, tokens, targets) -> summed token loss (normalised by the harness over the whole update).
LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Workload:
    model: nn.Module
    blocks: nn.ModuleList | None  # the repeated layers: where activation checkpointing applies
    make_batch: BatchMaker
    loss_sum: LossFn
    description: str
    counted: Counted = Counted.TOKENS  # what throughput counts: tokens, or samples (targets one per example)


def synthetic_tokens(vocab: int, data: DataKind) -> BatchMaker:
    """Random tokens from a seeded generator; ``padded``: lengths uniform in [seq/2, seq], the rest -100."""

    def make(gen: torch.Generator, micro_batch: int, seq: int, device: torch.device):
        tokens = torch.randint(0, vocab, (micro_batch, seq + 1), generator=gen)
        inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
        if data is DataKind.PADDED:
            lengths = torch.randint(seq // 2, seq + 1, (micro_batch,), generator=gen)
            pad = torch.arange(seq)[None, :] >= lengths[:, None]
            targets[pad] = -100
            inputs[pad] = 0
        return inputs.to(device), targets.to(device)

    return make


def _builtin_loss(model, tokens, targets):
    return model(tokens, targets, loss_sum=True)


def build_workload(cfg: RunConfig) -> Workload:
    """The workload for cfg.model_source (random init, nothing downloaded), with cfg.loss's loss path."""
    from batchlab.models.loss import loss_fn

    stand_in = stand_in_text(cfg)
    cfg = runnable(cfg)
    wl = _source_workload(cfg)
    if stand_in:
        wl.description += f"; {stand_in}"
    wl.loss_sum = loss_fn(cfg.loss, cfg.model_kind, wl.loss_sum)
    return wl


def _source_workload(cfg: RunConfig) -> Workload:
    if cfg.model_kind is ModelSource.BUILTIN:
        from batchlab.models.gpt import GPT

        model = GPT(cfg.model)
        return Workload(model, model.blocks, synthetic_tokens(cfg.model.vocab, cfg.data), _builtin_loss,
                        f"built-in GPT ({cfg.model.name})")
    if cfg.model_kind is ModelSource.HF:
        from batchlab.models.hf import build_hf_workload

        return build_hf_workload(cfg)
    from batchlab.models.factory import build_factory_workload

    return build_factory_workload(cfg)
