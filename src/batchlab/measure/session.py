"""One measurement in this process: warmup, a separate memory update, timed updates; OOM caught.

Order of updates (``w`` = warmup, ``n`` = steps)::

    update 1            warmup (with a CPU memory budget: tracked, so an over-budget config stops early)
    update 2            memory update (tracker on CPU/MPS, allocator statistics on CUDA) — never timed; with a
                        timeline on CPU/MPS without a budget, the same tracked update also records it
    updates 3 .. w+1    the rest of the warmup
    (timeline only)     CUDA, or a CPU/MPS budget: 1 more, recorded as a memory timeline
                        (batchlab.measure.timeline_update) — never timed
    next n updates      timed: device synchronised around each, per-phase clock
    (CUDA/MPS only)     3 more updates with a synchronising phase clock for the per-phase split

Compiled (``--compile``): updates 1 and 2 are warm-up whatever ``warmup`` says (the first compiles forward and
backward, the second may recompile), their compilation seconds and the first update's own on the compile line;
the memory update comes after them and reads the CPU allocator's events (measure/allocmem.py); compilations after
them are counted and warned about.

Listeners that cost time (tracker, allocator reads, synchronising at phase marks on an asynchronous device)
never run inside the timed updates.
"""
from __future__ import annotations

import platform
import statistics
import time
from typing import Callable

import torch

from batchlab import host
from batchlab.config import CompileMode, ConfigError, RunConfig, catalogue_key
from batchlab.measure.clock import PhaseClock, synchronizer, timed
from batchlab.measure.device import torch_device
from batchlab.measure.devmem import CudaMemoryListener, from_snapshot
from batchlab.measure.memory import tracker_for
from batchlab.measure.oom_classify import OOMKind, classify_oom
from batchlab.measure.options import MeasureOptions
from batchlab.measure.result import Draft, MeasuredMemory, MeasuredTime, Measurement, Outcome
from batchlab.config.phase import Phase
from batchlab.util.units import fmt_bytes

# progress(done, total, label): called before the work starts and after every update
Progress = Callable[[int, int, str], None]
PHASE_UPDATES = 3  # synchronised phase-split updates on asynchronous devices




def parameter_bytes(cfg: RunConfig) -> int:
    """Bytes of the model's parameters and buffers, built on the meta device (nothing allocated)."""
    from batchlab.models import build_workload

    with torch.device("meta"):
        model = build_workload(cfg).model
    per = 2 if cfg.precision.value == "bf16" else None  # pure bf16: the harness casts the model
    seen: dict[int, int] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen[id(t)] = t.numel() * (per or t.element_size())
    return sum(seen.values())


def check_budget(cfg: RunConfig) -> None:
    if cfg.memory_budget is None:
        return
    need = parameter_bytes(cfg)
    if need > cfg.memory_budget:
        raise ConfigError("memory_budget", f"{fmt_bytes(cfg.memory_budget)} cannot hold the model's "
                                           f"parameters alone ({fmt_bytes(need)}, {need:,} bytes); "
                                           "give a larger budget or a smaller model")


def environment(device: torch.device) -> dict:
    import batchlab

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    elif device.type == "mps":
        name = "Apple MPS"
    else:
        name = host.cpu_name()
    return {"torch": torch.__version__, "python": platform.python_version(), "batchlab": batchlab.__version__,
            "platform": platform.platform(), "torch_device": str(device), "device_name": name,
            "threads": torch.get_num_threads(), "cuda": torch.version.cuda, "allocator": host.state()}


class _Recorder:
    """Remembers where the run is (stage, phase) for failure reports and forwards marks to the listener in use."""

    def __init__(self):
        self.stage, self.phase, self.inner = "setup", Phase.SETUP, None

    def use(self, stage: str, inner=None) -> "_Recorder":
        self.stage, self.phase, self.inner = stage, Phase.DATA, inner
        return self

    def mark(self, phase: Phase | str) -> None:
        self.phase = Phase(phase)
        if self.inner is not None:
            self.inner.mark(self.phase)


def run_inprocess(cfg: RunConfig, opts: MeasureOptions, progress: Progress | None = None) -> Measurement:
    if cfg.dp > 1:
        raise ConfigError("dp", f"one process measures DP = 1; DP = {cfg.dp} needs one process per rank: "
                                "use batchlab.run.measure (it launches them through batchlab.distributed)")
    device = torch_device(cfg, opts.torch_device)
    check_budget(cfg)
    m = Draft(config=cfg.to_dict(), global_batch=cfg.global_batch, environment=environment(device))
    here = catalogue_key(m.environment["device_name"]) if device.type == "cuda" else None
    if device.type == "cuda" and here != cfg.device:
        m.warnings.append(f"measured on {m.environment['device_name']} ({here or 'not in the catalogue'}), but "
                          f"--device is {cfg.device}: the formula figures beside it are for {cfg.device}")
    _check_compiled(cfg, opts, device)
    unsteady = host.warning() if device.type == "cpu" else None  # a non-glibc host allocator: said, not set
    if unsteady is not None:
        m.warnings.append(unsteady)
    rec = _Recorder()
    steps = _Steps(cfg, opts, device, progress)
    fraction_set = False
    # the budget is what refuses memory: tracked bytes on CPU/MPS, an allocator fraction on CUDA
    budget_binds = cfg.memory_budget is not None and device.type != "cuda"
    try:
        if device.type == "cuda" and cfg.memory_budget is not None:
            total = torch.cuda.get_device_properties(device).total_memory
            if cfg.memory_budget < total:
                # the caching allocator raises OutOfMemoryError past this fraction of the device's memory
                torch.cuda.set_per_process_memory_fraction(cfg.memory_budget / total, device)
                fraction_set = budget_binds = True
        steps.run(m, rec)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 — every failure becomes a recorded outcome
        _record_failure(m, exc, rec, budget=budget_binds)
    finally:
        if fraction_set:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    return m.build()


def _check_compiled(cfg: RunConfig, opts: MeasureOptions, device: torch.device) -> None:
    """What a compiled CPU run cannot give: the tracked-bytes budget and the tracker's timeline (inductor's buffers
    never pass the tracker's dispatch mode; its memory is read from the allocator instead)."""
    if cfg.compile is CompileMode.NONE or device.type == "cuda":
        return
    if cfg.memory_budget is not None:
        raise ConfigError("memory_budget", "a CPU budget is enforced by the live-storage tracker, which cannot see "
                                           "inside inductor's kernels: measure --compile without --memory-budget")
    if opts.timeline:
        raise ConfigError("timeline", "the CPU timeline is recorded by the live-storage tracker, which cannot see "
                                      "inside inductor's kernels: a compiled run's timeline is future work")


def _record_failure(m: Draft, exc: BaseException, rec: _Recorder, budget: bool) -> None:
    from batchlab.models.compiled import failure_text

    kind = classify_oom(exc)
    first_line = (str(exc).strip().splitlines() or [""])[0][:300]
    where = f"in {rec.phase} of the {rec.stage} update" if rec.stage != "setup" else "while building the model"
    if kind is None and isinstance(exc, torch._dynamo.exc.TorchDynamoException):
        m.outcome = Outcome.FAILED
        m.outcome_detail = f"torch.compile failed {where}: {failure_text(exc)[:300]}"
    elif kind is None:
        m.outcome = Outcome.FAILED
        m.outcome_detail = f"{type(exc).__name__} {where}: {first_line}"
    else:
        over_budget = kind is OOMKind.BUDGET or (budget and kind is OOMKind.DEVICE)
        m.outcome = Outcome.OOM_BUDGET if over_budget else Outcome.OOM
        m.outcome_detail = f"out of memory ({kind.value}) {where}: {first_line}"
    m.oom_phase = rec.phase if kind is not None else None
    m.environment["failed_stage"] = rec.stage


class _Steps:
    """The update sequence of one measurement (see the module docstring)."""

    def __init__(self, cfg: RunConfig, opts: MeasureOptions, device: torch.device, progress: Progress | None):
        self.cfg, self.opts, self.device = cfg, opts, device
        self.sync = synchronizer(device)
        self.progress = progress or (lambda done, total, label: None)
        self.async_device = device.type != "cpu"
        # a compiled run: the first update compiles forward and backward, the second may recompile; both untimed
        self.compiled = cfg.compile is not CompileMode.NONE
        self.warmup = max(opts.warmup, 2) if self.compiled else opts.warmup
        self.total = (self.warmup + (1 if self._memory_update else 0) + (opts.steps if opts.timing else 0)
                      + (PHASE_UPDATES if opts.timing and self.async_device else 0)
                      + (1 if opts.timeline and not self._timeline_in_memory else 0))
        self.done = 0
        self.timeline = None  # recorded by the memory update (``_timeline_in_memory``)

    @property
    def _timeline_in_memory(self) -> bool:
        """The memory update's live-storage tracker records the timeline too (one tracked update, not two):
        the timeline's recorder listens to the same tracker (measure/timeline_tracker.py), so its figures are the memory
        probe's.  Not on CUDA (allocator history) nor under a budget (its tracker enforces it)."""
        return self.opts.timeline and self.opts.memory and self.device.type != "cuda" and self._tracked_budget is None

    @property
    def _memory_update(self) -> bool:
        # with a budget on CPU/MPS the tracker must watch the steady-state update even if memory is not reported
        return self.opts.memory or self._tracked_budget is not None

    @property
    def _tracked_budget(self) -> int | None:
        """The budget the live-storage tracker enforces (CPU, MPS); on CUDA the allocator enforces it."""
        return self.cfg.memory_budget if self.device.type != "cuda" else None

    def _start(self, label: str) -> str:
        # reported before each update too, so an isolated run that dies says which update it was in
        self.progress(self.done, self.total, label)
        return label

    def _tick(self, label: str) -> None:
        self.done += 1
        self.progress(self.done, self.total, label)

    def run(self, m: Draft, rec: _Recorder) -> None:
        from batchlab.measure.harness import Trainer

        self.progress(0, self.total, "building the model")
        trainer = Trainer(self.cfg, self.device)
        m.environment["model"] = trainer.workload.description
        use_cache = getattr(getattr(trainer.raw_model, "config", None), "use_cache", None)
        m.environment["kv_cache"] = use_cache if isinstance(use_cache, bool) else None  # transformers' models only
        m.counted = trainer.workload.counted
        m.environment["parameters"] = sum(p.numel() for p in trainer.raw_model.parameters())
        m.environment["ac_wrapped_layers"] = list(trainer.wrapped_layers)
        watch = trainer.compiled  # models.compiled.CompileWatch, or None
        try:
            self._updates(trainer, rec, m, watch)
        finally:
            if watch is not None:
                watch.stop()

    def _updates(self, trainer, rec: _Recorder, m: Draft, watch) -> None:
        before_memory = 2 if watch is not None else 1  # a compiled run's memory update comes after any recompile
        for i in range(1, before_memory + 1):
            self._warmup(trainer, rec, i, m if watch is not None and i == 1 else None)
        settled = watch.compiles if watch is not None else 0
        if self._memory_update:
            memory = self._memory(trainer, rec)
            if self.opts.memory:
                m.memory = memory
        for i in range(before_memory + 1, self.warmup + 1):
            self._warmup(trainer, rec, i)
        if watch is not None:
            _compiled_warmup(m, watch, settled)
        if self.opts.timeline:
            m.timeline = self.timeline if self._timeline_in_memory else self._timeline(trainer, rec)
        if self.opts.timing:
            self._timing(trainer, rec, m)
        if watch is not None:
            _compiled_timed(m, watch)

    def _warmup(self, trainer, rec: _Recorder, i: int, compiling: Draft | None = None) -> None:
        label = self._start(f"warmup {i}/{self.warmup}" + (" (compiling)" if compiling is not None else ""))
        start = time.perf_counter()
        if i == 1 and self._tracked_budget is not None:
            self._tracked(trainer, rec.use(label))  # lazy optimizer state is created here: watch it
        else:
            trainer.update(listener=rec.use(label))
        if compiling is not None:  # its wall-clock, compilation included (apart later)
            compiling.environment["compile"] = {"first_update_wall_seconds": time.perf_counter() - start}
        self._tick(label)

    def _tracked(self, trainer, rec: _Recorder):
        tracker = tracker_for(trainer, budget=self._tracked_budget)
        rec.inner = tracker
        with tracker:
            trainer.update(listener=rec)
        return tracker.snapshot()

    def _memory(self, trainer, rec: _Recorder) -> MeasuredMemory:
        rec.use(self._start("memory"))
        if self.compiled and self.device.type != "cuda":  # inductor's buffers: the allocator's events
            from batchlab.measure.allocmem import AllocatorProbe

            with AllocatorProbe(trainer) as probe:
                trainer.update(listener=rec.use("memory", probe))
            result = probe.result()
        elif self.device.type == "cuda":
            listener = CudaMemoryListener(self.device)
            listener.begin()
            trainer.update(listener=rec.use("memory", listener))
            listener.mark("end")
            result = listener.result(trainer)
        elif self._timeline_in_memory:
            from batchlab.measure.timeline_update import recorded

            self.timeline, snap = recorded(self.cfg, trainer, lambda tracker: rec.use("memory", tracker))
            result = from_snapshot(snap)
        else:
            result = from_snapshot(self._tracked(trainer, rec))
        self._tick("memory")
        return result

    def _timeline(self, trainer, rec: _Recorder):
        """One more untimed update recorded as a memory timeline, in this (possibly isolated) process."""
        from batchlab.measure.timeline_update import record

        rec.use(self._start("timeline"))
        timeline = record(self.cfg, trainer=trainer)
        self._tick("timeline")
        return timeline

    def _timing(self, trainer, rec: _Recorder, m: Draft) -> None:
        # CPU: the phase clock's sync is a no-op, so the split comes from the timed updates themselves
        clock = PhaseClock(self.sync, sync_marks=not self.async_device)
        samples, cpu, useful = [], [], []
        phases: dict[str, list[float]] = {}
        # the heap pre-touched; on CPU the speed probe read before each timed update (which of this host's speeds
        # the update ran at); page faults counted per update
        around = host.TimedUpdates(speed_probe=not self.async_device)
        for i in range(self.opts.steps):
            label = self._start(f"timed {i + 1}/{self.opts.steps}")
            around.read_probe()
            with around.counting():
                result, wall, cpu_s = timed_update(trainer, clock, rec.use(label, clock), self.sync)
            samples.append(wall)
            cpu.append(cpu_s)
            useful.append(result.useful_tokens)
            if not self.async_device:
                _collect(phases, clock.seconds)
            self._tick(label)
        m.environment["page_faults_per_update"] = around.page_faults_per_update()  # 0 in the steady regime
        if self.async_device:
            split = PhaseClock(self.sync, sync_marks=True)
            for i in range(PHASE_UPDATES):
                label = self._start(f"phase split {i + 1}/{PHASE_UPDATES}")
                split.start()
                trainer.update(listener=rec.use(label, split))
                _collect(phases, split.seconds)
                self._tick(label)
        m.time = MeasuredTime(samples=samples, warmup=self.warmup,
                              phase_seconds={k: statistics.median(v) for k, v in phases.items()},
                              phase_samples=phases, cpu_seconds=cpu if self.device.type == "cpu" else [],
                              probe_seconds=around.probe_seconds)
        per_update = statistics.fmean(useful) * trainer.world
        m.useful_tokens_per_update = round(per_update)
        m.tokens_per_second = per_update / m.time.update_seconds_median
        if (noisy := m.time.noise_warning()) is not None:
            m.warnings.append(noisy)


def _compiled_warmup(m: Draft, watch, settled: int) -> None:
    """The compile line's figures: compilation seconds and the first update's own (wall-clock, untimed)."""
    info = m.environment["compile"]
    info.update(mode=watch.mode, backend=watch.backend, compile_seconds=watch.seconds, compilations=watch.compiles,
                first_update_seconds=max(info["first_update_wall_seconds"] - watch.seconds, 0.0),
                recompilations_timed=0, provenance="wall-clock (dynamo's compile "
                "callbacks; excluded from the medians)")
    info["recompilations_after_second_update"] = watch.compiles - settled  # the memory update and the rest of the warm-up
    info["_warm_count"] = watch.compiles


def _compiled_timed(m: Draft, watch) -> None:
    """Recompilations during the timed updates (flagged: their time is in the medians) and graph breaks."""
    from batchlab.models.compiled import break_summary

    info = m.environment["compile"]
    during = watch.compiles - info.pop("_warm_count")
    info["recompilations_timed"] = during
    info["graph_breaks"], info["graph_break_reasons"] = break_summary(watch.graph_breaks())
    watch.stop()
    if during:
        m.warnings.append(f"torch.compile recompiled {during} time(s) during the timed updates: those updates' "
                          "times include compiling (a changing shape, a Python value in a guard, or dynamo's "
                          "cache limit); see the compile line")
    after = info["recompilations_after_second_update"]
    if after:
        m.warnings.append(f"torch.compile recompiled {after} time(s) after the first two updates "
                          "(in the memory update or the rest of the warm-up)")


def timed_update(trainer, clock: PhaseClock, listener, sync):
    """One timed update (the benchmark's "timed loop" calls exactly this): (result, wall s, CPU s)."""
    clock.start()
    return timed(lambda: trainer.update(listener=listener), sync)


def _collect(phases: dict[str, list[float]], seconds: dict[str, float]) -> None:
    for k, v in seconds.items():
        phases.setdefault(k, []).append(v)
