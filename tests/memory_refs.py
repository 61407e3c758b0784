"""Independent readings of one training update's peak tensor memory, beside batchlab's live-storage tracker
(tests/test_tracker_vs_memtracker.py, benchmarks/tracker_vs_memtracker.py).  Test support, not the library.

All three watch the same steady-state update of one ``Trainer`` (AdamW's state exists: the first update runs
untracked):

- batchlab: ``batchlab.measure.memory`` (the tracker both ``measure`` and ``estimate --trace`` use);
- MemTracker: PyTorch's ``torch.distributed._tools.mem_tracker.MemTracker`` (a private module), the outer
  dispatch mode, given the model and optimizer with ``track_external``;
- allocator: the profiler's CPU memory events (every allocation and free c10's CPU allocator reports, no
  dispatch mode involved) added to the bytes of the storages alive before the update, counted once each by
  their address.  It also sees what a kernel allocates for itself and frees before returning, so it may
  read a few bytes above the two trackers, which count op outputs.

MemTracker also counts AdamW's 0-dim ``step`` counters (4 B per parameter tensor); batchlab leaves them out
on purpose (on CUDA they live in host memory, and the formula's 8 B per parameter has no room for them):
``steps`` holds their bytes, and ``memtracker - steps`` is what batchlab should read to the byte.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from batchlab.measure.memory import tracker_for


@dataclass(frozen=True)
class Readings:
    batchlab: int  # peak bytes, batchlab's tracker
    memtracker: int  # peak bytes, PyTorch's MemTracker
    allocator: int  # peak bytes, profiler memory events + storages alive before the update
    steps: int  # bytes of the optimizer's 0-dim state (AdamW step counters): MemTracker counts them
    phase: str  # where batchlab's peak is
    # the most one aten op allocated for itself above what it returned, freed before returning (the allocator
    # sees it, no tracker does): a CPU's kernels decide it (a bf16 matmul's packing buffers differ by vector unit)
    scratch: int = 0

    @property
    def difference(self) -> float:
        """(batchlab - MemTracker) / MemTracker."""
        return (self.batchlab - self.memtracker) / self.memtracker


def _held(trainer) -> tuple[int, int]:
    """(bytes of the distinct storages alive before the update, of them the optimizer's 0-dim state's): what
    ``measure --compile`` adds to its allocator events (measure/allocmem.py), with the step counters it leaves out."""
    from batchlab.measure.allocmem import held_bytes

    steps = _optimizer_steps(trainer)
    return held_bytes(trainer) + steps, steps


def _profiled_peak(prof) -> int:
    """Highest running sum of the allocator's byte events (allocations +, frees -) in time order."""
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def _kernel_scratch(prof) -> int:
    """The largest transient inside one aten op: the running sum of the allocator's events during the op, at its
    highest, over where it ended (what the op returned stays live and both trackers count it)."""
    import bisect

    events = prof.profiler.kineto_results.events()
    mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    times = [t for t, _ in mem]
    worst = 0
    for e in events:
        if e.name() == "[memory]" or not e.name().startswith("aten::"):
            continue
        i, j = bisect.bisect_left(times, e.start_ns()), bisect.bisect_right(times, e.start_ns() + e.duration_ns())
        live = high = 0
        for _, nbytes in mem[i:j]:
            live += nbytes
            high = max(high, live)
        worst = max(worst, high - max(live, 0))
    return worst


def _optimizer_steps(trainer) -> int:
    opt = getattr(trainer.optimizer, "optim", trainer.optimizer)
    return sum(v.untyped_storage().nbytes() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() == 0)


def read_trace(cfg) -> Readings:
    """batchlab's and MemTracker's peak over the trace's update (FakeTensorMode, as ``estimate --trace`` runs
    it); nothing is allocated, so there is no allocator reading (0)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from batchlab.trace.patches import eager_branches
    from batchlab.trace.run import FakeTrainer, fake_mode

    with fake_mode():
        trainer = FakeTrainer(cfg, torch.device("cpu"))
        with eager_branches(True):
            trainer.update(micro_batches=1)
            reference = MemTracker()
            reference.track_external(trainer.raw_model, trainer.optimizer)
            tracker = tracker_for(trainer)
            with reference, tracker:
                trainer.update(listener=tracker)
        snap = tracker.snapshot()
        tracker.release()
        peak = reference.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        return Readings(batchlab=snap.peak_bytes, memtracker=peak, allocator=0, steps=_optimizer_steps(trainer),
                        phase=snap.peak_phase.value)


def read_update(trainer) -> Readings:
    """batchlab's, MemTracker's and the allocator's peak over one steady-state update of ``trainer``."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.profiler import ProfilerActivity, profile

    if trainer.updates_done == 0:
        trainer.update()  # AdamW creates its state in the first step
    held, steps = _held(trainer)
    reference = MemTracker()
    reference.track_external(trainer.raw_model, trainer.optimizer)
    tracker = tracker_for(trainer)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with reference, tracker:
            trainer.update(listener=tracker)
    snap = tracker.snapshot()
    tracker.release()
    peak = reference.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return Readings(batchlab=snap.peak_bytes, memtracker=peak, allocator=held + _profiled_peak(prof), steps=steps,
                    phase=snap.peak_phase.value, scratch=_kernel_scratch(prof))
