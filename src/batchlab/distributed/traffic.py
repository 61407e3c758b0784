"""Collective traffic of one update, counted on the process group: every c10d op any engine issues.

A TorchDispatchMode sees each collective as it is dispatched (``c10d::allreduce_``, ``_allgather_base_``,
``_reduce_scatter_base_``, ``broadcast_``): DDP's bucket all-reduce from its comm hook, FSDP2's all-gathers
and reduce-scatters, ZeroRedundancyOptimizer's broadcasts, and the harness's own bookkeeping (the global
useful-token count, the gradient norm of sharded gradients).  It is also a harness listener (``mark``), so it
knows which micro-batch and phase issued each.

Bytes counted per call are the collective's full buffer, the size nccl-tests calls "size": all-reduce and
broadcast: the tensor; all-gather: the gathered output; reduce-scatter: the unreduced input.  One-element
tensors (counts, norms) are bookkeeping and counted apart.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
# c10d op -> (kind, index of the argument whose bytes count)
_OPS = {"allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
        "_allgather_base_": ("all_gather", 0), "allgather_": ("all_gather", 0),
        "allgather_into_tensor_coalesced_": ("all_gather", 0),
        "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
        "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1), "broadcast_": ("broadcast", 0)}


def _nbytes(arg) -> tuple[int, int]:
    """(bytes, elements) of a tensor or a (nested) list of tensors."""
    if isinstance(arg, torch.Tensor):
        return arg.numel() * arg.element_size(), arg.numel()
    total = [0, 0]
    for a in arg:
        b, n = _nbytes(a)
        total[0] += b
        total[1] += n
    return total[0], total[1]


@dataclass
class Call:
    kind: str
    bytes: int
    micro_batch: int  # -1: before the first forward (data phase)
    phase: str


@dataclass
class TrafficCounter(TorchDispatchMode):
    calls: list[Call] = field(default_factory=list)
    bookkeeping: list[Call] = field(default_factory=list)  # one-element collectives
    phase: str = "data"
    micro: int = -1

    def __post_init__(self):
        super().__init__()

    def mark(self, phase: str) -> None:
        if phase == "data":
            self.calls, self.bookkeeping, self.micro = [], [], -1
        elif phase == "forward":
            self.micro += 1
        self.phase = phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and func._opname in _OPS:
            kind, i = _OPS[func._opname]
            nbytes, numel = _nbytes(args[i])
            (self.bookkeeping if numel <= 1 else self.calls).append(Call(kind, nbytes, self.micro, self.phase))
        return func(*args, **(kwargs or {}))

    def summary(self, accum: int) -> dict:
        """Plain JSON: bytes and calls per kind per micro-batch (index) and per update, by phase too."""
        per_micro = [dict.fromkeys(KINDS, 0) for _ in range(accum)]
        per_update, calls, by_phase = dict.fromkeys(KINDS, 0), dict.fromkeys(KINDS, 0), {}
        outside = dict.fromkeys(KINDS, 0)  # issued outside any micro-batch (optimizer step)
        for c in self.calls:
            per_update[c.kind] += c.bytes
            calls[c.kind] += 1
            by_phase.setdefault(c.phase, dict.fromkeys(KINDS, 0))[c.kind] += c.bytes
            if c.phase in ("forward", "backward") and 0 <= c.micro_batch < accum:
                per_micro[c.micro_batch][c.kind] += c.bytes
            else:
                outside[c.kind] += c.bytes
        return dict(per_update=per_update, calls_per_update=calls, per_micro_batch=per_micro,
                    outside_micro_batches=outside, by_phase=by_phase,
                    bookkeeping_calls=len(self.bookkeeping), bookkeeping_bytes=sum(c.bytes for c in self.bookkeeping),
                    method="c10d ops counted by a TorchDispatchMode on the process group's calls")
