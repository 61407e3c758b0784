"""Bytes a transformer layer keeps for backward, counted from the tensors batchlab's GPT really saves.

Reference point: Korthikanti et al. 2022 (arXiv 2205.05198) Table 2, ``sbh(34 + 5as/h)`` bytes per layer for
Megatron's 16-bit layer.  A plain PyTorch layer keeps more (contiguous q/k/v copies before the matmuls, the
LayerNorm output and the projection input as separate tensors, dropout masks in the activation dtype on
CPU), so each term below names the tensor it is; ``korthikanti_layer_bytes`` gives the paper's count.

Symbols: s sequence, b micro-batch, h hidden, a heads, kv key/value width, f MLP inner size.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from batchlab.config import (AttentionImpl, Backend, Choice, Implementation, MLPKind, ModelSource, ModelSpec, NormKind,
                             Precision, PositionKind)

F32 = 4


@dataclass(frozen=True)
class Widths:
    """Element sizes in bytes for one config."""

    e: int  # matmul outputs (activation dtype)
    res: int  # residual stream (fp32 under autocast: embeddings and adds stay fp32)
    mask: int  # dropout mask: bool on CUDA (native_dropout), activation dtype elsewhere
    softmax: int  # CUDA autocast runs softmax in fp32; CPU autocast keeps it in the low precision
    cuda: bool = False  # CUDA kernels: rms_norm fused (_fused_rms_norm), layer_norm statistics in fp32

    @property
    def fp32_list(self) -> int:
        """Output width of ops on CUDA autocast's fp32 list (softmax, pow, ...): fp32 there, the input's dtype on CPU."""
        return self.softmax

    @classmethod
    def of(cls, precision: Precision, backend: Backend) -> "Widths":
        e = precision.compute_bytes
        res = 2 if precision.low_precision_residual else 4
        return cls(e=e, res=res, mask=1 if backend is Backend.CUDA else e,
                   softmax=F32 if precision.mixed and backend is Backend.CUDA else e, cuda=backend is Backend.CUDA)


@dataclass(frozen=True)
class LayerActivations:
    """One layer's saved tensors with no recompute (bytes); the parts add up to ``total``."""

    norms: int  # both norms' inputs, statistics and outputs
    qkv: int  # what attention keeps of q, k, v (views, copies or rotated tensors)
    scores: int  # s x s terms: softmax output, dropout mask and dropped scores (0 with fused SDPA)
    attn_out: int  # SDPA output + log-sum-exp, and the projection's input
    mlp: int  # MLP intermediates
    masks: int  # residual dropout masks

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))


def materialises_scores(m: ModelSpec, backend: Backend) -> bool:
    """Eager attention keeps s x s tensors; so does SDPA with dropout on CPU (it falls back to the math path)."""
    return m.attention is AttentionImpl.EAGER or (m.dropout > 0 and backend is not Backend.CUDA)


def _norm_bytes(m: ModelSpec, s: int, b: int, w: Widths, impl: "Impl | None" = None, readers: int = 1) -> int:
    """One norm: its input and statistics, plus the output the next matmuls save (``readers`` linears read it)."""
    sbh = s * b * m.hidden
    # the following linears' input: under autocast each linear casts the fp32 output to its own 16-bit copy
    # (autocast caches casts of leaf tensors, the weights, only); otherwise they all save the output itself
    cast_out = sbh * w.e * (readers if w.e != w.res else 1)
    if m.norm is NormKind.RMSNORM and impl is Impl.TT_LLAMA and w.cuda:  # nn.RMSNorm, _fused_rms_norm: input, rstd
        return sbh * w.res + s * b * F32 + cast_out
    if m.norm is NormKind.RMSNORM and impl is Impl.TT_LLAMA:  # nn.RMSNorm's composite: x.float(), rstd, fp32 x * rstd
        return sbh * F32 + s * b * F32 + sbh * F32 + cast_out
    if m.norm is NormKind.RMSNORM and impl is Impl.HF_LLAMA:
        # LlamaRMSNorm: x.to(fp32) (saved by pow and mul), rstd, x * rstd cast back to the input's dtype (saved by
        # the weight's mul); the fp32 copy is the input itself when the residual stream is fp32
        return sbh * F32 + sbh * w.res + s * b * F32 + cast_out
    if m.norm is NormKind.RMSNORM:  # composite: input, x * rstd, rstd
        return sbh * w.res + sbh * w.res + s * b * F32 + cast_out
    # layer_norm: input, mean, rstd; the CPU kernel keeps the statistics in a 16-bit input's dtype, CUDA in fp32
    stats = F32 if w.cuda or w.res == F32 else w.res
    return sbh * w.res + 2 * s * b * stats + cast_out


class Impl(Choice):
    """Whose layer code keeps the tensors (``ModelSpec.impl``, or what an hf: source builds)."""

    BUILTIN = "builtin"
    HF_GPT2 = "hf-gpt2"  # Conv1D fused qkv; gelu_new written in Python ops
    HF_LLAMA = "hf-llama"  # separate q, k, v projections
    TT_LLAMA = "torchtitan-llama"  # separate wq, wk, wv; RoPE through fp32 complex views; nn.RMSNorm
    NANOGPT = "nanogpt"  # fused c_attn, SDPA on its views, nn.GELU, a contiguous copy before c_proj
    MEGATRON = "megatron"  # Megatron-LM's layer: every activation in the weights' 16-bit dtype (no autocast)


def implementation(kind: ModelSource, m: ModelSpec) -> Impl:
    """The layer code the built-in terms count: what an hf: source builds, else the model's ``impl``; a
    factory's stand-in shape is counted as batchlab's GPT."""
    if kind is ModelSource.FACTORY:
        return Impl.BUILTIN
    if kind is ModelSource.HF or m.impl is Implementation.HF:
        return Impl.HF_LLAMA if m.mlp is MLPKind.SWIGLU else Impl.HF_GPT2
    return {Implementation.TORCHTITAN: Impl.TT_LLAMA, Implementation.NANOGPT: Impl.NANOGPT,
            Implementation.MEGATRON: Impl.MEGATRON}.get(m.impl, Impl.BUILTIN)


def describe_impl(impl: Impl) -> str:
    """One phrase naming the code an Impl's terms describe, for estimate's output."""
    return {Impl.BUILTIN: "batchlab's GPT (models/gpt.py)", Impl.HF_GPT2: "transformers' GPT2LMHeadModel",
            Impl.HF_LLAMA: "transformers' LlamaForCausalLM", Impl.TT_LLAMA: "torchtitan's Llama (models/llama3)",
            Impl.NANOGPT: "nanoGPT's GPT (model.py)", Impl.MEGATRON: "Megatron-LM's GPT layer"}[impl]


def _attention_readers(impl: Impl) -> int:
    """Linears reading the attention norm's output: separate q, k, v projections in both Llamas, fused elsewhere."""
    return 3 if impl in (Impl.HF_LLAMA, Impl.TT_LLAMA) else 1


def _mlp_readers(m: ModelSpec) -> int:
    """Linears reading the MLP norm's output: SwiGLU's gate and up projections are separate in every implementation."""
    return 2 if m.mlp is MLPKind.SWIGLU else 1


def layer_activations(m: ModelSpec, s: int, b: int, precision: Precision, backend: Backend,
                      impl: Impl = Impl.BUILTIN, kv_cache: bool = False) -> LayerActivations:
    """``kv_cache``: transformers' training forward builds a DynamicCache (RunConfig.kv_cache)."""
    if impl is Impl.MEGATRON:
        return megatron_layer(m, s, b, precision, backend)
    w = Widths.of(precision, backend)
    h, a, kv, f = m.hidden, m.heads, m.kv_hidden, m.ffn
    sbh = s * b * h
    gqa = m.kv_heads != m.heads
    rope = m.position is PositionKind.ROPE
    scores = materialises_scores(m, backend)
    # q, k, v as attention receives them
    if rope and impl is Impl.HF_LLAMA:  # rotated q and k, and v from its own projection
        qkv = sbh * w.e + 2 * s * b * kv * w.e
    elif impl is Impl.TT_LLAMA:
        # xq_ * freqs_cis saves only the constant freqs_cis (the fp32 complex copies are freed); SDPA keeps the
        # rotated q and k cast back, and v; with GQA repeat_kv's expand + reshape copies k and v at full width
        qkv = sbh * w.e + (2 * sbh * w.e if gqa else 2 * s * b * kv * w.e)
    elif rope and gqa and not scores:  # rotated q; k, v repeated (new tensors): the fused output is freed
        qkv = sbh * w.e
    elif rope:  # rotated q and k are new tensors; v stays a view of the fused qkv output
        qkv = sbh * w.e + s * b * kv * w.e + s * b * (h + 2 * kv) * w.e
    elif scores:  # matmul on transposed views makes contiguous copies of q, k and v
        qkv = 3 * sbh * w.e
    else:  # SDPA takes the views: the whole qkv output stays alive
        qkv = s * b * (h + 2 * kv) * w.e
    if kv_cache and impl is Impl.HF_GPT2:
        # DynamicCache.update concatenates k and v into new tensors, which SDPA then keeps, while q's view keeps the
        # fused c_attn output alive: two more s x kv tensors.  (Llama's cache copies replace the rotated k and the v
        # projection's output, which nothing else keeps: no change.)
        qkv += 2 * s * b * kv * w.e
    if gqa and impl not in (Impl.HF_LLAMA, Impl.TT_LLAMA):  # repeat_interleave materialises k and v at full width
        qkv += 2 * sbh * w.e  # (transformers passes enable_gqa to SDPA instead, when there is no mask)
    ass = a * s * s * b
    if scores:
        sc = ass * w.softmax + s * s  # softmax output, causal mask (bool)
        if m.dropout > 0:
            sc += ass * w.mask  # dropout mask
        if w.softmax != w.e or m.dropout > 0:
            # the AV matmul's input: the (dropped) probabilities, as its own low-precision copy when softmax ran in
            # fp32 (the fp32 dropped tensor itself is not kept: dropout's backward needs only the mask)
            sc += ass * w.e
        attn_out = sbh * w.e  # projection input
    else:
        sc = 0
        # SDPA's output is laid out (b, s, a, d): the projection's input is a view of it, not a copy (torchtitan's
        # and nanoGPT's transpose(1, 2).contiguous() finds it contiguous already)
        attn_out = sbh * w.e + a * s * b * F32  # SDPA output (= projection input), log-sum-exp
    if m.mlp is MLPKind.SWIGLU:
        mlp = 4 * s * b * f * w.e  # gate, silu(gate), up, product
    elif impl is Impl.HF_GPT2:
        # gelu_new = 0.5·x·(1 + tanh(√(2/π)(x + 0.044715x³))) in Python ops keeps x (pow's input), tanh(..), 0.5·x
        # and 1 + tanh(..), then its output for c_proj: five s x b x f tensors where a fused GELU keeps two.  Under
        # CUDA autocast pow is on the fp32 list: pow keeps an fp32 copy of x, the fp32 result makes tanh(..) and
        # 1 + tanh(..) fp32, and c_proj keeps its own low-precision copy of the fp32 product
        mlp = s * b * f * (3 * w.fp32_list + 2 * w.e)
    else:
        mlp = 2 * s * b * f * w.e  # fc output, gelu output
    masks = 2 * sbh * w.mask if m.dropout > 0 else 0
    norms = _norm_bytes(m, s, b, w, impl, _attention_readers(impl)) + _norm_bytes(m, s, b, w, impl, _mlp_readers(m))
    return LayerActivations(norms=norms, qkv=qkv, scores=sc, attn_out=attn_out,
                            mlp=mlp, masks=masks)


def megatron_layer(m: ModelSpec, s: int, b: int, precision: Precision, backend: Backend) -> LayerActivations:
    """Megatron's layer as Korthikanti et al. 2022 (sec. 4.1, Table 2) count it, ``sbh(34 + 5as/h)`` for a GELU MLP
    of 4h with dropout, generalised to GQA's narrower k/v, SwiGLU (fc1's fused gate+up output and the product)
    and fused attention (Transformer Engine / flash: no s x s term, a log-sum-exp).  Megatron's --bf16/--fp16
    train the 16-bit weights themselves: the residual stream and norm inputs are 16-bit too."""
    e, mask = precision.compute_bytes, 1 if backend is Backend.CUDA else precision.compute_bytes
    h, a, kv, f = m.hidden, m.heads, m.kv_hidden, m.ffn
    sbh = s * b * h
    stats = (2 if m.norm is NormKind.LAYERNORM else 1) * s * b * F32  # mean and rstd (rmsnorm: rstd), fp32
    norms = 2 * (2 * sbh * e + stats)  # each norm's input and output (the next linear's input)
    qkv = (sbh + 2 * s * b * kv) * e  # Q, K, V as the attention core reads them
    if materialises_scores(m, backend):  # unfused: softmax output, its dropout mask and output
        ass = a * s * s * b
        scores = ass * e + ((ass * mask + ass * e) if m.dropout > 0 else 0)
        qkv += 2 * s * b * (h - kv) * e  # k and v expanded to every query head before the matmuls
        attn_out = sbh * e
    else:
        scores, attn_out = 0, sbh * e + a * s * b * F32  # fused attention: its output, the log-sum-exp
    mlp = (3 if m.mlp is MLPKind.SWIGLU else 2) * s * b * f * e  # fc1 output (SwiGLU: gate and up), activation
    masks = 2 * sbh * mask if m.dropout > 0 else 0  # the two residual dropout masks
    return LayerActivations(norms=norms, qkv=qkv, scores=scores, attn_out=attn_out, mlp=mlp, masks=masks)


def legacy_softmax_input_bytes(m: ModelSpec, s: int, b: int, precision: Precision, backend: Backend) -> int:
    """PyTorch < 1.11 keeps softmax's s x s input as well: its backward formula referenced ``self`` although only
    the output is used (pytorch/pytorch#64000, "we retain reference to `self` and use more memory than needed";
    fixed by #65242, first released in 1.11).  The input has the output's dtype (autocast casts it to fp32)."""
    if not materialises_scores(m, backend):
        return 0
    return m.heads * s * s * b * Widths.of(precision, backend).softmax


def selective_layer_bytes(m: ModelSpec, s: int, b: int, precision: Precision) -> int:
    """Selective recompute keeps the block input and the linear layers' outputs (models/ac.py policy)."""
    w = Widths.of(precision, Backend.CPU)
    h, kv, f = m.hidden, m.kv_hidden, m.ffn
    sbh = s * b * h
    mlp = (2 if m.mlp is MLPKind.SWIGLU else 1) * s * b * f
    return sbh * w.res + (s * b * (h + 2 * kv) + sbh + mlp + sbh) * w.e


def checkpointed_layer_bytes(m: ModelSpec, s: int, b: int, precision: Precision) -> int:
    """Full recompute keeps only the block's input (Korthikanti et al. 2022, sec. 4: 2sbh in 16-bit)."""
    return s * b * m.hidden * Widths.of(precision, Backend.CPU).res


def embedding_mask_bytes(m: ModelSpec, s: int, b: int, precision: Precision, backend: Backend) -> int:
    return s * b * m.hidden * Widths.of(precision, backend).mask if m.dropout > 0 else 0


def outside_layers_bytes(m: ModelSpec, s: int, b: int, precision: Precision, backend: Backend) -> int:
    """Embedding dropout mask and final norm (what the loss keeps: formula/loss.py)."""
    w = Widths.of(precision, backend)
    return embedding_mask_bytes(m, s, b, precision, backend) + _norm_bytes(m, s, b, w)


def rope_table_bytes(m: ModelSpec, s: int, precision: Precision, backend: Backend, impl: "Impl") -> int:
    """The rotary tables transformers' Llama makes once per forward of the model (or of a pipeline stage:
    ``LlamaModel.rotary_emb``), cos and sin of (1, s, head_dim) in the hidden states' dtype, which every layer's
    rotation (``q * cos``) saves for backward: kept once per forward, whatever the layer count or batch."""
    if impl is not Impl.HF_LLAMA or m.position is not PositionKind.ROPE:
        return 0
    return 2 * s * m.head_dim * Widths.of(precision, backend).res


def korthikanti_terms(s: int, b: int, h: int, a: int) -> dict[str, int]:
    """Megatron's layer as the paper counts it (sec. 4.1), 16-bit activations, 1-byte dropout masks."""
    sbh, as2b = s * b * h, a * s * s * b
    return {
        "attention: QKV input, Q and K, V, projection input": 2 * sbh + 4 * sbh + 2 * sbh + 2 * sbh,
        "attention: softmax output, dropout mask, dropout output": 2 * as2b + as2b + 2 * as2b,
        "attention: residual dropout mask": sbh,
        "MLP: input, GELU input, GELU output, dropout mask": 2 * sbh + 8 * sbh + 8 * sbh + sbh,
        "two LayerNorm inputs": 4 * sbh,
    }


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, selective: bool = False) -> int:
    # Korthikanti et al. 2022, Table 2, no parallelism: sbh(34 + 5as/h); selective recompute: 34sbh
    return s * b * h * 34 + (0 if selective else 5 * a * s * s * b)
