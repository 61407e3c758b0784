"""A compiled update's memory on CPU, from the allocator's own events.

Inductor's generated code allocates its buffers straight from the CPU allocator, past the dispatcher, so the
live-storage tracker (a dispatch mode) never sees them.  The profiler's memory events (``profile_memory=True``:
every allocation and free c10's CPU allocator makes) do: the peak is the bytes of the storages alive before the
update (parameters, buffers, gradients kept, optimizer state) plus the highest running sum of those events; the
phases are the harness's marks, recorded as profiler ranges on the same clock.
"""
from __future__ import annotations

import torch

from batchlab.config.phase import Phase
from batchlab.measure.devmem import model_state_bytes
from batchlab.measure.memory import storage_bytes
from batchlab.measure.result import MeasuredMemory

METHOD = ("CPU allocator events (torch.profiler profile_memory) over the update, plus the storages alive before "
          "it: inductor's buffers bypass the live-storage tracker's dispatch mode")
_RANGE = "batchlab:"


def held_bytes(trainer) -> int:
    """Distinct storages alive between updates: parameters, buffers, gradients kept, optimizer state (its 0-dim
    step counters left out, as the tracker leaves them)."""
    model = trainer.raw_model
    optimizer = getattr(trainer.optimizer, "optim", trainer.optimizer)
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return storage_bytes([*model.parameters(), *model.buffers(), *grads, *state])


class AllocatorProbe:
    """A phase listener: ``with probe: trainer.update(listener=probe)``, then ``result(trainer)``."""

    def __init__(self, trainer):
        self.trainer = trainer
        self._range = None
        self._prof = None
        self.held = 0

    def __enter__(self) -> "AllocatorProbe":
        from torch.profiler import ProfilerActivity, profile

        self.held = held_bytes(self.trainer)
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        self.mark(Phase.DATA)
        return self

    def mark(self, phase: Phase | str) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
        self._range = torch.autograd.profiler.record_function(_RANGE + Phase(phase).value)
        self._range.__enter__()

    def __exit__(self, *exc) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        self._prof.__exit__(*exc)

    def result(self) -> MeasuredMemory:
        events = self._prof.profiler.kineto_results.events()
        memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
        ranges = sorted((e.start_ns(), e.start_ns() + e.duration_ns(), e.name()[len(_RANGE):])
                        for e in events if e.name().startswith(_RANGE))
        live, peak, peak_at = self.held, self.held, ranges[0][0] if ranges else 0
        starts: dict[str, int] = {}  # phase -> live bytes when its last range began
        r = 0
        for t, nbytes in memory:
            while r < len(ranges) and ranges[r][0] <= t:
                starts[ranges[r][2]] = live
                r += 1
            live += nbytes
            if live > peak:
                peak, peak_at = live, t
        peak_phase = next((name for a, b, name in reversed(ranges) if a <= peak_at), Phase.DATA.value)
        activations = max(starts.get(Phase.BACKWARD.value, 0) - starts.get(Phase.FORWARD.value, 0), 0)
        return MeasuredMemory(peak_bytes=peak, activations_bytes=activations, peak_phase=Phase(peak_phase),
                              breakdown=model_state_bytes(self.trainer), method=METHOD)
