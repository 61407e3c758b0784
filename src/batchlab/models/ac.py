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

from batchlab.config import ACMode, ACPolicy, ACPolicySpec, Applied, ConfigError

_aten = torch.ops.aten
_SAVE, _RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE


@functools.lru_cache(maxsize=None)  # asked for every op the dispatch mode sees
def _ops(names: tuple[str, ...]) -> frozenset:
    """The default overloads of the aten ops a catalogue entry names (those this torch has)."""
    return frozenset(getattr(_aten, n).default for n in names if getattr(_aten, n, None) is not None)


def _policy(spec: ACPolicySpec, counts: defaultdict, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """A catalogue entry's selective policy (config/acpolicies.py): its ``saved_ops`` kept; of its
    ``alternate_ops`` the 1st, 3rd, ... call of the block (counted apart in forward and recompute, as
    torchtitan's ``mm_count_key``); every other op kept under ``save_others``, else recomputed."""
    if op in _ops(spec.saved_ops):
        return _SAVE
    if op in _ops(spec.alternate_ops):
        key = "recompute" if ctx.is_recompute else "forward"
        counts[key] += 1
        return _SAVE if counts[key] % 2 == 1 else _RECOMPUTE
    return _SAVE if spec.save_others else _RECOMPUTE


def _context_fn(mode: ACMode):
    if not mode.spec.dispatch_mode:
        return None
    return functools.partial(_selective_contexts, mode.spec)


def _selective_contexts(spec: ACPolicySpec):
    """A fresh counter for every checkpointed call; a module-level function under a partial, since torch.compile
    traces a checkpoint whose context_fn is a function or a partial, not a closure made in the compiled frame."""
    return create_selective_checkpoint_contexts(functools.partial(_policy, spec, defaultdict(int)))


# (enter, leave) pairs told each time a checkpointed branch or attention core starts and ends, in forward and in its
# recompute (trace/ops.py: the region's own call and which ops are recomputed); a compiled graph's is not told.  A
# whole block's checkpoint is seen by its block's hooks instead (``Checkpointed.block``), which also run where dynamo
# broke the graph around the checkpoint and ran it eagerly (a decision taken while tracing could not see that)
_LISTENERS: list[tuple] = []


class _Listening:
    """The handle of one ``listen``: ``remove()`` as a hook's."""

    def __init__(self, pair: tuple):
        self.pair = pair
        _LISTENERS.append(pair)

    def remove(self) -> None:
        if self.pair in _LISTENERS:
            _LISTENERS.remove(self.pair)


def listen(enter, leave) -> _Listening:
    """Call ``enter(mode)`` / ``leave(mode)`` around every eager run of a checkpointed branch or attention core."""
    return _Listening((enter, leave))


def _checkpoint(fn, mode: ACMode, *args, **kwargs):
    """``fn`` under a non-reentrant checkpoint (``preserve_rng_state=True``: dropout in the recompute draws the
    same mask as the forward did), the listeners told around each of its runs."""
    if _LISTENERS and not torch.compiler.is_compiling():
        fn = functools.partial(_told, fn, mode)
    return _checkpointed(fn, mode, *args, **kwargs)


def _checkpointed(fn, mode: ACMode, *args, **kwargs):
    context_fn = _context_fn(mode)
    extra = {"context_fn": context_fn} if context_fn else {}
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)


def _told(fn, mode: ACMode, *args, **kwargs):
    pairs = tuple(_LISTENERS)
    for enter, _ in pairs:
        enter(mode)
    try:
        return fn(*args, **kwargs)
    finally:
        for _, leave in pairs:
            leave(mode)


class Checkpointed(nn.Module):
    """Wraps one block; its forward runs under torch.utils.checkpoint (non-reentrant, RNG preserved)."""

    def __init__(self, block: nn.Module, mode: ACMode):
        super().__init__()
        self.block = block
        self.mode = mode

    @property
    def selective(self) -> bool:
        return self.mode.spec.selective

    def forward(self, *args, **kwargs):
        return _checkpointed(self.block, self.mode, *args, **kwargs)


class _CoreAttentionCheckpointed(Checkpointed):
    """Megatron's selective recompute: inside the block, ``F.scaled_dot_product_attention`` (the attention
    core) runs under a checkpoint, so its own saved output and log-sum-exp (and on the math path the s x s
    scores) are dropped and recomputed; q, k, v are kept.  Needs SDPA attention (RunConfig checks)."""

    def forward(self, *args, **kwargs):
        plain = F.scaled_dot_product_attention
        core = functools.partial(_checkpoint, plain, self.mode)

        F.scaled_dot_product_attention = core  # the model code looks it up at call time (ours and transformers')
        try:
            return self.block(*args, **kwargs)
        finally:
            F.scaled_dot_product_attention = plain


class _BranchCheckpointed(Checkpointed):
    """One submodule of the block (the entry's ``branch``, e.g. ``mlp``) runs under a checkpoint: the block keeps
    what it keeps without checkpointing, less what that submodule keeps inside (its input is kept)."""

    def __init__(self, block: nn.Module, mode: ACMode):
        super().__init__(block, mode)
        name = mode.spec.branch
        if not isinstance(getattr(block, name, None), nn.Module):
            raise ConfigError("ac", f"{mode} recomputes each block's {name!r} submodule; "
                                    f"{type(block).__name__} has none")
        sub = getattr(block, name)
        # the submodule's own forward, under checkpoint; its hooks and names unchanged
        sub.forward = functools.partial(_checkpoint, sub.forward, mode)

    def forward(self, *args, **kwargs):
        return self.block(*args, **kwargs)


_WRAPPERS = {Applied.WHOLE_BLOCK: Checkpointed, Applied.SAVE_OPS: Checkpointed,
             Applied.ATTENTION_CORE: _CoreAttentionCheckpointed, Applied.BRANCH: _BranchCheckpointed}


def apply_ac(blocks: nn.ModuleList, policy: ACPolicy) -> list[int]:
    """Wrap the blocks the policy names (each with its layer's mode: ``ACPolicy.layer_modes``), in place;
    returns the wrapped indices."""
    if policy.layers and len(policy.layers) != len(blocks):  # a plan
        raise ConfigError("ac", f"the plan names {len(policy.layers)} layers; the model has {len(blocks)} blocks")
    done = []
    for i, mode in enumerate(policy.layer_modes(len(blocks))):
        if not mode.spec.recomputes:
            continue
        done.append(i)
        if isinstance(blocks[i], Checkpointed):
            continue
        blocks[i] = _WRAPPERS[mode.spec.applied](blocks[i], mode)  # as its catalogue entry applies it
    return done
