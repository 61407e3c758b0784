"""Wall-clock phase listeners.  The device is synchronised before every clock read: CUDA and MPS run kernels
asynchronously, so an unsynchronised clock measures kernel launches, not the work.
"""
from __future__ import annotations

import time
from typing import Callable

import torch


def synchronizer(device: torch.device) -> Callable[[], None]:
    """A zero-argument function that waits for all queued work on ``device`` (a no-op on CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    if device.type == "mps":
        return torch.mps.synchronize
    return lambda: None


class PhaseClock:
    """A phase listener: accumulates wall time per phase over one update (phases repeat once per micro-batch).

    ``sync_marks``: synchronise at every mark.  Exact per-phase split, but on an asynchronous device it
    removes the overlap between host and device, so timed updates there use ``sync_marks=False`` and the
    split comes from separate updates.  On CPU the sync is free and both come from the same updates.
    """

    def __init__(self, sync: Callable[[], None], sync_marks: bool = True,
                 clock: Callable[[], float] = time.perf_counter):
        self._sync = sync
        self._clock = clock
        self._sync_marks = sync_marks
        self.phase: str | None = None
        self._t = 0.0
        self.seconds: dict[str, float] = {}

    def start(self) -> None:
        self.phase, self.seconds = None, {}

    def mark(self, phase: str) -> None:
        if self._sync_marks:
            self._sync()
            now = self._clock()
            if self.phase is not None and self.phase != "end":
                self.seconds[self.phase] = self.seconds.get(self.phase, 0.0) + (now - self._t)
            self._t = now
        self.phase = phase


def timed(fn: Callable[[], object], sync: Callable[[], None]) -> tuple[object, float, float]:
    """Run ``fn`` between two synchronised clock reads: (its result, wall seconds, process CPU seconds)."""
    sync()
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    sync()
    t1, c1 = time.perf_counter(), time.process_time()
    return out, t1 - t0, c1 - c0


class Listeners:
    """Several harness listeners marked together (the harness's ``update`` takes one listener)."""

    def __init__(self, *listeners):
        self.listeners = listeners

    def mark(self, phase) -> None:
        for p in self.listeners:
            p.mark(phase)
