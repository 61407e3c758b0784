"""What the LM loss keeps, per loss path and precision (no torch).

PyTorch's ``F.cross_entropy(logits.float(), targets)`` = ``nll_loss(log_softmax(x))``: ``log_softmax`` saves
its fp32 output for backward; ``.float()`` of 16-bit logits makes an fp32 copy (freed once the log-softmax
exists); under autocast ``cross_entropy`` / ``log_softmax`` are on the run-in-fp32 list anyway (PyTorch AMP op
reference).  In backward: the log-softmax gradient (fp32) and the logits' gradient (fp32, then 16-bit through
``.float()``'s backward).  Chunked (torchtune CEWithChunkedOutputLoss: "only upcasting one chunk at a time";
here each chunk is also checkpointed, models/loss.py) keeps none of it: one chunk's logits live at a time,
rebuilt in backward.  Fused (flash-attn ``CrossEntropyLoss``, as llm-foundry's MPT uses): saves the 16-bit
logits and the log-sum-exp, and writes the logits' gradient in their place.  Fused-linear (Liger's
``LigerFusedLinearCrossEntropy``): the LM head's matmul inside the loss, both gradients made in forward a token
chunk at a time, the logits never whole (``fused_linear_path``).  Classifier (Hugging Face
``*ForSequenceClassification``): no LM head; a pooled b x labels output whose loss keeps nothing of note.
Compiled (``torch.compile`` of the full loss, as torchtitan does with --training.compile since 2025): the
min-cut partitioner AOTAutograd gives inductor saves the 16-bit logits and two per-row fp32 statistics and
recomputes the rest in one fused backward kernel (checked with the aot_eager_decomp_partition backend).  A
whole-model graph (``--compile model``) of a model whose forward computes its own loss (batchlab's GPT, transformers'
``labels=``) holds the loss in the same graph, so its full loss is partitioned as a compiled one (``in_graph``).

Symbols: N = s·b tokens, V vocabulary, e the activation element size.
"""
from __future__ import annotations

from dataclasses import dataclass

from batchlab.config import CompileMode, LossMode, ModelSource, RunConfig
from batchlab.formula.activations import Widths
from batchlab.formula.deepspeed import activation_precision

F32 = 4


@dataclass(frozen=True)
class LossPath:
    kept: int  # held from the loss's forward until backward reaches it (part of the activations)
    forward_transient: int  # on top of ``kept`` while the loss's forward runs (end of forward)
    backward_transient: int  # gradients alive at the start of backward, on top of ``kept``


def loss_path(cfg: RunConfig, t: int = 1) -> LossPath:
    """The loss's tensors; ``t``: the ranks its vocabulary is split over (RankShare.vocab_split), which divides the
    vocabulary-sized tensors (N·V/t logits on a rank) and leaves the per-token ones whole."""
    w = Widths.of(activation_precision(cfg), cfg.device_spec.backend)
    nv = cfg.seq * cfg.micro_batch * cfg.model.vocab // t
    upcast = nv * F32 if w.e != F32 else 0  # .float() of 16-bit logits; a no-op in fp32
    mode = LossMode.COMPILED if in_graph(cfg) else cfg.loss.mode
    if mode is LossMode.CLASSIFIER:  # b x labels logits: nothing of the vocabulary's size
        return LossPath(kept=0, forward_transient=0, backward_transient=0)
    if mode is LossMode.COMPILED:  # 16-bit logits + amax and log-sum-exp per row; the 16-bit gradient beside them
        return LossPath(kept=nv * w.e + 2 * cfg.seq * cfg.micro_batch * F32, forward_transient=0,
                        backward_transient=nv * w.e)
    if mode is LossMode.FUSED:
        lse = cfg.seq * cfg.micro_batch * F32
        return LossPath(kept=nv * w.e + lse, forward_transient=0, backward_transient=0)
    if mode is LossMode.FUSED_LINEAR:
        return fused_linear_path(cfg, t)
    if mode is LossMode.CHUNKED:  # one chunk: its logits, the fp32 copy, the log-softmax; then their gradients
        chunk = -(-nv // cfg.loss.chunks)
        c_upcast = chunk * F32 if w.e != F32 else 0
        return LossPath(kept=0, forward_transient=chunk * w.e + c_upcast + chunk * F32,
                        backward_transient=chunk * w.e + chunk * F32 + 2 * chunk * F32)
    if cfg.assumptions.torch_before(1, 11):  # log_softmax keeps its fp32 input too (pytorch#64000, fixed in 1.11)
        return LossPath(kept=2 * nv * F32, forward_transient=nv * w.e if upcast else 0, backward_transient=2 * nv * F32)
    return LossPath(kept=nv * F32, forward_transient=nv * w.e + upcast, backward_transient=2 * nv * F32)


def fused_linear_path(cfg: RunConfig, t: int = 1) -> LossPath:
    """Liger's fused linear cross-entropy (liger_kernel/ops/fused_linear_cross_entropy.py,
    ``fused_linear_cross_entropy_forward``).  Its forward allocates ``grad_input = zeros_like(_input)`` (N x h, the
    head input's dtype), ``grad_weight = zeros_like(weight)`` (V x h, the weight's dtype: fp32 under autocast, 16-bit
    where DeepSpeed holds the module in 16 bits) and an fp32 per-token ``loss_1d``, and saves the two gradients for
    backward, which only scales them in place (``element_mul_kernel``; nothing when the incoming gradient is 1).
    Between, one chunk of logits at a time: chunk = next_pow2(ceil(N / ceil(V / h))) tokens (about N x h
    elements), the cross-entropy kernel writing their gradient in place.  At backward's start ``grad_weight`` becomes
    the LM head's weight gradient, which the backward walk already counts (formula/memory.py): kept until then.

    On one of t ranks holding 1/t of the vocabulary the kernel runs over that shard (V/t rows of the head): the
    vocabulary-sized tensors (``grad_weight``, a chunk's logits, and the chunk length it derives from V) are the
    shard's; ``grad_input`` and ``loss_1d`` span every token whatever the split."""
    m, n = cfg.model, cfg.seq * cfg.micro_batch
    v = m.vocab // t
    w = Widths.of(activation_precision(cfg), cfg.device_spec.backend)
    chunk = min(n, 1 << (-(-n // -(-v // m.hidden)) - 1).bit_length())
    weight = F32 if activation_precision(cfg).mixed else w.e  # autocast keeps fp32 weights
    return LossPath(kept=n * m.hidden * w.e + v * m.hidden * weight + n * F32,
                    forward_transient=chunk * v * w.e, backward_transient=0)


def in_graph(cfg: RunConfig) -> bool:
    """The full loss is traced into the model's compiled graph: --compile model, and the model's own forward computes
    it (models/loss.py ``loss_fn``: a factory's loss_sum may call anything).  Only for a tied LM head so far: the
    traced untied Llama holds the logits' gradient twice at backward's start, as the eager count has it."""
    return (cfg.compile is CompileMode.MODEL and cfg.loss.mode is LossMode.FULL
            and cfg.model_kind is not ModelSource.FACTORY and cfg.model.tied_embeddings)


def vocab_parallel_path(cfg: RunConfig, t: int) -> LossPath:
    """The loss on one of t ranks holding 1/t of the vocabulary (the logits' shard, n = N·V/t elements), as
    PyTorch's ``loss_parallel()`` computes it (torch/distributed/tensor/parallel/loss.py; Megatron's
    vocab-parallel cross entropy alike): ``_log_softmax`` keeps its fp32 output (shifted - logsumexp, the max and
    the sum-exp all-reduced), built from ``shifted = x - max`` beside the logits (and their fp32 copy from
    ``.float()`` of 16-bit logits); ``exp(shifted)`` dies inside its ``torch.sum`` before the output is made, so
    one more fp32 shard at a time; backward, ``_nll_loss_and_log_softmax_backward`` writes the log-softmax's
    gradient in one go from ``zeros_like(x)`` and ``exp(x)``: three fp32 shards at its high point."""
    w = Widths.of(cfg.precision, cfg.device_spec.backend)
    n = cfg.seq * cfg.micro_batch * cfg.model.vocab // t
    upcast = n * F32 if w.e != F32 else 0
    return LossPath(kept=n * F32, forward_transient=n * w.e + upcast + n * F32, backward_transient=3 * n * F32)


def megatron_loss_path(cfg: RunConfig, t: int) -> LossPath:
    """Megatron's vocab-parallel cross entropy on one of t ranks (n = N·V/t logits; megatron/core/tensor_parallel/
    cross_entropy.py): ``.float()`` of the 16-bit logits, then max-subtract, ``exp(out=)`` and the division all in
    place on that fp32 copy, which it saves as the softmax; backward turns the saved softmax into the gradient in
    place and casts it to the 16-bit logits' gradient.  Kept: one fp32 shard; beside it in forward the 16-bit
    logits, in backward their 16-bit gradient.

    ``--loss fused`` is Megatron's ``--cross-entropy-loss-fusion`` (megatron/core/fusions/fused_cross_entropy.py,
    the native implementation): the same steps, each under ``jit_fuser``, which is ``torch.compile`` from torch 2.2
    (megatron/core/jit.py).  Compiled, the backward's scatter into the saved softmax (``grad_2d[arange,
    target] -= ...``) is functionalised into an out-of-place ``index_put``: a second fp32 shard beside the saved
    one while the 16-bit gradient is written."""
    e = cfg.precision.compute_bytes
    n = cfg.seq * cfg.micro_batch * cfg.model.vocab // t
    # torch.jit.script before torch 2.2 (megatron/core/jit.py): no functionalised copy
    scatter_copy = n * F32 if cfg.loss.mode is LossMode.FUSED and not cfg.assumptions.torch_before(2, 2) else 0
    return LossPath(kept=n * F32, forward_transient=n * e, backward_transient=n * e + scatter_copy)
