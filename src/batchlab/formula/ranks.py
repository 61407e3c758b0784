"""What one rank of a tensor- and pipeline-parallel layout holds: its stage's layers, the parameters of its
tensor-parallel slice, and the activations of its in-flight micro-batches (no torch).

Tensor parallelism (Shoeybi et al. 2019, Megatron-LM, sec. 3): attention's q/k/v and MLP's first matrices are split
by columns, the output projections by rows, the vocabulary-parallel embedding and LM head by rows of the
vocabulary: each of these is 1/t per rank; norms, learned position tables and the row-parallel outputs' biases
are replicated.  Activations (Korthikanti et al. 2022, arXiv 2205.05198, Table 2): the tensors inside the TP
region divide by t; the norms' inputs and outputs and the residual dropout masks only with sequence parallelism.
Pipeline parallelism (Narayanan et al. 2021): stage r holds ``Layout.stage_layers``; the first stage the
embedding, the last the final norm, head and loss (a tied embedding: both hold a copy, as Megatron does); it
keeps ``Layout.in_flight(r, accum)`` micro-batches' activations at its high point.  The data-parallel ranks of
a stage, and its tensor-parallel ranks, hold alike: one entry per stage describes them all.
"""
from __future__ import annotations

from dataclasses import dataclass

from batchlab.config import ACMode, Applied, ModelSpec, PositionKind, RunConfig
from batchlab.formula.activations import LayerActivations, Widths
from batchlab.formula.params import count, norm_params, position_params


@dataclass(frozen=True)
class RankShare:
    """One rank of pipeline stage ``stage``: parameter elements it holds, by part (they add up to ``params``)."""

    stage: int
    stages: int  # pp
    layers: tuple[int, ...]  # the model's layer indices it runs (all of them without a pipeline)
    tp: int
    sequence_parallel: bool
    in_flight: float  # micro-batches of activations at its high point (1 without a pipeline)
    per_layer: int  # one layer's parameters on this rank
    embedding: int  # token (/t) and learned position (replicated) tables; 0 off the first stage
    final_norm: int  # 0 off the last stage
    head: int  # LM head (/t), a tied embedding's copy on a pipeline's last stage; 0 off the last stage
    layer_matrices: int  # of ``per_layer``, the TP-split part (the rest is replicated)
    vocab_split: int = 1  # the divisor of the embedding table, LM head and loss: t where tp splits the vocabulary

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def params(self) -> int:
        return self.embedding + self.per_layer * len(self.layers) + self.final_norm + self.head

    @property
    def whole(self) -> bool:
        """One rank holds the whole replica (tp = pp = 1): every figure as without a layout."""
        return self.tp == 1 and self.stages == 1

    @property
    def in_sp(self) -> int:
        """Divisor of the norms, dropouts and residual stream: t with sequence parallelism, else 1."""
        return self.tp if self.sequence_parallel else 1

    def describe(self) -> str:
        """'pipeline stage 0 (first: embedding + 2 in-flight micro-batches)'."""
        if self.stages == 1:
            return "every rank (one pipeline stage)" if self.tp > 1 else "the one rank"
        role = ("first: embedding" if self.first else "last: final norm, head and loss" if self.last
                else "middle")
        if self.first and self.last:
            role = "embedding, head and loss"
        return f"pipeline stage {self.stage} ({role}; {self.in_flight:g} in-flight micro-batches)"


def replicated_per_layer(m: ModelSpec) -> int:
    """A layer's parameters every TP rank keeps whole: both norms and the row-parallel outputs' biases (attention
    projection, MLP down projection) -- Megatron's RowParallelLinear adds its bias after the all-reduce."""
    return 2 * norm_params(m) + (2 * m.hidden if m.bias else 0)


def share(cfg: RunConfig, stage: int) -> RankShare:
    lay, m, c = cfg.parallel, cfg.model, count(cfg.model)
    t = lay.tp
    rep = min(replicated_per_layer(m), c.per_layer)
    split = c.per_layer - rep
    first, last = lay.holds_embedding(stage), lay.holds_head(stage)
    pos = min(position_params(m), c.embedding)
    v = t if cfg.vocab_parallel else 1  # RunConfig.vocab_parallel: else the table and head are whole on every rank
    embedding = (c.embedding - pos) // v + pos if first else 0
    # a tied head is the embedding's table: one copy without a pipeline, a second one on the last stage with one
    head = (c.head if not m.tied_embeddings or lay.pp == 1 else m.vocab * m.hidden) // v if last else 0
    return RankShare(stage=stage, stages=lay.pp, layers=lay.stage_layers(m.layers, stage), tp=t,
                     sequence_parallel=lay.sequence_parallel, in_flight=lay.in_flight(stage, cfg.accum),
                     per_layer=split // t + rep, embedding=embedding, final_norm=c.final_norm if last else 0,
                     head=head, layer_matrices=split // t, vocab_split=v)


def shares(cfg: RunConfig) -> tuple[RankShare, ...]:
    """One RankShare per pipeline stage, first to last."""
    return tuple(share(cfg, r) for r in range(cfg.parallel.pp))


def tp_layer_bytes(parts: LayerActivations, t: int, sp: bool, gathered: int = 0) -> int:
    """A layer's kept bytes on one of t tensor-parallel ranks (Korthikanti et al. 2022, Table 2:
    sbh(10 + 24/t + 5as/(ht)) without SP, sbh(34 + 5as/h)/t with SP): q/k/v, scores, the attention output and
    the MLP are inside the TP region; the norms (inputs and outputs: the next matmul's input) and the residual
    dropout masks are split only along the sequence.  ``gathered``: of the norms' bytes, the outputs the next
    column-parallel matmuls save whole under SP (``sp_gathered_inputs``)."""
    inside = parts.qkv + parts.scores + parts.attn_out + parts.mlp
    outside = parts.norms + parts.masks
    return inside // t + ((outside - gathered) // t + gathered if sp else outside)


def sp_gathered_inputs(share_: RankShare, norm_output: int, norms: int) -> int:
    """With sequence parallelism, what the column-parallel matmuls after ``norms`` norms save: each norm's output
    (``norm_output`` bytes for the whole sequence) all-gathered over the sequence, whole on every rank.  PyTorch's
    ``ColwiseParallel`` with ``input_layouts=Shard(1)`` redistributes its input to ``Replicate()`` before
    ``F.linear``, whose autograd saves that gathered input (torch/distributed/tensor/parallel/style.py,
    ``_prepare_input_fn``); Megatron's ``LinearWithGradAccumulationAndAsyncCommunication`` saves the shard and
    all-gathers it again in backward (Korthikanti et al. 2022, sec. 4.2.2), which Table 2's /t assumes."""
    return norms * norm_output if share_.sequence_parallel and share_.tp > 1 else 0


def tp_kept_bytes(mode: ACMode, full: LayerActivations, kept: int, share_: RankShare, gathered: int = 0) -> int:
    """What a layer under ``mode`` keeps on this rank, from what it keeps on one rank (``kept``) and its whole
    breakdown (``full``): none as Table 2; full recompute keeps the layer input (split with SP only);
    megatron-selective drops only attention-core tensors (inside the TP region); the other selective policies
    keep a mix, split in the whole layer's proportion (an approximation)."""
    t, sp = share_.tp, share_.sequence_parallel
    if t == 1:
        return kept
    whole = tp_layer_bytes(full, t, sp, gathered)
    applied = mode.spec.applied
    if applied is Applied.NOTHING:
        return whole
    if applied is Applied.WHOLE_BLOCK:
        return kept // share_.in_sp
    if applied is Applied.ATTENTION_CORE:
        return whole - (full.total - kept) // t
    return round(kept * whole / full.total) if full.total else kept


@dataclass(frozen=True)
class RankMemory:
    """One pipeline stage's ranks at their peak (bytes): ``parts`` add up to ``peak_bytes`` (the tensors live at
    the peak, by part, and the allocator's margin above them)."""

    stage: int
    layers: int
    in_flight: float  # micro-batches of activations held at the high point
    peak_bytes: int
    activations_bytes: int
    parameters: int  # elements one rank of the stage holds before data-parallel sharding
    parts: dict[str, int]
    role: str  # what the stage holds, in words
    provenance: str = "formula"


def residual_bytes(cfg: RunConfig, rank: RankShare) -> int:
    """One micro-batch's residual stream on ``rank``: b·s·h at the residual's width, 1/t of it under SP."""
    w = Widths.of(cfg.precision, cfg.device_spec.backend)
    return cfg.seq * cfg.micro_batch * cfg.model.hidden * w.res // rank.in_sp


def largest_param(cfg: RunConfig, rank: RankShare) -> int:
    """Elements of the largest parameter tensor on ``rank``: the embedding table (its vocabulary shard) or learned
    positions on the first stage, the table or head on the last, a layer's widest matrix (1/t of it) where it
    holds layers."""
    m, t = cfg.model, rank.tp
    positions = m.max_positions * m.hidden if m.position is PositionKind.LEARNED and rank.first else 0
    table = m.vocab * m.hidden // rank.vocab_split if rank.first or rank.head else 0  # can be outsized by the positions'
    layer = max(m.hidden * m.ffn, m.hidden * (m.hidden + 2 * m.kv_hidden)) // t if rank.layers else 0
    return max(table, positions, layer)
