"""What the trace changes so that the model's code runs on fake tensors as a real eager run does.

``eager_branches``: library code that branches on "am I being traced?" or reads tensor values takes the branch a
real run takes; applied to every traced model source but batchlab's own GPT (hf:, and factories, which may build
transformers models) once the model is built, where the process has imported transformers: a model built with it
has imported it by then, and importing it for one that does not (a vision factory) cost ~1 s of CPU.
``fake_deepcopy``: the one tensor operation fake tensors get wrong at build time.  ``caught_warnings`` and
``library_logs``: what the traced code warns or logs is kept for the result instead of printed.
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import logging
import sys
import warnings

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

    torch's nn.Transformer reads a mask's values to tell whether it is the causal one (then the layers drop it and
    SDPA runs with is_causal, keeping no mask for backward): a fake mask of the causal mask's shape is taken as
    causal, which is what a decoder's square tgt_mask is for; the list yielded says when that was assumed.
    """
    assumed: list[str] = []
    with contextlib.ExitStack() as stack:
        if needed:
            _causal_mask_check(stack, assumed)
        if needed and "transformers" in sys.modules:
            masking = _module("transformers.masking_utils")
            if hasattr(masking, "find_packed_sequence_indices"):
                _patch(stack, masking, "find_packed_sequence_indices", lambda position_ids: None)
            moe = _module("transformers.integrations.moe")
            if hasattr(moe, "_can_use_grouped_mm"):
                original = moe._can_use_grouped_mm
                _patch(stack, moe, "_can_use_grouped_mm", lambda input, weight, offs:
                       weight.dtype == torch.bfloat16 and original(input, weight, offs))
        yield assumed


CAUSAL_ASSUMED = ("nn.Transformer's causal-mask check reads the mask's values: a square mask was taken as the causal "
                  "one (the layers then keep no mask, as in a real run with a causal tgt_mask)")


def _causal_mask_check(stack: contextlib.ExitStack, assumed: list[str]) -> None:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.nn.modules import transformer

    original = transformer._detect_is_causal_mask

    def detect(mask, is_causal=None, size=None):
        if is_causal is None and isinstance(mask, FakeTensor):
            sz = size if size is not None else mask.size(-2)
            square = tuple(mask.shape) == (sz, sz)
            if square and CAUSAL_ASSUMED not in assumed:
                assumed.append(CAUSAL_ASSUMED)
            return square
        return original(mask, is_causal, size)

    _patch(stack, transformer, "_detect_is_causal_mask", detect)


@contextlib.contextmanager
def fake_deepcopy():
    """``copy.deepcopy`` of a fake tensor stays in its own fake mode.

    torch's Tensor.__deepcopy__ deep-copies the tensor's ``__dict__``, where a fake tensor keeps its FakeTensorMode:
    the copy lands in a new mode (after a data_ptr warning) and fails the first op that meets the model's other
    tensors ("Mixing fake modes").
    Models that build their layers by deep-copying one (nn.TransformerEncoder / Decoder, most ``_get_clones``
    helpers) do this at build time.  A fake copy needs no storage: a clone in the same mode with the same
    requires_grad and the caller's attributes (a parameter's ``_is_param``) is what the real copy is.
    """
    from torch._subclasses.fake_tensor import FakeTensor

    def deepcopy(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        with self.fake_mode, torch.no_grad():
            new = self.clone()
        new.requires_grad_(self.requires_grad)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key not in new.__dict__:  # the clone has the mode's own fields already (fake_mode, fake_device)
                setattr(new, key, copy.deepcopy(value, memo))
        return new

    own = FakeTensor.__dict__.get("__deepcopy__")  # inherited from Tensor unless torch defines its own
    FakeTensor.__deepcopy__ = deepcopy
    try:
        yield
    finally:
        if own is None:
            del FakeTensor.__deepcopy__
        else:
            FakeTensor.__deepcopy__ = own


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


@contextlib.contextmanager
def caught_warnings():
    """The warnings raised while tracing, each distinct one once, as a list filled when the block ends: fake
    tensors trip warnings a real run never shows (a deprecated data_ptr access), so none reaches the terminal."""
    found: list[str] = []
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        try:
            yield found
        finally:
            seen = dict.fromkeys(f"{r.category.__name__}: {str(r.message).splitlines()[0]}" for r in records)
            found.extend(seen)


@contextlib.contextmanager
def library_logs(found: list[str]):
    """transformers' own log lines during the trace (it logs its notices, not Python warnings) appended to ``found``
    instead of printed; entered once the model is built, so the library is imported when it is used."""
    if "transformers" not in sys.modules:
        yield
        return
    handlers = logging.getLogger("transformers").handlers

    def keep(record: logging.LogRecord) -> bool:
        if not record.name.startswith("transformers"):  # a handler transformers shares with other loggers (torch's)
            return True
        line = f"transformers: {(record.getMessage().splitlines() or [''])[0]}"
        if line not in found:
            found.append(line)
        return False

    for h in handlers:
        h.addFilter(keep)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(keep)
