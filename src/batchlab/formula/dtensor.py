"""DTensor's host work on a tensor-parallel rank: which ops DTensor dispatches, and what they cost (no torch).

Under ``parallelize_module`` (distributed/tensor_parallel.py) the sharded linears' weights, the sequence-parallel
norms' weights and the vocabulary-split embedding / head are DTensors, so every op that touches one goes through
DTensor's own dispatch in Python (sharding propagation, unwrapping to the local shard and wrapping the output), a
host cost per op that tensor parallelism does not divide.  The ops, by mechanism, per micro-batch (as aten
decomposes them, counted on real runs in tests/formula/test_dtensor_ops.py):

- a sharded linear on a (b, s, i) input: forward ``t``, the input's and output's ``view`` and ``addmm`` (or ``mm`` +
  ``_unsafe_view`` without a bias); backward two ``mm`` with their four transposes and two views, + the bias
  gradient's ``sum`` and one more view with a bias;
- each DTensor parameter's gradient accumulation (AccumulateGrad: ``detach`` on the first micro-batch, ``add_``
  after); a tied embedding and head add their two gradients once more;
- a sequence-parallel norm: its kernel forward and backward;
- the vocabulary-split ends: the embedding lookup and its backward; the loss under ``loss_parallel`` (view,
  log-softmax, detach, nll, the normaliser's div; backward their five, the loss value read); a Hugging Face
  model's loss is its mean multiplied back by the token count (models/hf.py): one more op each way;
- per update, the optimizer's per-element step ops on each DTensor parameter (config/optimizers.py's loop); under
  FSDP2 every parameter is one;
- each tensor-parallel collective (formula/pipeline.py's ``tp_collectives``) is a DTensor redistribution: its
  planning, the functional collective's clone, autograd wrapper and wait, in Python on the rank's main thread
  beside what the link prices (calibrate/dtensor_collective.py);
- under FSDP2, each of its all-gathers and reduce-scatters (formula/sharding.py's ``fsdp_collectives``) comes with
  its hooks, copy-in and copy-out and the swap of sharded and unsharded DTensor parameters, on the main thread
  (calibrate/fsdp_host.py: on a 1-D mesh, and on a 2-D one beside tensor parallelism), its optimizer's ops on the
  DTensor parameters priced per op as above, with or without tensor or pipeline parallelism.
"""
from __future__ import annotations

from batchlab.config import Backend, Implementation, MLPKind, ModelSource, PositionKind, RunConfig
from batchlab.config.optimizers import optimizer_spec
from batchlab.formula.opcost import OpCosts
from batchlab.formula.params import norm_tensors
from batchlab.formula.ranks import RankShare

# Seconds each DTensor op adds on a CPU rank where nothing was calibrated: DTensor's Python dispatch per op on one
# server CPU (docs/cpu.md names it: another CPU's differ), as calibrate/dtensor.py measures it (docs/cpu.md, "Figures behind the code's choices"); forward ops
# cost more (their shardings are propagated afresh).  "collective": a redistribution's host work over a plain
# gloo all-reduce's, as calibrate/dtensor_collective.py measures it on the same kind of core; "fsdp-hooks" /
# "fsdp-tp-hooks": FSDP2's host work per collective on a 1-D mesh / beside TP on a 2-D one, its optimizer step
# left out (priced per op as "plain"), as calibrate/fsdp_host.py measures it (docs/cpu.md).
NOMINAL = {"forward": 75e-6, "backward": 35e-6, "plain": 25e-6, "collective": 450e-6, "fsdp-hooks": 0.7e-3,
           "fsdp-tp-hooks": 0.7e-3}

LINEAR_FORWARD = 4  # t, view, addmm, view (t, view, mm, _unsafe_view without a bias)
LINEAR_BACKWARD = 8  # 2 mm, 4 t, 2 view
BIAS_BACKWARD = 2  # sum, view
LOSS_FORWARD = 5  # view, _log_softmax, detach, nll_loss_forward, div
LOSS_BACKWARD = 8  # ones_like, div, nll_loss_backward, _log_softmax_backward_data, view, _local_scalar_dense, 2 detach


def sharded_linears(cfg: RunConfig) -> int:
    """Linears per layer under the plan: attention's q/k/v (fused in the built-in GPT) and output projection, the
    MLP's up (and gate) and down."""
    return _qkv_linears(cfg) + 1 + (3 if cfg.model.mlp is MLPKind.SWIGLU else 2)


def _qkv_linears(cfg: RunConfig) -> int:
    return 3 if cfg.model_kind is ModelSource.HF else 1


def column_linears_by_block(cfg: RunConfig) -> dict[str, int]:
    """Column-parallel linears of a layer's attention and MLP blocks, each a backward all-reduce of its input's
    gradient under DTensor (config.engines.TensorParallelSpec.per_column): all but the two row-parallel ones
    (attention's output, the MLP's down): q/k/v (fused in the built-in GPT), the MLP's up (and gate); Megatron's own
    layers reduce once per block (its f operator)."""
    if cfg.model.impl is Implementation.MEGATRON:
        return {"attention": 1, "mlp": 1}
    return {"attention": _qkv_linears(cfg), "mlp": 2 if cfg.model.mlp is MLPKind.SWIGLU else 1}


def column_linears(cfg: RunConfig) -> int:
    """Column-parallel linears per layer (``column_linears_by_block``'s sum)."""
    return sum(column_linears_by_block(cfg).values())


def dtensor_params(cfg: RunConfig, rank: RankShare) -> int:
    """The DTensor parameters ``rank`` holds: the sharded linears' weights (and biases), the sequence-parallel norms',
    the vocabulary-split embedding and head (one where tied on this rank)."""
    if rank.tp == 1:
        return 0
    layers = len(rank.layers)
    n = layers * sharded_linears(cfg) * (2 if cfg.model.bias else 1)
    if cfg.sequence_parallel:
        n += norm_tensors(cfg.model) * (2 * layers + (1 if rank.last else 0))
    if cfg.vocab_parallel:
        ends = (1 if rank.first else 0) + (1 if rank.last else 0)
        n += 1 if ends == 2 and cfg.model.tied_embeddings else ends
    return n


def rank_tensors(cfg: RunConfig, rank: RankShare) -> int:
    """The parameter tensors ``rank`` holds: its layers' linears (and biases) and norms, the embedding (and learned
    positions) on the first stage, the final norm and an untied head (a tied one's copy off the first stage) on the
    last."""
    m = cfg.model
    per_layer = sharded_linears(cfg) * (2 if m.bias else 1) + 2 * norm_tensors(cfg.model)
    n = per_layer * len(rank.layers)
    if rank.first:
        n += 1 + (1 if m.position is PositionKind.LEARNED else 0)
    if rank.last:
        n += norm_tensors(cfg.model) + (0 if m.tied_embeddings and rank.first else 1)
    return n


def dtensor_ops(cfg: RunConfig, rank: RankShare) -> dict[str, int]:
    """DTensor ops of ``rank``: "forward" and "backward" per micro-batch, "plain" (the optimizer's) per update.
    FSDP2 keeps every parameter as a DTensor sharded over the data-parallel ranks (``fully_shard``): its compute runs
    on the gathered (plain or TP-sharded) weights, its optimizer step on DTensors, each parameter's."""
    step = sum(1 for s in optimizer_spec(cfg.optimizer).step_ops if s.per_element)
    if rank.tp == 1 or cfg.model.impl is Implementation.MEGATRON:  # Megatron's TP runs its own layers, no DTensor
        fsdp = cfg.parallel.fsdp and cfg.model.impl is not Implementation.MEGATRON
        return {"forward": 0, "backward": 0, "plain": step * rank_tensors(cfg, rank)} if fsdp else {}
    layers, bias = len(rank.layers), cfg.model.bias
    linears = layers * sharded_linears(cfg)
    fwd = LINEAR_FORWARD * linears
    bwd = (LINEAR_BACKWARD + (BIAS_BACKWARD if bias else 0)) * linears + dtensor_params(cfg, rank)
    if cfg.sequence_parallel:
        norms = 2 * layers + (1 if rank.last else 0)
        fwd, bwd = fwd + norms, bwd + norms
    if cfg.vocab_parallel:
        own = 1 if cfg.model_kind is ModelSource.HF else 0  # the loss's mean multiplied back
        if rank.first:
            fwd, bwd = fwd + 1, bwd + 1
        if rank.last:
            fwd += LINEAR_FORWARD + LOSS_FORWARD + own
            bwd += LINEAR_BACKWARD + LOSS_BACKWARD + own
        if rank.first and rank.last and cfg.model.tied_embeddings:
            bwd += 1
    stepped = rank_tensors(cfg, rank) if cfg.parallel.fsdp else dtensor_params(cfg, rank)
    return {"forward": fwd, "backward": bwd, "plain": step * stepped}


def seconds_per_op(costs: OpCosts | None, cpu: bool = True) -> tuple[dict[str, float], str]:
    """(seconds each DTensor op adds, by dispatch kind; where the figures come from).  The nominal figure is a CPU
    rank's own host; a GPU's host issues ahead of its kernels and no figure of such a host is known: none there
    unless calibrated ({})."""
    if costs is not None and costs.dtensor_seconds:
        return {**NOMINAL, **costs.dtensor_seconds}, "calibrated"
    return ((dict(NOMINAL), "nominal: one server CPU's own calibration (docs/cpu.md), not this host's; a first "
             "tensor-parallel measure or compare times this host's") if cpu
            else ({}, "not priced: no figure for this device's host"))


def source_of(costs: OpCosts | None, keys: tuple[str, ...], cpu: bool = True) -> str:
    """Where the figures of ``keys`` come from: this host's calibration where it holds every one, else the nominal
    figures' source (a calibration made before a figure was added holds the others only)."""
    calibrated = costs is not None and all(k in costs.dtensor_seconds for k in keys)
    return "calibrated" if calibrated else seconds_per_op(None, cpu)[1]


def redistributions(cfg: RunConfig, rank: RankShare, collectives: dict | None) -> int:
    """Of a micro-batch's tensor-parallel ``collectives`` on ``rank`` ({(kind, phase): (calls, bytes)}, formula/
    pipeline.py's ``tp_collectives``), the calls DTensor issues: all under PyTorch's plan, none under Megatron's."""
    mine = rank.tp > 1 and cfg.model.impl is not Implementation.MEGATRON
    return sum(calls for calls, _ in (collectives or {}).values()) if mine else 0


def host_seconds(cfg: RunConfig, rank: RankShare, costs: OpCosts | None, scale: float = 1.0,
                 collectives: dict | None = None) -> tuple[float, float]:
    """(per micro-batch, per update) seconds of DTensor's host work on ``rank``; ``scale``: how much slower this
    rank's host runs beside the other local ranks (formula/timing.py's sharing and contention); ``collectives``:
    the micro-batch's tensor-parallel collectives, each a redistribution's host work."""
    ops = dtensor_ops(cfg, rank)
    per, _ = seconds_per_op(costs, cfg.device_spec.backend is Backend.CPU)
    if not ops or not per:
        return 0.0, 0.0
    micro = (ops["forward"] * per["forward"] + ops["backward"] * per["backward"]
             + redistributions(cfg, rank, collectives) * per.get("collective", 0.0))
    return micro * scale, ops["plain"] * per["plain"] * scale


def fsdp_key(cfg: RunConfig) -> str:
    """The figure FSDP2's host work is priced with: beside tensor parallelism its parameters are sharded on a 2-D
    mesh."""
    return "fsdp-tp-hooks" if cfg.parallel.tp > 1 else "fsdp-hooks"


def fsdp_host_seconds(cfg: RunConfig, collectives: int, costs: OpCosts | None, scale: float = 1.0) -> float:
    """Seconds of FSDP2's host work per update on a rank that issues ``collectives`` FSDP2 all-gathers and
    reduce-scatters per update (0 without FSDP2, or where no figure prices a device's host); ``scale`` as in
    ``host_seconds``."""
    if not cfg.parallel.fsdp or not collectives:
        return 0.0
    per, _ = seconds_per_op(costs, cfg.device_spec.backend is Backend.CPU)
    return collectives * per.get(fsdp_key(cfg), 0.0) * scale


def fsdp_text(cfg: RunConfig, collectives: int, seconds: float, costs: OpCosts | None) -> str:
    """The assumptions line's clause on FSDP2's host work, with where its per-collective figure comes from ("" where
    none is priced)."""
    if not seconds:
        return ""
    cpu = cfg.device_spec.backend is Backend.CPU
    per, source = seconds_per_op(costs, cpu)[0], source_of(costs, (fsdp_key(cfg),), cpu)
    return (f"; FSDP2's host work (hooks, copy-in and copy-out) around its {collectives} collectives per update, "
            f"{per[fsdp_key(cfg)] * 1e6:.0f} us each ({source}): {seconds * 1e3:.1f} ms at this rank's host speed")


def text(cfg: RunConfig, rank: RankShare, costs: OpCosts | None, collectives: dict | None = None) -> str:
    """The assumptions line's clause on DTensor's host work."""
    ops = dtensor_ops(cfg, rank)
    if not ops:
        return ""
    cpu = cfg.device_spec.backend is Backend.CPU
    per, source = seconds_per_op(costs, cpu)
    if not per:
        return f"DTensor's host work {source}"
    if not (ops["forward"] or ops["backward"]):  # FSDP2 alone: its optimizer steps DTensors, its compute does not
        return (f"DTensor's host work: {ops['plain']} optimizer ops per update on FSDP2's DTensor parameters, at "
                f"{per['plain'] * 1e6:.0f} us each ({source_of(costs, ('plain',), cpu)})")
    return (f"DTensor's host work: {ops['forward']} forward + {ops['backward']} backward ops per micro-batch, "
            f"{ops['plain']} optimizer ops per update on DTensors, at {per['forward'] * 1e6:.0f} / "
            f"{per['backward'] * 1e6:.0f} / {per['plain'] * 1e6:.0f} us each "
            f"({source_of(costs, ('forward', 'backward', 'plain'), cpu)}), not divided by TP"
            + (f"; {n} redistributions per micro-batch at {per['collective'] * 1e6:.0f} us of host work each "
               f"({source_of(costs, ('collective',), cpu)})"
               if (n := redistributions(cfg, rank, collectives)) and per.get("collective") else ""))

