"""What a layout's runtime hides of its tensor-parallel collectives and pipeline sends behind compute (no torch).

- Tensor parallelism with ``--tp-overlap async`` (config.engines.TPOverlap): each sequence-parallel collective is
  split into t chunks and pipelined with the GEMM it feeds or follows (Wang et al. 2023, ASPLOS, "Overlap
  communication with dependent computation via decomposition"; torch's symmetric-memory
  ``_fused_all_gather_matmul`` / ``_fused_matmul_reduce_scatter``, which torchtitan's AsyncTP turns on; Transformer
  Engine's userbuffers ring exchange, NeMo's ``tp_comm_overlap``).  A ring of t - 1 transfers of T_comm/(t-1) each
  beside t GEMM chunks of T_gemm/t each: the all-gather computes on its local shard first, the reduce-scatter sends
  its own output's partial last, so one GEMM chunk has no transfer beside it and

      exposed = max(0, T_comm - (t-1)/t x T_gemm)        per (collective, GEMM) pair

  (the transfers run back to back; each GEMM chunk waits for its own; whichever chain is longer sets the end).
  Pairs, per layer and block (attention, MLP): forward, the input all-gather with the column-parallel GEMMs and the
  output reduce-scatter with the row-parallel one; backward, the output gradient's all-gather with the row-parallel
  GEMM's backward and, under Megatron's layer, the column-parallel inputs' gradient reductions with the column GEMMs'
  backward (DTensor's all-reduces there are not decomposed); a fully recomputed layer's forward again as forward.
  The norms' and the model ends' collectives stay exposed, and the GEMM is taken at its own speed (the copies' share
  of the card's bandwidth is not priced).  Torch's async TP needs CUDA symmetric memory: elsewhere nothing is hidden.
- Pipeline sends: torch.distributed.pipelining's GPipe fires each send and waits for them all after the last forward
  (backward); its interleaved runtime (``_PipelineScheduleRuntime``) posts every receive as early as it may and waits
  for the sends only when the step ends; Megatron's interleaved schedule overlaps them by default
  (``--no-overlap-p2p-communication`` turns it off, and validate_args turns it off outside the interleaved schedule);
  torch's 1F1B waits for each send with the next receive before it computes (``Schedule1F1B._step_microbatches``).
  Where a schedule overlaps (``ScheduleSpec.overlaps_sends``) each send hides behind one chunk's forward, the
  shorter phase a send runs beside: exposed max(0, t_send - t_chunk_forward), receives posted early.  On local CPU
  ranks gloo copies on the cores the ranks compute on: nothing is hidden there.
"""
from __future__ import annotations

from batchlab.config import Backend, Implementation, MLPKind, RunConfig
from batchlab.config.acpolicies import Applied
from batchlab.config.engines import TPOverlap
from batchlab.config.phase import Phase
from batchlab.formula import dtensor
from batchlab.formula.opbuild import OpList, widths
from batchlab.formula.opcost import OpCosts

BLOCKS = ("attention", "mlp")


def activation_message_bytes(cfg: RunConfig) -> int:
    """b·s·h in the activations' dtype: what a TP collective (the gathered sequence) and a pipeline send move per
    micro-batch."""
    return cfg.micro_batch * cfg.seq * cfg.model.hidden * cfg.precision.compute_bytes


def tp_overlapped(cfg: RunConfig) -> bool:
    """``--tp-overlap async`` on a device whose runtime can run it (CUDA's symmetric memory / userbuffers)."""
    lay = cfg.parallel
    return (lay.tp_overlap is TPOverlap.ASYNC and lay.tp > 1 and lay.sequence_parallel
            and cfg.device_spec.backend is Backend.CUDA)


def _linears(cfg: RunConfig) -> dict[tuple[str, str], tuple[tuple[int, int, bool], ...]]:
    """One layer's linears (in, out, is the block's input) by (block, column | row), as formula/oplist.py's layer
    writes them."""
    m = cfg.model
    h, f = m.hidden, m.ffn
    if m.mlp is MLPKind.SWIGLU and widths(cfg).megatron:
        up = ((h, 2 * f, True),)  # one fc1 of gate and up
    elif m.mlp is MLPKind.SWIGLU:
        up = ((h, f, True), (h, f, False))
    else:
        up = ((h, f, True),)
    return {("attention", "column"): ((h, h + 2 * m.kv_hidden, True),), ("attention", "row"): ((h, h, False),),
            ("mlp", "column"): up, ("mlp", "row"): ((f, h, False),)}


def gemm_seconds(cfg: RunConfig, costs: OpCosts) -> dict[tuple[str, str, Phase], float]:
    """One layer's GEMM time on one tensor-parallel rank (1/t of the whole layer's work, as formula/pipeline.py's
    compute divides it), by (block, column | row, forward | backward), priced by the per-op model."""
    out: dict[tuple[str, str, Phase], float] = {}
    tokens, w = cfg.micro_batch * cfg.seq, widths(cfg)
    for (block, side), shapes in _linears(cfg).items():
        ops = OpList(w)
        for i, o, first in shapes:
            ops.linear(Phase.FORWARD, tokens, i, o, cfg.model.bias, w.autocast and first)
        for ph in (Phase.FORWARD, Phase.BACKWARD):
            out[(block, side, ph)] = sum(costs.work_seconds(op) * op.count for op in ops.out
                                         if op.phase is ph) / cfg.parallel.tp
    return out


def _decomposed(cfg: RunConfig, kind: str) -> bool:
    """Whether the overlap decomposes a paired collective of ``kind``: all-gathers and reduce-scatters always; the
    column inputs' gradient reductions only under Megatron's layer, whose reduce-scatters Transformer Engine overlaps
    with the weight-gradient GEMM (userbuffers' bulk wgrad); DTensor's are all-reduces, which torch's micro-pipeline
    TP pass (torch/_inductor/fx_passes/micro_pipeline_tp.py: all_gather -> mm, mm -> reduce_scatter) leaves whole."""
    return kind != "all_reduce" or cfg.model.impl is Implementation.MEGATRON


def tp_hidden_seconds(cfg: RunConfig, layers: tuple[int, ...], link, costs: OpCosts | None) -> float:
    """One micro-batch's TP collective time the GEMMs hide on a rank running ``layers`` (0 without the overlap):
    per (collective, GEMM) pair, min(T_comm, (t-1)/t x T_gemm), each collective over one b·s·h buffer on ``link``
    (the TP link, formula/pipeline.py's ``Link``).  The pairs are the layout catalogue's (``Collective.paired``:
    per layer one per block, the column inputs' reductions one per column linear, ``dtensor.column_linears_by_block``),
    a fully recomputed layer's forward ones again; the unpaired (norms, the model's ends) stay exposed."""
    if not tp_overlapped(cfg) or costs is None or not layers:
        return 0.0
    t, nbytes, spec = cfg.parallel.tp, activation_message_bytes(cfg), cfg.parallel.tp_spec
    gemm, columns = gemm_seconds(cfg, costs), dtensor.column_linears_by_block(cfg)

    def hidden(collectives, per_column: bool = False) -> float:
        out = 0.0
        for c in collectives:
            if not c.paired or not _decomposed(cfg, c.kind):
                continue
            for block in BLOCKS:
                calls = c.count * columns[block] if per_column else c.count // len(BLOCKS)
                comm = link.collective_seconds(c.kind, nbytes, t) * calls
                out += min(comm, (t - 1) / t * gemm[(block, c.paired, Phase(c.phase))])
        return out

    modes = cfg.ac.layer_modes(cfg.model.layers)
    redone = sum(modes[i].spec.applied is Applied.WHOLE_BLOCK for i in layers)
    return len(layers) * (hidden(spec.per_layer) + hidden(spec.per_column, per_column=True)) + redone * hidden(
        spec.recompute)


def sends_overlapped(cfg: RunConfig) -> bool:
    """The schedule's runtime posts its sends asynchronously and computes beside them, on a device whose
    communication runs beside its kernels (not CPU ranks, where gloo needs the cores the ranks compute on)."""
    return (cfg.parallel.pipelined and cfg.parallel.schedule_spec.overlaps_sends
            and cfg.device_spec.backend is not Backend.CPU)


def pp_exposed_seconds(cfg: RunConfig, sends: int, send_seconds: float, receives_seconds: float,
                       chunk_forward_seconds: float | None) -> float:
    """One micro-batch's point-to-point time on a rank: ``sends`` sends of ``send_seconds`` each and its receives;
    where the schedule overlaps them, what one chunk's forward cannot hide of each send, the receives posted early
    (``chunk_forward_seconds`` None: nothing hidden)."""
    if chunk_forward_seconds is None or not sends_overlapped(cfg):
        return sends * send_seconds + receives_seconds
    return sends * max(0.0, send_seconds - chunk_forward_seconds)


def text(cfg: RunConfig, local: bool) -> str:
    """The assumptions clause on what the layout hides of its TP collectives and PP sends (``local``: CPU ranks on
    this host); "" without TP or PP."""
    lay, parts = cfg.parallel, []
    if tp_overlapped(cfg):  # TP > 1 with sequence parallelism
        parts.append(f"TP collectives decomposed and overlapped with their GEMMs (--tp-overlap async): per pair "
                     f"max(0, T_comm - (t-1)/t x T_gemm) exposed, t = {lay.tp}; the norms' and ends' exposed")
    elif lay.tp > 1:
        parts.append("TP collectives in the critical path" + (
            " (--tp-overlap async ignored: torch's async TP needs CUDA symmetric memory)"
            if lay.tp_overlap is TPOverlap.ASYNC else ""))
    if lay.pipelined and sends_overlapped(cfg) and not local:
        who = ("Megatron's interleaved schedule overlaps its sends (overlap_p2p_comm, on by default)"
               if cfg.model.impl is Implementation.MEGATRON and lay.schedule_spec.virtual
               else f"torch's {lay.schedule_spec.api} posts its sends asynchronously")
        parts.append(f"{who}: each hides behind one chunk's forward")
    elif lay.pipelined:
        parts.append("PP sends not overlapped" + (" (Megatron overlaps them only in the interleaved schedule)"
                                                  if cfg.model.impl is Implementation.MEGATRON else ""))
    return "; ".join(parts)
