"""Time of one optimizer update: the per-op model over the update's ops (formula/opcost.py), plus the
gradient all-reduce once per update.

The ops come from the model's terms (formula/oplist.py); their costs from ``batchlab calibrate`` where the
device was calibrated (measured rates are what kernels of each size reach, so no achievable fraction is
applied on top), else from nominal figures of the device entry: peak x achievable fraction for large
matmuls, a fixed per-call start-up cost that keeps small matmuls below it, the memory bandwidth, and a
typical per-op dispatch (CPU) or launch (GPU) cost.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from batchlab.config import Backend, CompileMode, DataKind, DeviceSpec, ModelSource, RunConfig
from batchlab.formula import dtensor, fp8, inkernel, offload, opdescribe
from batchlab.formula.efficiency import Sourced, achievable_fraction, bus_bandwidth, exposed_comm_seconds
from batchlab.formula.flops import FlopsEstimate, flops
from batchlab.formula.links import dp_link
from batchlab.formula.params import count
from batchlab.formula.memo import cache, lookup
from batchlab.formula.memory import MemoryEstimate
from batchlab.formula.opcost import OpClass, OpCosts, OpCount, TimeBreakdown, link_text, price
from batchlab.config.phase import Phase
from batchlab.formula.deepspeed import activation_precision
from batchlab.formula.oplist import update_ops
from batchlab.formula.pipeline import gradient_reductions, pipeline_time, replicated_ops, text as layout_time_text
from batchlab.formula.ranks import shares
from batchlab.formula.states import heaviest
from batchlab.formula.sharding import collective_seconds, fsdp_collectives, ring_messages, traffic
from batchlab.util.units import fmt_count

# Nominal per-op costs where nothing was calibrated (seconds).  CPU: eager PyTorch's Python + dispatcher
# cost per aten op, as `batchlab calibrate` measures it (docs/cpu.md, "Figures behind the code's choices");
# CUDA/MPS: the host side of a kernel launch, ~5-10 us in eager PyTorch.  MATMUL_START: a matmul call's fixed
# start-up (blocking, packing, a launch), which is why small matmuls stay far below the peak.
# An op under selective checkpointing's Python dispatch mode (opcost.SAC_KIND) costs host-side Python on every
# backend, seconds per op in forward and in recompute (calibrated figures: docs/cpu.md).
NOMINAL_SAC = {"forward-sac": 35e-6, "recompute-sac": 28e-6}
NOMINAL_DISPATCH = {Backend.CPU: {"forward": 6e-6, "backward": 5e-6, "plain": 4e-6, **NOMINAL_SAC},
                    Backend.CUDA: {"forward": 8e-6, "backward": 7e-6, "plain": 5e-6, **NOMINAL_SAC},
                    Backend.MPS: {"forward": 12e-6, "backward": 10e-6, "plain": 8e-6, **NOMINAL_SAC}}
MATMUL_START = {Backend.CPU: 2e-6, Backend.CUDA: 5e-6, Backend.MPS: 10e-6}
# CPU per-element kernels, cycles per element on one core: nominal figures of an x86 core with AVX-512, by class
# (docs/cpu.md, "Figures behind the code's choices"); `batchlab calibrate` measures the host's own.  GPUs are
# bandwidth-bound on these: bytes decide.
CPU_CYCLES_PER_ELEMENT = {"activation": 13, "activation-grad": 35, "softmax": 5, "loss": 14, "masked": 13, "norm": 4,
                          "random": 50}


@dataclass(frozen=True)
class TimeEstimate:
    compute_seconds_per_micro_batch: float  # forward + backward + recompute of one micro-batch
    compute_seconds: float  # accum micro-batches
    allreduce_bytes: int  # gradient bytes reduced per update (all-reduce + reduce-scatter)
    allreduce_seconds: float  # ring time of every collective of the update, before overlap
    exposed_comm_seconds: float  # the part not hidden behind backward
    optimizer_seconds: float  # clip + optimizer step + zero_grad (and the data phase)
    update_seconds: float
    tokens_per_second: float  # useful tokens, all ranks
    overhead_seconds_per_micro_batch: float  # the dispatch part of compute_seconds_per_micro_batch
    flops_ceiling: float  # effective matmul FLOP/s of this update's matmuls (FLOPs / matmul seconds)
    ceiling_source: str  # calibrated on ... / nominal ...
    bandwidth_bytes_per_s: float  # link used for the all-reduce
    ops: TimeBreakdown | None = None  # the per-op model's split by phase and op class (one rank)
    model: str = ""  # the time model's assumptions: rates, their source, dispatch share
    collective_bytes: dict[str, int] = field(default_factory=dict)  # per update, by kind (formula.sharding)
    achievable_fraction: float = 0.0  # of the peak, on large matmuls (nominal costs only; 0: measured rates)
    fraction_source: str = ""  # where it comes from (formula/efficiency.py), or why none is applied
    overlap_source: str = ""  # how the engine hides communication
    # a tensor / pipeline layout (formula/pipeline.py), the slowest stage's rank: 0 without one
    bubble_fraction: float = 0.0  # idle share of the update ((p-1)/(v·m+p-1))
    bubble_seconds: float = 0.0
    tp_comm_seconds: float = 0.0  # tensor-parallel collectives per update, what no GEMM hides (formula/overlap.py)
    pp_comm_seconds: float = 0.0  # pipeline sends per update, what no compute hides (formula/overlap.py)
    stage_seconds: tuple[float, ...] = ()  # per micro-batch, each pipeline stage: compute + TP + sends
    provenance: str = "formula"
    offload_seconds: float = 0.0  # activation copies to the host and back not hidden behind compute

    def time_to_tokens(self, tokens: float) -> float:
        return tokens / self.tokens_per_second


def ring_allreduce_seconds(nbytes: float, n: int, bus_bytes_per_s: float) -> float:
    # nccl-tests PERFORMANCE.md: ring all-reduce moves 2(n-1)/n of the buffer over the slowest link.
    return collective_seconds("all_reduce", nbytes, n, bus_bytes_per_s)


def useful_fraction(cfg: RunConfig) -> float:
    """Expected non-padding share: padded lengths are uniform in [s/2, s] (models.synthetic_tokens)."""
    if cfg.data is DataKind.FIXED:
        return 1.0
    s = cfg.seq
    return (s // 2 + s) / 2 / s


def matmul_curve(rate: float, start: float) -> tuple[tuple[float, float], ...]:
    """(FLOPs per call, FLOP/s) of a matmul with a fixed start-up ``start`` s: f / (start + f / rate)."""
    return tuple((f, f / (start + f / rate)) for f in (1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12))


def nominal_costs(cfg: RunConfig, flop_ratio: float = 1.0) -> OpCosts:
    """Per-op costs from the device entry alone (no calibration): said so in every prediction.  Large matmuls
    reach the achievable fraction of the peak for the device and precision (formula/efficiency.py).
    ``flop_ratio``: the op list's matmul FLOPs over formula/flops.py's hardware FLOPs, the count a GPU's
    end-to-end fraction was derived against (FlopCounterMode counts attention's backward as five matmuls)."""
    dev, frac, fp8_on = cfg.device_spec, achievable_fraction(cfg), fp8.active(cfg) is not None
    return lookup(_NOMINAL, (dev, frac, flop_ratio, fp8_on), lambda: _nominal(dev, frac, flop_ratio, fp8_on))


_NOMINAL = cache(limit=256)  # one OpCosts per (device, fraction, FLOP ratio): its per-op work is remembered


def _nominal(dev: DeviceSpec, frac: Sourced, flop_ratio: float, fp8_on: bool = False) -> OpCosts:
    named = dev.source if dev.source.startswith("nominal") else f"nominal: {dev.source} figures of {dev.name}"
    start = MATMUL_START[dev.backend]
    end_to_end = dev.backend is not Backend.CPU
    scale = frac.value * (flop_ratio if end_to_end else 1.0)
    curves = {"fp32": matmul_curve(dev.peak_flops_fp32 * scale, start),
              "bf16": matmul_curve(dev.peak_flops_bf16 * scale, start)}
    if fp8_on:  # FP8 GEMMs reach the same fraction of the card's FP8 peak (formula/fp8.py)
        curves[fp8.CURVE] = matmul_curve(dev.peak_flops_fp8 * scale, start)
    if end_to_end:
        # matmuls at the published fraction; element-wise kernels, copies and the optimizer step are
        # bandwidth-bound on a GPU (roofline, Williams et al. 2009): their bytes over the datasheet HBM rate (a
        # transposed copy at half of it), so their share grows where the matmuls shrink (small hidden sizes, the
        # vocabulary-wide loss); a fused kernel (FlashAttention, a batched matmul) runs at its whole call's rate
        return OpCosts(matmul=curves, memory=((1.0, dev.hbm_bytes_per_s),), strided_bytes_per_s=dev.hbm_bytes_per_s / 2,
                       element_seconds={}, dispatch=NOMINAL_DISPATCH[dev.backend], asynchronous=True,
                       whole_call_rate=True,
                       source=f"{named}, achievable fraction {frac.value:.2f} on matmuls ({frac.source}); element-wise "
                              f"work and the optimizer at {fmt_count(dev.hbm_bytes_per_s, 'B/s')} (batchlab calibrate on "
                              "the card measures each)")
    clock = dev.peak_flops_fp32 / 64  # cores x clock (the entry's peak assumes 64 FLOP/cycle per core)
    elements = {f"{k}:fp32": c / clock for k, c in CPU_CYCLES_PER_ELEMENT.items()}
    # a strided gather reaches about a quarter of the streaming bandwidth (cache lines partly used)
    return OpCosts(matmul=curves, memory=((1.0, dev.hbm_bytes_per_s),), strided_bytes_per_s=dev.hbm_bytes_per_s / 4,
                   element_seconds=elements,
                   dispatch=NOMINAL_DISPATCH[dev.backend],
                   source=f"{named}, achievable fraction {frac.value:.2f} on large matmuls ({frac.source})")


def costs_for(cfg: RunConfig, calibrated: OpCosts | None, ops: tuple[OpCount, ...] = ()) -> OpCosts:
    """The calibrated costs where given (under autocast, a mixed precision, its dispatch costs where measured),
    else nominal ones for ``ops`` (the update's op list, one rank); ``op_overhead_seconds`` replaces every
    dispatch cost."""
    if calibrated is not None:
        costs = calibrated
        own = costs.family_dispatch.get(dispatch_family(cfg) or "") if costs.family_dispatch else None
        if own:
            costs = own_dispatch(costs, own, cfg.model_source)
        costs = fp8.with_curve(costs, cfg)  # a calibration has no FP8 curve: its bf16 one at the peaks' ratio
        if activation_precision(cfg).mixed and costs.dispatch_autocast:  # what autocast did not measure (SAC's) stays
            costs = dataclasses.replace(costs, dispatch={**costs.dispatch, **costs.dispatch_autocast},
                                        source=costs.source + "; dispatch as measured under autocast")
    else:
        hardware = flops(cfg).flops_per_micro_batch * cfg.accum
        counted = sum(o.flops * o.count for o in ops)
        costs = nominal_costs(cfg, counted / hardware if counted and hardware else 1.0)
    per_op = cfg.assumptions.op_overhead_seconds
    if per_op is not None:
        costs = dataclasses.replace(costs, dispatch=dict.fromkeys(costs.dispatch, per_op),
                                    source=costs.source + f"; dispatch {per_op:g} s per op (op_overhead_seconds)")
    return costs


def dispatch_family(cfg: RunConfig) -> str | None:
    """What a model's own dispatch figures are cached under (calibrate/family.py): its Hugging Face source, its
    attention code and the transformers version; None for batchlab's GPT (the calibration's own trainer) and
    a factory's model (code whose shape batchlab cannot shrink)."""
    version = _transformers_version()
    if cfg.model_kind is not ModelSource.HF or version is None:
        return None
    return f"{cfg.model_source} attention={cfg.model.attention.value} transformers={version}"


@functools.cache
def _transformers_version() -> str | None:
    # read once a process: the installed distribution's metadata (no import of transformers itself)
    from importlib import metadata

    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def own_dispatch(costs: OpCosts, ratios: dict[str, float], name: str) -> OpCosts:
    """``costs`` with a model's own Python per op: each kind's calibrated cost x the model's measured ratio
    (its forward and backward code against batchlab's GPT's), the difference added where that code runs again
    (recompute, selective checkpointing's modes) and under autocast."""
    base = costs.dispatch
    extra = {k: base[k] * (r - 1.0) for k, r in ratios.items() if k in base}
    extra.update({sac: extra.get("forward", 0.0) for sac in ("forward-sac", "recompute-sac")})

    def plus(d):
        return {k: max(v + extra.get(k, 0.0), 0.0) for k, v in d.items()}

    return dataclasses.replace(costs, dispatch=plus(base), dispatch_autocast=plus(costs.dispatch_autocast),
                               source=costs.source + f"; {name}'s own dispatch per op ({ratios_text(ratios)} "
                                                     "batchlab's GPT's, measured)")


def ratios_text(ratios: dict[str, float]) -> str:
    """A model's own dispatch ratios as every output says them: "backward x1.08, forward x1.52"."""
    return ", ".join(f"{k} x{r:.2f}" for k, r in sorted(ratios.items()))


def timing(cfg: RunConfig, fl: FlopsEstimate, mem: MemoryEstimate, calibrated: OpCosts | None = None
           ) -> TimeEstimate:
    """``calibrated``: the per-op costs ``batchlab calibrate`` measured for cfg's device, else nominal ones."""
    ops = update_ops(cfg)
    # a compiled run's matmuls are eager's kernels, fewer where its partition recomputes less: the FLOP ratio the
    # nominal fraction is scaled by is the eager op list's, so the FLOPs it drops save time (budget:F has no eager run)
    plain = cfg.compile is CompileMode.NONE or cfg.ac.budget is not None
    eager = ops if plain else update_ops(cfg.replace(compile=CompileMode.NONE))
    costs = costs_for(cfg, calibrated, eager)
    if cfg.parallel.engine_spec.shards_optimizer:  # each rank steps only its shard of the optimizer state
        ops = tuple(OpCount(o.name, o.phase, o.cost_class, o.flops, o.bytes // cfg.dp, o.elements // cfg.dp,
                            o.low_precision, o.count, o.flops_per_matmul, o.sac_dispatched, o.launch)
                    if o.phase is Phase.OPTIMIZER else o
                    for o in ops)
    t = on_host(ops, cfg, costs)
    # the fused step (formula/inbackward.py) runs inside backward: its time moves there, the total stays
    stepped = ("forward", "backward", "recompute") + (("optimizer",) if cfg.optimizer_in_backward else ())
    compute = sum(t.by_phase.get(p, 0.0) for p in stepped)
    rest = t.seconds - compute
    dispatch_compute = sum(costs.dispatch_seconds(o.phase, o.sac_dispatched, o.launch) * o.count for o in ops
                           if o.phase.value in ("forward", "backward", "recompute"))
    link = dp_link(cfg, costs, sharing(cfg, costs))  # TP's and PP's link too; None off a CPU host's local link
    local = link is not None
    bw = link.bytes_per_s if local else bus_bandwidth(cfg).value
    # what the stage's engine sends per update: DDP's all-reduce (+ ZeRO-1's broadcasts), FSDP2's all-gathers
    # and reduce-scatters of every micro-batch (formula.sharding); the engine's overlap hides part of it
    sent = traffic(cfg).per_update
    layout = cfg.parallel.tp * cfg.parallel.pp > 1
    held = heaviest(cfg).params / max(count(cfg.model).total, 1) if layout else 1.0
    issued = (tuple((t.work_by_phase[p] / cfg.accum, t.dispatch_by_phase.get(p, 0.0) / cfg.accum)
                    for p in ("forward", "backward", "recompute") if p in t.work_by_phase)
              if costs.asynchronous and t.work_by_phase else ())
    # without sequence parallelism each TP rank runs the layers' norms, dropouts and residual adds whole
    replicated = (sum(on_host(replicated_ops(cfg), cfg, costs).work_by_phase.values())
                  if layout and cfg.parallel.tp > 1 and not cfg.parallel.sequence_parallel else 0.0)
    pipe, speed = None, sharing(cfg, costs) * (1 + skew(cfg, costs)) * contention(cfg, costs).get("dispatch", 1.0)
    if layout:  # formula/pipeline.py: per stage, then the bubble; the dispatch part at the rank's host speed
        pipe = pipeline_time(cfg, compute / cfg.accum, costs, issued, replicated,
                             min(dispatch_compute * speed, compute) / cfg.accum, speed, sharing(cfg, costs))
    host = 0.0  # the optimizer's ops on DTensor parameters (formula/dtensor.py), issued ahead on a GPU
    if pipe is not None:  # the data-parallel group of a stage's TP rank reduces (and steps) its slice only
        sent = {k: round(v * held) for k, v in sent.items()}
        compute = cfg.accum * pipe.stages[pipe.slowest].compute_seconds
        dispatch_compute *= compute / max(sum(t.by_phase.get(p, 0.0) for p in stepped[:3]), 1e-300)
        rest, host = rest * held, pipe.stages[pipe.slowest].dtensor_update_seconds
    elif cfg.parallel.fsdp:  # FSDP2 steps every parameter as a DTensor
        host = dtensor.host_seconds(cfg, shares(cfg)[0], costs, speed)[1]
    rest += (added := max(0.0, host - rest) if costs.asynchronous else host)
    units = fsdp_collectives(cfg, shares(cfg)[pipe.slowest] if pipe is not None else None)
    gathers = sum(units.values())
    fsdp_host = dtensor.fsdp_host_seconds(cfg, gathers, costs, speed)  # its hooks and copies, in every micro-batch
    grad_bytes = sent["all_reduce"] + sent["reduce_scatter"]
    ran = link.runs_as if local else (lambda kind: kind)  # gloo runs a reduce-scatter as an all-reduce
    comm = sum(collective_seconds(ran(kind), nbytes, cfg.dp, bw) for kind, nbytes in sent.items())
    if local:  # a ring step is one message per rank: 2(n-1) per all-reduce, n-1 per all-gather / reduce-scatter
        reductions = gradient_reductions(cfg, shares(cfg)[pipe.slowest]) if pipe is not None else 0
        comm += link.latency_s * (sum(calls * ring_messages(ran(kind), cfg.dp) for kind, calls in units.items())
                                  if units else 2 * (cfg.dp - 1) * (reductions or ddp_buckets(grad_bytes)))
        comm += link.latency_s * 2 * (cfg.dp - 1)  # the token count's all-reduce
    after_step = collective_seconds("broadcast", sent["broadcast"], cfg.dp, bw)
    hidden = exposed_comm_seconds(cfg, comm, compute, compute / cfg.accum, after_step)
    if cfg.assumptions.comm_overlap is None and local and fills_cores(cfg, costs):
        # gloo copies and sums on the cores the ranks compute on: an all-reduce issued mid-compute adds what it
        # takes alone (docs/cpu.md)
        hidden = Sourced(comm, "local ranks fill the cores: gloo's copies and sums need them, nothing hidden")
    exposed = hidden.value
    offloaded = offload.exposed_seconds(cfg, compute)  # host copies beyond what the side stream hides
    update = t.seconds + exposed + offloaded + fsdp_host + added
    extra: dict = {}
    if pipe is not None:
        slow = pipe.stages[pipe.slowest]
        update = pipe.seconds + rest + exposed + offloaded + fsdp_host
        extra = dict(bubble_fraction=pipe.bubble_fraction, bubble_seconds=pipe.bubble_seconds,
                     tp_comm_seconds=cfg.accum * slow.tp_comm_seconds, pp_comm_seconds=cfg.accum * slow.pp_comm_seconds,
                     stage_seconds=tuple(st.seconds for st in pipe.stages))
    matmul_s = t.by_class.get(OpClass.MATMUL.value, 0.0)
    useful = cfg.tokens_per_update * useful_fraction(cfg)
    frac = (Sourced(0.0, "none applied: measured rates are what kernels of each size reach (batchlab calibrate)")
            if calibrated is not None else achievable_fraction(cfg))
    model = opdescribe.describe(costs, t) + machine_text(cfg, costs)
    if pipe is not None:
        model += "; " + layout_time_text(cfg, pipe, costs)
    elif host:
        model += "; " + dtensor.text(cfg, shares(cfg)[0], costs)
    model += dtensor.fsdp_text(cfg, gathers, fsdp_host, costs)
    compute += fsdp_host  # host work inside forward and backward, shown with them
    return TimeEstimate(compute_seconds_per_micro_batch=compute / cfg.accum, compute_seconds=compute,
                        allreduce_bytes=grad_bytes, allreduce_seconds=comm, exposed_comm_seconds=exposed,
                        optimizer_seconds=rest, update_seconds=update, offload_seconds=offloaded, tokens_per_second=useful / update,
                        overhead_seconds_per_micro_batch=dispatch_compute / cfg.accum,
                        flops_ceiling=t.flops / matmul_s if matmul_s else 0.0, ceiling_source=costs.source,
                        bandwidth_bytes_per_s=bw, ops=t, model=model, collective_bytes=sent,
                        achievable_fraction=frac.value, fraction_source=frac.source, overlap_source=hidden.source,
                        **extra)


DDP_BUCKET_BYTES = 25 * 2**20  # DDP's bucket_cap_mb default
DDP_FIRST_BUCKET_BYTES = 2**20  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES: a small first bucket starts early


def ddp_buckets(grad_bytes: int) -> int:
    """DDP's gradient buckets: the first of 1 MiB, the rest of up to 25 MiB (its defaults), one all-reduce each;
    the harness also all-reduces the update's token count once (``Trainer._global_useful``)."""
    rest = max(0, grad_bytes - DDP_FIRST_BUCKET_BYTES)
    return (1 if grad_bytes else 0) + -(-rest // DDP_BUCKET_BYTES)


def local_ranks(cfg: RunConfig) -> int:
    """The ranks a CPU layout runs on this host, each a process: every data-, tensor- and pipeline-parallel rank."""
    return cfg.parallel.world_size


def sharing(cfg: RunConfig, costs: OpCosts) -> float:
    """How much slower each rank's ops run when the local ranks' threads outnumber the cores: the cores are
    time-shared, so R ranks x T threads on C cores give each rank C / (R T) of its calibrated speed (an
    otherwise idle machine: other processes' load is not predicted)."""
    if cfg.device_spec.backend is not Backend.CPU or not (costs.cores and costs.threads):
        return 1.0
    return max(1.0, local_ranks(cfg) * costs.threads / costs.cores)


def fills_cores(cfg: RunConfig, costs: OpCosts) -> bool:
    """Local CPU ranks whose threads leave no core idle (R ranks x T threads >= C cores)."""
    return (cfg.device_spec.backend is Backend.CPU and bool(costs.cores and costs.threads)
            and local_ranks(cfg) * costs.threads >= costs.cores)


def contention(cfg: RunConfig, costs: OpCosts) -> dict[str, float]:
    """Per kind (compute | memory | dispatch), how much slower each local rank's ops run while the other ranks
    run theirs at the same moment (they step in lockstep: every update ends in the all-reduce): the calibrated
    slowdown of concurrent processes (shared memory bandwidth and caches), at least 1; {} for one rank."""
    if local_ranks(cfg) < 2 or cfg.device_spec.backend is not Backend.CPU or not costs.contention:
        return {}
    return {k: max(1.0, f) for k, f in costs.contention.items()}


def skew(cfg: RunConfig, costs: OpCosts) -> float:
    """How much longer the slowest local CPU rank computes than the ranks' mean (0 for one rank): the
    calibrated spread of two ranks over the same matmuls (calibrate/link.py), which every all-reduce waits out."""
    if local_ranks(cfg) < 2 or cfg.device_spec.backend is not Backend.CPU:
        return 0.0
    return max(0.0, costs.rank_skew)


def contended(costs: OpCosts, slow: dict[str, float]) -> OpCosts:
    """``costs`` with every op's work and dispatch ``slow`` times as long, by the kind it contends like:
    matmuls and the per-element kernels (their operands mostly in cache) compute-bound, element-wise ops by
    bytes and copies memory-bound, dispatch as the tiny-op loop."""
    c, m, d = (slow.get(k, 1.0) for k in ("compute", "memory", "dispatch"))
    scale = lambda curve, f: tuple((x, r / f) for x, r in curve) if curve else curve  # noqa: E731 — rates
    return dataclasses.replace(
        costs, matmul={k: scale(v, c) for k, v in costs.matmul.items()},
        matmul_start={k: tuple((x, t * c) for x, t in v) for k, v in costs.matmul_start.items()},
        memory=scale(costs.memory, m),
        memory_low=scale(costs.memory_low, m), memory_inplace=scale(costs.memory_inplace, m),
        strided_bytes_per_s=costs.strided_bytes_per_s / m,
        element_seconds={k: s * c for k, s in costs.element_seconds.items()},
        dispatch={k: s * d for k, s in costs.dispatch.items()})


def on_host(ops, cfg: RunConfig, costs: OpCosts, provenance: str = "formula") -> TimeBreakdown:
    """One local rank's ops priced at the speed it gets beside the other ranks on this host: the cores
    time-shared (``sharing``), each op slowed by the concurrent ranks' contention (``contention``), and the
    update waiting for the slowest rank (``skew``: the ranks' calibrated spread over the same work)."""
    slow = contention(cfg, costs)
    t = price(ops, contended(costs, slow) if slow else costs, provenance)
    k = sharing(cfg, costs) * (1 + skew(cfg, costs))
    if k == 1.0:
        return t
    return dataclasses.replace(t, seconds=t.seconds * k, by_phase={p: s * k for p, s in t.by_phase.items()},
                               by_class={c: s * k for c, s in t.by_class.items()},
                               work_by_phase={p: s * k for p, s in t.work_by_phase.items()},
                               dispatch_by_phase={p: s * k for p, s in t.dispatch_by_phase.items()})


def machine_text(cfg: RunConfig, costs: OpCosts) -> str:
    """The machine-sharing and link assumptions of a CPU prediction, for the assumptions line."""
    if cfg.device_spec.backend is not Backend.CPU or not costs.cores:
        return ""
    out = (f"; {local_ranks(cfg)} local rank(s) x {costs.threads} thread(s) on {costs.cores} cores, ops x{sharing(cfg, costs):.2f}"
           " (an otherwise idle machine assumed)")
    slow = contention(cfg, costs)
    if slow:
        out += (f"; ranks running at once slow each other (calibrated with {costs.contention_processes} processes): "
                + ", ".join(f"{k} x{f:.2f}" for k, f in slow.items()) + "; the update waits for the slowest rank")
    spread = skew(cfg, costs)
    if spread:
        out += f"; the slowest rank computes {spread:.1%} longer than the ranks' mean (calibrated)"
    if (link := dp_link(cfg, costs, sharing(cfg, costs))) is not None:
        out += f"; all-reduce: {link_text(link.bytes_per_s)} + {link.latency_s * 1e6:.0f} us a message ({link.source})"
    return out + (inkernel.text(costs.element_seconds) if cfg.compile is not CompileMode.NONE else "")
