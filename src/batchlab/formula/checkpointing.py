"""What a selectively checkpointed block keeps for backward, per policy (models/ac.py applies them).

- ``selective``: the block input and every linear layer's output (batchlab's policy).
- ``selective-op``: torchtitan's per-op policy (torchtitan/distributed/activation_checkpoint.py @ b5bcd76c,
  "Save all compute/comm ops, except every second mm/linear"): the block input, matmuls 1, 3, 5, ... in call
  order, and the fused attention kernel's outputs (output and log-sum-exp).
- ``megatron-selective``: Megatron's core_attn recompute (Korthikanti et al. 2022, sec. 5): the layer as
  without checkpointing less what only the attention core keeps: with a fused kernel just its log-sum-exp
  (its output is the projection's saved input, kept anyway: measured on CPU; Megatron's maintainers: "not
  needed if using Flash Attention"), on the math path the s x s terms and the q/k/v copies.
- ``selective-attn``: the block input and the attention kernel's outputs (fused: output and log-sum-exp; eager
  or SDPA's math path: the softmax output, a x s x s); every matmul is recomputed.

Symbols: s sequence, b micro-batch, h hidden, kv key/value width, f MLP inner size, a heads.
"""
from __future__ import annotations

from batchlab.config import ACMode, Backend, MLPKind, ModelSpec, Precision
from batchlab.formula import activations as act
from batchlab.formula.activations import Impl

F32 = 4


def matmul_outputs(m: ModelSpec, impl: Impl) -> tuple[tuple[int, int], ...]:
    """(output width, weight elements) of each linear layer in the order the block calls it."""
    h, kv, f = m.hidden, m.kv_hidden, m.ffn
    mlp = ((f, h * f), (f, h * f), (h, f * h)) if m.mlp is MLPKind.SWIGLU else ((f, h * f), (h, f * h))
    if impl is Impl.HF_LLAMA:  # q, k, v, o, then gate, up, down
        return ((h, h * h), (kv, h * kv), (kv, h * kv), (h, h * h)) + mlp
    return ((h + 2 * kv, h * (h + 2 * kv)), (h, h * h)) + mlp  # fused qkv, projection, MLP


def _lse(m: ModelSpec, s: int, b: int) -> int:
    return m.heads * s * b * F32  # the fused kernel's log-sum-exp, fp32


def _sdpa_saved(m: ModelSpec, s: int, b: int, w: act.Widths) -> int:
    return s * b * m.hidden * w.e + _lse(m, s, b)  # output, log-sum-exp


def selective_op_bytes(m: ModelSpec, s: int, b: int, precision: Precision, backend: Backend, impl: Impl) -> int:
    w = act.Widths.of(precision, backend)
    odd = sum(width for i, (width, _) in enumerate(matmul_outputs(m, impl)) if i % 2 == 0)  # 1st, 3rd, ...
    fused = not act.materialises_scores(m, backend)  # eager / math-path attention: its matmuls are bmm, not kept
    return s * b * m.hidden * w.res + s * b * odd * w.e + (_sdpa_saved(m, s, b, w) if fused else 0)


def selective_attn_bytes(m: ModelSpec, s: int, b: int, precision: Precision, backend: Backend,
                         impl: Impl | None = None) -> int:
    w = act.Widths.of(precision, backend)
    if act.materialises_scores(m, backend):  # the softmax output, in its own width
        return s * b * m.hidden * w.res + m.heads * s * s * b * w.softmax
    return s * b * m.hidden * w.res + _sdpa_saved(m, s, b, w)


def megatron_bytes(m: ModelSpec, s: int, b: int, precision: Precision, backend: Backend, impl: Impl) -> int:
    full = act.layer_activations(m, s, b, precision, backend, impl)
    w = act.Widths.of(precision, backend)
    if act.materialises_scores(m, backend):  # SDPA's math path: the s x s terms and the q/k/v copies go
        return full.total - full.scores - full.qkv + s * b * (m.hidden + 2 * m.kv_hidden) * w.e
    return full.total - _lse(m, s, b)


def mlp_recomputed_bytes(m: ModelSpec, s: int, b: int, precision: Precision, backend: Backend, impl: Impl) -> int:
    """``selective-mlp`` (each block's MLP under checkpoint): the layer as without checkpointing less what only the
    MLP keeps inside -- its intermediates and its dropout mask (one of the layer's two).  Its input is kept by the
    checkpoint: under autocast the norm's fp32 output instead of the 16-bit copy each first matmul saved."""
    full = act.layer_activations(m, s, b, precision, backend, impl)
    w = act.Widths.of(precision, backend)
    first = 2 if m.mlp is MLPKind.SWIGLU else 1  # matmuls reading the MLP input (gate and up, or fc)
    swap = s * b * m.hidden * (w.res - first * w.e) if precision.mixed else 0
    return full.total - full.mlp - full.masks // 2 + swap


def selective_bytes(m: ModelSpec, s: int, b: int, precision: Precision, backend: Backend, impl: Impl) -> int:
    return act.selective_layer_bytes(m, s, b, precision)


def block_input_bytes(m: ModelSpec, s: int, b: int, precision: Precision, backend: Backend, impl: Impl) -> int:
    """The whole block recomputed: its input alone is kept (Megatron's layer: in the 16-bit dtype it trains in)."""
    if impl is Impl.MEGATRON:
        return s * b * m.hidden * precision.compute_bytes
    return act.checkpointed_layer_bytes(m, s, b, precision)


def kept_bytes(mode: ACMode, m: ModelSpec, s: int, b: int, precision: Precision, backend: Backend,
               impl: Impl) -> int:
    """Bytes one block keeps under a policy that recomputes: the function its catalogue entry names
    (config/acpolicies.py ``kept``)."""
    return _term(mode.spec.kept)(m, s, b, precision, backend, impl)


def selective_op_flops(m: ModelSpec, s: int, impl: Impl) -> float:
    """The even-numbered matmuls; the attention core is kept."""
    return sum(2 * weights for i, (_, weights) in enumerate(matmul_outputs(m, impl)) if i % 2 == 1)


def all_matmul_flops(m: ModelSpec, s: int, impl: Impl) -> float:
    """Every matmul (the fused kernel's output is served from the cache)."""
    return sum(2 * weights for _, weights in matmul_outputs(m, impl))


def mlp_flops(m: ModelSpec, s: int, impl: Impl) -> float:
    """The MLP's matmuls but its last: the recompute stops once every saved tensor is rebuilt, and the output
    projection's output is saved by nothing (as full recompute, formula/flops.py)."""
    n = 3 if m.mlp is MLPKind.SWIGLU else 2
    return sum(2 * weights for _, weights in matmul_outputs(m, impl)[-n:-1])


def attention_core_flops(m: ModelSpec, s: int, impl: Impl) -> float:
    """The attention core: QK^T and AV (PaLM's 12·h·s per layer is 3 x this)."""
    return 4 * m.hidden * s


def recompute_flops_per_token(mode: ACMode, m: ModelSpec, s: int, impl: Impl) -> float:
    """Forward work a selective policy repeats in backward, per token of one layer: the function its catalogue
    entry names (``recompute_flops``)."""
    return _term(mode.spec.recompute_flops)(m, s, impl)


def _term(name: str):
    term = globals().get(name)
    if not callable(term):
        raise LookupError(f"formula/checkpointing.py has no term {name!r} (named by config/acpolicies.py)")
    return term
