"""Out-of-memory, whatever its spelling: one function decides, so every caller agrees.

Peers match message text and miss some forms (a plain ``MemoryError``, ``RuntimeError("CUDA error: out of
memory")``); the spellings below are the ones PyTorch's allocators and libraries raise (c10 CUDA/HIP/MPS
caching allocators, CUDA runtime errors, cuDNN / cuBLAS allocation failures, c10's DefaultCPUAllocator).
"""
from __future__ import annotations

from batchlab.config import Choice


class OOMKind(Choice):
    BUDGET = "memory budget"  # batchlab's tracked-bytes budget (CPU) or per-process fraction (CUDA)
    DEVICE = "device allocator"  # torch.OutOfMemoryError: CUDA / HIP / MPS / XPU caching allocator
    CUDA_RUNTIME = "CUDA runtime"  # "CUDA error: out of memory" (cudaMalloc outside the caching allocator)
    LIBRARY = "cuDNN/cuBLAS workspace"  # a library failed to allocate its workspace
    HOST = "host allocator"  # CPU: c10 DefaultCPUAllocator, or Python's MemoryError


# (substring, kind); matched case-sensitively against the message as PyTorch writes it.
_SPELLINGS: tuple[tuple[str, OOMKind], ...] = (
    ("CUDA out of memory", OOMKind.DEVICE),
    ("HIP out of memory", OOMKind.DEVICE),
    ("MPS backend out of memory", OOMKind.DEVICE),
    ("XPU out of memory", OOMKind.DEVICE),
    ("CUDA error: out of memory", OOMKind.CUDA_RUNTIME),
    ("hipErrorOutOfMemory", OOMKind.CUDA_RUNTIME),
    ("CUDNN_STATUS_ALLOC_FAILED", OOMKind.LIBRARY),
    # cuDNN reports a failed workspace allocation this way for some convolutions (accelerate's
    # should_reduce_batch_size treats it as OOM too)
    ("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input",
     OOMKind.LIBRARY),
    ("CUBLAS_STATUS_ALLOC_FAILED", OOMKind.LIBRARY),
    ("DefaultCPUAllocator: can't allocate memory", OOMKind.HOST),
    ("DefaultCPUAllocator: not enough memory", OOMKind.HOST),
)


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def classify_oom(exc: BaseException) -> OOMKind | None:
    """The kind of out-of-memory ``exc`` is (following its cause chain), or None if it is not one."""
    from batchlab.measure.memory import BudgetExceeded

    for e in _chain(exc):
        if isinstance(e, BudgetExceeded):
            return OOMKind.BUDGET
        if type(e).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError (torch.cuda.OutOfMemoryError)
            return OOMKind.DEVICE
        message = str(e)
        for text, kind in _SPELLINGS:
            if text in message:
                return kind
        if isinstance(e, MemoryError):
            return OOMKind.HOST
    return None


__all__ = ["OOMKind", "classify_oom"]
