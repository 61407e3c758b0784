"""``batchlab.observe``: the harness's listeners around a user's own training loop.

    with batchlab.observe(model, optimizer, warmup=2) as obs:
        for tokens, targets in loader:
            with obs.update(tokens=int((targets != -100).sum())):   # one optimizer update
                loss = ...; obs.mark("backward"); loss.backward()
                obs.mark("optimizer"); optimizer.step(); optimizer.zero_grad()
    print(obs.measurement.memory.peak_bytes, obs.measurement.time.update_seconds_median)

The same discipline as ``batchlab measure``: update 1 is warmup, update 2 the memory update (live-storage
tracker on CPU/MPS, allocator statistics on CUDA; never timed), then the rest of the ``warmup``; every
later update is timed with the device synchronised around it.  ``memory_every=N`` adds memory updates
2 + N, 2 + 2N, ... (untimed; the figure is the highest peak among them, for runs whose batches change
shape).  The memory figure's ``method`` names the updates it comes from.  ``obs.mark(phase)`` (forward,
backward, optimizer) is optional and gives the per-phase split and the peak phase.  An out-of-memory inside
an update is recorded (outcome ``oom`` and its phase) and re-raised: it is your loop.  With ``notebook=``,
the uncontrolled factors are sampled between updates, never during one.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn as nn

from batchlab import host
from batchlab.measure.clock import PhaseClock, synchronizer
from batchlab.measure.devmem import CudaMemoryListener, from_snapshot
from batchlab.measure.memory import tracker_for
from batchlab.measure.oom_classify import OOMKind, classify_oom
from batchlab.measure.result import Draft, MeasuredMemory, MeasuredTime, Measurement, Outcome
from batchlab.config.phase import Phase

FACTOR_INTERVAL = 2.0  # seconds between /proc samples of an observed run (taken between updates)


class Observer:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, warmup: int = 2, memory: bool = True,
                 device: torch.device | str | None = None, config=None, global_batch: int | None = None,
                 memory_every: int | None = None, after_update: Callable[[], None] | None = None):
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"warmup must be >= 1 (the first update is never timed), got {warmup!r}")
        if memory_every is not None and (isinstance(memory_every, bool) or not isinstance(memory_every, int)
                                         or memory_every < 2):
            raise ValueError(f"memory_every must be >= 2 (every other update at most: memory updates are never "
                             f"timed) or None (update 2 only), got {memory_every!r}")
        self.model, self.optimizer, self.warmup, self.memory = model, optimizer, warmup, memory
        self.memory_every = memory_every
        self._memory_updates: list[int] = []  # 1-based indices of the updates the memory figures come from
        self._best_memory: MeasuredMemory | None = None
        self._after_update = after_update  # called after each update, outside its timed window
        if device is None:
            first = next(model.parameters(), None)
            device = first.device if first is not None else "cpu"
        self.device = torch.device(device)
        self.sync = synchronizer(self.device)
        self._async = self.device.type != "cpu"
        self.updates = 0
        self._samples: list[float] = []
        self._cpu: list[float] = []
        self._host = host.TimedUpdates(speed_probe=False, pretouch=False)  # faults per update; the user's allocator unchanged
        self._tokens: list[int] = []
        self._phases: dict[str, list[float]] = {}
        self._listener = None
        self._update_tokens: int | None = None
        self.record, self.notebook_id = None, None  # set by observe(notebook=...) at the end
        self.phase = Phase.DATA
        self._draft = Draft(config=config.to_dict() if config is not None else {},
                            global_batch=config.global_batch if config is not None else global_batch)
        self._result: Measurement | None = None

    @property
    def measurement(self) -> Measurement:
        """The result: final once the ``observe`` block has ended; before that, what was found so far."""
        return self._result if self._result is not None else self._draft.build()

    # -- used inside the user's update
    def mark(self, phase: Phase | str) -> None:
        """``forward``, ``backward`` or ``optimizer`` (``data`` is where each update starts)."""
        self.phase = Phase.parse("phase", phase)
        if self._listener is not None:
            self._listener.mark(self.phase)

    def count_tokens(self, n: int) -> None:
        """Add ``n`` useful tokens to the current update (for callers that learn them micro-batch by micro-batch)."""
        self._update_tokens = (self._update_tokens or 0) + int(n)

    @contextlib.contextmanager
    def update(self, tokens: int | None = None):
        """One optimizer update of the user's loop; ``tokens``: its useful (non-padding) tokens."""
        index, self.updates = self.updates, self.updates + 1
        self.phase = Phase.DATA
        self._update_tokens = tokens
        try:
            if self._is_memory_update(index):
                with self._memory_update():
                    yield self
            elif index < self.warmup + (1 if self.memory else 0):
                yield self
            else:
                with self._timed_update():
                    yield self
        except Exception as exc:
            kind = classify_oom(exc)
            if kind is not None:
                self._draft.outcome = Outcome.OOM_BUDGET if kind is OOMKind.BUDGET else Outcome.OOM
                self._draft.oom_phase = self.phase
                self._draft.outcome_detail = f"out of memory ({kind.value}) in {self.phase} of update {index + 1}"
            raise
        finally:
            self._listener = None
            if self._after_update is not None:
                self._after_update()

    def _is_memory_update(self, index: int) -> bool:
        """Update 2 (index 1), and with ``memory_every`` = N also updates 2 + N, 2 + 2N, ... past the warmup."""
        if not self.memory:
            return False
        if index == 1:
            return True
        return self.memory_every is not None and index > self.warmup and (index - 1) % self.memory_every == 0

    @contextlib.contextmanager
    def _memory_update(self):
        if self.device.type == "cuda":
            listener = CudaMemoryListener(self.device)
            listener.begin()
            self._listener = listener
            yield
            listener.mark("end")
            self._set_memory(listener.result(SimpleNamespace(raw_model=self.model, optimizer=self.optimizer)))
            return
        tracker = tracker_for(SimpleNamespace(raw_model=self.model, optimizer=self.optimizer))
        self._listener = tracker
        with tracker:
            yield
        self._set_memory(from_snapshot(tracker.snapshot()))
        tracker.release()  # its finalizers on the parameters' and optimizer's storages would live on with them

    def _set_memory(self, memory: MeasuredMemory) -> None:
        """Keep the memory update with the highest peak; the method names every memory update (provenance:
        the figures are theirs alone, and no timed update ran a memory measurement)."""
        self._memory_updates.append(self.updates)
        best = self._best_memory if self._best_memory is not None and \
            self._best_memory.peak_bytes >= memory.peak_bytes else memory
        self._best_memory = best
        which = (f"update {self._memory_updates[0]} only" if len(self._memory_updates) == 1 else
                 f"peak of updates {', '.join(map(str, self._memory_updates))}")
        self._draft.memory = replace(best, method=f"{best.method}; {which}, untimed")

    @contextlib.contextmanager
    def _timed_update(self):
        clock = PhaseClock(self.sync, sync_marks=not self._async)
        clock.start()
        clock.mark("data")
        self._listener = clock
        # the clock reads bracket the user's block: synchronise, read, run, synchronise, read
        self.sync()
        with self._host.counting():
            c0, t0 = time.process_time(), time.perf_counter()
            yield
            self.sync()
            t1, c1 = time.perf_counter(), time.process_time()
        clock.mark("end")
        self._samples.append(t1 - t0)
        self._cpu.append(c1 - c0)
        if self._update_tokens is not None:
            self._tokens.append(self._update_tokens)
        if not self._async:
            for k, v in clock.seconds.items():
                self._phases.setdefault(k, []).append(v)

    # -- result
    def finish(self) -> Measurement:
        m = self._draft
        # the user's process runs in its own allocator regime: stated, not changed (batchlab.host.regime)
        m.environment["allocator"] = host.state()
        if self._samples:
            m.environment["page_faults_per_update"] = self._host.page_faults_per_update()
            m.time = MeasuredTime(samples=list(self._samples), warmup=self.warmup,
                                  cpu_seconds=list(self._cpu) if self.device.type == "cpu" else [],
                                  phase_seconds={k: statistics.median(v) for k, v in self._phases.items()},
                                  phase_samples={k: list(v) for k, v in self._phases.items()})
            if self._tokens and len(self._tokens) == len(self._samples):
                per_update = statistics.fmean(self._tokens)
                m.useful_tokens_per_update = round(per_update)
                m.tokens_per_second = per_update / m.time.update_seconds_median
        elif m.outcome is Outcome.OK:
            m.warnings.append(f"no timed update: {self.updates} update(s) observed, the first {self.warmup} are "
                              f"warmup{' plus one memory update' if self.memory else ''}")
        self._result = m.build()
        return self._result


@contextlib.contextmanager
def observe(model: nn.Module, optimizer: torch.optim.Optimizer, *, warmup: int = 2, memory: bool = True,
            device: torch.device | str | None = None, config=None, global_batch: int | None = None,
            notebook=None, predict: bool = True, note: str = "", memory_every: int | None = None):
    """Record peak memory and update time over the updates of your own loop (see the module docstring).
    With ``notebook`` (a path or Notebook), an observed record is written at the end: ``obs.record``,
    ``obs.notebook_id``; ``config`` (a RunConfig describing the loop) gives the formula's prediction."""

    # what else uses the CPU, sampled between updates (never during one) until the record is made
    before = host.LoadSampler(interval=FACTOR_INTERVAL, thread=False).start() if notebook is not None else None
    obs = Observer(model, optimizer, warmup=warmup, memory=memory, device=device, config=config,
                   global_batch=global_batch, memory_every=memory_every,
                   after_update=before.poll if before is not None else None)
    try:
        yield obs
    finally:
        m = obs.finish()
        if notebook is not None:
            from batchlab.experiment.notebook import open_notebook
            from batchlab.experiment.observed import Source, finish, loop_settings

            settings, unmapped = loop_settings(config, global_batch, type(model).__name__, str(obs.device),
                                               type(optimizer).__name__)
            obs.record, obs.notebook_id = finish(Source.LOOP, settings, m, config, unmapped, before,
                                                 notebook=open_notebook(notebook), predict=predict, note=note)
