"""Model sources the harness and the trace can train: the built-in GPT, Hugging Face configs, user factories.

A Workload is what one training update needs from a model source, whatever it is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from batchlab.config import Counted, DataKind, Implementation, MLPKind, ModelSource, RunConfig

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


# The installed code nearest to each implementation that is not installed here (formula/activations.py's terms):
# transformers' Llama has torchtitan's separate q/k/v and gate/up projections; batchlab's GPT has nanoGPT's fused
# qkv and fused GELU, and Megatron's fused qkv and Korthikanti's layer (with its own Python-op extras).
STAND_IN = {Implementation.TORCHTITAN: Implementation.HF, Implementation.NANOGPT: Implementation.BATCHLAB,
            Implementation.MEGATRON: Implementation.BATCHLAB}


def runnable(cfg: RunConfig) -> RunConfig:
    """The config whose code the harness runs: a preset with ``--impl hf`` is built with transformers' class of
    its family (what the calculator counts for it), as ``hf:gpt2`` / ``hf:llama-2-7b`` with its shape; torchtitan
    and nanoGPT are not installed here, so their shapes run as the nearest installed code (``STAND_IN``)."""
    if cfg.model_kind is not ModelSource.BUILTIN:
        return cfg
    if STAND_IN.get(cfg.model.impl, cfg.model.impl) is Implementation.HF:
        family = "llama-2-7b" if cfg.model.mlp is MLPKind.SWIGLU else "gpt2"
        stand_in = cfg.model.impl is not Implementation.HF  # torchtitan's Llama has no KV cache
        return cfg.replace(model_source="hf:" + family, impl=Implementation.HF,
                           use_cache=False if stand_in else cfg.model.use_cache)
    return cfg


def stand_in_text(cfg: RunConfig) -> str | None:
    """What runs in place of the config's implementation when it is not installed here, else None."""
    if cfg.model_kind is not ModelSource.BUILTIN or cfg.model.impl not in STAND_IN:
        return None
    return f"{cfg.model.impl.label} is not installed here: {STAND_IN[cfg.model.impl].label} runs in its place"


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
