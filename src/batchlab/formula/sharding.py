"""What each ZeRO stage's engine sends per micro-batch and per update, and what FSDP2 gathers (no torch).

Engines (Rajbhandari et al. 2019, ZeRO, sec. 5 for the volumes; PyTorch's engines for the schedule):
- ZeRO-0/1, DDP: gradients all-reduced once per update (``no_sync`` on the other micro-batches); ZeRO-1
  (ZeroRedundancyOptimizer) then broadcasts every parameter from the rank that owns its optimizer shard.
- ZeRO-2/3, FSDP2 per block + root: each micro-batch all-gathers every unit's parameters in forward; ZeRO-3
  frees them after forward and gathers them again in backward; each unit's gradient is reduce-scattered
  after its backward (every micro-batch, or only the last with ``set_requires_gradient_sync(False)``).
Bytes are each collective's full buffer (nccl-tests "size"): all-gather output, reduce-scatter input.
FSDP2 pads each parameter's first dimension to a multiple of DP.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchlab.config import MLPKind, ModelSpec, Precision, RunConfig
from batchlab.formula import fp8
from batchlab.formula.params import count, norm_params, position_table

if TYPE_CHECKING:
    from batchlab.formula.ranks import RankShare

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")


def _padded(dim0: int, rest: int, dp: int) -> int:
    return -(-dim0 // dp) * dp * rest


def _block_tensors(m: ModelSpec, t: int = 1) -> list[tuple[int, int]]:
    """(first dim, elements per row) of each parameter of one built-in block (models/gpt.py) on one of ``t``
    tensor-parallel ranks: column-parallel matrices (q/k/v, MLP up) and their biases split by rows, row-parallel
    ones (projections, MLP down) by columns; norms and the row-parallel biases whole (formula/ranks.py)."""
    h, kv, f = m.hidden, m.kv_hidden, m.ffn
    norm = [(h, 1)] * (norm_params(m) // h)
    mats = [(f // t, h), (f // t, h), (h, f // t)] if m.mlp is MLPKind.SWIGLU else [(f // t, h), (h, f // t)]
    out = norm * 2 + [((h + 2 * kv) // t, h), (h, h // t)] + mats
    if m.bias:
        out += [((h + 2 * kv) // t, 1), (h, 1), (h, 1)] + ([(f // t, 1)] * (len(mats) - 1))
    return out


def _root_tensors(m: ModelSpec, rank: "RankShare | None" = None) -> list[tuple[int, int]]:
    """Embeddings, final norm and an untied head: the parameters outside the blocks (the root unit); on a
    pipeline stage, those it holds (vocabulary-parallel tables split by rows over TP)."""
    t, first, last = (rank.vocab_split, rank.first, rank.last) if rank is not None else (1, True, True)
    tied_copy = rank is not None and rank.stages > 1 and m.tied_embeddings  # the last stage's copy
    out = [(m.vocab // t, m.hidden)] if first else []
    out += position_table(m) if first else []
    out += [(m.hidden, 1)] * (norm_params(m) // m.hidden) if last else []
    return out + ([(m.vocab // t, m.hidden)] if last and (not m.tied_embeddings or tied_copy) else [])


def unit_elements(cfg: RunConfig, rank: "RankShare | None" = None) -> tuple[int, ...]:
    """Elements of each FSDP2 unit as it is gathered (padded): the root, then one per block; ``rank``: those of
    one pipeline stage's tensor-parallel slice (formula/ranks.py), else the whole replica's."""
    m, dp = cfg.model, cfg.dp
    t, layers = (rank.tp, len(rank.layers)) if rank is not None else (1, m.layers)
    block = sum(_padded(d, r, dp) for d, r in _block_tensors(m, t))
    return (sum(_padded(d, r, dp) for d, r in _root_tensors(m, rank)),) + (block,) * layers


def gathered_bytes_per_element(cfg: RunConfig) -> int:
    """FSDP2 gathers in param_dtype: 16-bit under mixed precision (MixedPrecisionPolicy) and bf16."""
    return 4 if cfg.precision is Precision.FP32 else 2


def gathered_bytes(cfg: RunConfig, units: tuple[int, ...]) -> int:
    """Bytes FSDP2 gathers of ``units`` (the root first, then blocks): the blocks at FP8's width under an fp8
    all-gather (formula/fp8.py), the root in param_dtype."""
    w = gathered_bytes_per_element(cfg)
    return units[0] * w + sum(units[1:]) * fp8.block_gather_bytes(cfg, w) if units else 0


def reduced_bytes_per_element(cfg: RunConfig) -> int:
    """Gradients are reduced in fp32 (reduce_dtype=fp32 under mixed precision), in bf16 for bf16 weights."""
    return 2 if cfg.precision is Precision.BF16 else 4


@dataclass(frozen=True)
class Traffic:
    per_micro_batch: tuple[dict[str, int], ...]  # bytes issued in each micro-batch's forward + backward
    outside_micro_batches: dict[str, int]  # bytes issued in the optimizer step
    sync_every_micro_batch: bool = True  # FSDP2: reduce-scatter after every micro-batch
    provenance: str = "formula"

    @property
    def per_update(self) -> dict[str, int]:
        return {k: sum(mb[k] for mb in self.per_micro_batch) + self.outside_micro_batches[k] for k in KINDS}

    @property
    def total_bytes(self) -> int:
        return sum(self.per_update.values())


def traffic(cfg: RunConfig, sync_every_micro_batch: bool = True) -> Traffic:
    """Collective bytes of one update on one rank.  ``sync_every_micro_batch=False``: FSDP2 with
    ``set_requires_gradient_sync(False)`` on all but the last micro-batch."""
    none = dict.fromkeys(KINDS, 0)
    if cfg.dp == 1:
        return Traffic(per_micro_batch=(none,) * cfg.accum, outside_micro_batches=none,
                       sync_every_micro_batch=sync_every_micro_batch)
    n = count(cfg.model).total
    spec = cfg.parallel.engine_spec
    if spec.deepspeed and spec.stage in (1, 2):
        # DeepSpeed's stage_1_and_2.py: the 16-bit gradients reduced into each rank's partition (stage 2 in every
        # micro-batch's backward, stage 1 at the accumulation boundary: reduce_gradients), and after the step the
        # updated 16-bit weights all-gathered into every rank's whole copy (all_gather_dp_groups)
        w = gathered_bytes_per_element(cfg)
        rs = dict(none, reduce_scatter=n * w)
        micro = tuple(rs if spec.stage == 2 or i == cfg.accum - 1 else none for i in range(cfg.accum))
        return Traffic(per_micro_batch=micro, outside_micro_batches=dict(none, all_gather=n * w),
                       sync_every_micro_batch=sync_every_micro_batch)
    if not cfg.parallel.shards_gradients:  # DDP (ZeRO-0 / ZeRO-1)
        w = 2 if cfg.precision is Precision.BF16 else 4  # DDP reduces .grad in the weights' dtype
        last = dict(none, all_reduce=n * w)
        outside = dict(none, broadcast=n * w) if cfg.parallel.stage == 1 else none
        return Traffic(per_micro_batch=(none,) * (cfg.accum - 1) + (last,), outside_micro_batches=outside,
                       sync_every_micro_batch=sync_every_micro_batch)
    units, z3 = sum(unit_elements(cfg)), cfg.parallel.reshards_after_forward
    g, rs = gathered_bytes(cfg, unit_elements(cfg)), units * reduced_bytes_per_element(cfg)
    if cfg.parallel.pipelined:
        # torch.distributed.pipelining (PyTorch 2.13, counted on a real update): ZeRO-3 gathers in every forward
        # and once more in the update's first backward (no reshard after backward), ZeRO-2 once per update; one
        # reduce-scatter once every backward is done (perform_reduce_grad)
        first, later = (2 * g, g) if z3 else (g, 0)
        micro = tuple(dict(none, all_gather=first if i == 0 else later, reduce_scatter=rs if i == cfg.accum - 1 else 0)
                      for i in range(cfg.accum))
        return Traffic(per_micro_batch=micro, outside_micro_batches=none, sync_every_micro_batch=False)
    ag = (2 if z3 else 1) * g  # ZeRO-3: forward, and again in backward
    micro = tuple(dict(none, all_gather=ag, reduce_scatter=rs if sync_every_micro_batch or i == cfg.accum - 1 else 0)
                  for i in range(cfg.accum))
    return Traffic(per_micro_batch=micro, outside_micro_batches=none, sync_every_micro_batch=sync_every_micro_batch)


def fsdp_collectives(cfg: RunConfig, rank: "RankShare | None" = None) -> dict[str, int]:
    """FSDP2's collectives of one update on one rank (``rank``: a pipeline stage's units, else the replica's): per
    micro-batch each unit's all-gather in forward (and again in backward under ZeRO-3) and its reduce-scatter, or
    a pipeline stage's, as ``traffic`` sizes them; {} for another engine."""
    if not cfg.parallel.fsdp:
        return {}
    units = sum(n > 0 for n in unit_elements(cfg, rank))  # a middle stage's root holds nothing: no collective
    z3, m = cfg.parallel.reshards_after_forward, cfg.accum
    if cfg.parallel.pipelined:  # as ``traffic`` counts a pipeline stage's
        return {"all_gather": (m + 1 if z3 else 1) * units, "reduce_scatter": units}
    return {"all_gather": (2 if z3 else 1) * units * m, "reduce_scatter": units * m}


def unsharded_gradient_bytes(cfg: RunConfig) -> int:
    """Per rank, what ``set_requires_gradient_sync(False)`` keeps between micro-batches under FSDP2: every
    unit's unsharded gradient (accumulated locally until the last micro-batch reduce-scatters it)."""
    if not cfg.parallel.engine_spec.shards_gradients or cfg.accum == 1:
        return 0
    return sum(unit_elements(cfg)) * reduced_bytes_per_element(cfg)


def ring_messages(kind: str, n: int) -> int:
    """Messages each rank sends in one ring collective over ``n`` ranks: 2(n-1) for an all-reduce (reduce-scatter
    then all-gather), n-1 for an all-gather, a reduce-scatter or a (pipelined) broadcast; one for a send."""
    if n <= 1:
        return 0
    return {"all_reduce": 2 * (n - 1), "send": 1}.get(kind, n - 1)


def collective_seconds(kind: str, nbytes: float, n: int, bus_bytes_per_s: float) -> float:
    """Ring algorithms (nccl-tests PERFORMANCE.md): all-reduce moves 2(n-1)/n of the buffer over the slowest
    link, all-gather and reduce-scatter (n-1)/n, broadcast the buffer once."""
    if n <= 1 or nbytes == 0:
        return 0.0
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
              "broadcast": 1.0}[kind]
    return factor * nbytes / bus_bytes_per_s
