"""The op list of one update derived from the model's terms, without torch: the calculator's side of the
per-op time model (formula/opcost.py), the same aten ops the trace records (trace/ops.py) for batchlab's GPT.

Each construct of the layer code (models/gpt.py) is written down once with the aten ops PyTorch 2.13 runs for it,
forward and backward, as read from the trace of that code: a biased ``nn.Linear`` on a 3-D input is ``view, t, addmm,
view`` forward and ``view, t, mm, t, mm, t, sum, view, detach, t, detach, view`` backward (AccumulateGrad detaches),
dropout is ``empty_like, bernoulli_, div_, mul`` forward and one ``mul`` backward, and so on.  FLOPs are the
matmuls' 2·m·n·k; bytes the tensors read and written; elements the output's.  tests/formula/test_time_model.py
checks counts, FLOPs and bytes against the trace of the real code.  Symbols: T = b·s tokens per micro-batch,
h hidden, kv key/value width, f MLP inner size, a heads, d head size, V vocabulary, E = a·s·s·b score elements.
"""
from __future__ import annotations

from collections import Counter

from batchlab.config import (CompileMode, LossMode, MLPKind, PositionKind, Precision, RunConfig,
                             optimizer_spec)
from batchlab.formula import compiled as compiled_blocks, fp8, megatron_kernels
from batchlab.formula.fusion import fuse
from batchlab.formula.memo import cache, lookup
from batchlab.formula.opbuild import (BWD, DATA, F32, FWD, OPT, OpList, op as _op, own_calls, views as _views,
                                        widths as _widths)
from batchlab.formula.activations import Impl, implementation, materialises_scores
from batchlab.formula.deepspeed import activation_precision
from batchlab.formula.opcost import OpClass, OpCount, merge
from batchlab.formula.params import tensor_sizes
from batchlab.config.phase import Launch, Phase


def _attention(ops: OpList, cfg: RunConfig, ph: Phase, backward: bool) -> None:
    m, s, b = cfg.model, cfg.seq, cfg.micro_batch
    t, h, kv, a, d, e = b * s, m.hidden, m.kv_hidden, m.heads, m.head_dim, ops.w.e
    ops.add(_views(ph, 7))  # split, three views, three transposes
    if backward:
        ops.add(_op("cat", BWD, t * (h + 2 * kv), 2 * t * (h + 2 * kv) * e), _views(BWD, 4))
    if m.position is PositionKind.ROPE and ops.w.megatron:
        ops.add(*(k for width in (h, kv) for k in megatron_kernels.rope(ph, t * width, e, backward)))
    elif m.position is PositionKind.ROPE:  # rotate-half on q and k: neg, cat, two muls and an add each
        for width in (h, kv):
            n = t * width
            ops.add(_op("neg", ph, n // 2, n * e), _op("cat", ph, n, 2 * n * e), _op("mul", ph, n, 3 * n * e, count=2),
                    _op("add", ph, n, 3 * n * e), _views(ph, 2))
            if backward:
                ops.add(_op("mul", BWD, n, 3 * n * e, count=2), _op("neg", BWD, n // 2, n * e),
                        _op("slice_backward", BWD, n, 2 * n * e, count=2), _op("add", BWD, n, 3 * n * e, count=2),
                        _views(BWD, 4))
    if cfg.kv_cache:  # DynamicCache.update concatenates k and v onto its empty tensors; their gradient: zeros
        ops.add(_op("cat", ph, t * kv, 2 * t * kv * e, count=2), _views(ph, 2))
        if backward:
            ops.add(_op("zeros", BWD, 0, 0, count=2), _views(BWD, 2))
    fused = not materialises_scores(m, cfg.device_spec.backend)
    if m.kv_heads != m.heads and not (fused and ops.w.megatron):  # repeat_interleave of k and v to full width
        ops.add(_op("clone", ph, t * h, t * (h + kv) * e, count=2, strided=True), _views(ph, 4))
        if backward:
            ops.add(_op("sum", BWD, t * kv, t * (h + kv) * e, count=2), _views(BWD, 2))
    score, fl = a * s * s * b, 2 * b * a * s * s * d
    g = fl // (a * b)  # one (batch, head)'s matmul: what decides the rate
    if fused:  # on CUDA the kernel draws the dropout mask itself (FlashAttention-2, Dao 2023, sec. 3.1): no s x s bytes
        name = "_scaled_dot_product_flash_attention" + ("" if ops.w.cuda else "_for_cpu")
        ops.add(_op(name, ph, t * h, 4 * t * h * e + a * t * F32, 2 * fl, ops.w.low, flops_per_matmul=2 * g),
                _views(ph, 2))
        if backward:
            ops.add(_op(name + "_backward", BWD, 3 * t * h, 8 * t * h * e + a * t * F32, 5 * fl, ops.w.low,
                        flops_per_matmul=2 * g), _views(BWD, 3))
    else:  # eager (or SDPA's math path with dropout on CPU): materialised scores
        copies = 3 if b > 1 else 0  # matmul copies expanded q, k, v (a batch of one needs no copy)
        ops.add(_op("clone", ph, t * h, 2 * t * h * e, count=copies, strided=True), _views(ph, 6),
                _op("_unsafe_view", ph, t * h, 0, count=copies),
                _op("bmm", ph, score, (2 * t * h + score) * e, fl, ops.w.low, flops_per_matmul=g),
                _op("bmm", ph, t * h, (t * h + score + t * h) * e, fl, ops.w.low, flops_per_matmul=g),
                _op("_unsafe_view", ph, score, 0), _op("_unsafe_view", ph, t * h, 0),
                _op("mul", ph, score, 2 * score * e), _op("ones", ph, s * s, s * s), _op("triu", ph, s * s, 2 * s * s),
                _op("masked_fill", ph, score, 2 * score * e + s * s), _op("_softmax", ph, score, 2 * score * e),
                _views(ph, 1))
        ops.dropout(ph, score, m.dropout, e, backward)
        if backward:
            ops.add(_op("bmm", BWD, t * h, (t * h + 2 * score) * e, fl, ops.w.low, count=2, flops_per_matmul=g),
                    _op("bmm", BWD, score, (2 * t * h + score) * e, fl, ops.w.low, flops_per_matmul=g),
                    _op("bmm", BWD, t * h, (t * h + score + t * h) * e, fl, ops.w.low, flops_per_matmul=g),
                    _op("mul", BWD, score, 2 * score * e), _op("_softmax_backward_data", BWD, score, 3 * score * e),
                    _op("masked_fill", BWD, score, 2 * score * e + s * s),
                    _op("clone", BWD, t * h, 2 * t * h * e, count=2 if b > 1 else 0, strided=True),
                    _op("_unsafe_view", BWD, t * h, 0, count=2),
                    _views(BWD, 10))
        # y.transpose(1, 2).reshape(b, s, h): one contiguous copy (SDPA's output already has that layout)
        ops.add(_op("clone", ph, t * h, 2 * t * h * e, strided=True), _op("_unsafe_view", ph, t * h, 0), _views(ph, 1))
        if backward:
            ops.add(_op("clone", BWD, t * h, 2 * t * h * e, strided=True), _op("_unsafe_view", BWD, t * h, 0),
                    _views(BWD, 2))


def _gelu_new(ops: OpList, ph: Phase, n: int, backward: bool) -> None:
    """Hugging Face's NewGELUActivation, 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), in Python ops
    (transformers/activations.py) as traced: forward ``mul pow mul add mul tanh add mul``; backward two products'
    gradients, ``tanh_backward``, the chain back through the scalars and ``pow(x, 2)``, three paths summed."""
    e = ops.w.e
    unary, binary = 2 * n * e, 3 * n * e  # bytes: a tensor (and a scalar) in, one out; two tensors in
    ops.add(_op("mul", ph, n, unary, count=3), _op("pow", ph, n, unary), _op("add", ph, n, binary),
            _op("tanh", ph, n, unary), _op("add", ph, n, unary), _op("mul", ph, n, binary), _views(ph, 1))
    if backward:
        ops.add(_op("mul", BWD, n, binary, count=3), _op("tanh_backward", BWD, n, binary),
                _op("mul", BWD, n, unary, count=4), _op("pow", BWD, n, unary), _op("add", BWD, n, binary, count=2),
                _views(BWD, 1))


def _layer(ops: OpList, cfg: RunConfig, ph: Phase, backward: bool = True, only: str = "") -> None:
    """One block's forward ops into ``ph`` (forward or recompute), and (``backward``) its backward ops; ``only``:
    the inner ops of that branch alone (its submodule: no norm, dropout or residual add)."""
    m = cfg.model
    t, h, kv, f, w = cfg.micro_batch * cfg.seq, m.hidden, m.kv_hidden, m.ffn, ops.w
    for branch in ("attention", "mlp"):
        if only and branch != only:
            continue
        if not only:
            ops.norm(ph, t, h, m.norm, m.bias, backward)
        if branch == "attention":
            ops.linear(ph, t, h, h + 2 * kv, m.bias, w.autocast, backward)
            _attention(ops, cfg, ph, backward)
            ops.linear(ph, t, h, h, m.bias, False, backward)
        elif m.mlp is MLPKind.SWIGLU and w.megatron:  # one fc1 of gate and up, one fused kernel
            ops.linear(ph, t, h, 2 * f, m.bias, w.autocast, backward)
            ops.add(*megatron_kernels.swiglu(ph, t, f, w.e, backward))
            ops.linear(ph, t, f, h, m.bias, False, backward)
        elif m.mlp is MLPKind.SWIGLU:
            ops.linear(ph, t, h, f, m.bias, w.autocast, backward)
            ops.linear(ph, t, h, f, m.bias, False, backward)
            ops.elementwise("silu", ph, t * f, w.e)
            ops.elementwise("mul", ph, t * f, w.e, inputs=2)
            if backward:
                ops.add(_op("mul", BWD, t * f, 3 * t * f * w.e, count=2), _op("silu_backward", BWD, t * f, 3 * t * f * w.e),
                        _op("add", BWD, t * h, 3 * t * h * w.e))
            ops.linear(ph, t, f, h, m.bias, False, backward)
        else:
            ops.linear(ph, t, h, f, m.bias, w.autocast, backward)
            if implementation(cfg.model_kind, m) is Impl.HF_GPT2:
                _gelu_new(ops, ph, t * f, backward)
            else:
                ops.elementwise("gelu", ph, t * f, w.e)
                if backward:
                    ops.add(_op("gelu_backward", BWD, t * f, 3 * t * f * w.e), _views(BWD, 1))
            ops.linear(ph, t, f, h, m.bias, False, backward)
        if only:
            continue
        ops.dropout(ph, t * h, m.dropout, w.e, backward)
        ops.elementwise("add", ph, t * h, w.res, inputs=2)  # the residual add
        if backward:
            ops.elementwise("add", BWD, t * h, w.res, inputs=2)  # its gradient joins the other branch's
            if w.autocast:  # the branch output's gradient cast to 16 bits
                ops.add(_op("_to_copy", BWD, t * h, t * h * (F32 + w.e), low=True))


def _outside(ops: OpList, cfg: RunConfig) -> None:
    """Embeddings, final norm, LM head and the fp32 cross-entropy (models/gpt.py GPT.forward)."""
    m, w = cfg.model, ops.w
    t, h, V = cfg.micro_batch * cfg.seq, m.hidden, m.vocab
    ops.add(_op("embedding", FWD, t * h, 2 * t * h * w.res + t * 8), _op("embedding_dense_backward", BWD, V * h,
            V * h * w.res + t * h * w.res + t * 8))
    if m.position is PositionKind.LEARNED:
        ops.add(_op("arange", FWD, cfg.seq, cfg.seq * 8), _op("embedding", FWD, cfg.seq * h, 2 * cfg.seq * h * w.res),
                _op("add", FWD, t * h, (2 * t * h + cfg.seq * h) * w.res),
                _op("sum", BWD, cfg.seq * h, (t * h + cfg.seq * h) * w.res),
                _op("embedding_dense_backward", BWD, m.max_positions * h, m.max_positions * h * w.res),
                _views(BWD, 1))
    else:  # rope tables: arange, outer, cat, cos, sin (and two casts under autocast)
        ops.add(_op("arange", FWD, cfg.seq, cfg.seq * 8, count=2), _op("mul", FWD, cfg.seq * m.head_dim, 0, count=2),
                _op("cat", FWD, cfg.seq * m.head_dim, 0), _op("cos", FWD, cfg.seq * m.head_dim, 0),
                _op("sin", FWD, cfg.seq * m.head_dim, 0), _views(FWD, 3))
    ops.dropout(FWD, t * h, m.dropout, w.res)
    ops.norm(FWD, t, h, m.norm, m.bias)
    if cfg.loss.mode is LossMode.CLASSIFIER:  # a pooled b x labels classifier: no vocabulary-sized work
        return
    ops.linear(FWD, t, h, V, False, w.autocast, block=False)
    if m.tied_embeddings:  # the head's and the embedding's gradients summed into one tensor
        ops.add(_op("add", BWD, V * h, 3 * V * h * w.res))
    if w.autocast:  # logits.float()
        ops.add(_op("_to_copy", FWD, t * V, t * V * (w.e + F32)), _op("_to_copy", BWD, t * V, t * V * (w.e + F32), low=True))
    ops.add(_op("_log_softmax", FWD, t * V, 2 * t * V * F32), _op("nll_loss_forward", FWD, 1, t * V * F32 + t * 8),
            _op("div", FWD, 1, 8), _views(FWD, 4),
            _op("ones_like", BWD, 1, 4), _op("div", BWD, 1, 8), _op("nll_loss_backward", BWD, t * V, t * V * F32 * 2),
            _op("_log_softmax_backward_data", BWD, t * V, 3 * t * V * F32), _views(BWD, 5))


_OPTIMIZER, _MICRO, _UPDATE = cache(), cache(), cache()


def _micro_key(cfg: RunConfig) -> tuple:
    """Every field micro_batch_ops reads (model_kind derives from model_source; the backend picks CUDA's kernels)."""
    return (cfg.model, cfg.model_source, cfg.seq, cfg.micro_batch, cfg.precision, activation_precision(cfg), cfg.ac, cfg.loss,
            cfg.device_spec.backend, cfg.fp8, cfg.dp, cfg.compile)


def _step_width(cfg: RunConfig) -> int:
    """Bytes per element of the step's weights, gradients and state: bf16 under pure bf16, fp32 where Megatron-Core /
    DeepSpeed step fp32 copies."""
    engine = cfg.parallel.engine_spec
    return 2 if cfg.precision is Precision.BF16 and not (engine.megatron or engine.deepspeed) else F32


def _optimizer(ops: OpList, cfg: RunConfig) -> None:
    """clip_grad_norm_ (foreach norm and scale), the per-parameter optimizer loop (foreach=False), zero_grad: a function of the model, the optimizer and the weights' dtype alone."""
    w = _step_width(cfg)
    ops.add(*lookup(_OPTIMIZER, (cfg.model, cfg.optimizer, w), lambda: _optimizer_ops(cfg, w)))


def _optimizer_ops(cfg: RunConfig, w: int) -> tuple[OpCount, ...]:
    ops = OpList(_widths(cfg))
    sizes = tensor_sizes(cfg.model)
    p, n = len(sizes), sum(sizes)
    ops.add(_op("_foreach_norm", OPT, p, n * w), _op("stack", OPT, p, 2 * p * F32),
            _op("linalg_vector_norm", OPT, 1, p * F32), _op("add", OPT, 1, 8), _op("reciprocal", OPT, 1, 8),
            _op("mul", OPT, 1, 8), _op("clamp", OPT, 1, 8), _op("_foreach_mul_", OPT, 0, 2 * n * w),
            _op("_local_scalar_dense", OPT, 0, 0))
    for size, k in Counter(sizes).items():  # parameters of one size run the same ops: listed once, counted k times
        b = size * w
        # the catalogue entry's step on one parameter (config/optimizers.py)
        step = (_op(s.name, OPT, size, s.passes * b) if s.per_element else _op(s.name, OPT, s.elements, s.nbytes)
                for s in optimizer_spec(cfg.optimizer).step_ops)
        ops.add(*(o.times(k) for o in step))
    return tuple(ops.out)


def _data(ops: OpList, cfg: RunConfig) -> None:
    b, s, n = cfg.micro_batch, cfg.seq, cfg.micro_batch * (cfg.seq + 1)
    ops.add(_op("randint", DATA, n, n * 8, count=cfg.accum), _op("clone", DATA, b * s, 2 * b * s * 8, count=2 * cfg.accum, strided=b > 1),
            _op("ne", DATA, b * s, b * s * 9, count=cfg.accum), _op("sum", DATA, 1, b * s, count=cfg.accum),
            _op("_local_scalar_dense", DATA, 0, 0, count=cfg.accum), _views(DATA, 2 * cfg.accum))


def micro_batch_ops(cfg: RunConfig) -> tuple[OpCount, ...]:
    """Forward, recompute and backward ops of one micro-batch."""
    return lookup(_MICRO, _micro_key(cfg), lambda: _micro_batch_ops(cfg))


def _micro_batch_ops(cfg: RunConfig) -> tuple[OpCount, ...]:
    ops = OpList(_widths(cfg))
    # blocks dynamo does not compile (a graph break around the checkpointed block) run their ops eagerly
    n, compiled = cfg.model.layers, compiled_blocks.runs_compiled(cfg)
    # a compiled region: pointwise chains fused into one kernel each, recompute included (formula/fusion.py)
    def region(out, keeps=True, recompute=False):
        # the kept masks' bool stores and reads are priced at inductor's C++ (CPU) kernels' own rates; a GPU's
        # Triton kernels are priced as if they kept none (their bool traffic is not timed anywhere)
        return merge(fuse(out, ops.w.e, keeps and not ops.w.cuda, recompute)) if compiled else merge(out)

    # selective policies run under checkpoint's Python dispatch mode (models/ac.py) unless compiled into a graph
    sac = 0 if compiled else sum(k for mode, k in cfg.ac.selective_kinds(n).items() if mode.dispatch_mode)
    # a compiled block whose recompute redraws every dropout (recomputed whole, or by a selective policy caching only
    # matmuls: no branch) keeps no dropout mask in its forward (formula/fusion.py)
    whole = sum(1 for m in cfg.ac.layer_modes(n) if m.spec.recomputes and not m.spec.branch) if compiled else 0
    # every block runs the same ops: list one, and one recompute, then count them per block
    block = OpList(ops.w)
    _layer(block, cfg, FWD)
    kept = region(block.out)
    ops.add(*(o.times(n - sac - whole) for o in kept if n - sac - whole))
    ops.add(*(o.times(whole) for o in (region(block.out, False) if whole else ())))
    ops.add(*(_sac(o.times(sac)) for o in kept if sac))
    # every recomputing policy's layers, whole blocks first
    groups = sorted(Counter(m for m in cfg.ac.layer_modes(n) if m.spec.recomputes).items(),
                    key=lambda group: group[0].spec.selective)
    for mode, k in ((mode, k) for mode, k in groups if k):
        redo = OpList(ops.w)
        # ops whose outputs a policy serves from its cache in the recompute: its catalogue entry's
        _recompute(redo, cfg, mode.spec.cached_in_recompute, mode.spec.branch)
        ops.add(*(_sac(o.times(k)) if mode.dispatch_mode and not compiled else o.times(k)
                  for o in region(redo.out, recompute=not mode.spec.branch)))
        if not compiled and not mode.dispatch_mode:  # (a dispatch mode's per-op cost includes its regions')
            ops.add(*own_calls(Launch.CHECKPOINT, k))  # every saved tensor's hooks: the views _recompute lists
    rest = OpList(ops.w)
    _outside(rest, cfg)  # compiled with the blocks only when the whole model is
    ops.add(*(region(rest.out) if cfg.compile is CompileMode.MODEL else rest.out))
    # each compiled graph's own call: the whole model's one, or one per block
    ops.add(*own_calls(Launch.GRAPH, (1 if cfg.compile is CompileMode.MODEL else n) if compiled else 0))
    return merge(ops.out)


def _sac(op: OpCount) -> OpCount:
    """``op`` in a block under selective checkpointing: its forward and recompute run under the policy's dispatch mode;
    backward runs in the autograd engine, outside it."""
    return op.under_sac() if op.phase in (FWD, Phase.RECOMPUTE) else op


def _recompute(ops: OpList, cfg: RunConfig, cached: tuple[str, ...], branch: str = "") -> None:
    """The forward again inside backward (non-reentrant checkpoint); selective checkpointing serves the saved outputs of
    ``cached`` ops from its cache, the rest re-run; ``branch`` (and a compiled block, whose partition drops what
    backward never reads): its ops up to its last matmul, whose output only the residual add takes."""
    redo = OpList(ops.w)
    _layer(redo, cfg, Phase.RECOMPUTE, backward=False, only=branch)
    if branch or compiled_blocks.runs_compiled(cfg):
        last = [i for i, op in enumerate(redo.out) if op.name in ("mm", "addmm", fp8.SCALED_MM)][-1]
        # a compiled backward draws the numbers of a dropout past that matmul again, inside the kernel using them
        redrawn = (op for op in redo.out[last:] if op.cost_class is OpClass.RANDOM and not branch)
        ops.add(*(op for op in redo.out[:last] if op.name not in cached), *redrawn, _views(Phase.RECOMPUTE, 4),
                _views(BWD, 3))
        return
    # early stop: the last residual add and the dropout multiply before it produce nothing backward needs
    last = [i for i, op in enumerate(redo.out) if op.name == "add"][-1:]
    last += [i for i, op in enumerate(redo.out) if op.name == "mul"][-1:] if cfg.model.dropout > 0 else []
    for i, op in enumerate(redo.out):
        if i in last or op.name in cached:
            continue
        ops.add(op)
    # checkpoint's unpack hooks: a detach per saved tensor in recompute, an alias in backward (GPT block traced: 19, 18)
    ops.add(_views(Phase.RECOMPUTE, 19), _views(BWD, 18))


def update_ops(cfg: RunConfig) -> tuple[OpCount, ...]:
    """Every op of one optimizer update on one rank: accum micro-batches, then the optimizer."""
    return lookup(_UPDATE, (_micro_key(cfg), cfg.accum, cfg.optimizer, _step_width(cfg)), lambda: _update_ops(cfg))


def _update_ops(cfg: RunConfig) -> tuple[OpCount, ...]:
    per_micro = micro_batch_ops(cfg)
    ops = OpList(_widths(cfg))
    ops.add(*(o.times(cfg.accum) for o in per_micro))
    # AccumulateGrad: the first micro-batch's gradient is kept (a detach per parameter), later ones are
    # added into it
    sizes = tensor_sizes(cfg.model)
    ops.add(_views(BWD, len(sizes)), *(_op("add_", BWD, n, 3 * n * F32, count=(cfg.accum - 1) * k)
                                       for n, k in Counter(sizes).items()))
    _data(ops, cfg)
    _optimizer(ops, cfg)
    ops.add(*fp8.update_ops(cfg))
    return merge(ops.out)
