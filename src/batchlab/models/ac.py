"""Activation checkpointing for a model's repeated blocks, driven by the config's ACPolicy.

Activation checkpointing recomputes a block's forward during backward to avoid keeping its activations;
it is not the training checkpoint saved to disk.  One function applies the policy for every model source
(built-in, Hugging Face, user factory), so the harness and the trace run the same wrapping.  The selective
policies are ``torch.utils.checkpoint`` selective-checkpoint policies over aten ops; formula/checkpointing.py
counts what each keeps.
"""
from __future__ import annotations

import functools
from collections import defaultdict

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from batchlab.config import ACMode, ACPolicy, ConfigError

_aten = torch.ops.aten
_MATMULS = {_aten.mm.default, _aten.addmm.default}  # a linear layer (with or without bias) on a 2-D view
# fused attention kernels (CUDA flash / memory-efficient / cuDNN, and the CPU flash kernel)
_SDPA = {op for op in (getattr(_aten, n, None) for n in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")) if op is not None}
_SDPA = {getattr(op, "default") for op in _SDPA}
# eager attention's softmax, and SDPA's math path (CPU with dropout), which calls _safe_softmax
_SOFTMAX = {op.default for op in (getattr(_aten, n, None) for n in ("_softmax", "_safe_softmax")) if op is not None}
_SAVE, _RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE


def _matmul_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """batchlab ``selective``: keep every linear layer's output, recompute everything else."""
    return _SAVE if op in _MATMULS else _RECOMPUTE


def _attention_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """``selective-attn``: keep the attention kernel's outputs (eager attention and SDPA's math path: the
    softmax output), recompute every matmul and element-wise op."""
    return _SAVE if op in _SDPA or op in _SOFTMAX else _RECOMPUTE


def _every_other_matmul(counts: defaultdict, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """torchtitan ``selective op``: keep the SDPA outputs and matmuls 1, 3, 5, ... of the block (counted
    separately in forward and recompute, as torchtitan's ``mm_count_key``); recompute the rest."""
    if op in _SDPA:
        return _SAVE
    if op not in _MATMULS:
        return _RECOMPUTE
    key = "recompute" if ctx.is_recompute else "forward"
    counts[key] += 1
    return _SAVE if counts[key] % 2 == 1 else _RECOMPUTE


def _context_fn(mode: ACMode):
    if mode is ACMode.SELECTIVE:
        return functools.partial(create_selective_checkpoint_contexts, _matmul_policy)
    if mode is ACMode.SELECTIVE_ATTN:
        return functools.partial(create_selective_checkpoint_contexts, _attention_policy)
    if mode is ACMode.SELECTIVE_OP:
        return _selective_op_contexts
    return None


def _selective_op_contexts():
    """A fresh matmul counter for every checkpointed call; a module-level function, since torch.compile traces
    a checkpoint whose context_fn is a function or a partial, not a closure made in the compiled frame."""
    return create_selective_checkpoint_contexts(functools.partial(_every_other_matmul, defaultdict(int)))


class Checkpointed(nn.Module):
    """Wraps one block; its forward runs under torch.utils.checkpoint (non-reentrant, RNG preserved)."""

    def __init__(self, block: nn.Module, mode: ACMode = ACMode.FULL):
        super().__init__()
        self.block = block
        self.mode = mode

    @property
    def selective(self) -> bool:
        return self.mode is not ACMode.FULL

    def forward(self, *args, **kwargs):
        context_fn = _context_fn(self.mode)
        extra = {"context_fn": context_fn} if context_fn else {}
        # preserve_rng_state=True: dropout in the recompute draws the same mask as the forward did.
        return checkpoint(self.block, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)


class _CoreAttentionCheckpointed(Checkpointed):
    """Megatron's selective recompute: inside the block, ``F.scaled_dot_product_attention`` (the attention
    core) runs under a checkpoint, so its own saved output and log-sum-exp (and on the math path the s x s
    scores) are dropped and recomputed; q, k, v are kept.  Needs SDPA attention (RunConfig checks)."""

    def __init__(self, block: nn.Module):
        super().__init__(block, ACMode.MEGATRON)

    def forward(self, *args, **kwargs):
        plain = F.scaled_dot_product_attention

        def core(*a, **kw):
            return checkpoint(plain, *a, use_reentrant=False, preserve_rng_state=True, **kw)

        F.scaled_dot_product_attention = core  # the model code looks it up at call time (ours and transformers')
        try:
            return self.block(*args, **kwargs)
        finally:
            F.scaled_dot_product_attention = plain


def apply_ac(blocks: nn.ModuleList, policy: ACPolicy) -> list[int]:
    """Wrap the blocks the policy names (each with its layer's mode: ``ACPolicy.layer_modes``), in place;
    returns the wrapped indices."""
    if policy.mode is ACMode.PLAN and len(policy.layers) != len(blocks):
        raise ConfigError("ac", f"the plan names {len(policy.layers)} layers; the model has {len(blocks)} blocks")
    done = []
    for i, mode in enumerate(policy.layer_modes(len(blocks))):
        if mode is ACMode.NONE:
            continue
        done.append(i)
        if isinstance(blocks[i], Checkpointed):
            continue
        blocks[i] = _CoreAttentionCheckpointed(blocks[i]) if mode is ACMode.MEGATRON else Checkpointed(blocks[i], mode)
    return done
