"""The measured update loop: warm-up, one memory update, timed updates.  One loop for a one-process measurement
(measure/session.py) and for each rank of a distributed one (distributed/worker.py).

What differs between them is a parameter, never a copy:

* the plan (``LoopPlan``): how many updates of each kind, which budget the live-storage tracker enforces, how
  the memory update reads memory;
* the seams (``Seams``): how one update is called (a rank's test-only fault injection), what listens besides
  the loop's own listeners (a rank's DDP communication monitor, its traffic counter during the memory update)
  and what the tracker must be told before it counts (an engine's buckets and resizable storages);
* the hooks (``LoopHooks``): what a caller reads at the loop's stage boundaries (a compiled run's compilations).

Order of updates::

    updates 1 .. settle      warm-up; the steady state starts after them (AdamW's lazy state, a compiled run's
                             recompile, DDP's bucket rebuild); with a tracked budget the first is tracked too
    memory update            never timed (tracker, allocator statistics or allocator events)
    the rest of the warm-up
    (timeline only)          one more, recorded as a memory timeline, unless the memory update recorded it
    n timed updates          device synchronised around each, per-phase clock
    phase split              on an asynchronous device: updates with a synchronising phase clock

Listeners that cost time (tracker, allocator reads, synchronising at phase marks on an asynchronous device)
never run inside the timed updates.
"""
from __future__ import annotations

import contextlib
import enum
import time
from dataclasses import dataclass, field
from typing import Callable

from batchlab import host
from batchlab.config.phase import Phase
from batchlab.measure.clock import PhaseClock, synchronizer, timed
from batchlab.measure.devmem import CudaMemoryListener, from_snapshot
from batchlab.measure.memory import tracker_for
from batchlab.measure.result import MeasuredMemory

# progress(done, total, label): called before the work starts and after every update
Progress = Callable[[int, int, str], None]
PHASE_UPDATES = 3  # synchronised phase-split updates on asynchronous devices (one process)


class MemoryReader(enum.Enum):
    """How the memory update reads memory on CPU/MPS (on CUDA: the allocator's statistics)."""

    TRACKER = "tracker"  # every storage created and freed
    ALLOCATOR = "allocator"  # compiled CPU: inductor's buffers never pass the tracker, the allocator's events do
    TIMELINE = "timeline"  # the tracker, with the timeline's recorder listening to it (one tracked update, not two)


@dataclass(frozen=True)
class LoopPlan:
    warmup: int  # untimed updates (the memory and timeline updates not counted)
    settle: int = 1  # of them, those before the memory update
    memory: bool = True  # one untimed update reads memory
    steps: int = 0  # timed updates
    phase_split: int = 0  # on an asynchronous device: synchronised phase-split updates after the timed ones
    tracked_budget: int | None = None  # bytes the live-storage tracker enforces (CPU/MPS; the allocator on CUDA)
    budget_in_warmup: bool = True  # the first update is tracked under that budget (lazy optimizer state made there)
    reader: MemoryReader = MemoryReader.TRACKER
    timeline: bool = False  # a memory timeline (recorded by the memory update when ``reader`` is TIMELINE)
    first_note: str = ""  # said beside the first update's label (" (compiling)")

    def updates(self, async_device: bool) -> int:
        return (self.warmup + (1 if self.memory else 0) + self.steps
                + (self.phase_split if self.steps and async_device else 0)
                + (1 if self.timeline and self.reader is not MemoryReader.TIMELINE else 0))


class Recorder:
    """Remembers where the run is (stage, phase) for failure reports and forwards marks to the listener in use."""

    def __init__(self):
        self.stage, self.phase, self.inner = "setup", Phase.SETUP, None

    def use(self, stage: str, inner=None) -> "Recorder":
        self.stage, self.phase, self.inner = stage, Phase.DATA, inner
        return self

    def mark(self, phase: Phase | str) -> None:
        self.phase = Phase(phase)
        if self.inner is not None:
            # as marked: a rank's listeners keep plain names in records that cross processes (unpickled
            # without batchlab's classes)
            self.inner.mark(phase)


class Seams:
    """One process's seams: the harness's update as it is, nothing else listening, the tracker as built.
    A rank's (distributed/worker.py) overrides them."""

    def update(self, trainer, listener):
        return trainer.update(listener=listener)

    def listening(self, listener):
        """The listener an update is given, from the loop's own (None: none of its own)."""
        return listener

    def tracker(self, trainer, budget: int | None):
        return tracker_for(trainer, budget=budget)

    def counting(self):
        """Around the memory update (a rank counts its collectives there)."""
        return contextlib.nullcontext()


class LoopHooks:
    """Called at the loop's stage boundaries; no-ops here."""

    def first_update(self, wall_seconds: float) -> None:
        """After the first update, with its wall-clock (compilation included)."""

    def settled(self) -> None:
        """After the updates before the memory update."""

    def warmed(self) -> None:
        """After the whole warm-up."""

    def timed(self) -> None:
        """At the end: after the timed updates and the phase split, if any."""


@dataclass
class TimedUpdates:
    samples: list[float] = field(default_factory=list)  # wall seconds per timed update
    cpu_seconds: list[float] = field(default_factory=list)
    useful_tokens: list[int] = field(default_factory=list)
    phase_seconds: list[dict] = field(default_factory=list)  # per timed update (empty where marks are not synced)
    split_seconds: list[dict] = field(default_factory=list)  # per phase-split update
    page_faults_per_update: float | None = None
    probe_seconds: list = field(default_factory=list)
    first_update: int = 0  # updates this loop ran before the first timed one


@dataclass
class LoopRecord:
    memory: MeasuredMemory | None = None
    timeline: object = None
    time: TimedUpdates | None = None


class UpdateLoop:
    """The update sequence of one measurement (see the module docstring)."""

    def __init__(self, trainer, plan: LoopPlan, seams: Seams | None = None, progress: Progress | None = None,
                 hooks: LoopHooks | None = None, rec: Recorder | None = None):
        self.trainer, self.plan = trainer, plan
        self.seams, self.hooks, self.rec = seams or Seams(), hooks or LoopHooks(), rec or Recorder()
        self.device = trainer.device
        self.sync = synchronizer(self.device)
        self.async_device = self.device.type != "cpu"
        self.progress = progress or (lambda done, total, label: None)
        self.total = plan.updates(self.async_device)
        self.done = 0
        self.record = LoopRecord()

    def run(self) -> LoopRecord:
        plan = self.plan
        for i in range(1, plan.settle + 1):
            self._warmup(i)
        self.hooks.settled()
        if plan.memory:
            self.record.memory = self.memory_update()
        for i in range(plan.settle + 1, plan.warmup + 1):
            self._warmup(i)
        self.hooks.warmed()
        if plan.timeline and plan.reader is not MemoryReader.TIMELINE:
            self.record.timeline = self._timeline()
        if plan.steps:
            self.record.time = self._timing()
        self.hooks.timed()
        return self.record

    def _start(self, label: str) -> str:
        # reported before each update too, so an isolated run that dies says which update it was in
        self.progress(self.done, self.total, label)
        return label

    def _tick(self, label: str) -> None:
        self.done += 1
        self.progress(self.done, self.total, label)

    def _listener(self, label: str, inner=None):
        return self.rec.use(label, self.seams.listening(inner))

    def _update(self, label: str, inner=None):
        return self.seams.update(self.trainer, self._listener(label, inner))

    def _warmup(self, i: int) -> None:
        label = self._start(f"warmup {i}/{self.plan.warmup}" + (self.plan.first_note if i == 1 else ""))
        start = time.perf_counter()
        if i == 1 and self.plan.budget_in_warmup and self.plan.tracked_budget is not None:
            self._tracked(label)  # lazy optimizer state is created here: watch it
        else:
            self._update(label)
        if i == 1:
            self.hooks.first_update(time.perf_counter() - start)
        self._tick(label)

    def _tracked(self, label: str):
        tracker = self.seams.tracker(self.trainer, self.plan.tracked_budget)
        with tracker:
            self._update(label, tracker)
        return tracker.snapshot()

    def memory_update(self) -> MeasuredMemory:
        """One untimed update that reads memory: the allocator's statistics on CUDA, else as the plan says."""
        label = self._start("memory")
        self.rec.use(label)
        with self.seams.counting():
            if self.device.type == "cuda":
                listener = CudaMemoryListener(self.device)
                listener.begin()
                self._update(label, listener)
                result = listener.result(self.trainer)
            elif self.plan.reader is MemoryReader.ALLOCATOR:
                from batchlab.measure.allocmem import AllocatorProbe

                with AllocatorProbe(self.trainer) as probe:
                    self._update(label, probe)
                result = probe.result()
            elif self.plan.reader is MemoryReader.TIMELINE:
                from batchlab.measure.timeline_update import recorded

                self.record.timeline, snap = recorded(self.trainer.cfg, self.trainer,
                                                      lambda tracker: self.rec.use(label, tracker))
                result = from_snapshot(snap)
            else:
                result = from_snapshot(self._tracked(label))
        self._tick(label)
        return result

    def _timeline(self):
        """One more untimed update recorded as a memory timeline, in this (possibly isolated) process."""
        from batchlab.measure.timeline_update import record

        label = self._start("timeline")
        self.rec.use(label)
        timeline = record(self.trainer.cfg, trainer=self.trainer)
        self._tick(label)
        return timeline

    def _timing(self) -> TimedUpdates:
        # CPU: the phase clock's sync is a no-op, so the split comes from the timed updates themselves
        clock = PhaseClock(self.sync, sync_marks=not self.async_device)
        out = TimedUpdates(first_update=self.done)
        # the heap pre-touched; on CPU the speed probe read before each timed update (which of this host's speeds
        # the update ran at); page faults counted per update
        around = host.TimedUpdates(speed_probe=not self.async_device)
        for i in range(self.plan.steps):
            label = self._start(f"timed {i + 1}/{self.plan.steps}")
            around.read_probe()
            with around.counting():
                result, wall, cpu_s = timed_update(self.trainer, clock, self._listener(label, clock), self.sync,
                                                   self.seams.update)
            out.samples.append(wall)
            out.cpu_seconds.append(cpu_s)
            out.useful_tokens.append(result.useful_tokens)
            out.phase_seconds.append(dict(clock.seconds))
            self._tick(label)
        out.page_faults_per_update = around.page_faults_per_update()  # 0 in the steady regime
        out.probe_seconds = around.probe_seconds
        if self.async_device:
            split = PhaseClock(self.sync, sync_marks=True)
            for i in range(self.plan.phase_split):
                label = self._start(f"phase split {i + 1}/{self.plan.phase_split}")
                split.start()
                self._update(label, split)
                out.split_seconds.append(dict(split.seconds))
                self._tick(label)
        return out


def timed_update(trainer, clock: PhaseClock, listener, sync, update=None):
    """One timed update (the benchmark's "timed loop" calls exactly this): (result, wall s, CPU s)."""
    clock.start()
    update = update or Seams().update
    return timed(lambda: update(trainer, listener), sync)
