"""DeepSpeed ZeRO-3's gathered parameters over one forward and backward (no torch).

ZeRO-3 gathers a module's parameters when its forward or backward starts and frees them when it ends
(deepspeed/runtime/zero/partitioned_param_coordinator.py, ``PartitionedParameterCoordinator``), with three
exceptions, replayed here over the module trace it records on the first step:

- ``fetch_sub_module`` prefetches the next parameters of the trace while fewer than stage3_prefetch_bucket_size
  elements are in flight and fewer than stage3_max_live_parameters are gathered (``max_params_to_prefetch``: the
  last one may overshoot the bucket); a parameter the scan meets already gathered is skipped but marked, and
  ``__params_to_release`` keeps a marked one until the trace reaches that use;
- ``__params_to_release`` keeps a parameter that occurs again within the next stage3_max_reuse_distance elements of
  the trace (it sums the elements of each module it passes, and stops once the sum reaches the distance);
- a parameter smaller than stage3_param_persistence_threshold is never partitioned (``ds_persist``): it is
  gathered all along, and counted here as such.

The trace of a decoder: the token embedding, each layer's matmuls, the LM head, then backward in reverse; under
full recompute each layer's matmuls run forward again just before its backward (transformers'
gradient checkpointing).  Biases and norm weights ride with their module (and are persistent at any threshold a
config sets).  Figures are elements; the caller prices them in the engine's 16-bit (or fp32) dtype.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from batchlab.config import MLPKind, ModelSpec, PositionKind
from batchlab.config.deepspeed import DeepSpeedSettings
from batchlab.formula.params import count


@dataclass(frozen=True)
class Gathered:
    """Gathered elements: at the loss (the LM head's forward done, its backward not begun), the most in the
    backward pass, and the persistent parameters (gathered all along, inside both)."""

    at_loss: int
    backward: int
    persistent: int


def modules(m: ModelSpec, layers: int) -> tuple[list[tuple[str, int]], list[str]]:
    """(name, elements) of each module that holds parameters, and the forward order of layer matmuls."""
    h, kv, f = m.hidden, m.kv_hidden, m.ffn
    sizes = {"embed": m.vocab * h + (m.max_positions * h if m.position is PositionKind.LEARNED else 0)}
    mats = [("q", h * h), ("k", h * kv), ("v", h * kv), ("o", h * h)]
    mats += [("gate", h * f), ("up", h * f), ("down", f * h)] if m.mlp is MLPKind.SWIGLU else [("fc1", h * f),
                                                                                                 ("fc2", f * h)]
    for i in range(layers):
        sizes.update({f"{i}.{n}": e for n, e in mats})
    sizes["head"] = 0 if m.tied_embeddings else m.vocab * h  # tied: the embedding's table again
    return list(sizes.items()), [n for n, _ in mats]


def trace(m: ModelSpec, layers: int, recompute: bool | tuple[bool, ...]) -> list[str]:
    """The modules in the order ZeRO-3 fetches them over one forward and backward; ``recompute``: whether each layer
    (or every layer) runs its forward again before its backward."""
    _, mats = modules(m, layers)
    again = (recompute,) * layers if isinstance(recompute, bool) else recompute
    head = "embed" if m.tied_embeddings else "head"
    fwd = ["embed"] + [f"{i}.{n}" for i in range(layers) for n in mats] + [head]
    bwd = [head]
    for i in reversed(range(layers)):
        bwd += [f"{i}.{n}" for n in mats] if again[i] else []
        bwd += [f"{i}.{n}" for n in reversed(mats)]
    return fwd + bwd + ["embed"]


@functools.lru_cache(maxsize=256)  # ModelSpec and the settings are frozen; --vary and fit ask again and again
def gathered(m: ModelSpec, layers: int, recompute: bool | tuple[bool, ...], ds: DeepSpeedSettings) -> Gathered:
    """Replay the coordinator's fetch, prefetch and release over the trace (the module docstring)."""
    ds = ds.resolved(m.hidden)
    size = dict(modules(m, layers)[0])
    order = trace(m, layers, recompute)
    persist = {n for n, e in size.items() if e < ds.stage3_param_persistence_threshold}
    steps = [n for n in order if n not in persist and size[n] > 0]  # modules with something to gather
    queue = list(range(len(steps)))  # the parameter trace: one entry per use
    marked: dict[str, int] = {}  # parameter -> the latest use a prefetch scan passed (most_recent_step_id...)
    live: set[str] = set()
    at_loss, backward = 0, 0
    forward = 2 + layers * len(modules(m, layers)[1])  # the embedding, the layers' matmuls, the LM head
    loss_step = sum(1 for n in order[:forward] if n not in persist and size[n] > 0) - 1  # the LM head's forward
    q = 0
    for k, name in enumerate(steps):
        live.add(name)
        # pop this use off the queue, then prefetch up to the bucket while under the live limit
        while q < len(queue) and queue[q] <= k:
            marked[steps[queue[q]]] = max(marked.get(steps[queue[q]], -1), queue[q])
            q += 1
        n_live = sum(size[n] for n in live)
        budget, fetching, wanted = min(ds.stage3_max_live_parameters - n_live, ds.stage3_prefetch_bucket_size), 0, set()
        while q < len(queue) and fetching < budget:
            use = queue[q]
            q += 1
            p = steps[use]
            marked[p] = max(marked.get(p, -1), use)
            if p not in live and p not in wanted:
                wanted.add(p)
                fetching += size[p]
        live |= wanted
        now = sum(size[n] for n in live)
        if k > loss_step:
            backward = max(backward, now)
        # release at the module's end unless a prefetch scan passed a use beyond the next step (the step counter
        # is already past this module), or it recurs within the distance
        keep = marked.get(name, -1) > k + 1
        traversed = 0
        for later in steps[k + 1:]:
            if keep or traversed >= ds.stage3_max_reuse_distance:
                break
            keep = later == name
            traversed += size[later]
        if not keep:
            live.discard(name)
        if k == loss_step:
            at_loss = sum(size[n] for n in live)
    c = count(m)  # the norms' weights and the biases: under any threshold a config sets, never partitioned
    small = layers * max(0, c.per_layer - sum(e for n, e in size.items() if n.startswith("0."))) + c.final_norm
    persistent = sum(size[n] for n in persist) + small
    return Gathered(at_loss=at_loss + persistent, backward=backward + persistent, persistent=persistent)
