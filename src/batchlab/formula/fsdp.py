"""Per-rank memory of FSDP2 (ZeRO-2 / ZeRO-3) at the high point of each phase (no torch).

What FSDP2 keeps (``fully_shard`` per block, then the root; PyTorch 2.13, seen with a live-storage tracker):
- always: this rank's parameter shards, gradient shards and optimizer state (1/DP of each);
- forward: each unit is all-gathered into full-size working copies; ZeRO-3 frees a block's after its
  forward, ZeRO-2 keeps every one to backward; the root unit (embeddings, head) stays gathered throughout;
- backward, per block (last first): ZeRO-3 gathers the block again, and prefetches the next one; when the
  block's backward ends it is resharded, its unsharded gradient copied into a flat buffer and
  reduce-scattered into the gradient shard; that flat buffer lives on into the next block's backward.
Each point's parts add up; the peak is the largest point.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from batchlab.config import Precision, RunConfig
from batchlab.formula import fp8
from batchlab.formula.sharding import (gathered_bytes, gathered_bytes_per_element, reduced_bytes_per_element,
                                       unit_elements)

if TYPE_CHECKING:
    from batchlab.formula.ranks import RankShare


def fsdp_phases(cfg: RunConfig, resident: dict[str, int], per_layer_full: int, kept: tuple[int, ...],
                below_layers: int, activations_total: int, logits_fwd: int, loss_grads: int, head_grad: int,
                transient: int, opt_tmp: int, sharded_grads: int,
                walk: list[int] | None = None, rank=None) -> dict[str, dict[str, int]]:
    """Parts live at each phase's high point.  ``resident``: parameter shards (``parameters``, or ``master``
    under a 16-bit param_dtype), optimizer state and data; the rest as in formula.memory (per-layer kept activations, the in-layer
    transient of backward, the LM head's weight gradient).  ``walk`` (if given) receives the tensor bytes as
    backward starts, then each block's higher point (inside it, or at its reduce-scatter), last block first.
    ``rank``: a pipeline stage's tensor-parallel slice (formula/ranks.py), whose units FSDP2 shards."""
    units = unit_elements(cfg, rank)
    wg, wr, dp, L = gathered_bytes_per_element(cfg), reduced_bytes_per_element(cfg), cfg.dp, len(kept)
    z3 = cfg.parallel.reshards_after_forward
    root, block = units[0] * wg, (units[1] if L else 0) * fp8.block_gather_bytes(cfg, wg)
    block_grad = (units[1] if L else 0) * wr
    shards = resident["parameters"]  # 0 where the fp32 shards are the master copy (resident["master"])
    # shards of earlier micro-batches' gradients (or of the last update's, zeroed in place: set_to_none=False)
    grads_kept = cfg.accum > 1 or not cfg.assumptions.zero_grad_set_to_none
    before = sharded_grads if grads_kept else 0
    # forward's high point, at the loss: the root gathered, ZeRO-2 every block's copies too, and one block's
    # flat all-gather output still held (gloo's work object releases it later)
    phases = {"forward": dict(resident, parameters=shards + root + (0 if z3 else L * block) + block,
                              gradients=before,
                              activations=activations_total, recompute=0, temporaries=logits_fwd)}
    # backward's start (the loss's gradients): every activation kept, the root and ZeRO-3's last block
    # gathered again (ZeRO-2: still every block)
    best = dict(resident, parameters=shards + root + (block if z3 else L * block), gradients=before,
                activations=activations_total, recompute=0, temporaries=loss_grads)
    kept_below = sum(kept)
    if walk is not None:
        walk.append(sum(best.values()))
    for i in reversed(range(L)):
        done = 0 if grads_kept else (L - 1 - i) * block_grad // dp  # new shards of later blocks
        grads = before + head_grad + done
        gathered = root + (block + (block if i else 0) if z3 else (i + 1) * block)
        # the previous block's flat reduce-scatter input is freed only when this block's is issued
        pending = block_grad if i < L - 1 else 0
        inside = dict(resident, parameters=shards + gathered, gradients=grads + pending,
                      activations=below_layers + kept_below, recompute=per_layer_full - kept[i], temporaries=transient)
        kept_below -= kept[i]
        # the block's reduce-scatter: flat fp32 input + output shard, the unsharded gradient being copied in.
        # ZeRO-2's block is resharded first; ZeRO-3's too or not yet, as gloo's worker threads release the
        # gathered buffers (either can happen, one block apart): the later, higher case is taken
        at_rs = dict(resident, parameters=shards + gathered - (0 if z3 else block),
                     gradients=grads + block_grad + block_grad // dp,
                     activations=below_layers + kept_below, recompute=0, temporaries=block_grad)
        if walk is not None:
            walk.append(max(sum(inside.values()), sum(at_rs.values())))
        for p in (inside, at_rs):
            if sum(p.values()) > sum(best.values()):
                best = p
    phases["backward"] = best
    phases["optimizer"] = dict(resident, parameters=shards, gradients=sharded_grads, activations=0, recompute=0,
                               temporaries=opt_tmp)
    return phases


def with_pipeline_no_sync(cfg: RunConfig, rank, phases: dict[str, dict[str, int]], shards: int
                          ) -> dict[str, dict[str, int]]:
    """FSDP2 under a pipeline stage no schedule prices step by step (formula/fsdp_pipeline.py, fsdp_interleaved.py):
    torch.distributed.pipelining runs every micro-batch's backward with
    ``set_reshard_after_backward(False)`` and ``set_requires_gradient_sync(False)`` and reduce-scatters only after
    the last one (stage.py, ``backward_maybe_with_nosync``), so from the first backward on the stage's units stay
    gathered (param_dtype) and its gradients accumulate unsharded, upcast to reduce_dtype (FSDP2's
    ``to_accumulated_grad_if_needed``).  Forward and backward high points (steady state) hold both whole, beside
    the resident parameter ``shards`` (what the phases' walk gathers unit by unit is part of the whole)."""
    if rank is None or rank.stages == 1:
        return phases
    units = unit_elements(cfg, rank)
    elements = sum(units)
    gathered, grads = gathered_bytes(cfg, units), elements * reduced_bytes_per_element(cfg)
    return {ph: (dict(parts, parameters=max(parts["parameters"], shards + gathered),
                      gradients=max(parts["gradients"], grads))
                 if ph in ("forward", "backward") else parts) for ph, parts in phases.items()}


def fsdp_shard_bytes(cfg: RunConfig, rank: "RankShare | None" = None) -> int:
    """FSDP2 keeps fp32 (bf16: 16-bit) parameter shards at ZeRO-2 and 3 alike, and gathers 16-bit working
    copies under mixed precision (MixedPrecisionPolicy): then the fp32 shards are the master copy."""
    return sum(unit_elements(cfg, rank)) * (2 if cfg.precision is Precision.BF16 else 4) // cfg.dp


def sharded_master(cfg: RunConfig) -> bool:
    return cfg.precision not in (Precision.FP32, Precision.BF16)


def fsdp_gradient_shard_bytes(cfg: RunConfig, rank: "RankShare | None" = None) -> int:
    """Gradient shards keep the shards' dtype (reduced in fp32 under MixedPrecisionPolicy(reduce_dtype=fp32))."""
    return fsdp_shard_bytes(cfg, rank)


def fsdp_resident(cfg: RunConfig, weights: dict[str, int], shards: int) -> dict[str, int]:
    """The fp32 shards are the master copy under a 16-bit param_dtype (FSDP2's "parameters" are then only the
    gathered 16-bit working copies); in fp32 and bf16 they are the parameters themselves."""
    return dict(weights, parameters=0, master=shards) if sharded_master(cfg) else dict(weights, parameters=shards,
                                                                                       master=0)
