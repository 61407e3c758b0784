"""Library code that branches on "am I being traced?" made to take the branch a real eager run takes.

Applied to every traced model source but batchlab's own GPT (hf:, and factories, which may build
transformers models) once the model is built, where the process has imported transformers: a model built with
it has imported it by then, and importing it for one that does not (a vision factory) cost ~1 s of CPU.
"""
from __future__ import annotations

import contextlib
import importlib
import sys

import torch


def _patch(stack: contextlib.ExitStack, module, name: str, value) -> None:
    original = getattr(module, name)
    setattr(module, name, value)
    stack.callback(setattr, module, name, original)


@contextlib.contextmanager
def eager_branches(needed: bool = True):
    """transformers' mask builder sees a fake tensor as tracing and then keeps a packed-sequence mask, so the
    layers get an explicit mask (no is_causal fast path, repeated k/v under GQA): more memory than the real
    run.  Eagerly it reads the positions and finds no packing, which is always the answer for the harness's
    batches (no position_ids are passed, so positions are 0..s-1 in every row).

    transformers' MoE experts call ``grouped_mm``, whose fake-tensor kernel accepts only bf16 (the CPU
    kernel takes fp32 too); the library's own fallback op keeps the same tensors (input and weights) for
    backward and has a fake kernel, so the trace routes the grouped matmuls there.
    """
    with contextlib.ExitStack() as stack:
        if needed and "transformers" in sys.modules:
            masking = _module("transformers.masking_utils")
            if hasattr(masking, "find_packed_sequence_indices"):
                _patch(stack, masking, "find_packed_sequence_indices", lambda position_ids: None)
            moe = _module("transformers.integrations.moe")
            if hasattr(moe, "_can_use_grouped_mm"):
                original = moe._can_use_grouped_mm
                _patch(stack, moe, "_can_use_grouped_mm", lambda input, weight, offs:
                       weight.dtype == torch.bfloat16 and original(input, weight, offs))
        yield


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
