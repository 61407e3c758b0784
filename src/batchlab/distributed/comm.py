"""A DDP communication hook that counts, sizes and times the gradient all-reduce of each optimizer update.

It wraps PyTorch's own ``allreduce_hook`` (``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``),
so what is communicated is exactly what plain DDP does; the hook only watches.  It is also a harness
listener (``mark(phase)``), so it knows which micro-batch's backward launched each bucket.

Timing is an approximation, by design of what a hook can see: on gloo (CPU) an interval runs from the
hook's call (the bucket is ready and the all-reduce is launched) to the completion callback of its
future, wall-clock; it includes waiting for the slowest rank to reach the same bucket.  On CUDA/NCCL the
work is stream-ordered (host time would measure the launch), so intervals are CUDA events: one recorded
before the all-reduce, one in the completion callback, which runs on a stream that waits for it.  Per update the intervals of all buckets are merged (union), so overlapping buckets are not
counted twice.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from batchlab.config.phase import Phase


@dataclass
class UpdateComm:
    """What the hook saw during one optimizer update."""

    calls: int = 0  # hook invocations = DDP buckets all-reduced
    bytes: int = 0  # sum of bucket buffer sizes
    micro_batches: set[int] = field(default_factory=set)  # indices whose backward launched an all-reduce
    intervals: list[tuple[float, float]] = field(default_factory=list)  # (start, end) seconds

    @property
    def rounds(self) -> int:
        """Backward passes that all-reduced: 1 when all but the last micro-batch run under no_sync()."""
        return len(self.micro_batches)

    def seconds(self) -> float:
        """Wall time during which at least one bucket's all-reduce was in flight."""
        total, end = 0.0, float("-inf")
        for a, b in sorted(self.intervals):
            if b <= end:
                continue
            total += b - max(a, end)
            end = b
        return total


class CommMonitor:
    """Register with ``ddp.register_comm_hook(monitor, CommMonitor.hook)``; use as a phase listener in ``update``."""

    def __init__(self, cuda: bool = False):
        self.cuda = cuda
        self.updates: list[UpdateComm] = []
        self.current = UpdateComm()
        self.micro = -1
        self._lock = threading.Lock()  # gloo runs completion callbacks on its own threads
        self._starts: list = []  # CUDA start events of this update, in launch order
        self._ends: dict[int, object] = {}  # launch index -> CUDA end event
        self.bucket_buffers: list[torch.Tensor] = []  # the last update's flat gradient buckets

    # -- listener interface (Trainer.update calls mark between phases)
    def mark(self, phase: Phase | str) -> None:
        phase = Phase(phase)
        if phase is Phase.DATA:
            self.current, self.micro, self.bucket_buffers = UpdateComm(), -1, []
        elif phase is Phase.FORWARD:
            self.micro += 1
        elif phase is Phase.END:
            self._resolve_cuda_events()
            self.updates.append(self.current)

    # -- the hook itself
    @staticmethod
    def hook(state, bucket):  # unannotated: DDP rejects annotations it cannot compare (string ones)
        return state._watch(bucket)

    def _watch(self, bucket) -> torch.futures.Future:
        buf = bucket.buffer()
        record = self.current
        with self._lock:
            record.calls += 1
            record.bytes += buf.numel() * buf.element_size()
            record.micro_batches.add(self.micro)
            # the reducer keeps these buffers alive anyway; kept here so the memory tracker can register them
            self.bucket_buffers.append(buf)
        if self.cuda:
            return self._watch_cuda(bucket)
        start = time.perf_counter()
        fut = allreduce_hook(None, bucket)

        def done(f):
            end = time.perf_counter()
            with self._lock:
                record.intervals.append((start, end))
            return f.value()

        return fut.then(done)

    def _watch_cuda(self, bucket) -> torch.futures.Future:
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        index = len(self._starts)
        self._starts.append(start)
        fut = allreduce_hook(None, bucket)

        def done(f):
            # CUDA futures run callbacks on a stream that waits for the NCCL work: the event marks its end
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            with self._lock:
                self._ends[index] = end
            return f.value()

        return fut.then(done)

    def _resolve_cuda_events(self) -> None:
        if not self._starts:
            return
        torch.cuda.synchronize()
        starts, ends, self._starts, self._ends = self._starts, self._ends, [], {}
        origin = starts[0]  # recorded first on the same stream: all offsets are >= 0
        for i, start in enumerate(starts):
            if i in ends:
                a = origin.elapsed_time(start) / 1e3  # elapsed_time is in milliseconds
                self.current.intervals.append((a, a + start.elapsed_time(ends[i]) / 1e3))


def register(ddp_model, cuda: bool = False) -> CommMonitor:
    monitor = CommMonitor(cuda=cuda)
    ddp_model.register_comm_hook(monitor, CommMonitor.hook)
    return monitor
