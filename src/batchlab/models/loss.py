"""The loss paths of RunConfig.loss that run for real: full cross-entropy, and the chunked loss.

Chunked: the LM head and cross-entropy run over N token chunks, each under ``torch.utils.checkpoint``, so
only one chunk's logits (and their fp32 copy and log-softmax) are alive at a time, in forward and again in
backward (formula/loss.py counts it).  The fused kernel (``--loss fused``) is formula-only: it needs
flash-attn or Liger, which batchlab does not depend on.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from batchlab.config import ConfigError, LossMode, LossPolicy, ModelSource


def _chunk_loss(head: nn.Module, features: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(features).float(), targets, ignore_index=-100, reduction="sum")


def chunked_cross_entropy_sum(head: nn.Module, features: torch.Tensor, targets: torch.Tensor,
                              chunks: int) -> torch.Tensor:
    """Summed token cross-entropy of ``head(features)`` against ``targets`` over ``chunks`` token chunks."""
    flat, tgt = features.flatten(0, 1), targets.reshape(-1)
    fn = functools.partial(_chunk_loss, head)
    parts = [checkpoint(fn, f, t, use_reentrant=False) for f, t in zip(flat.chunk(chunks), tgt.chunk(chunks))]
    return torch.stack(parts).sum()


def _builtin_parts(model: nn.Module, tokens: torch.Tensor):
    return model.features(tokens), model.head


def _hf_parts(model: nn.Module, tokens: torch.Tensor):
    # base_model: the decoder without its LM head (GPT2LMHeadModel.transformer, LlamaForCausalLM.model), whose
    # output already went through the final norm
    return model.base_model(input_ids=tokens).last_hidden_state, model.get_output_embeddings()


def loss_fn(policy: LossPolicy, kind: ModelSource, full):
    """The workload's ``loss_sum(model, tokens, targets)`` for ``policy``; ``full`` is the source's own."""
    if policy.mode is LossMode.FULL:
        return full
    if policy.mode is LossMode.COMPILED:
        raise ConfigError("loss", "compiled (torch.compile of the loss) is formula-only; measure with full or chunked")
    if policy.mode is LossMode.CLASSIFIER:
        raise ConfigError("loss", "classifier (a pooled sequence classifier, no LM head) is formula-only; "
                                  "measure with full or chunked")
    if policy.mode in (LossMode.FUSED, LossMode.FUSED_LINEAR):
        raise ConfigError("loss", f"{policy} is formula-only (it needs flash-attn or Liger kernels); measure with "
                                  "chunked or full")
    if kind is ModelSource.FACTORY:
        raise ConfigError("loss", f"{policy} needs the model's features and LM head: the built-in or a Hugging "
                                  "Face model (a factory gives its own loss_sum)")
    parts = _builtin_parts if kind is ModelSource.BUILTIN else _hf_parts

    def loss_sum(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        features, head = parts(getattr(model, "module", model), tokens)  # under DDP: the wrapped module
        return chunked_cross_entropy_sum(head, features, targets, policy.chunks)

    return loss_sum
