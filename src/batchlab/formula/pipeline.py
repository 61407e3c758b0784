"""Time of a tensor- and pipeline-parallel update, per rank (no torch).

- Compute: each stage runs its layers' share of the replica's priced ops (split by hardware FLOPs,
  ``flops.stage_flops_per_token``), each tensor-parallel rank 1/t of it.
- Tensor parallelism (Shoeybi et al. 2019, Megatron's f and g operators): per layer and micro-batch 2 all-reduces of
  the b·s·h activations in forward and 2 in backward (+2 where a fully recomputed layer runs forward again); with
  sequence parallelism each becomes an all-gather + reduce-scatter pair of the same volume (Korthikanti et al. 2022,
  sec. 4.2.2).  Ring cost 2(t-1)/t x bytes / link for an all-reduce, on the node's link (NVLink) while t fits a
  node; not overlapped with compute (Megatron runs them in the critical path).
- Pipeline: (m + p - 1) x the slowest stage's micro-batch time for GPipe and 1F1B; with v chunks per rank the
  bubble shrinks v-fold (Narayanan et al. 2021, sec. 2.2: bubble fraction (p-1)/(v·m+p-1), ``Layout.bubble_fraction``).
  Point-to-point: each micro-batch sends b·s·h activations forward and their gradient back across every chunk
  boundary, on the inter-node link when the world spans nodes; not overlapped.
"""
from __future__ import annotations

from dataclasses import dataclass

from batchlab.config import Applied, RunConfig
from batchlab.formula.activations import Widths
from batchlab.formula.flops import stage_flops_per_token
from batchlab.formula.ranks import RankShare, shares
from batchlab.formula.sharding import collective_seconds


def stage_output_bytes(cfg: RunConfig, rank: RankShare) -> int:
    """The outputs a pipeline rank's ``PipelineStage`` keeps at its high point: ``forward_one_chunk`` stores each
    micro-batch's output in ``fwd_cache`` until that micro-batch's ``backward_one_chunk`` (torch/distributed/
    pipelining/stage.py), so every in-flight chunk-forward keeps one: b·s·h (this rank's sequence slice under SP)
    from a stage that sends on, the logits (this rank's vocabulary shard) from the last stage -- one in flight on
    the rank holding it among its interleaved chunks.  0 without a pipeline."""
    if rank.stages == 1:
        return 0
    m, s, b = cfg.model, cfg.seq, cfg.micro_batch
    w = Widths.of(cfg.precision, cfg.device_spec.backend)
    hidden = s * b * m.hidden * w.res // rank.in_sp
    logits = s * b * m.vocab * w.e // rank.vocab_split
    chunks = round(rank.in_flight * cfg.parallel.chunks)  # chunk-forwards in flight
    if not rank.last:
        return chunks * hidden
    if cfg.parallel.chunks == 1:
        return chunks * logits
    return logits + (chunks - 1) * hidden


def _chunk_stages(cfg: RunConfig, rank: RankShare) -> list[int]:
    """The pipeline stage indices (of pp x chunks) this rank runs: r, r + pp, ... (distributed/pipeline.py)."""
    lay = cfg.parallel
    return [j * lay.pp + rank.stage for j in range(lay.chunks)]


def receive_buffer_bytes(cfg: RunConfig, rank: RankShare) -> tuple[int, int]:
    """(resident, in use): a ``PipelineStage`` allocates one receive buffer per micro-batch, once, for the activations
    from the previous stage (every stage but the first) and for the gradients from the next (every stage but the
    last), b·s·h each (torch/distributed/pipelining/stage.py, ``_create_act_recv_info`` / ``_create_grad_recv_info``:
    ``_make_tensor_from_meta``), and keeps them from step to step.  In use: the in-flight micro-batches' received
    activations are their first layer's input, which the layers' terms count already."""
    if rank.stages == 1:
        return 0, 0
    w = Widths.of(cfg.precision, cfg.device_spec.backend)
    one = cfg.seq * cfg.micro_batch * cfg.model.hidden * w.res // rank.in_sp
    count = cfg.parallel.pp * cfg.parallel.chunks
    mine = _chunk_stages(cfg, rank)
    buffers = sum((i > 0) + (i < count - 1) for i in mine) * cfg.accum
    receiving = sum(i > 0 for i in mine) / len(mine)  # the share of this rank's chunk-forwards that received
    return buffers * one, round(rank.in_flight * cfg.parallel.chunks * receiving) * one


def gradient_send_bytes(cfg: RunConfig, rank: RankShare) -> int:
    """The input gradients (b·s·h each) a stage's high-point backward runs beside, still held by their send
    (``ScheduleSpec.gradient_sends_held``)."""
    if rank.stages == 1:
        return 0
    w = Widths.of(cfg.precision, cfg.device_spec.backend)
    held = cfg.parallel.schedule_spec.gradient_sends_held(rank.stage, cfg.accum)
    return held * cfg.seq * cfg.micro_batch * cfg.model.hidden * w.res // rank.in_sp


@dataclass(frozen=True)
class StageTime:
    stage: int
    compute_seconds: float  # one micro-batch's forward + backward (+ recompute) on one rank of the stage
    tp_comm_seconds: float  # its tensor-parallel collectives
    pp_comm_seconds: float  # its point-to-point sends

    @property
    def seconds(self) -> float:
        return self.compute_seconds + self.tp_comm_seconds + self.pp_comm_seconds


@dataclass(frozen=True)
class PipelineTime:
    stages: tuple[StageTime, ...]
    micro_batches: int  # per update per pipeline: accum
    bubble_fraction: float
    slowest: int  # the stage that sets the pace

    @property
    def busy_seconds(self) -> float:
        """m micro-batches at the slowest stage's pace, no bubble."""
        return self.micro_batches * self.stages[self.slowest].seconds

    @property
    def seconds(self) -> float:
        """Busy time over the non-bubble share: (m + p - 1) x slowest stage for GPipe / 1F1B."""
        return self.busy_seconds / (1 - self.bubble_fraction)

    @property
    def bubble_seconds(self) -> float:
        return self.seconds - self.busy_seconds


def tp_link(cfg: RunConfig) -> float:
    dev = cfg.device_spec
    return dev.intra_node_bytes_per_s if cfg.tp <= dev.gpus_per_node else dev.inter_node_bytes_per_s


def pp_link(cfg: RunConfig) -> float:
    dev = cfg.device_spec
    return dev.intra_node_bytes_per_s if cfg.parallel.world_size <= dev.gpus_per_node else dev.inter_node_bytes_per_s


def activation_message_bytes(cfg: RunConfig) -> int:
    """b·s·h in the activations' dtype: what a TP collective and a pipeline send move per micro-batch."""
    return cfg.micro_batch * cfg.seq * cfg.model.hidden * cfg.precision.compute_bytes


def tp_seconds(cfg: RunConfig, rank: RankShare) -> float:
    """One micro-batch's TP collectives on ``rank``: 4 all-reduces per layer (2 forward, 2 backward), 2 more per
    fully recomputed layer."""
    if rank.tp == 1:
        return 0.0
    modes = cfg.ac.layer_modes(cfg.model.layers)
    calls = sum(4 + (2 if modes[i].spec.applied is Applied.WHOLE_BLOCK else 0) for i in rank.layers)
    return calls * collective_seconds("all_reduce", activation_message_bytes(cfg), rank.tp, tp_link(cfg))


def pp_seconds(cfg: RunConfig, rank: RankShare) -> float:
    """One micro-batch's sends from ``rank``: activations to the next stage, gradients to the previous one, at
    every chunk boundary it has (v chunks: v of each, less the pipeline's two ends)."""
    if rank.stages == 1:
        return 0.0
    v = cfg.parallel.chunks
    sends = 2 * v - (1 if rank.first else 0) - (1 if rank.last else 0)
    return sends * activation_message_bytes(cfg) / pp_link(cfg)


def pipeline_time(cfg: RunConfig, compute_per_micro_batch: float) -> PipelineTime:
    """``compute_per_micro_batch``: the whole replica's forward + backward (+ recompute) of one micro-batch on one
    device, as the per-op model priced it."""
    ranks = shares(cfg)
    per = [stage_flops_per_token(cfg, r.layers, r.last) for r in ranks]
    total = sum(per) or 1.0
    stages = tuple(StageTime(stage=r.stage, compute_seconds=compute_per_micro_batch * f / total / r.tp,
                             tp_comm_seconds=tp_seconds(cfg, r), pp_comm_seconds=pp_seconds(cfg, r))
                   for r, f in zip(ranks, per))
    slowest = max(range(len(stages)), key=lambda i: (stages[i].seconds, -i))
    return PipelineTime(stages=stages, micro_batches=cfg.accum, bubble_fraction=cfg.parallel.bubble_fraction(cfg.accum),
                        slowest=slowest)


def text(cfg: RunConfig, p: PipelineTime) -> str:
    """The assumptions line of a layout's time."""
    lay = cfg.parallel
    parts = []
    if lay.tp > 1:
        parts.append(f"TP {lay.tp}: each rank computes 1/{lay.tp} of its stage's FLOPs; 4 all-reduces of b·s·h per "
                     "layer per micro-batch (2 forward, 2 backward; +2 per fully recomputed layer"
                     + ("; as all-gather + reduce-scatter pairs with sequence parallelism" if lay.sequence_parallel else "")
                     + f") over {tp_link(cfg) / 1e9:g} GB/s, not overlapped")
    if lay.pp > 1:
        parts.append(f"PP {lay.pp} ({lay.schedule.value}): (m + (p-1)/v) x the slowest stage's micro-batch, bubble "
                     f"{p.bubble_fraction:.1%} of the update (m = accum = {cfg.accum}); stage compute split by FLOPs; "
                     f"b·s·h sends each way per micro-batch over {pp_link(cfg) / 1e9:g} GB/s, not overlapped")
    return "; ".join(parts)
