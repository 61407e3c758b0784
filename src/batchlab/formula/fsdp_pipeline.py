"""FSDP2 inside a pipeline stage: what a rank holds at each forward and backward of its schedule (no torch).

torch.distributed.pipelining runs every micro-batch's backward with ``set_reshard_after_backward(False)`` and
``set_requires_gradient_sync(False)`` and reduce-scatters only once all of them are done (stage.py,
``backward_maybe_with_nosync`` then ``perform_reduce_grad``).  So, seen with a live-storage tracker (PyTorch 2.13):
- a stage's forward gathers its units and keeps them until the stage's output is made; ZeRO-3 then reshards them
  all, ZeRO-2 keeps them to the end of the update;
- a backward that follows a forward (ZeRO-3) gathers the units again, last block first: the root and the top
  block before the loss's gradient, each lower block's flat all-gather output prefetched while the block above
  runs; they stay gathered (no reshard after backward), so a backward right after another finds them all;
- the first backward of an update creates the unsharded gradients block by block (none exist before it with
  ``zero_grad(set_to_none=True)``); every later one accumulates into all of them (upcast to reduce_dtype).
Which of these meet the most in-flight micro-batches depends on the schedule's order of forwards and backwards
(formula/stage_steps.py): the first backward holds every warm-up micro-batch but only the gradients made so far; later
ones hold every gradient but, once the forwards run out, fewer micro-batches.  Each is priced; the caller takes
the highest with the pipeline's own tensors for that many micro-batches.
"""
from __future__ import annotations

from typing import Callable

from batchlab.config import RunConfig
from batchlab.formula.stage_steps import distinct, ordered
from batchlab.formula.ranks import residual_bytes
from batchlab.formula import fp8
from batchlab.formula.sharding import (gathered_bytes, gathered_bytes_per_element, reduced_bytes_per_element,
                                       unit_elements)


def walked(cfg: RunConfig) -> bool:
    """The schedules ``stage_steps`` orders (one chunk per rank; several: formula/fsdp_interleaved.py)."""
    return ordered(cfg) and cfg.parallel.fsdp


def phases(cfg: RunConfig, rank, resident: dict[str, int], kept: tuple[int, ...], per_layer_full: int,
           one_micro_batch: int, below: int, logits_fwd: int, loss_grads: int, head_grad: int, transient: int,
           opt_tmp: int, grad_shards: int, dress: Callable[[int, str, dict[str, int], int], dict[str, int]],
           walk: list[int] | None = None) -> dict[str, dict[str, int]]:
    """The parts at each phase's highest point; ``resident``: shards, optimizer state and data; ``one_micro_batch``:
    one micro-batch's kept activations on the stage, ``below`` of them held under the layers while they run
    backward; the other terms as formula.fsdp's.  ``dress(held, phase, parts, done)`` adds the pipeline's own
    tensors for ``held`` micro-batches in flight after ``done`` forwards (formula.memory).  ``walk`` (if given)
    receives the tensor bytes as the highest backward starts, then at each block's higher point, last block first."""
    residual = residual_bytes(cfg, rank)  # passed between blocks
    before = 0 if cfg.assumptions.zero_grad_set_to_none else grad_shards  # zeroed shards, or none
    found = _candidates(cfg, rank, resident, kept, per_layer_full, one_micro_batch, below, logits_fwd, loss_grads,
                        head_grad, transient, residual, before)
    found.append((0, "optimizer", [dict(resident, gradients=grad_shards, activations=0, recompute=0,
                                        temporaries=opt_tmp)], cfg.accum))
    out: dict[str, dict[str, int]] = {}
    highest = (-1, [])
    for held, ph, points, done in found:
        # what dress adds depends on held, done and the phase alone: the step's highest point stays its highest
        parts = dress(held, ph, max(points, key=lambda p: sum(p.values())), done)
        if ph not in out or sum(parts.values()) > sum(out[ph].values()):
            out[ph] = parts
            if ph == "backward" and len(points) > 1:
                highest = (sum(parts.values()), points)
    if walk is not None and highest[1]:
        start, *inner = [sum(p.values()) for p in highest[1]]
        per_block = len(inner) // max(len(kept), 1)  # a block's points: its copy-out (regathered) and its inside
        walk += [start] + [max(inner[i:i + per_block]) for i in range(0, len(inner), per_block)]
    return out


def _candidates(cfg: RunConfig, rank, resident: dict[str, int], kept: tuple[int, ...], per_layer_full: int,
                one_micro_batch: int, below: int, logits_fwd: int, loss_grads: int, head_grad: int, transient: int,
                residual: int, before: int) -> list[tuple[int, str, list[dict[str, int]], int]]:
    """(micro-batches held, phase, its points, forwards done) for every distinct step of the stage's update, and
    the gradients' final reduce-scatter."""
    units = unit_elements(cfg, rank)
    wg, wr, L = gathered_bytes_per_element(cfg), reduced_bytes_per_element(cfg), len(kept)
    z3 = cfg.parallel.reshards_after_forward
    # the blocks as gathered (fp8 under an fp8 all-gather, as formula/fsdp.py), the root in param_dtype
    block_width = fp8.block_gather_bytes(cfg, wg)
    root, block, block_grad = units[0] * wg, (units[1] if L else 0) * block_width, (units[1] if L else 0) * wr
    shards, whole, whole_grads = resident["parameters"], gathered_bytes(cfg, units), sum(units) * wr
    out: list[tuple[int, str, list[dict[str, int]], int]] = []
    for step in distinct(cfg.parallel.schedule, rank.stage, rank.stages, cfg.accum, z3):
        regather = step.backward and step.after_forward and z3
        grads = before + (whole_grads if step.after_backward else 0)
        others = (step.held - 1) * one_micro_batch
        if not step.backward:
            # the last block's gather; the stage's output made, its units still gathered; the loss after
            # ZeRO-3's reshard
            points = [dict(resident, parameters=shards + whole + block, gradients=grads,
                           activations=others + one_micro_batch - (kept[-1] if L else 0), recompute=0, temporaries=0),
                      dict(resident, parameters=shards + whole, gradients=grads,
                           activations=others + one_micro_batch, recompute=0, temporaries=0)]
            if rank.last:
                points.append(dict(resident, parameters=shards + (0 if z3 else whole), gradients=grads,
                                   activations=others + one_micro_batch, recompute=0, temporaries=logits_fwd))
            out.append((step.held, "forward", points, step.done))
            continue
        fresh = not step.after_backward  # its gradients are made block by block

        def gathered(i: int) -> int:  # blocks i.. unsharded, and block i - 1's prefetched flat output
            return root + ((L - i) * block + (block if i > 0 else 0) if regather else L * block)

        # the loss's gradient comes before the root's pre-backward hook, which starts the gathers
        start = 0 if regather and rank.last else gathered(L - 1 if L else 0)
        points = [dict(resident, parameters=shards + start, gradients=grads,
                       activations=others + one_micro_batch, recompute=0, temporaries=loss_grads)]
        kept_below = sum(kept)
        for i in reversed(range(L)):
            made = (head_grad + (L - 1 - i) * block_grad) if fresh else 0
            if regather:  # block i's copy-out beside its flat output, the blocks above done
                points.append(dict(resident, parameters=shards + root + (L - i + 1) * block, gradients=grads + made,
                                   activations=below + others + kept_below, recompute=0, temporaries=residual))
            points.append(dict(resident, parameters=shards + gathered(i), gradients=grads + made,
                               activations=below + others + kept_below, recompute=per_layer_full - kept[i],
                               temporaries=transient))
            kept_below -= kept[i]
        out.append((step.held, "backward", points, step.done))
    # perform_reduce_grad: every activation freed, each unit's flat fp32 input and output shard beside the gradients
    out.append((0, "backward", [dict(resident, parameters=shards + whole, gradients=before + whole_grads + block_grad
                                     + block_grad // cfg.dp, activations=0, recompute=0, temporaries=0)], cfg.accum))
    return out
