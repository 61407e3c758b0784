"""The writer of op lists (formula/oplist.py, formula/pipeline.py): element widths, one op's count, and the
constructs every layer repeats (a linear, a norm, a dropout), each as the aten ops PyTorch 2.13 runs for it."""
from __future__ import annotations

from dataclasses import dataclass

from batchlab.config import Backend, NormKind, RunConfig
from batchlab.config.phase import GRAPH_CALL, REGION_CALL, Launch, Phase
from batchlab.formula import fp8
from batchlab.formula.activations import Impl, implementation
from batchlab.formula.deepspeed import activation_precision
from batchlab.formula.opcost import OpClass, OpCount, op_class

F32 = 4
FWD, BWD, OPT, DATA = Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER, Phase.DATA


@dataclass(frozen=True)
class OpWidths:
    """Element widths (bytes) and whether matmuls run in 16 bits."""

    e: int  # matmul operands / outputs
    res: int  # residual stream and norms (fp32 under autocast)
    autocast: bool
    fused_rms: bool = False  # torch.rms_norm on CUDA: one _fused_rms_norm kernel each way (torchtitan's nn.RMSNorm)
    megatron: bool = False  # Megatron-LM's fused RoPE and SwiGLU kernels on CUDA (formula/megatron_kernels.py)
    cuda: bool = False  # CUDA kernels (F.dropout is one native_dropout kernel there)
    fp8: "fp8.FP8Spec | None" = None  # the blocks' linear layers as FP8 GEMMs (formula/fp8.py), their weights' shards 1/dp8
    dp8: int = 1

    @property
    def low(self) -> bool:
        return self.e == 2


def op(name: str, phase: Phase, elements: int, nbytes: int, flops: int = 0, low: bool = False,
        count: int = 1, strided: bool = False, flops_per_matmul: int = 0) -> OpCount:
    return OpCount(name=name, phase=phase, cost_class=op_class(name, strided=strided), flops=flops, bytes=nbytes,
                   elements=elements, low_precision=low, count=count, flops_per_matmul=flops_per_matmul)


def views(phase: Phase, n: int) -> OpCount:
    return OpCount(name="view", phase=phase, cost_class=op_class("view", is_view=True), count=n)


class OpList:
    """Collects OpCounts; ``phase`` is where forward ops go (forward, or recompute)."""

    def __init__(self, w: OpWidths):
        self.w = w
        self.out: list[OpCount] = []

    def add(self, *ops: OpCount) -> None:
        self.out.extend(op for op in ops if op.count)

    def linear(self, ph: Phase, t: int, i: int, o: int, bias: bool, cast_input: bool, backward: bool = True, block=True):
        """nn.Linear on a (b, s, i) input: addmm (mm + _unsafe_view without a bias); backward: two mms."""
        w, e = self.w, self.w.e
        if block and w.fp8 is not None:
            return self.add(*fp8.linear_ops(w.fp8, ph, t, i, o, bias, backward, e, w.dp8))
        fl = 2 * t * i * o
        if w.autocast:  # autocast copies the fp32 weight (and bias, and an fp32 input) to 16 bits
            self.add(op("_to_copy", ph, i * o, i * o * (F32 + e), low=True),
                     op("_to_copy", ph, o, o * (F32 + e), low=True, count=int(bias)),
                     op("_to_copy", ph, t * i, t * i * (F32 + e), low=True, count=int(cast_input)))
        name = "addmm" if bias else "mm"
        self.add(op(name, ph, t * o, (t * i + i * o + t * o + (o if bias else 0)) * e, fl, w.low),
                 views(ph, 3 if bias else 2), op("_unsafe_view", ph, t * o, 0, count=int(not bias)))
        if not backward:
            return
        self.add(op("mm", BWD, t * i, (t * o + i * o + t * i) * e, fl, w.low),
                 op("mm", BWD, i * o, (t * o + t * i + i * o) * e, fl, w.low),
                 op("sum", BWD, o, (t * o + o) * e, low=w.low, count=int(bias)),
                 views(BWD, 7 if bias else 6))
        if w.autocast:  # the gradients of the copies, back to fp32
            self.add(op("_to_copy", BWD, i * o, i * o * (F32 + e)),
                     op("_to_copy", BWD, o, o * (F32 + e), count=int(bias)),
                     op("_to_copy", BWD, t * i, t * i * (F32 + e), count=int(cast_input)))

    def norm(self, ph: Phase, t: int, h: int, kind: NormKind, bias: bool, backward: bool = True) -> None:
        r = self.w.res
        if kind is NormKind.LAYERNORM:
            self.add(op("native_layer_norm", ph, t * h, 2 * t * h * r + 2 * h * r + 2 * t * F32))
            if backward:
                self.add(op("native_layer_norm_backward", BWD, t * h, 3 * t * h * r + 2 * t * F32 + 2 * h * r))
            return
        if self.w.fused_rms:  # reads x and the weight, writes y and rstd; backward reads dy, x, rstd, writes dx, dw
            self.add(op("_fused_rms_norm", ph, t * h, 2 * t * h * r + h * r + t * F32))
            if backward:
                self.add(op("_fused_rms_norm_backward", BWD, t * h, 3 * t * h * r + t * F32 + 2 * h * r))
            return
        # F.rms_norm on CPU is composite: pow, mean, add, rsqrt, mul, mul (weight)
        self.add(op("pow", ph, t * h, 2 * t * h * r), op("mean", ph, t, t * h * r + t * F32),
                 op("add", ph, t, 2 * t * F32), op("rsqrt", ph, t, 2 * t * F32),
                 op("mul", ph, t * h, 2 * t * h * r + t * F32, count=2), views(ph, 3))
        if backward:
            self.add(op("mul", BWD, t * h, 3 * t * h * r, count=6), op("sum", BWD, h, t * h * r),
                     op("sum", BWD, t, t * h * r), op("mul", BWD, t, 3 * t * F32, count=2),
                     op("div", BWD, t * h, 3 * t * h * r), op("pow", BWD, t * h, 2 * t * h * r, count=2),
                     op("add", BWD, t * h, 3 * t * h * r, count=2), views(BWD, 2))

    def dropout(self, ph: Phase, n: int, p: float, width: int, backward: bool = True) -> None:
        if p <= 0:
            return
        if self.w.cuda:  # native_dropout: reads x, writes the output and a bool mask; backward: one masked scale
            self.add(op("native_dropout", ph, n, n * (2 * width + 1)))
            if backward:
                self.add(op("native_dropout_backward", BWD, n, n * (2 * width + 1)))
            return
        self.add(op("empty_like", ph, n, 0), op("bernoulli_", ph, n, 2 * n * width), op("div_", ph, n, 2 * n * width),
                 op("mul", ph, n, 3 * n * width))
        if backward:
            self.add(op("mul", BWD, n, 3 * n * width))

    def elementwise(self, name: str, ph: Phase, n: int, width: int, inputs: int = 1, count: int = 1) -> None:
        self.add(op(name, ph, n, (inputs + 1) * n * width, count=count))


def widths(cfg: RunConfig) -> OpWidths:
    """The widths of the ops that run: a DeepSpeed 16-bit module runs without autocast (no per-op weight casts)."""
    precision = activation_precision(cfg)
    e = precision.compute_bytes
    # on CUDA torchtitan's nn.RMSNorm reaches ATen's fused kernel, Megatron's is TE's or Apex's; HF's is Python ops
    cuda, impl = cfg.device_spec.backend is Backend.CUDA, implementation(cfg.model_kind, cfg.model)
    fused = cuda and impl in (Impl.TT_LLAMA, Impl.MEGATRON)
    s8 = fp8.active(cfg)
    return OpWidths(e=e, res=2 if precision.low_precision_residual else 4, autocast=precision.mixed, fused_rms=fused,
                   cuda=cuda, megatron=cuda and impl is Impl.MEGATRON, fp8=s8, dp8=cfg.dp if s8 and s8.fsdp_fp8_all_gather else 1)


def own_calls(launch: Launch, count: int) -> tuple[OpCount, ...]:
    """``count`` runs of a compiled graph's (``Launch.GRAPH``: forward and backward) or an eager checkpoint
    region's (``Launch.CHECKPOINT``: forward and recompute) own call: no data, no op, priced at its timed kind
    (calibrate/calls.py)."""
    name, second = (GRAPH_CALL, BWD) if launch is Launch.GRAPH else (REGION_CALL, Phase.RECOMPUTE)
    return tuple(OpCount(name, phase, OpClass.VIEW, 0, 0, 0, False, count, 0, False, launch)
                 for phase in (FWD, second)) if count else ()
