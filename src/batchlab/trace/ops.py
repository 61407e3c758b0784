"""The op list of one training update: every aten op with its phase, FLOPs, bytes moved and output size.

A TorchDispatchMode sees each op the update really runs (forward, backward, the recompute of activation
checkpointing, the optimizer) with its tensors' shapes, on fake or real tensors alike.  FLOPs come from
torch's own ``flop_registry`` (the FlopCounterMode formulas); bytes are the footprints of the tensors read
and written (a broadcast input counts its real elements once).  ``formula.opcost.price`` turns the list
into seconds.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from batchlab.formula.opcost import OpClass, OpCount, Phase, merge, op_class
from batchlab.models.ac import Checkpointed
from batchlab.trace.flops import register_cpu_attention_flops, update_under
from batchlab.trace.tree import HookSet

_LOW = (torch.bfloat16, torch.float16)


def footprint(t: torch.Tensor) -> int:
    """Bytes a kernel touches for ``t``: its elements, a stride-0 (broadcast) dimension counted once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def _tensors(x) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def op_of(func, args, kwargs, out, phase: Phase) -> OpCount:
    """One call as an OpCount (count 1)."""
    name = func.overloadpacket.__name__
    outs, ins = _tensors(out), _tensors((args, kwargs))
    klass = op_class(name, is_view=func.is_view, strided=bool(ins) and not ins[-1].is_contiguous())
    flops = 0
    if func.overloadpacket in flop_registry:
        flops = int(flop_registry[func.overloadpacket](*args, **kwargs, out_val=out))
    nbytes = 0
    if klass is not OpClass.VIEW:
        # an in-place op's output is its input: read once, written once
        ids = {id(t) for t in ins}
        nbytes = sum(footprint(t) for t in ins) + sum(footprint(t) for t in outs if id(t) not in ids or
                                                       func._schema.is_mutable)
        if name == "embedding":  # reads the rows it gathers (as many as it writes), not the whole table
            nbytes = 2 * footprint(outs[0]) + footprint(ins[1])
    low = any(t.dtype in _LOW for t in (outs or ins)[:1])
    elements = max((t.numel() for t in outs), default=0)
    return OpCount(name, phase, klass, flops, nbytes, elements, low, grain=_grain(name, ins, flops))


def _grain(name: str, ins: list[torch.Tensor], flops: int) -> int:
    """FLOPs of one independent matmul: a bmm's per batch entry, attention's per (batch, head)."""
    if not flops or not ins:
        return 0
    if name in ("bmm", "baddbmm"):
        return flops // max(ins[-1].shape[0], 1)
    if name.startswith("_scaled_dot_product") and ins[0].dim() == 4:  # the forward's 4 s^2 d per head
        per_head = flops // max(ins[0].shape[0] * ins[0].shape[1], 1)
        return per_head * 2 // 5 if name.endswith("_backward") else per_head
    return 0


class OpRecorder(TorchDispatchMode, HookSet):
    """Records each op's OpCount; also a harness probe (``mark``) so ops carry their phase.

    Recompute is told apart: ops inside a checkpointed block's forward while backward runs (non-reentrant
    checkpointing calls the block again from its unpack hook); a trace's FLOPs by phase come from these
    (trace/flops.py ``flops_of``).
    """

    def __init__(self, model: nn.Module | None = None):
        TorchDispatchMode.__init__(self)
        HookSet.__init__(self)
        self.phase = Phase.DATA
        self._in_block = 0
        self.ops: list[OpCount] = []
        for m in (model.modules() if model is not None else ()):
            if isinstance(m, Checkpointed):
                self._handles.append(m.block.register_forward_pre_hook(self._enter))
                self._handles.append(m.block.register_forward_hook(self._leave, always_call=True))
        register_cpu_attention_flops()

    def _enter(self, module, args) -> None:
        self._in_block += 1

    def _leave(self, module, args, output) -> None:
        self._in_block -= 1

    def mark(self, phase: str) -> None:
        if phase != "end":
            self.phase = Phase(phase)

    def current(self) -> Phase:
        if self.phase is Phase.BACKWARD and self._in_block > 0:
            return Phase.RECOMPUTE
        return self.phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "aten":  # not prim::device and other metadata queries fake tensors dispatch
            self.ops.append(op_of(func, args, kwargs, out, self.current()))
        return out

    def result(self) -> tuple[OpCount, ...]:
        return merge(self.ops)


def record_update(trainer) -> tuple[OpCount, ...]:
    """The ops of one update of ``trainer`` (real or fake tensors), identical calls merged."""
    rec = OpRecorder(trainer.raw_model)
    return update_under(trainer, rec, rec)
