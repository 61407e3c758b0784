"""Time of a tensor- and pipeline-parallel update, per rank (no torch).

- Compute: each stage runs its layers' share of the replica's priced ops (split by hardware FLOPs,
  ``flops.stage_flops_per_token``), each tensor-parallel rank 1/t of their work but every op's dispatch (each rank
  issues the whole op list on its shards), plus DTensor's host work per op on a DTensor (formula/dtensor.py).
- Tensor parallelism (Shoeybi et al. 2019, Megatron's f and g operators): per layer and micro-batch 2 all-reduces of
  the b·s·h activations in forward and 2 in backward (+2 where a fully recomputed layer runs forward again); with
  sequence parallelism each becomes an all-gather + reduce-scatter pair of the same volume (Korthikanti et al. 2022,
  sec. 4.2.2).  Ring cost 2(t-1)/t x bytes / link for an all-reduce, on the node's link (NVLink) while t fits a
  node; in the critical path (Megatron's f and g), unless ``--tp-overlap async`` pairs them with GEMMs (overlap.py).
- Pipeline: (m + p - 1) x the slowest stage's micro-batch time for GPipe and 1F1B; with v chunks per rank the
  bubble shrinks v-fold (Narayanan et al. 2021, sec. 2.2: bubble fraction (p-1)/(v·m+p-1), ``Layout.bubble_fraction``).
  Point-to-point: each micro-batch sends b·s·h activations forward and their gradient back across every chunk
  boundary, on the inter-node link when the world spans nodes; what a schedule's runtime hides: overlap.py.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from batchlab.config import Applied, Implementation, RunConfig
from batchlab.config.engines import Sent
from batchlab.formula import dtensor, overlap
from batchlab.formula.overlap import activation_message_bytes
from batchlab.formula.activations import Widths
from batchlab.formula.deepspeed import activation_precision
from batchlab.formula.flops import stage_flops_per_token
from batchlab.formula.params import norm_tensors
from batchlab.formula.ranks import RankShare, residual_bytes, shares
from batchlab.config.phase import Phase
from batchlab.formula.opcost import OpCosts, OpCount, merge
from batchlab.formula.opbuild import OpList, widths
from batchlab.formula.links import Link, local_link, pp_link, shared, tp_link


def megatron_runtime(cfg: RunConfig) -> bool:
    """Whether Megatron's own pipeline runtime runs the stages (its layers, or its engine): it receives into a fresh
    tensor per micro-batch and frees each output once sent (megatron/core/pipeline_parallel/schedules.py
    ``deallocate_output_tensor``), where torch.distributed.pipelining keeps buffers and outputs."""
    return cfg.model.impl is Implementation.MEGATRON or cfg.parallel.engine_spec.megatron


def keeps_outputs(cfg: RunConfig, last: bool) -> bool:
    """A stage (``last``: the pipeline's last) keeps every micro-batch's output to the step's end:
    ``forward_one_chunk`` appends it to ``output_chunks`` for ``_merge_outputs`` (torch/distributed/pipelining/
    stage.py).  Every stage did before torch 2.8 (pytorch PR 153383: 'output_chunks is only used for last stage');
    the last stage still does unless the script calls ``step(..., return_outputs=False)``, an argument torch 2.10
    added (pytorch PR 165822; torchtitan passes it since its PR 1922, 'Update PP to release memory earlier').
    The version stands in for the call: on torch >= 2.10 a script calling ``step()`` plainly still keeps the last
    stage's outputs (``return_outputs`` defaults True), which this rule does not count; batchlab's own pipeline
    passes False (distributed/layouts.py)."""
    return cfg.assumptions.torch_before(2, 10) if last else cfg.assumptions.torch_before(2, 8)


def outputs_held(cfg: RunConfig, last: bool, in_flight: int, done: int) -> int:
    """The outputs a stage (an interleaved rank's chunk; ``last``: the pipeline's last) holds after ``done``
    forwards of the step: those of its ``in_flight`` micro-batches (``fwd_cache``, to their backward), or every one
    where ``output_chunks`` keeps them (``keeps_outputs``)."""
    return max(in_flight, done) if keeps_outputs(cfg, last) else in_flight


def logits_bytes(cfg: RunConfig, rank: RankShare) -> int:
    """One micro-batch's output of the last stage: the logits, this rank's vocabulary shard."""
    return cfg.seq * cfg.micro_batch * cfg.model.vocab * Widths.of(cfg.precision, cfg.device_spec.backend).e \
        // rank.vocab_split


def stage_output_bytes(cfg: RunConfig, rank: RankShare, done: int | None = None) -> int:
    """The outputs a pipeline rank's ``PipelineStage`` keeps at its high point: ``forward_one_chunk`` stores each
    micro-batch's output in ``fwd_cache`` until that micro-batch's ``backward_one_chunk`` (torch/distributed/
    pipelining/stage.py), so every in-flight chunk-forward keeps one: b·s·h (this rank's sequence slice under SP)
    from a stage that sends on, the logits (this rank's vocabulary shard) from the last stage -- one in flight on
    the rank holding it among its interleaved chunks.  Where a one-chunk stage keeps every output
    (``outputs_held``): one per forward ``done`` so far (the step's; None: all m, the last step's).  0 without a
    pipeline or with none in flight on interleaved chunks."""
    if rank.stages == 1:
        return 0
    m, s, b = cfg.model, cfg.seq, cfg.micro_batch
    w = Widths.of(activation_precision(cfg), cfg.device_spec.backend)
    hidden = s * b * m.hidden * w.res // rank.in_sp
    logits = logits_bytes(cfg, rank)
    chunks = round(rank.in_flight * cfg.parallel.chunks)  # chunk-forwards in flight
    if cfg.parallel.chunks == 1:
        chunks = outputs_held(cfg, rank.last, chunks, cfg.accum if done is None else done)
    if not rank.last:
        return chunks * hidden
    if cfg.parallel.chunks == 1:
        return chunks * logits
    return logits + (chunks - 1) * hidden if chunks else 0


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
    one = residual_bytes(cfg, rank)
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
    return cfg.parallel.schedule_spec.gradient_sends_held(rank.stage, cfg.accum) * residual_bytes(cfg, rank)


@dataclass(frozen=True)
class StageTime:
    stage: int
    compute_seconds: float  # one micro-batch's forward + backward (+ recompute) on one rank of the stage
    tp_comm_seconds: float  # its tensor-parallel collectives
    pp_comm_seconds: float  # its point-to-point sends
    dtensor_seconds: float = 0.0  # DTensor's host work on its forward and backward ops
    dtensor_update_seconds: float = 0.0  # DTensor's host work on the optimizer's ops, once per update

    @property
    def seconds(self) -> float:
        return self.compute_seconds + self.tp_comm_seconds + self.pp_comm_seconds + self.dtensor_seconds


@dataclass(frozen=True)
class PipelineTime:
    stages: tuple[StageTime, ...]
    micro_batches: int  # per update per pipeline: accum
    bubble_fraction: float
    slowest: int  # the stage that sets the pace
    time_shared: float = 1.0  # local CPU ranks' threads over the cores (formula/timing.py ``sharing``), at least 1

    @property
    def busy_seconds(self) -> float:
        """m micro-batches at the slowest stage's pace, no bubble."""
        return self.micro_batches * self.stages[self.slowest].seconds

    @property
    def seconds(self) -> float:
        """Busy time over the non-bubble share: (m + p - 1) x slowest stage for GPipe / 1F1B.  Where local CPU ranks
        time-share the cores, a rank idle in the bubble leaves its core to the others, which then run faster: the
        flush takes the longer of its critical path at a core's whole speed and m micro-batches at the shared speed
        (processor sharing; with no more threads than cores, the first)."""
        alone = self.stages[self.slowest].seconds / self.time_shared
        return max(self.busy_seconds, self.micro_batches * alone / (1 - self.bubble_fraction))

    @property
    def bubble_seconds(self) -> float:
        return self.seconds - self.busy_seconds


def tp_collectives(cfg: RunConfig, rank: RankShare) -> dict[tuple[str, str], tuple[int, int]]:
    """One micro-batch's tensor-parallel collectives on ``rank``, by (kind, phase): (calls, bytes per call summed),
    from the catalogue (``config.engines.TENSOR_PARALLEL``): each layer's and its column-parallel linears', a fully
    recomputed layer's forward again, the norms' gradients, and the model's ends this stage holds."""
    if rank.tp == 1:
        return {}
    spec = cfg.parallel.tp_spec
    modes = cfg.ac.layer_modes(cfg.model.layers)
    w = widths(cfg)  # a norm's gradient: fp32 under autocast, else the module's width (DeepSpeed's 16 bits)
    norm_bytes = cfg.model.hidden * (4 if w.autocast else w.e)
    sizes = {Sent.ACTIVATION: activation_message_bytes(cfg), Sent.NORM: norm_bytes,
             Sent.TOKENS: cfg.micro_batch * cfg.seq * 4}
    out: dict[tuple[str, str], tuple[int, int]] = {}

    def add(items, times: int = 1) -> None:
        for c in items:
            calls, nbytes = out.get((c.kind, c.phase), (0, 0))
            out[(c.kind, c.phase)] = (calls + c.count * times, nbytes + c.count * times * sizes[c.sent])

    for i in rank.layers:
        add(spec.per_layer)
        add(spec.per_column, dtensor.column_linears(cfg))
        if modes[i].spec.applied is Applied.WHOLE_BLOCK:
            add(spec.recompute)
    norms = norm_tensors(cfg.model) * (2 * len(rank.layers) + (1 if rank.last else 0))
    add(spec.per_norm, norms)
    add(spec.ends(rank.first, rank.last, cfg.vocab_parallel))
    return out


def gradient_reductions(cfg: RunConfig, rank: RankShare) -> int:
    """All-reduces over the data-parallel group per update on ``rank`` of a layout without FSDP2: DDP takes neither
    DTensor parameters nor pipeline stages, so the measured layouts average each parameter tensor's gradient (shard)
    on its own after the last backward (distributed/layouts.py), no buckets."""
    return dtensor.rank_tensors(cfg, rank) if cfg.parallel.dp > 1 and not cfg.parallel.fsdp else 0


def replicated_ops(cfg: RunConfig) -> tuple[OpCount, ...]:
    """One micro-batch's ops outside the layers' tensor-parallel regions (each layer's two norms, residual dropouts
    and adds, backward, and a whole-block recompute's forward again): without sequence parallelism every
    tensor-parallel rank runs them on the whole b·s·h (Korthikanti et al. 2022, sec. 4.2.2)."""
    ops, m, t = OpList(widths(cfg)), cfg.model, cfg.micro_batch * cfg.seq  # oplist's own op writer
    redo = sum(mode.spec.applied is Applied.WHOLE_BLOCK for mode in cfg.ac.layer_modes(m.layers))
    for ph, layers, backward in ((Phase.FORWARD, m.layers, True), (Phase.RECOMPUTE, redo, False)):
        block = OpList(ops.w)
        for _ in ("attention", "mlp"):
            block.norm(ph, t, m.hidden, m.norm, m.bias, backward)
            block.dropout(ph, t * m.hidden, m.dropout, ops.w.e, backward)
            block.elementwise("add", ph, t * m.hidden, ops.w.res, inputs=2, count=2 if backward else 1)
        ops.add(*(o.times(layers) for o in merge(block.out) if layers))
    return merge(ops.out)


def tp_seconds(cfg: RunConfig, rank: RankShare, link: Link | None = None) -> float:
    """One micro-batch's TP collectives on ``rank`` (``tp_collectives``), each priced on the link."""
    link = link or tp_link(cfg)
    return sum(link.collective_seconds(kind, nbytes / calls, rank.tp) * calls
               for (kind, _), (calls, nbytes) in tp_collectives(cfg, rank).items())


def schedule_actions(cfg: RunConfig, rank: RankShare) -> dict[str, int]:
    """One update's actions of ``rank``'s schedule, by kind as torch.distributed.pipelining's schedule IR names
    them (``_ComputationType``): per micro-batch, a forward "F" and a backward "B" of each of its chunk-stages;
    "SEND_F" of the activations from every chunk-stage but the pipeline's last, "RECV_F" into every one but the
    first, "SEND_B" / "RECV_B" of their gradients the other way.  GPipe, 1F1B and interleaved 1F1B order them
    differently, with the same counts (Huang et al. 2019; Narayanan et al. 2021 sec. 2.2); v chunks per rank
    multiply the boundaries a rank sits on.  {} without a pipeline."""
    if rank.stages == 1:
        return {}
    m, last = cfg.accum, cfg.parallel.pp * cfg.parallel.chunks - 1
    mine = _chunk_stages(cfg, rank)
    inner, outer = sum(i > 0 for i in mine), sum(i < last for i in mine)
    return {"F": m * len(mine), "B": m * len(mine), "SEND_F": m * outer, "RECV_F": m * inner,
            "SEND_B": m * inner, "RECV_B": m * outer}


def pp_sends(cfg: RunConfig, rank: RankShare) -> int:
    """One micro-batch's sends from ``rank``: activations to the next stage, gradients to the previous one, at
    every chunk boundary it has (v chunks: v of each, less the pipeline's two ends)."""
    acts = schedule_actions(cfg, rank)
    return (acts["SEND_F"] + acts["SEND_B"]) // cfg.accum if acts else 0


def pp_receives(cfg: RunConfig, rank: RankShare) -> int:
    """One micro-batch's receives posted by ``rank``: as many as its sends (a chunk-stage that sends its
    activations on receives their gradient back)."""
    acts = schedule_actions(cfg, rank)
    return (acts["RECV_F"] + acts["RECV_B"]) // cfg.accum if acts else 0


def pp_seconds(cfg: RunConfig, rank: RankShare, link: Link | None = None, chunk_forward: float | None = None) -> float:
    """One micro-batch's point-to-point actions on ``rank``, each one message on the link: its sends with their
    bytes (b·s·h each, this rank's sequence slice under sequence parallelism), its receives posted (the per-message
    cost: a receive is its own request on gloo, ``batch_isend_irecv`` issuing one per op); with ``chunk_forward``
    (one chunk's forward on the rank), less what the schedule hides (overlap.py)."""
    link = link or pp_link(cfg)
    send, receives = link.send_seconds(activation_message_bytes(cfg) / rank.in_sp), pp_receives(cfg, rank) * link.latency_s
    return overlap.pp_exposed_seconds(cfg, pp_sends(cfg, rank), send, receives, chunk_forward)


def rank_compute_seconds(share: float, tp: int, compute: float,
                         issued: tuple[tuple[float, float], ...] = (), replicated: float = 0.0,
                         dispatch: float = 0.0) -> float:
    """One micro-batch's compute on one rank of a stage holding ``share`` of the replica's work.  ``issued``: per
    phase, the replica's (kernel work, host issue time) on an asynchronous device: a tensor-parallel rank runs 1/t
    of each kernel's work but issues every kernel of its stage (each rank runs the whole layer on its shard:
    Shoeybi et al. 2019, sec. 3), so the launches do not shrink with t; the host issues ahead of the kernels through
    the micro-batch (nothing inside it waits for the device), so it takes the longer of its kernels' work and its
    launches.  Without ``issued`` (a synchronous device, a CPU): the priced ``compute`` split by share, its work by t
    too, not the ``dispatch`` part of it (each op's fixed cost: every TP rank dispatches every op on its shard).
    ``replicated``: the work of this stage's layers that every TP rank runs whole (``replicated_ops``): the rest of
    it beyond its 1/t in ``compute``."""
    again = replicated * (1 - 1 / tp)
    if not issued:
        return ((compute - dispatch) / tp + dispatch) * share + again
    return max(sum(work for work, _ in issued) * share / tp + again, sum(launch for _, launch in issued) * share)


def pipeline_time(cfg: RunConfig, compute_per_micro_batch: float, costs: OpCosts | None = None,
                  issued: tuple[tuple[float, float], ...] = (), replicated: float = 0.0,
                  dispatch_per_micro_batch: float = 0.0, host_scale: float = 1.0, time_shared: float = 1.0
                  ) -> PipelineTime:
    """``compute_per_micro_batch``: the whole replica's forward + backward (+ recompute) of one micro-batch on one
    device, as the per-op model priced it; ``issued``: the same per phase as (kernel work, host issue time) on an
    asynchronous device, and ``replicated`` the work every TP rank runs whole, ``dispatch_per_micro_batch`` the
    fixed cost per op of ``compute`` on a synchronous one (``rank_compute_seconds``); ``costs``: the per-op costs,
    whose calibrated link prices local ranks' messages; ``host_scale``: how much slower a rank's host work runs beside
    the other local ranks (formula/timing.py), ``time_shared`` the part of it that is the cores' time-sharing."""
    ranks = shares(cfg)
    per = [stage_flops_per_token(cfg, r.layers, r.last) for r in ranks]
    total = sum(per) or 1.0
    pp = shared(cfg, costs, pp_link(cfg, costs), time_shared)
    # forward's share of a micro-batch's compute: as priced per phase, else a third (2 FLOPs per MAC, backward 4)
    forward = issued[0][0] / (sum(w for w, _ in issued) or 1.0) if issued else 1 / 3
    def stage(r: RankShare, f: float) -> StageTime:
        compute = rank_compute_seconds(f / total, r.tp, compute_per_micro_batch, issued,
                                       replicated * len(r.layers) / cfg.model.layers, dispatch_per_micro_batch)
        host, update = dtensor.host_seconds(cfg, r, costs, host_scale, tp_collectives(cfg, r))
        if issued:  # the host issues ahead of the device: DTensor's host work shows only beyond the kernels' time
            host = max(0.0, host + sum(launch for _, launch in issued) * f / total - compute)
        tp_r = tp_at_gap(cfg, r, costs, compute, time_shared)
        exposed_tp = max(0.0, tp_seconds(cfg, r, tp_r) - overlap.tp_hidden_seconds(cfg, r.layers, tp_r, costs))
        sends = pp_seconds(cfg, r, pp, compute * forward / cfg.parallel.chunks if local_link(cfg, costs) is None else None)
        return StageTime(stage=r.stage, compute_seconds=compute, tp_comm_seconds=exposed_tp, pp_comm_seconds=sends,
                         dtensor_seconds=host, dtensor_update_seconds=update)

    stages = tuple(stage(r, f) for r, f in zip(ranks, per))
    slowest = max(range(len(stages)), key=lambda i: (stages[i].seconds, -i))
    return PipelineTime(stages=stages, micro_batches=cfg.accum, bubble_fraction=cfg.parallel.bubble_fraction(cfg.accum),
                        slowest=slowest, time_shared=max(1.0, time_shared))


def tp_at_gap(cfg: RunConfig, rank: RankShare, costs: OpCosts | None, compute: float, time_shared: float) -> Link:
    """The TP link as ``rank``'s collectives meet it: on a local CPU link, each message ``compute`` (its micro-batch)
    over its collectives after the last, as a chain of all-reduces that far apart pays each (``Link.in_chain``; where
    unmeasured ``Link.after_gap``), then stretched by the cores' time-sharing (``shared``)."""
    link = tp_link(cfg, costs)
    if costs is not None and local_link(cfg, costs) is not None:
        gap = compute / max(sum(n for n, _ in tp_collectives(cfg, rank).values()), 1)
        link = link.in_chain(costs.link_chain_seconds or {}, costs.link_warm_latency_s, gap)
    return shared(cfg, costs, link, time_shared)


def collectives_text(items) -> str:
    """"forward 2 all_reduce, backward 2 all_reduce": a catalogue entry's collectives, by phase."""
    phases: dict[str, Counter] = {}
    for c in items:  # the same kind in a phase counted once: a layer's and its column linears' all-reduces add
        phases.setdefault(c.phase, Counter())[c.kind] += c.count
    return ", ".join(f"{ph} " + " + ".join(f"{n} {k.replace('_', '-')}" for k, n in v.items())
                     for ph, v in phases.items())


def text(cfg: RunConfig, p: PipelineTime, costs: OpCosts | None = None) -> str:
    """The assumptions line of a layout's time."""
    lay, parts = cfg.parallel, []
    pp = shared(cfg, costs, pp_link(cfg, costs), p.time_shared)
    slow = shares(cfg)[p.slowest]
    tp = tp_at_gap(cfg, slow, costs, p.stages[p.slowest].compute_seconds, p.time_shared)
    if lay.tp > 1:
        spec = lay.tp_spec
        parts.append(f"TP {lay.tp}" + (" with sequence parallelism" if lay.sequence_parallel else "")
                     + f": each rank computes 1/{lay.tp} of its stage's FLOPs; per layer per micro-batch "
                     f"{collectives_text(spec.per_layer + spec.per_column * dtensor.column_linears(cfg))} of b·s·h"
                     + (f" (+{collectives_text(spec.recompute)} per fully recomputed layer)" if spec.recompute else "")
                     + (", the norms' weight gradients all-reduced every micro-batch" if spec.per_norm else "")
                     + f", the embedding's and head's at the ends ({spec.api}); each collective over "
                     f"{tp.text()}; each rank dispatches every op; "
                     + dtensor.text(cfg, slow, costs, tp_collectives(cfg, slow)))
    if lay.pp > 1:
        parts.append(f"PP {lay.pp} ({lay.schedule.value}): (m + (p-1)/v) x the slowest stage's micro-batch, bubble "
                     f"{p.bubble_fraction:.1%} of the update (m = accum = {cfg.accum}); stage compute split by FLOPs; "
                     f"b·s·h sends each way per micro-batch and chunk boundary over {pp.text()}, "
                     "each receive one more message"
                     + (f"; the local ranks time-share the cores (x{p.time_shared:.2f}): a rank idle in the bubble "
                        f"leaves its core to the others, {p.bubble_seconds * 1e3:.1f} ms of it left"
                        if p.time_shared > 1 else ""))
    if hides := overlap.text(cfg, local_link(cfg, costs) is not None):
        parts.append(hides)
    if reductions := gradient_reductions(cfg, slow):
        parts.append(f"data-parallel reduction: one all-reduce per parameter tensor, {reductions} on this rank "
                     "(no DDP buckets over DTensors or pipeline stages)")
    return "; ".join(parts)


def bubble_change(a: RunConfig, b: RunConfig) -> str:
    """A compare verdict's clause on the pipeline bubble, (p-1)/(v·m+p-1) of each side's update (Narayanan et al.
    2021, sec. 2.2), and what moved it; "" where neither side runs a pipeline."""
    la, lb = a.parallel, b.parallel
    if la.pp == 1 and lb.pp == 1:
        return ""
    fa, fb = la.bubble_fraction(a.accum), lb.bubble_fraction(b.accum)
    if round(fa, 3) == round(fb, 3):
        moved = f"the bubble stays at {fa:.0%}"
    else:
        moved = f"the bubble {'falls' if fb < fa else 'grows'} from {fa:.0%} to {fb:.0%}"
    why = []
    if la.schedule != lb.schedule and not (la.schedule_spec.virtual or lb.schedule_spec.virtual):
        why.append("1F1B and GPipe keep the same bubble (1F1B holds fewer micro-batches' activations)")
    if la.chunks != lb.chunks:
        more = lb.chunks > la.chunks
        why.append(f"{max(la.chunks, lb.chunks)} chunks per rank {'divide' if more else 'no longer divide'} it by "
                   f"{max(la.chunks, lb.chunks) // min(la.chunks, lb.chunks)}")
    if a.accum != b.accum:
        why.append(f"accumulation (micro-batches per flush, {a.accum} -> {b.accum}) "
                   + ("shrinks it" if b.accum > a.accum else "grows it"))
    if la.pp != lb.pp:
        why.append(f"{'more' if lb.pp > la.pp else 'fewer'} stages ({la.pp} -> {lb.pp}) "
                   + ("grow it" if lb.pp > la.pp else "shrink it"))
    return moved + (": " + ", ".join(why) if why else "")
