"""The per-op time model: an update's time is the sum, over the ops it runs, of a cost per op class.

    t(op) = dispatch(phase) + work(op) / rate(class, dtype, size)

- matmul-like ops (mm, addmm, bmm, SDPA): FLOPs at a rate that depends on the call's size (small matmuls
  do not reach the peak): a calibrated curve over shape classes, interpolated in log FLOPs;
- memory-bound ops (element-wise, copies, indexing, reductions, the optimizer's ops): bytes moved at the
  measured bandwidth: an out-of-place op writes a fresh output (a step keeps activations, so the buffer is
  not the one just freed: its writes miss the cache; no page faults in batchlab's steady allocator regime,
  batchlab.host.regime), an in-place one (``add_``, the optimizer's) rewrites memory it read: two curves;
- per-element ops whose cost is arithmetic, not bytes (transcendental activations, softmax, norms, the
  dropout RNG): elements at a calibrated per-element rate of a representative kernel; views: dispatch only;
- plus a fixed dispatch cost per op that depends on who issues it: the forward (autograd records a graph
  node), the autograd engine in backward, plain no-grad code (optimizer) or a compiled graph; on CUDA a launch.

Torch-free: the trace (trace/ops.py) and the calculator (formula/oplist.py) both produce ``OpCount``s by
aten op name and classify them with ``op_class`` here, so both paths are priced by the same function.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from batchlab.config import Choice
from batchlab.config.phase import Launch, Phase, own_kind
from batchlab.formula.inkernel import MASK_LOAD, MASK_LOAD_RANDOM, MASK_STORE, RNG, aten_name, rate_keys
from batchlab.formula.memo import cache, lookup
from batchlab.util.units import fmt_count, fmt_seconds


class OpClass(Choice):
    MATMUL = "matmul"  # priced by FLOPs
    MEMORY = "memory"  # element-wise, copies, indexing, reductions: priced by bytes moved
    STRIDED = "strided-copy"  # a transposed view made contiguous (clone, copy_): bytes at the gather rate
    ACTIVATION = "activation"  # transcendental element-wise (gelu, silu, tanh, exp): by elements
    ACTIVATION_GRAD = "activation-grad"  # their gradients (about 3x the forward's arithmetic): by elements
    SOFTMAX = "softmax"  # softmax over attention rows and its backward: by elements
    LOSS = "loss"  # log-softmax over the vocabulary and its backward (exp and log per element): by elements
    MASKED = "masked"  # masked_fill / where with a broadcast mask (not vectorised over the mask): by elements
    NORM = "norm"  # layer / RMS norm and backward: by elements
    RANDOM = "random"  # the dropout mask's RNG: by elements
    VIEW = "view"  # metadata only: dispatch cost alone


# Who dispatches the op decides its fixed cost: forward and recompute record autograd nodes, backward runs
# through the autograd engine, data and optimizer are plain no-grad calls.
DISPATCH_KIND = {Phase.DATA: "plain", Phase.FORWARD: "forward", Phase.RECOMPUTE: "forward",
                 Phase.BACKWARD: "backward", Phase.OPTIMIZER: "plain"}
# Selective checkpointing's TorchDispatchMode runs Python per op of the block: several times a plain op's
# dispatch cost per op in forward (docs/cpu.md), and its cached mode in recompute
SAC_KIND = {Phase.FORWARD: "forward-sac", Phase.RECOMPUTE: "recompute-sac"}

_MATMUL = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_scaled_dot_product_flash_attention",
           "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_backward",
           "_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_efficient_attention",
           "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_cudnn_attention",
           "_scaled_dot_product_cudnn_attention_backward", "_flash_attention_forward", "_flash_attention_backward",
           "_efficient_attention_forward", "_efficient_attention_backward", "convolution", "convolution_backward",
           "_scaled_mm"}
# transcendental: arithmetic per element, not bytes, decides (sqrt, pow, relu vectorise like an add)
_ACTIVATION = {"gelu", "silu", "tanh", "exp", "log", "sigmoid", "erf", "sin", "cos"}
_ACTIVATION_GRAD = {"gelu_backward", "silu_backward", "tanh_backward", "sigmoid_backward"}
_COPIES = {"clone", "copy_", "_to_copy", "contiguous"}
_SOFTMAX = {"_softmax", "_softmax_backward_data", "softmax", "_safe_softmax", "nll_loss_forward",
            "nll_loss_backward"}
_LOSS = {"_log_softmax", "_log_softmax_backward_data", "log_softmax"}
_MASKED = {"masked_fill", "masked_fill_", "where", MASK_LOAD, MASK_LOAD_RANDOM}
_NORM = {"native_layer_norm", "native_layer_norm_backward", "_fused_rms_norm", "_fused_rms_norm_backward",
         "rms_norm"}
_RANDOM = {"bernoulli", "bernoulli_", "native_dropout", "uniform_", "normal_", "random_", "randint", "rand",
           "randn", "exponential_", RNG, "inductor_randint", MASK_STORE}

# no data moved: reshapes that return a new tensor header, uninitialised allocations, scalar reads,
# profiler markers
_NO_DATA = {"_unsafe_view", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach",
            "alias", "lift_fresh", "_local_scalar_dense", "_record_function_enter_new", "_record_function_exit"}


@functools.lru_cache(maxsize=None)  # a pure function of a few hundred op names, called per op per estimate
def op_class(name: str, is_view: bool = False, strided: bool = False) -> OpClass:
    """The class of an aten op by its overload packet name (``addmm``, ``native_layer_norm``, ...);
    ``strided``: its input is a non-contiguous view (a copy of it gathers)."""
    name = aten_name(name)  # an op inside an inductor kernel: its ATen op's class
    if is_view or name in _NO_DATA:
        return OpClass.VIEW
    if strided and name in _COPIES:
        return OpClass.STRIDED
    for names, cost_class in ((_MATMUL, OpClass.MATMUL), (_ACTIVATION, OpClass.ACTIVATION),
                         (_ACTIVATION_GRAD, OpClass.ACTIVATION_GRAD), (_SOFTMAX, OpClass.SOFTMAX),
                         (_LOSS, OpClass.LOSS), (_MASKED, OpClass.MASKED),
                         (_NORM, OpClass.NORM), (_RANDOM, OpClass.RANDOM)):
        if name in names:
            return cost_class
    return OpClass.MEMORY


@dataclass(frozen=True)
class OpCount:
    """``count`` identical calls of one op: per call its FLOPs, bytes read + written and output elements."""

    name: str
    phase: Phase
    cost_class: OpClass
    flops: int = 0
    bytes: int = 0
    elements: int = 0
    low_precision: bool = False  # 16-bit operands (bf16 / fp16 matmul rate, 16-bit element rates)
    count: int = 1
    # FLOPs of one independent matmul inside the call (a bmm's batch entry; for fused attention the forward's
    # FLOPs per (batch, head), backward included); 0: the whole call's
    flops_per_matmul: int = 0
    # run inside selective activation checkpointing, whose Python dispatch mode sees every op of the block
    # (torch.utils.checkpoint's caching mode in forward, its cached mode in recompute): dispatched at that cost
    sac_dispatched: bool = False
    launch: Launch = Launch.EAGER  # who issues it: eager dispatch, a compiled graph's wrapper, or none (fused)

    def to_dict(self) -> dict:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {k: v.value if isinstance(v, Choice) else v for k, v in values.items()}

    def with_count(self, count: int) -> "OpCount":
        # the constructor directly, positionally: dataclasses.replace costs ~5x more, and this runs per op per estimate
        return OpCount(self.name, self.phase, self.cost_class, self.flops, self.bytes, self.elements,
                       self.low_precision, count, self.flops_per_matmul, self.sac_dispatched, self.launch)

    def under_sac(self) -> "OpCount":
        """The same calls inside selective activation checkpointing."""
        return OpCount(self.name, self.phase, self.cost_class, self.flops, self.bytes, self.elements,
                       self.low_precision, self.count, self.flops_per_matmul, True, self.launch)

    def times(self, n: int) -> "OpCount":
        return self.with_count(self.count * n)


def merge(ops: Iterable[OpCount]) -> tuple[OpCount, ...]:
    """Identical calls folded into one OpCount with their count (order of first appearance)."""
    first: dict[tuple, OpCount] = {}
    counts: dict[tuple, int] = {}
    for op in ops:
        key = (op.name, op.phase, op.cost_class, op.flops, op.bytes, op.elements, op.low_precision, op.flops_per_matmul,
               op.sac_dispatched, op.launch)
        if key in first:
            counts[key] += op.count
        else:
            first[key], counts[key] = op, op.count
    return tuple(op if op.count == counts[k] else op.with_count(counts[k]) for k, op in first.items())


@dataclass(frozen=True)
class OpCosts:
    """The calibrated parameters of the model (from ``batchlab calibrate``, or nominal device figures).

    ``matmul``: per precision ("fp32", "bf16") the measured (FLOPs per call, FLOP/s) points of the shape
    classes, ascending; ``element_seconds``: per class and precision, the seconds per output element of its
    representative kernel; ``memory``: bandwidth of an element-wise op by the bytes one call moves (small calls
    stay in cache); ``dispatch``: seconds per op by kind (and per graph or checkpoint region: ``Launch``)."""

    matmul: Mapping[str, tuple[tuple[float, float], ...]]
    memory: tuple[tuple[float, float], ...]  # (bytes moved per call, bytes/s), ascending
    strided_bytes_per_s: float  # a transposed view copied to contiguous memory (read + write)
    element_seconds: Mapping[str, float]  # "activation:fp32" -> s / element
    dispatch: Mapping[str, float]  # "forward" | "backward" | "plain" (| "forward-sac" | "recompute-sac") -> s / op
    # 16-bit element-wise ops by bytes per call: on CPUs they convert to fp32 and back, so halving the bytes
    # does not halve the time; None: the fp32 curve
    memory_low: tuple[tuple[float, float], ...] | None = None
    # in-place ops (name ending in "_"): the output is the input, no fresh memory; None: the ``memory`` curve
    memory_inplace: tuple[tuple[float, float], ...] | None = None
    # fused attention ("sdpa-bf16", "sdpa-backward-fp32", ...): seconds a call costs beyond its (batch, head)
    # entries' work, by FLOPs per entry; absent: none
    matmul_start: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    asynchronous: bool = False  # GPU: the host issues ahead of the kernels, so an op costs max(launch, work)
    link_bytes_per_s: float | None = None  # CPU: measured loopback between local ranks (gloo); None: the device's
    link_latency_s: float = 0.0  # per message on that link, after a step's compute
    link_warm_latency_s: float = 0.0  # per message back to back (formula/links.py ``after_gap``); 0: unmeasured
    threads: int = 0  # CPU: intra-op threads the rates were measured at (0: unknown)
    cores: int = 0  # CPU: cores of the calibrated machine (0: unknown)
    # CPU: a process's time per op while ``contention_processes`` run alike at once, over alone, by kind
    # (compute | memory | dispatch); empty: unmeasured (local ranks then only share the cores)
    contention: Mapping[str, float] = field(default_factory=dict)
    contention_processes: int = 0
    rank_skew: float = 0.0  # CPU: the slower local rank's compute over the ranks' mean, less 1 (0: unmeasured)
    # CPU: the ranks' own CPU seconds in the link per "message" and "byte" (calibrate/shared_link.py); {}: unmeasured
    link_cpu_seconds: Mapping[str, float] = field(default_factory=dict)
    # CPU: one all-reduce's seconds in a chain of them by the gap before each (calibrate/chain.py); {}: unmeasured
    link_chain_seconds: Mapping[str, float] = field(default_factory=dict)
    # per-op dispatch under autocast (every forward op passes its dispatch key), by kind; {}: ``dispatch`` serves
    dispatch_autocast: Mapping[str, float] = field(default_factory=dict)
    # a model's own dispatch per op over the calibrated GPT's, by kind, keyed by timing.dispatch_family ({}: none)
    family_dispatch: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    # (FLOPs per call, FLOPs per fp32 byte its operands and output move) of the shapes the linear-layer curve was
    # timed on, ascending; empty: unknown (nominal figures, an older cache)
    matmul_intensity: tuple[tuple[float, float], ...] = ()
    # GPU: a batched matmul or a fused attention call is one kernel over all its (batch, head) entries (cuBLAS
    # strided-batched, FlashAttention's grid: Dao et al. 2022 sec. 3.1), so the whole call's FLOPs set its rate;
    # False: the CPU kernels' loop over entries, each entry's size sets it (and a start-up per call)
    whole_call_rate: bool = False
    dtensor_seconds: Mapping[str, float] = field(default_factory=dict)  # a DTensor op's extra host s, by kind; {}: none
    untimed: Mapping[str, str] = field(default_factory=dict)  # why a kind was not timed here (a graph's own call)
    source: str = "nominal"

    def matmul_rate(self, flops: float, low_precision: bool, kind: str = "") -> float:
        """FLOP/s of one matmul of ``flops``: linear in log FLOPs between the calibrated points, flat outside.
        ``kind``: "bmm" (one entry of a batched matmul), "sdpa" or "sdpa-backward" (fused attention, per
        (batch, head)), from its own curve where calibrated (the backward: else the forward's), else the
        linear layers' curve."""
        key = "bf16" if low_precision else "fp32"
        kinds = (kind, "sdpa") if kind == "sdpa-backward" else (kind,)
        pts = next((self.matmul[f"{k}-{key}"] for k in kinds if kind and self.matmul.get(f"{k}-{key}")), None)
        pts = pts or self.matmul.get(key) or self.matmul["fp32"]
        return interpolate_log(pts, flops)

    def element_rate_seconds(self, cost_class: OpClass, low_precision: bool, name: str = "") -> float:
        """Seconds per element: the op's own kernel where calibrated by name (``activation/silu:bf16``), else
        its class's representative kernel, in its precision where calibrated, else fp32's (formula/inkernel.py)."""
        e = self.element_seconds
        keys = rate_keys(cost_class.value, name, "bf16" if low_precision else "fp32")
        return next((e[key] for key in keys if key in e), 0.0)

    def work_seconds(self, op: OpCount) -> float:
        """One call's time beyond its dispatch."""
        if op.cost_class is OpClass.MATMUL:
            kind = ("bmm" if not op.name.startswith("_scaled_dot_product") else "sdpa-backward" if op.name.endswith(
                "_backward") else "sdpa") if op.flops_per_matmul else ("fp8" if op.name == "_scaled_mm" else "")
            if not op.flops:
                return 0.0
            start = self.matmul_start.get(f"{kind}-{'bf16' if op.low_precision else 'fp32'}")
            per_matmul = 0 if self.whole_call_rate else op.flops_per_matmul
            return (op.flops / self.matmul_rate(per_matmul or op.flops, op.low_precision, kind)
                    + (interpolate_log(start, op.flops_per_matmul) if start else 0.0)
                    + (0.0 if op.flops_per_matmul else self.excess_bytes(op) / self.memory[-1][1]))
        if op.cost_class is OpClass.MEMORY:
            if op.name.endswith("_") and self.memory_inplace:
                return op.bytes / interpolate_log(self.memory_inplace, max(op.bytes, 1.0))
            return op.bytes / self.bandwidth(op.bytes, op.low_precision)
        if op.cost_class is OpClass.STRIDED:
            return op.bytes / self.strided_bytes_per_s
        if op.cost_class is OpClass.VIEW:
            return 0.0
        # per-element kernels also move their bytes: whichever bound is slower (roofline)
        return max(op.elements * self.element_rate_seconds(op.cost_class, op.low_precision, op.name),
                   op.bytes / self.bandwidth(op.bytes, op.low_precision))

    def excess_bytes(self, op: OpCount) -> float:
        """Bytes a linear-layer matmul call moves beyond what the calibration's shape of the same FLOPs moved:
        the curve's rate already pays for those; a skinny call (few tokens against a wide weight) streams far
        more per FLOP, and the extra comes from beyond the cache (``memory``'s largest size); bytes in, bytes out.
        The measurement behind it: docs/cpu.md, "Figures behind the code's choices"."""
        if not self.matmul_intensity:
            return 0.0
        moved = op.flops / interpolate_log(self.matmul_intensity, op.flops) * (0.5 if op.low_precision else 1.0)
        return max(0.0, op.bytes - moved)

    def bandwidth(self, nbytes: float, low_precision: bool = False) -> float:
        curve = self.memory_low if low_precision and self.memory_low else self.memory
        return interpolate_log(curve, max(nbytes, 1.0))

    def dispatch_seconds(self, phase: Phase, sac_dispatched: bool = False, launch: Launch = Launch.EAGER) -> float:
        """Seconds per op by who dispatches it; under selective checkpointing its own calibrated cost where
        measured ("forward-sac", "recompute-sac"), else the plain one; a compiled graph's kernel a no-grad call's."""
        if launch is not Launch.EAGER:  # a graph's or checkpointed region's own call: its kind ("graph-forward")
            return self.dispatch["plain"] if launch is Launch.COMPILED else 0.0 if launch is Launch.FUSED \
                else self.dispatch.get(own_kind(launch, phase), 0.0)
        if sac_dispatched and SAC_KIND.get(phase) in self.dispatch:
            return self.dispatch[SAC_KIND[phase]]
        return self.dispatch[DISPATCH_KIND[phase]]


def interpolate(points: tuple[tuple[float, float], ...], x: float, scale=lambda v: v) -> float:
    """y at x, linear in scale(x) between sorted (x, y) points; the end values beyond the ends."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            w = (scale(x) - scale(x0)) / (scale(x1) - scale(x0)) if x1 > x0 else 1.0
            return y0 + w * (y1 - y0)
    return points[-1][1]


def interpolate_log(points: tuple[tuple[float, float], ...], x: float) -> float:
    """y at x, linear in log(x) between sorted (x, y) points; the end values beyond the ends."""
    return interpolate(points, x, math.log)


@dataclass(frozen=True)
class TimeBreakdown:
    """Predicted seconds of the ops of one update (one rank), split by phase and by op class; parts add up."""

    seconds: float
    by_phase: dict[str, float]
    by_class: dict[str, float]  # work per op class, plus "dispatch"
    ops: int  # calls
    flops: int
    bytes: int  # bytes moved by memory-bound and per-element ops
    bytes_by_phase: dict[str, int] = field(default_factory=dict)
    flops_by_phase: dict[str, int] = field(default_factory=dict)
    # the kernels' work and the host's issue time per phase, before the asynchronous device's max of the two
    work_by_phase: dict[str, float] = field(default_factory=dict)
    dispatch_by_phase: dict[str, float] = field(default_factory=dict)
    source: str = ""
    provenance: str = "formula"
    # a graph's or region's own call whose kind ("graph-forward") the costs lack: priced at 0, said in ``describe``
    unpriced: tuple[str, ...] = ()

    @property
    def dispatch_share(self) -> float:
        return self.by_class.get("dispatch", 0.0) / self.seconds if self.seconds else 0.0


_OWN = (Launch.GRAPH, Launch.CHECKPOINT)  # a graph's or a region's own call: priced by its kind alone
_WORK = cache(limit=64)  # what decides work_seconds -> {op shape: one call's work seconds}
WORK_LIMIT = 50_000  # op shapes remembered per costs
# OpCosts fields work_seconds never reads (a calibration loaded per estimate differs in none of the others)
_NOT_WORK = {"dispatch", "dispatch_autocast", "family_dispatch", "asynchronous", "link_bytes_per_s", "link_latency_s", "link_warm_latency_s", "threads", "cores", "contention",
             "contention_processes", "rank_skew", "link_cpu_seconds", "link_chain_seconds", "source", "untimed"}


def _frozen(v):
    return tuple((k, _frozen(x)) for k, x in v.items()) if isinstance(v, Mapping) else v


def _work_table(costs: OpCosts) -> dict:
    key = tuple(_frozen(getattr(costs, f.name)) for f in dataclasses.fields(costs) if f.name not in _NOT_WORK)
    table = lookup(_WORK, key, dict)
    if len(table) > WORK_LIMIT:
        table.clear()
    return table


def price(ops: Iterable[OpCount], costs: OpCosts, provenance: str = "formula") -> TimeBreakdown:
    """The time the model gives ``ops``: Σ count × (dispatch + work) on a synchronous device (CPU); on an
    asynchronous one (GPU) the host issues ahead of the kernels, so each phase takes max(Σ dispatch, Σ work)
    and only the host time beyond the kernels' shows as "dispatch".  One call's work depends on the op's
    shape alone (not its phase or count): remembered per costs, the sums taken in the ops' order."""
    by_phase: dict[Phase, float] = {}
    disp: dict[Phase, float] = {}
    by_class: dict[OpClass, float] = {}
    b_phase: dict[Phase, int] = {}
    f_phase: dict[Phase, int] = {}
    table, dispatch, unpriced = _work_table(costs), {}, {}
    calls = fl = by = 0
    for op in ops:
        ph, n = op.phase, op.count
        shape = (op.name, op.cost_class, op.flops, op.bytes, op.elements, op.low_precision, op.flops_per_matmul)
        one = table.get(shape)
        if one is None:
            one = table[shape] = costs.work_seconds(op)
        d = dispatch.get((ph, op.sac_dispatched, op.launch))
        if d is None:
            d = dispatch[ph, op.sac_dispatched, op.launch] = costs.dispatch_seconds(ph, op.sac_dispatched, op.launch)
            if op.launch in _OWN and (kind := own_kind(op.launch, ph)) not in costs.dispatch:
                unpriced[kind] = None
        w = n * one
        disp[ph] = disp.get(ph, 0.0) + n * d
        by_phase[ph] = by_phase.get(ph, 0.0) + w
        by_class[op.cost_class] = by_class.get(op.cost_class, 0.0) + w
        calls += n if op.launch in (Launch.EAGER, Launch.COMPILED) else 0  # a region's own call is no op
        fl += n * op.flops
        f_phase[ph] = f_phase.get(ph, 0) + n * op.flops
        if op.cost_class is not OpClass.MATMUL and op.cost_class is not OpClass.VIEW:
            by += n * op.bytes
            b_phase[ph] = b_phase.get(ph, 0) + n * op.bytes
    exposed = {ph.value: max(d - by_phase[ph], 0.0) if costs.asynchronous else d for ph, d in disp.items()}
    phases = {ph.value: w + exposed[ph.value] for ph, w in by_phase.items()}
    classes = {k.value: w for k, w in by_class.items()}
    classes["dispatch"] = sum(exposed.values())
    return TimeBreakdown(seconds=sum(phases.values()), by_phase=phases, by_class=classes, ops=calls, flops=fl, bytes=by,
                         bytes_by_phase={ph.value: b for ph, b in b_phase.items()},
                         flops_by_phase={ph.value: f for ph, f in f_phase.items()},
                         work_by_phase={ph.value: w for ph, w in by_phase.items()},
                         dispatch_by_phase={ph.value: d for ph, d in disp.items()}, source=costs.source,
                         provenance=provenance, unpriced=tuple(unpriced))


UNRESOLVED = 1e15  # bytes/s of a link whose fitted time did not grow with size (latency-bound): no bandwidth


def link_text(bytes_per_s: float) -> str:
    """A link's bandwidth, or why there is none to show (a placeholder is never printed as a quantity)."""
    return "no bandwidth resolved (latency-bound)" if bytes_per_s >= UNRESOLVED else fmt_count(bytes_per_s, "B/s")


def breakdown_text(t: TimeBreakdown) -> str:
    """``update time 151.0 ms [trace, per-op model]: forward 80.2 ms, ...; by op class: matmul 40%, ...``."""
    ms = fmt_seconds
    phases = ", ".join(f"{p} {ms(s)}" for p, s in t.by_phase.items() if s)
    classes = ", ".join(f"{k} {s / t.seconds:.0%}" for k, s in sorted(t.by_class.items(), key=lambda kv: -kv[1])
                        if t.seconds and s / t.seconds >= 0.005)
    return f"update time {ms(t.seconds)} [{t.provenance}, per-op model]: {phases}; by op class: {classes}"
