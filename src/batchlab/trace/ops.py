"""The op list of one training update: every aten op with its phase, FLOPs, bytes moved and output size.

A TorchDispatchMode sees each op the update really runs (forward, backward, the recompute of activation
checkpointing, the optimizer) with its tensors' shapes, on fake or real tensors alike.  FLOPs come from
torch's own ``flop_registry`` (the FlopCounterMode formulas); bytes are the footprints of the tensors read
and written (a broadcast input counts its real elements once).  ``formula.opcost.price`` turns the list
into seconds.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from batchlab.formula.opcost import OpClass, OpCount, op_class
from batchlab.config.phase import GRAPH_CALL, REGION_CALL, Launch, Phase
from batchlab.measure.memory import tensors_in
from batchlab.models import ac
from batchlab.trace.flops import register_cpu_attention_flops, update_under
from batchlab.models.owners import HookSet

_LOW = (torch.bfloat16, torch.float16)
# (launch, bytes or None) of the op a compiled graph is running now: set by its interpreter (trace/compiled.py),
# where a node is one kernel of inductor's, the bytes of the fused chain it ends; None: eager
_KERNEL: contextvars.ContextVar = contextvars.ContextVar("batchlab_kernel", default=None)


@contextlib.contextmanager
def kernel(launch: Launch, nbytes: int | None = None):
    """Ops recorded within are issued by ``launch``, moving ``nbytes`` where given (a fused chain's)."""
    token = _KERNEL.set((launch, nbytes))
    try:
        yield
    finally:
        _KERNEL.reset(token)


@torch.library.custom_op("batchlab::inductor_kernel", mutates_args=())
def _inductor_kernel_op(buffers: list[torch.Tensor]) -> None:
    """One of inductor's generated kernels as the trace sees it (trace/inductor_plan.py): no data, no storage;
    the op recorder counts its arguments' bytes once."""


@_inductor_kernel_op.register_fake
def _(buffers):
    return None


def inductor_kernel(buffers: list[torch.Tensor]) -> None:
    """Record one compiled kernel that reads and writes ``buffers`` (a wrapper's C++ kernel call, not built)."""
    if buffers:
        with kernel(Launch.COMPILED):
            torch.ops.batchlab.inductor_kernel(buffers)


@torch.library.custom_op("batchlab::fused_arithmetic", mutates_args=())
def _fused_arithmetic_op(name: str, elements: int, low: bool) -> None:
    """The per-element arithmetic of one op inside a compiled kernel (trace/inductor_plan.py): no data; the op
    recorder counts ``elements`` of op ``name`` (its class's per-element rate), no bytes (the kernel's own)."""


@_fused_arithmetic_op.register_fake
def _(name, elements, low):
    return None


def fused_arithmetic(name: str, elements: int, low: bool) -> None:
    """Record the arithmetic of ``elements`` of aten op ``name`` done inside a compiled kernel: no launch, no bytes."""
    with kernel(Launch.FUSED, 0):
        torch.ops.batchlab.fused_arithmetic(name, elements, low)


# the recorders open now (OpRecorder: from its creation to its close, which every user's ``finally`` reaches), told
# of each compiled graph's run
_RECORDERS: set = set()


def graph_call() -> None:
    """Record one run of a compiled graph's own call (guards, AOTAutograd's wrapper or its backward node) with
    every live recorder: no data, no op of the update's (nothing dispatched: the timeline, FLOP counters and the
    live-storage tracker never see it), its timed cost per call (calibrate/calls.py)."""
    for rec in _RECORDERS:
        rec.own_call(GRAPH_CALL, Launch.GRAPH)


def footprint(t: torch.Tensor) -> int:
    """Bytes a kernel touches for ``t``: its elements, a stride-0 (broadcast) dimension counted once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


class _Overload(NamedTuple):
    """What an op's record needs of its overload, read once per overload (``namespace`` and
    ``overloadpacket`` are properties that rebuild their answer on every read)."""

    name: str
    aten: bool
    is_view: bool
    mutable: bool
    packet: object
    cost_class: OpClass  # with a contiguous last input
    strided: OpClass  # with a non-contiguous one (a copy of a view gathers: STRIDED where op_class says so)
    # keyword-only arguments the op writes without reading (``out=``: the buffer an extern kernel of inductor's
    # wrapper writes into), moved once, as its output
    written: frozenset = frozenset()

    @classmethod
    def of(cls, func) -> "_Overload":
        name = func.overloadpacket.__name__
        # batchlab::inductor_kernel (a compiled kernel of the trace's, inductor_plan.py) is counted as aten's are
        written = frozenset(a.name for a in func._schema.arguments
                            if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write)
        return cls(name, func.namespace in ("aten", "batchlab"), func.is_view, func._schema.is_mutable,
                   func.overloadpacket,
                   op_class(name, is_view=func.is_view), op_class(name, is_view=func.is_view, strided=True), written)


_OVERLOADS: dict = {}


def _overload(func) -> _Overload:
    info = _OVERLOADS.get(func)
    if info is None:
        info = _OVERLOADS[func] = _Overload.of(func)
    return info


def _key(func, args, kwargs, out, phase: Phase) -> tuple:
    """One call as OpCount's fields but the count: (name, phase, cost class, FLOPs, bytes, elements, low,
    FLOPs per matmul)."""
    op = _overload(func)
    name = op.name
    if name == "fused_arithmetic":  # (name, elements, low) of an op inside a compiled kernel: its arithmetic only
        inner, elements, low = args
        return inner, phase, op_class(inner), 0, 0, elements, low, 0
    read = {k: v for k, v in kwargs.items() if k not in op.written} if op.written else kwargs
    outs, ins = tensors_in(out), tensors_in((args, read))
    cost_class = op.cost_class
    if cost_class is not op.strided and ins and not ins[-1].is_contiguous():
        cost_class = op.strided
    flops = 0
    formula = flop_registry.get(op.packet)
    if formula is not None:
        flops = int(formula(*args, **kwargs, out_val=out))
    nbytes = 0
    if cost_class is not OpClass.VIEW:
        # an in-place op's output is its input: read once, written once
        ids = {id(t) for t in ins}
        nbytes = sum(footprint(t) for t in ins) + sum(footprint(t) for t in outs if id(t) not in ids or op.mutable)
        if name == "embedding":  # reads the rows it gathers (as many as it writes), not the whole table
            nbytes = 2 * footprint(outs[0]) + footprint(ins[1])
    first = outs or ins
    low = bool(first) and first[0].dtype in _LOW
    elements = max((t.numel() for t in outs), default=0)
    return name, phase, cost_class, flops, nbytes, elements, low, _flops_per_matmul(name, ins, flops)


def _flops_per_matmul(name: str, ins: list[torch.Tensor], flops: int) -> int:
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
    """Records each op's OpCount; also a harness listener (``mark``) so ops carry their phase.

    Recompute is told apart: ops inside a checkpointed block's forward while backward runs (non-reentrant
    checkpointing calls the block again from its unpack hook); a trace's FLOPs by phase come from these
    (trace/flops.py ``flops_of``).
    """

    def __init__(self, model: nn.Module | None = None):
        TorchDispatchMode.__init__(self)
        HookSet.__init__(self)
        self.phase = Phase.DATA
        self._in_block = 0
        self._in_sac = 0  # inside a block under selective checkpointing's dispatch mode (OpCount.sac_dispatched)
        # identical calls counted as they come (OpCount's fields but the count -> calls), in order of first call
        self._counts: dict[tuple, int] = {}
        # a whole block's checkpoint seen by its block's hooks (also where dynamo ran it eagerly past a graph break);
        # a branch's or the attention core's where the policy enters it (models/ac.py ``listen``)
        for m in (model.modules() if model is not None else ()):
            if type(m) is ac.Checkpointed:
                self._handles.append(m.block.register_forward_pre_hook(lambda mod, args, m=m: self._enter(m.mode)))
                self._handles.append(m.block.register_forward_hook(lambda mod, args, out, m=m: self._leave(m.mode),
                                                                   always_call=True))
        self._handles.append(ac.listen(self._enter, self._leave))
        _RECORDERS.add(self)
        register_cpu_attention_flops()

    def close(self) -> None:
        _RECORDERS.discard(self)
        super().close()

    def _enter(self, mode) -> None:
        self._in_block += 1
        self._in_sac += mode.dispatch_mode
        # a selective policy's dispatch mode is priced per op (calibrate/dispatch.py); a compiled block's checkpoint
        # is part of its graph
        if not mode.dispatch_mode and not torch.compiler.is_compiling():
            self.own_call(REGION_CALL, Launch.CHECKPOINT)  # in forward, and as the recompute starts (current())

    def _leave(self, mode) -> None:
        self._in_block -= 1
        self._in_sac -= mode.dispatch_mode

    def own_call(self, name: str, launch: Launch) -> None:
        """Count one run of a graph's or a region's own call: priced by ``launch``'s timed kind, no data, no op."""
        key = (name, self.current(), OpClass.VIEW, 0, 0, 0, False, 0, False, launch)
        self._counts[key] = self._counts.get(key, 0) + 1

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
        self.record(func, args, kwargs, out)
        return out

    def record(self, func, args, kwargs, out) -> None:
        """Count one op that returned ``out`` (a StorageTracker's ``observer``, or this mode's own)."""
        if _overload(func).aten:  # not prim::device and other metadata queries fake tensors dispatch
            fields = _key(func, args, kwargs, out, self.current())
            launch, nbytes = _KERNEL.get() or (Launch.EAGER, None)
            if nbytes is not None and fields[2] is not OpClass.VIEW:
                fields = (*fields[:4], nbytes, *fields[5:])
            key = (*fields, self._in_sac > 0 and launch is Launch.EAGER, launch)
            self._counts[key] = self._counts.get(key, 0) + 1

    def result(self) -> tuple[OpCount, ...]:
        """The calls, identical ones merged (``formula.opcost.merge``'s order and counts)."""
        return tuple(OpCount(*fields, count=n, flops_per_matmul=flops_per_matmul, sac_dispatched=sac, launch=launch)
                     for (*fields, flops_per_matmul, sac, launch), n in self._counts.items())


def record_update(trainer) -> tuple[OpCount, ...]:
    """The ops of one update of ``trainer`` (real or fake tensors), identical calls merged."""
    rec = OpRecorder(trainer.raw_model)
    return update_under(trainer, rec, rec)
