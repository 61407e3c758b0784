"""Activation checkpointing for a model's repeated blocks, driven by the config's ACPolicy.

Activation checkpointing recomputes a block's forward during backward to avoid keeping its activations;
it is not the training checkpoint saved to disk.  One function applies the policy for every model source
(built-in, Hugging Face, user factory), so the harness and the trace run the same wrapping.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from batchlab.config import ACPolicy

_aten = torch.ops.aten
# Selective: keep what is expensive to recompute (the linear layers' matmul outputs), recompute the
# cheap element-wise ops and the attention core (Korthikanti et al. 2022, sec. 5: "selective recompute").
_SAVE = {_aten.mm.default, _aten.addmm.default}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


class Checkpointed(nn.Module):
    """Wraps one block; its forward runs under torch.utils.checkpoint (non-reentrant, RNG preserved)."""

    def __init__(self, block: nn.Module, selective: bool):
        super().__init__()
        self.block = block
        self.selective = selective

    def forward(self, *args, **kwargs):
        context_fn = (functools.partial(create_selective_checkpoint_contexts, _selective_policy)
                      if self.selective else None)
        extra = {"context_fn": context_fn} if context_fn else {}
        # preserve_rng_state=True: dropout in the recompute draws the same mask as the forward did.
        return checkpoint(self.block, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)


def apply_ac(blocks: nn.ModuleList, policy: ACPolicy) -> list[int]:
    """Wrap the blocks the policy names, in place; returns the wrapped indices."""
    n = len(blocks)
    full = set(policy.wrapped_layers(n))
    selective = set(policy.selective_layers(n))
    for i in sorted(full | selective):
        if not isinstance(blocks[i], Checkpointed):
            blocks[i] = Checkpointed(blocks[i], selective=i in selective)
    return sorted(full | selective)
