"""CUDA's kernel choices for a trace on CPU fake tensors, where the config's device is CUDA and this machine has none.

Fake CUDA tensors run forward ops without CUDA, but not autograd: a CPU build has no CUDA device guard (autograd
aborts recording a CUDA tensor's input metadata) and backward asks for the accelerator's current stream ("Cannot
access accelerator device when none is available").  So the trace keeps CPU fake tensors and makes the three
choices that decide what a CUDA run keeps for backward follow CUDA while it runs:

* autocast: CPU autocast's kernels are replaced by CUDA's policy, op by op.  Which ops CUDA's autocast handles is
  read from the dispatcher (the ops with an AutocastCUDA kernel, registered in CPU builds too); what it does with
  each is ``CATEGORY`` (aten/src/ATen/autocast_mode.h's lists).  Ops CPU autocast handles and CUDA's does not run
  in their inputs' dtypes, as on CUDA.  The lower-precision ops both lists share keep CPU's kernel (the same
  cast, with autocast's cache of weight casts); the few only CUDA casts down are cast without that cache.
* dropout: CUDA's ``dropout`` calls the fused ``native_dropout`` (a 1-byte mask kept for backward), CPU's
  multiplies by a noise tensor of the input's dtype.
* SDPA with dropout: CUDA's flash and memory-efficient kernels take dropout; CPU's flash kernel does not, and
  CPU falls back to the math path (s x s scores kept).  Where CPU would pick its flash kernel without dropout,
  that kernel runs with the dropout (it keeps the output and log-sum-exp, as CUDA's fused kernels do).

Not followed: what a CUDA kernel itself keeps where it differs from the CPU kernel's fake implementation
(layer_norm's statistics of a 16-bit input are fp32 on CUDA, s·b·4 bytes a norm; nn.RMSNorm's fused CUDA kernel),
the fused attention kernel's own layout (memory-efficient attention pads its log-sum-exp), and SDPA with dropout
under ``enable_gqa`` (CPU's math path runs).  The tensors stay on the CPU device, so the trainer touches no CUDA
state (RNG, GradScaler, memory statistics).

Everything is registered on entry and removed on exit (``Library._destroy`` restores the kernels it replaced).
"""
from __future__ import annotations

import contextlib
import warnings

import torch

NOTE = ("traced on CPU fake tensors with CUDA's kernel choices: CUDA's autocast op lists, the fused dropout (1-byte "
        "mask) and fused attention with dropout (fake CUDA tensors cannot run backward without a CUDA build of torch)")

LOWER, FP32, FP32_DTYPE, PROMOTE, BANNED = "lower", "fp32", "fp32-set-opt-dtype", "promote", "banned"

# aten/src/ATen/autocast_mode.h (AT_FORALL_LOWER_PRECISION_FP, AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE,
# AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE, AT_FORALL_PROMOTE) and autocast_mode.cpp (cudnn convolutions, the
# banned binary_cross_entropy); overload names as the dispatcher lists them.
_LISTS = {
    LOWER: "_convolution _convolution.deprecated conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d.input "
           "conv_transpose3d.input convolution prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm "
           "baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell "
           "rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention scaled_dot_product_attention "
           "cudnn_convolution cudnn_convolution_transpose",
    FP32: "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow.Tensor_Scalar "
          "pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm rms_norm group_norm frobenius_norm.dim "
          "nuclear_norm nuclear_norm.dim cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d "
          "hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss "
          "multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss "
          "binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp upsample_nearest1d "
          "_upsample_nearest_exact1d upsample_nearest2d _upsample_nearest_exact2d upsample_nearest3d "
          "_upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa "
          "upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa norm.Scalar norm.ScalarOpt_dim",
    FP32_DTYPE: "prod prod.dim_int softmax.int log_softmax.int cumprod cumsum linalg_vector_norm linalg_matrix_norm "
                "linalg_matrix_norm.str_ord sum sum.dim_IntList",
    PROMOTE: "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add",
    BANNED: "binary_cross_entropy",
}
CATEGORY = {op: category for category, ops in _LISTS.items() for op in ops.split()}

_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def autocast_ops(key: str) -> set[str]:
    """The aten ops (``name`` or ``name.overload``) with a kernel for dispatch key ``key`` (AutocastCPU / AutocastCUDA)."""
    return {n.removeprefix("aten::") for n in torch._C._dispatch_get_all_op_names()
            if n.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(n, key)}


def _eligible(t) -> bool:  # autocast_mode.h is_eligible: floating point, not double
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype is not torch.float64


def _cast(value, dtype: torch.dtype):
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value.to(dtype) if _eligible(value) else value


def _flat(args, kwargs):
    for v in (*args, *kwargs.values()):
        yield from (v if isinstance(v, (list, tuple)) else (v,))


def _overload(name: str):
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _kernel(op, category: str):
    """CUDA autocast's wrapper for ``op`` (autocast_mode.h WrapFunction_), casting CPU tensors as it casts CUDA ones."""
    dtype_at = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            if category == LOWER:
                low = torch.get_autocast_dtype("cpu")
                args, kwargs = _cast(args, low), {k: _cast(v, low) for k, v in kwargs.items()}
            elif category == FP32:
                args, kwargs = _cast(args, torch.float32), {k: _cast(v, torch.float32) for k, v in kwargs.items()}
            elif category == PROMOTE:
                widest = torch.get_autocast_dtype("cpu")
                for t in _flat(args, kwargs):
                    if _eligible(t):
                        widest = torch.promote_types(widest, t.dtype)
                args, kwargs = _cast(args, widest), {k: _cast(v, widest) for k, v in kwargs.items()}
            elif category == FP32_DTYPE and args and _eligible(args[0]):
                # the op computes in fp32 through its dtype argument unless the caller chose one
                if dtype_at is not None and dtype_at < len(args):
                    if args[dtype_at] is None:
                        args = (*args[:dtype_at], torch.float32, *args[dtype_at + 1:])
                elif kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)

    return kernel


def _dropout(input, p, train):
    # CUDA's dropout (aten/src/ATen/native/Dropout.cpp, is_fused_kernel_acceptable): the fused kernel when it drops
    if not train or p == 0 or input.numel() == 0:
        return input  # the input itself, as both kernels return it
    if p < 1:
        return torch.ops.aten.native_dropout.default(input, p, train)[0]
    return torch.ops.aten.dropout.default.decompose(input, p, train)


def _cpu_picks_flash(q, k, v, attn_mask, is_causal, scale, enable_gqa) -> bool:
    """Whether CPU's SDPA choice, without dropout, is its flash kernel (read by running it on the fake inputs)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    seen = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func is flash)
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Watch():
        torch.ops.aten.scaled_dot_product_attention.default.decompose(
            q, k, v, attn_mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa)
    return any(seen)


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    if dropout_p > 0 and not enable_gqa and _cpu_picks_flash(query, key, value, attn_mask, is_causal, scale,
                                                            enable_gqa):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
    return torch.ops.aten.scaled_dot_product_attention.default.decompose(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


def _register(lib: torch.library.Library) -> None:
    cuda_ops, cpu_ops = autocast_ops("AutocastCUDA"), autocast_ops("AutocastCPU")
    for name in sorted(cuda_ops | cpu_ops):
        category = CATEGORY.get(name) if name in cuda_ops else None
        if category == BANNED or (category == LOWER and name in cpu_ops):
            continue  # CPU's kernel does what CUDA's does (or refuses, as CUDA's does)
        kernel = torch.library.fallthrough_kernel if category is None else _kernel(_overload(name), category)
        lib.impl(name, kernel, "AutocastCPU")
    lib.impl("dropout", _dropout, "AutogradCPU")
    lib.impl("scaled_dot_product_attention", _sdpa, "AutogradCPU")


@contextlib.contextmanager
def cuda_kernels():
    """While open, CPU tensors get CUDA's autocast policy, dropout and attention kernel choices (module docstring)."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel", once per op
            _register(lib)
        yield
    finally:
        lib._destroy()
