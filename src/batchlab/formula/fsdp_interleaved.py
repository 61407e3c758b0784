"""FSDP2 inside the chunks of an interleaved pipeline stage: what a rank holds at each step (no torch).

Each chunk is its own PipelineStage and its own fully_shard units (a root per chunk, one per block), and
``_PipelineScheduleRuntime`` drives them (torch/distributed/pipelining/schedules.py): ``_add_unshard_reshard``
gathers every chunk among the next three the rank computes on before its first step and reshards it once it is no
longer among them; each backward runs with ``set_reshard_after_backward(False)`` and
``set_requires_gradient_sync(False)``, so a chunk's units stay gathered after its backwards and its unsharded
gradients accumulate until its ``REDUCE_GRAD`` after its last backward (``perform_reduce_grad``: reduce-scatter,
reshard).  ZeRO-3 reshards a chunk after each of its forwards; ZeRO-2 keeps it gathered.  Seen with a
live-storage tracker (PyTorch 2.13): a unit gathered in forward keeps its all-gather output beside its unsharded
parameters until it reshards or the next unit gathers; in backward the output is freed once copied out.
So at each step the other chunks add their gathered units and their gradients (none, unsharded, or the reduced
shards) to the stepping chunk's own forward or backward, priced as formula/fsdp_pipeline.py prices a stage's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from batchlab.config import RunConfig
from batchlab.formula import interleaved
from batchlab.formula.ranks import residual_bytes
from batchlab.formula import fp8
from batchlab.formula.sharding import (gathered_bytes, gathered_bytes_per_element, reduced_bytes_per_element,
                                       unit_elements)

Parts = dict[str, int]


def walked(cfg: RunConfig) -> bool:
    """FSDP2 on the data dimension of an interleaved pipeline (``interleaved.ordered``)."""
    return interleaved.ordered(cfg) and cfg.parallel.fsdp


@dataclass(frozen=True)
class Terms:
    """A chunk's own terms (the stage terms of formula/fsdp_pipeline.py, for one chunk)."""

    units: tuple[int, ...]  # elements of its root, then of each block
    kept: tuple[int, ...]  # each block's kept bytes for one micro-batch
    per_layer_full: int
    one: int  # one micro-batch's kept bytes on the chunk
    below: int  # of them, held under its blocks while they run backward
    forward_transient: int
    backward_transient: int
    head_grad: int
    transient: int  # in a block's backward
    shard: int  # its gradient shards' bytes once reduced


def active(actions: tuple[tuple[int, bool], ...], window: int = 3) -> list[set[int]]:
    """Per action, the chunks ``_add_unshard_reshard`` keeps gathered then: the next ``window`` distinct chunks
    still to run (it unshards those it lacks and reshards the others)."""
    out: list[set[int]] = []
    ahead: list[int] = []  # the chunks still to run, by their next action (one backward pass: linear in actions)
    for c, _ in reversed(actions):
        if c in ahead:
            ahead.remove(c)
        ahead.insert(0, c)
        out.append(set(ahead[:window]))
    return out[::-1]


def phases(cfg: RunConfig, rank, resident: Parts, opt_tmp: int, grad_shards: int,
           dress: Callable[[interleaved.ChunkStep, str, Parts], Parts], chunk: Callable) -> dict[str, Parts]:
    """The parts at each phase's highest point over the rank's steps; ``resident``: the rank's shards, optimizer
    state and data; ``dress(step, phase, parts)`` adds the pipeline's own tensors (formula/interleaved.py);
    ``chunk(c)``: a chunk's (in-block transient, head gradient, kept below, gradient shards' bytes)."""
    terms = chunk_terms(cfg, rank, chunk)
    p, v, m = cfg.parallel.pp, cfg.parallel.chunks, cfg.accum
    wg, wr = gathered_bytes_per_element(cfg), reduced_bytes_per_element(cfg)
    z3 = cfg.parallel.reshards_after_forward
    zeroed = not cfg.assumptions.zero_grad_set_to_none  # the shards exist, zeroed, from the update's start
    whole = [gathered_bytes(cfg, t.units) for t in terms]  # the blocks at fp8's width under an fp8 all-gather
    whole_grads = [sum(t.units) * wr for t in terms]
    residual = residual_bytes(cfg, rank)
    shards = resident["parameters"]
    actions = interleaved.rank_actions(p, v, m, rank.stage)
    fetched = active(actions)
    gathered, reduced, backwards = [False] * v, [False] * v, [0] * v
    out: dict[str, Parts] = {}

    def keep(ph: str, step, points: list[Parts]) -> None:
        parts = dress(step, ph, max(points, key=lambda q: sum(q.values())))
        if ph not in out or sum(parts.values()) > sum(out[ph].values()):
            out[ph] = parts

    def grads_of(c: int, made: bool) -> int:
        if reduced[c]:
            return terms[c].shard
        return whole_grads[c] if made else (terms[c].shard if zeroed else 0)

    order = interleaved.steps(p, v, m, rank.stage)
    for i, st in enumerate(order):
        if st.chunk is None:
            break
        c, t = st.chunk, terms[st.chunk]
        before = fetched[i - 1] if i else set()
        for j in fetched[i] - before:  # the schedule's UNSHARD before the step
            gathered[j] = True
        for j in before - fetched[i]:  # and its RESHARD
            gathered[j] = False
        bg_params = sum(whole[j] for j in range(v) if j != c and gathered[j])
        bg_grads = sum(grads_of(j, st.made[j]) for j in range(v) if j != c)
        held = sum(h * terms[j].one for j, h in enumerate(st.held))
        others = held - t.one
        grads = bg_grads + grads_of(c, st.made[c])
        base = dict(resident, gradients=grads, recompute=0)
        root, block = t.units[0] * wg, (t.units[1] if len(t.units) > 1 else 0) * fp8.block_gather_bytes(cfg, wg)
        L = len(t.kept)
        if not st.backward:
            # a unit gathered here keeps its all-gather output beside its parameters until the forward ends
            flat = 0 if gathered[c] else (block if L else root)
            points = [dict(base, parameters=shards + bg_params + whole[c] + flat, activations=held, temporaries=0)]
            if rank.last and c == v - 1:
                points.append(dict(base, parameters=shards + bg_params + (0 if z3 else whole[c]), activations=held,
                                   temporaries=t.forward_transient))
            keep("forward", st, points)
            gathered[c] = not z3
            continue
        regather = not gathered[c]
        fresh = not st.made[c]
        block_grad = (t.units[1] if L else 0) * wr

        def unsharded(k: int) -> int:  # blocks k.. gathered again, last first (all of them if they stayed)
            return root + ((L - k) * block if regather else L * block)

        last_chunk = rank.last and c == v - 1
        start = 0 if regather and last_chunk else unsharded(L - 1 if L else 0)
        points = [dict(base, parameters=shards + bg_params + start, activations=held,
                       temporaries=t.backward_transient)]
        kept_below = sum(t.kept)
        for k in reversed(range(L)):
            made = (t.head_grad + (L - 1 - k) * block_grad) if fresh else 0
            if regather:  # block k's all-gather output beside its copy-out, the blocks above done
                points.append(dict(base, parameters=shards + bg_params + root + (L - k + 1) * block,
                                   gradients=grads + made, activations=t.below + others + kept_below,
                                   temporaries=residual))
            points.append(dict(base, parameters=shards + bg_params + unsharded(k), gradients=grads + made,
                               activations=t.below + others + kept_below, recompute=t.per_layer_full - t.kept[k],
                               temporaries=t.transient))
            kept_below -= t.kept[k]
        keep("backward", st, points)
        gathered[c], backwards[c] = True, backwards[c] + 1
        if backwards[c] == m:  # REDUCE_GRAD: unit by unit, the root first, resharded, then reduce-scattered from
            # a flat input in reduce_dtype into its output shard, its unsharded gradients freed after
            all_grads = grads + (0 if st.made[c] else whole_grads[c])
            keep("backward", st, [dict(resident, gradients=all_grads - sum(t.units[:i]) * wr + u * wr + u * wr // cfg.dp,
                                       activations=others, recompute=0, temporaries=0,
                                       parameters=shards + bg_params + whole[c] - gathered_bytes(cfg, t.units[:i + 1]))
                                  for i, u in enumerate(t.units)])
            gathered[c], reduced[c] = False, True
    keep("optimizer", order[-1], [dict(resident, gradients=grad_shards, activations=0, recompute=0, temporaries=opt_tmp)])
    return out


def chunk_terms(cfg: RunConfig, rank, chunk: Callable) -> tuple[Terms, ...]:
    flat = interleaved.flat(cfg)
    out = []
    for ch in interleaved.chunks(cfg, rank):
        transient, head_grad, below, shard = chunk(ch)
        plan = ch.plan
        out.append(Terms(unit_elements(flat, ch.share), plan.per_layer_kept, plan.per_layer_full or 0, plan.total,
                         below, ch.forward_transient, ch.backward_transient, head_grad, transient, shard))
    return tuple(out)
