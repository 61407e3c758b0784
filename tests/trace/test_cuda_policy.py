"""A CUDA config traced on a machine without CUDA takes CUDA's kernel choices (trace/cuda_policy.py): CUDA's autocast
policy, the fused dropout's 1-byte mask, fused attention with dropout; and leaves CPU autocast as it found it."""
from __future__ import annotations

import pytest
import torch

from batchlab.config import RunConfig, preset
from batchlab.formula import estimate as formula
from batchlab.trace import estimate as trace
from batchlab.trace.cuda_policy import CATEGORY, autocast_ops, cuda_kernels

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="traces with real CUDA kernels here")


def tiny(**kw) -> RunConfig:
    return RunConfig(model=preset("tiny", layers=2), seq=64, micro_batch=2, **kw)


def rel(a: float, b: float) -> float:
    return abs(a - b) / b


def test_every_op_cuda_autocast_handles_has_a_category():
    # the dispatcher's AutocastCUDA registrations (present in CPU builds too) are the reference: an op a newer torch
    # adds to CUDA's lists must be categorised, not silently run in its input's dtype
    assert autocast_ops("AutocastCUDA") <= set(CATEGORY)


def _cuda_autocast(dtype):
    """CUDA's own autocast state, set directly (torch.autocast("cuda") turns itself off without CUDA)."""
    previous = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    torch.autocast_increment_nesting()
    return previous


def _restore(previous):
    torch.autocast_decrement_nesting()
    torch.set_autocast_enabled("cuda", previous[0])
    torch.set_autocast_dtype("cuda", previous[1])


OPS = {  # op -> inputs as (shape, dtype)
    "softmax": (lambda x: x.softmax(-1), [((4, 8), torch.bfloat16)]),
    "log_softmax": (lambda x: x.log_softmax(-1), [((4, 8), torch.bfloat16)]),
    "pow": (lambda x: x.pow(3.0), [((4, 8), torch.bfloat16)]),
    "layer_norm": (lambda x: torch.nn.functional.layer_norm(x, (8,)), [((4, 8), torch.bfloat16)]),
    "sum": (lambda x: x.sum(), [((4, 8), torch.bfloat16)]),
    "matmul": (lambda x, y: x @ y, [((4, 8), torch.float32), ((8, 4), torch.float32)]),
    "einsum": (lambda x, y: torch.einsum("ij,jk->ik", x, y), [((4, 8), torch.float32), ((8, 4), torch.float32)]),
    "addcmul": (lambda x, y: torch.addcmul(x, x, y), [((4, 8), torch.bfloat16), ((4, 8), torch.float32)]),
    "cat": (lambda x, y: torch.cat([x, y]), [((4, 8), torch.bfloat16), ((4, 8), torch.bfloat16)]),
    "mse_loss": (lambda x, y: torch.nn.functional.mse_loss(x, y), [((4, 8), torch.bfloat16), ((4, 8), torch.bfloat16)]),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_cpu_tensors_get_the_dtype_cuda_autocast_gives_fake_cuda_tensors(name):
    # reference: CUDA's own autocast kernels, run forward on fake CUDA tensors (no autograd: that needs CUDA)
    from torch._subclasses.fake_tensor import FakeTensorMode

    fn, inputs = OPS[name]
    with FakeTensorMode():
        previous = _cuda_autocast(torch.bfloat16)
        try:
            want = fn(*(torch.empty(s, dtype=d, device="cuda:0") for s, d in inputs)).dtype
        finally:
            _restore(previous)
        with cuda_kernels(), torch.autocast("cpu", dtype=torch.bfloat16):
            got = fn(*(torch.empty(s, dtype=d) for s, d in inputs)).dtype
    assert got == want


def test_cpu_autocast_is_cpus_own_again_afterwards_even_after_an_error():
    with pytest.raises(RuntimeError, match="inside"):
        with cuda_kernels():
            raise RuntimeError("inside")
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (x @ x.T).softmax(-1).dtype is torch.bfloat16  # CPU's lists leave softmax in the low precision
        assert torch.nn.functional.dropout(x, 0.5, True).dtype is torch.float32
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::softmax.int", "AutocastCPU")
    assert not torch.is_autocast_enabled("cpu") and not torch.is_autocast_enabled("cuda")


def _dropout_elements(cfg: RunConfig) -> int:
    """Elements of the dropout masks one forward keeps, by hand: the embedding's and each layer's two residual
    dropouts (s·b·h each) and each layer's attention-probability dropout (a·s·s·b)."""
    m, s, b = cfg.model, cfg.seq, cfg.micro_batch
    return s * b * m.hidden * (1 + 2 * m.layers) + m.layers * m.heads * s * s * b


def test_cuda_keeps_a_one_byte_dropout_mask_where_cpu_keeps_the_activation_dtype():
    # fp32: no autocast, so the dropout kernel is the one choice that differs: 4 bytes a mask element on CPU, 1 on CUDA
    cpu, gpu = trace(tiny(precision="fp32")), trace(tiny(precision="fp32", device="h100-sxm"))
    saved = cpu.memory.activations_bytes - gpu.memory.activations_bytes
    assert saved == (4 - 1) * _dropout_elements(tiny(precision="fp32"))
    assert gpu.traced_device.startswith("cpu (CUDA") and any("CUDA's kernel choices" in n for n in gpu.notes)
    assert not any("CPU kernels" in n for n in gpu.notes)
    # the trace's kernels are gone once it returns: CPU autocast has no softmax kernel of its own
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::softmax.int", "AutocastCPU")
    assert not torch.is_autocast_enabled("cpu") and not torch.is_autocast_enabled("cuda")


@pytest.mark.parametrize("kw", [dict(precision="bf16-mixed"),
                                dict(precision="bf16-mixed", attention="sdpa"),
                                dict(precision="bf16-mixed", model="gpt2")])
def test_a_cuda_config_traced_without_cuda_agrees_with_the_formulas_cuda_terms(kw):
    # sdpa: with dropout CUDA's fused kernels keep no s x s tensor, CPU's math path does; gpt2: transformers'
    # gelu_new calls pow, which CUDA's autocast runs in fp32 (the MLP keeps 16 bytes an element, not 10)
    kw = dict(kw)
    model = preset(kw.pop("model"), layers=2) if "model" in kw else None
    cfg = tiny(device="h100-sxm", **{k: v for k, v in kw.items() if k != "attention"})
    cfg = cfg.replace(model=model) if model is not None else cfg
    if "attention" in kw:
        cfg = cfg.replace(attention=kw["attention"])
    traced = trace(cfg)
    assert rel(formula(cfg).memory.activations_bytes, traced.memory.activations_bytes) <= 0.05


def test_where_cudas_choices_fail_the_trace_runs_cpus_kernels_and_says_so(monkeypatch):
    import contextlib

    import batchlab.trace.run as run

    @contextlib.contextmanager
    def failing():
        raise RuntimeError("no such kernel\nmore")
        yield

    monkeypatch.setattr(run, "cuda_kernels", failing)
    t = trace(tiny(precision="bf16-mixed", device="h100-sxm"))
    assert t.traced_device == "cpu"
    assert any("CPU kernels" in n and "CUDA's kernel choices failed: no such kernel)" in n for n in t.notes)
