"""FP8 training in the calculator (the recipes of config/fp8.py; no torch): the transformer blocks' linear layers
as FP8 GEMMs with their casts, what those layers save and keep, and the width of FSDP2's fp8 all-gather.

Time: each of a linear layer's three GEMMs (forward, grad-input, grad-weight; torchao's training docs,
workflows/training.md) is an ``_scaled_mm`` of the same FLOPs, priced at the device's dense FP8 peak times the
achievable fraction the bf16 matmuls get (formula/efficiency.py), its operands 1 byte wide; each operand's cast
is element-wise traffic at HBM bandwidth (``FP8Spec.cast_bytes`` per element).  Attention, norms, the LM head
(torchtitan's float8 converter filters "output"; Megatron's output layer is not a TE module) and the optimizer
are untouched.  Memory: what each library saves and caches (``saved_input_cut``, ``weight_cache_bytes``), and
FSDP2's gathered blocks at 1 byte per element (``block_gather_bytes``).
"""
from __future__ import annotations

import dataclasses

from batchlab.config import MLPKind, RunConfig
from batchlab.config.fp8 import FP8Recipe, FP8Spec, spec
from batchlab.config.phase import Phase
from batchlab.formula.opcost import OpCosts, OpCount, op_class

SCALED_MM = "_scaled_mm"  # torch's FP8 GEMM, where torchao's Float8TrainingTensor mm dispatches; TE's cuBLASLt alike
CURVE = "fp8-bf16"  # the OpCosts matmul curve an FP8 GEMM reads (opcost.OpCosts.matmul_rate: kind "fp8", 16-bit out)
FP8 = 1  # bytes of an fp8 element (e4m3 forward, e5m2 gradients)


def active(cfg: RunConfig) -> FP8Spec | None:
    return spec(cfg.fp8)


def _op(name: str, phase: Phase, elements: int, nbytes: int, flops: int = 0, count: int = 1) -> OpCount:
    return OpCount(name=name, phase=phase, cost_class=op_class(name, is_view=name == "view"), flops=flops,
                   bytes=nbytes, elements=elements, low_precision=True, count=count)


def linear_ops(s: FP8Spec, ph: Phase, t: int, i: int, o: int, bias: bool, backward: bool, e: int,
               shard: int = 1) -> list[OpCount]:
    """One block ``nn.Linear(i, o)`` on ``t`` tokens as FP8 GEMMs: forward into ``ph``, backward (``backward``).
    torchao casts the input, the weight and (twice, once per backward GEMM's layout) the output gradient in every
    call, and the saved bf16 input again for the grad-weight GEMM; under fp8 all-gather the weight arrives cast,
    its shard (1/``shard``) cast before the gather (the scale precomputed: a read and a write).  TE casts the
    input and the output gradient once each (cast-transpose), the weight once per update (``update_ops``)."""
    bwd, fl, c = Phase.BACKWARD, 2 * t * i * o, s.cast_bytes
    weight_casts = 0 if s.weight_cast_per_update or s.fsdp_fp8_all_gather else 1
    gemm = lambda ph_, m, k, n: _op(SCALED_MM, ph_, m * n, (m * k + k * n) * FP8 + m * n * e, fl)  # noqa: E731
    ops = [_op("_to_copy", ph, t * i, t * i * c), _op("_to_copy", ph, i * o, i * o * c, count=weight_casts),
           _op("_to_copy", ph, i * o // shard, i * o // shard * (e + FP8), count=int(s.fsdp_fp8_all_gather)),
           gemm(ph, t, i, o), _op("view", ph, 0, 0, count=3)]
    if not backward:
        return [op for op in ops if op.count]
    torchao = not s.weight_cast_per_update
    ops += [_op("_to_copy", bwd, t * o, t * o * c, count=2 if torchao else 1),
            _op("_to_copy", bwd, t * i, t * i * c, count=int(torchao)),
            _op("_to_copy", bwd, i * o, i * o * c, count=weight_casts),
            _op("_to_copy", bwd, i * o // shard, i * o // shard * (e + FP8), count=int(s.fsdp_fp8_all_gather)),
            gemm(bwd, t, o, i), gemm(bwd, o, t, i), _op("sum", bwd, o, (t * o + o) * e, count=int(bias)),
            _op("view", bwd, 0, 0, count=6)]
    return [op for op in ops if op.count]


def block_linear_params(cfg: RunConfig) -> int:
    """Weight elements of one block's linear layers (the GEMMs' weight operands)."""
    m = cfg.model
    mats = 3 if m.mlp is MLPKind.SWIGLU else 2
    return m.hidden * (m.hidden + 2 * m.kv_hidden) + m.heads * m.head_dim * m.hidden + mats * m.hidden * m.ffn


def update_ops(cfg: RunConfig) -> tuple[OpCount, ...]:
    """Once per update: TE's cast-transpose of every block weight (the first micro-batch's; later ones reuse the
    cached copies), or torchao's precomputed scales under fp8 all-gather (precompute_float8_dynamic_scale_for_fsdp:
    an amax over each fp32 weight shard, one all-reduce of the scalars)."""
    s = active(cfg)
    if s is None:
        return ()
    n = block_linear_params(cfg) * cfg.model.layers
    if s.weight_cast_per_update:
        return (_op("_to_copy", Phase.FORWARD, n, n * s.cast_bytes),)
    if s.fsdp_fp8_all_gather:
        return (_op("amax", Phase.OPTIMIZER, cfg.model.layers, n // cfg.dp * 4),)
    return ()


def with_curve(costs: OpCosts, cfg: RunConfig) -> OpCosts:
    """``costs`` with the FP8 GEMM curve: the bf16 linear-layer curve at the device's FP8/bf16 peak ratio (the same
    achieved fraction of a faster peak), where the costs have none of their own."""
    if active(cfg) is None or CURVE in costs.matmul:
        return costs
    dev = cfg.device_spec
    ratio = dev.peak_flops_fp8 / dev.peak_flops_bf16
    curve = tuple((f, r * ratio) for f, r in costs.matmul["bf16"])
    return dataclasses.replace(costs, matmul={**costs.matmul, CURVE: curve},
                               source=costs.source + f"; FP8 GEMMs at {ratio:.2g}x the bf16 rate (the FP8 peak's)")


def saved_input_cut(cfg: RunConfig, e: int, in_sp: int, tp: int, gathered: bool) -> int:
    """Bytes a block saves less for backward per micro-batch when its linear layers keep their inputs in fp8 (TE),
    on one tensor-parallel rank: the attention and MLP inputs (split along the sequence with sequence parallelism,
    whole where ``gathered``) and the inputs of the output projection and the MLP's down projection (1/t).  The
    distinct inputs: the q/k/v projections read one tensor, gate and up another."""
    s = active(cfg)
    if s is None or not s.saved_input_fp8:
        return 0
    m, t = cfg.model, cfg.micro_batch * cfg.seq
    per = e - FP8
    inputs = 2 * t * m.hidden * per
    return (inputs if gathered else inputs // in_sp) + t * (m.heads * m.head_dim + m.ffn) * per // tp


def weight_cache_bytes(cfg: RunConfig, layer_matrices: int, layers: int) -> int:
    """TE's fp8 weight and transpose kept between micro-batches, for ``layers`` blocks of ``layer_matrices``
    TP-split elements each (Transformer Engine docs, "FP8 weight caching")."""
    s = active(cfg)
    return 0 if s is None else s.weight_cache_bytes * layer_matrices * layers


def block_gather_bytes(cfg: RunConfig, default: int) -> int:
    """Bytes per element FSDP2 gathers of a block: 1 under fp8 all-gather, else ``default``.  The block's two norm
    weights (2h of its ~12h² elements) stay bf16 in the same flat buffer: counted at 1 byte too."""
    s = active(cfg)
    return FP8 if s is not None and s.fsdp_fp8_all_gather else default


__all__ = ["FP8Recipe", "FP8Spec", "SCALED_MM", "CURVE", "linear_ops", "update_ops", "with_curve", "saved_input_cut",
           "weight_cache_bytes", "block_gather_bytes"]
