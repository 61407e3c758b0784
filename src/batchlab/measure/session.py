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

import torch

from batchlab import host
from batchlab.config import CompileMode, ConfigError, RunConfig, catalogue_key
from batchlab.measure import unexpressed
from batchlab.measure.device import torch_device
from batchlab.measure.loop import (PHASE_UPDATES, LoopHooks, LoopPlan, MemoryReader, Progress, Recorder,
                                   TimedUpdates, UpdateLoop)
from batchlab.measure.oom_classify import OOMKind, classify_oom
from batchlab.measure.options import MeasureOptions
from batchlab.measure.result import Draft, MeasuredTime, Measurement, Outcome
from batchlab.util.units import fmt_bytes



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
    m.warnings.extend(unexpressed.warnings(cfg))
    unsteady = host.warning() if device.type == "cpu" else None  # a non-glibc host allocator: said, not set
    if unsteady is not None:
        m.warnings.append(unsteady)
    rec = Recorder()
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


def _record_failure(m: Draft, exc: BaseException, rec: Recorder, budget: bool) -> None:
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
    """One measurement's plan for the update loop (measure/loop.py), and what it adds: the model's description,
    a compiled run's compile line, the result's records."""

    def __init__(self, cfg: RunConfig, opts: MeasureOptions, device: torch.device, progress: Progress | None):
        self.cfg, self.opts, self.device = cfg, opts, device
        self.progress = progress or (lambda done, total, label: None)
        # the budget the live-storage tracker enforces (CPU, MPS); on CUDA the allocator enforces it
        tracked_budget = cfg.memory_budget if device.type != "cuda" else None
        compiled = cfg.compile is not CompileMode.NONE
        self.plan = LoopPlan(
            # a compiled run: the first update compiles forward and backward, the second may recompile; both
            # untimed, and the memory update comes after any recompile
            warmup=max(opts.warmup, 2) if compiled else opts.warmup, settle=2 if compiled else 1,
            # with a budget on CPU/MPS the tracker must watch the steady-state update even if memory is not reported
            memory=opts.memory or tracked_budget is not None,
            steps=opts.steps if opts.timing else 0, phase_split=PHASE_UPDATES,
            tracked_budget=tracked_budget, reader=_reader(opts, device, compiled, tracked_budget),
            timeline=opts.timeline, first_note=" (compiling)" if compiled else "")

    def run(self, m: Draft, rec: Recorder) -> None:
        from batchlab.measure.harness import Trainer

        self.progress(0, self.plan.updates(self.device.type != "cpu"), "building the model")
        trainer = Trainer(self.cfg, self.device)
        m.environment["model"] = trainer.workload.description
        use_cache = getattr(getattr(trainer.raw_model, "config", None), "use_cache", None)
        m.environment["kv_cache"] = use_cache if isinstance(use_cache, bool) else None  # transformers' models only
        m.counted = trainer.workload.counted
        m.environment["parameters"] = sum(p.numel() for p in trainer.raw_model.parameters())
        m.environment["ac_wrapped_layers"] = list(trainer.wrapped_layers)
        watch = trainer.compiled  # models.compiled.CompileWatch, or None
        hooks = _CompileHooks(m, watch) if watch is not None else None
        loop = UpdateLoop(trainer, self.plan, progress=self.progress, hooks=hooks, rec=rec)
        try:
            loop.run()
        finally:  # what was measured before a failure stays in its record
            if watch is not None:
                watch.stop()
            if self.opts.memory:
                m.memory = loop.record.memory
            if self.opts.timeline:
                m.timeline = loop.record.timeline
            if loop.record.time is not None:
                self._time(m, loop.record.time, trainer.world)

    def _time(self, m: Draft, t: TimedUpdates, world: int) -> None:
        phases: dict[str, list[float]] = {}
        for seconds in t.phase_seconds + t.split_seconds:
            for k, v in seconds.items():
                phases.setdefault(k, []).append(v)
        m.environment["page_faults_per_update"] = t.page_faults_per_update  # 0 in the steady regime
        m.time = MeasuredTime(samples=t.samples, warmup=self.plan.warmup,
                              phase_seconds={k: statistics.median(v) for k, v in phases.items()},
                              phase_samples=phases, cpu_seconds=t.cpu_seconds if self.device.type == "cpu" else [],
                              probe_seconds=t.probe_seconds)
        per_update = statistics.fmean(t.useful_tokens) * world
        m.useful_tokens_per_update = round(per_update)
        m.tokens_per_second = per_update / m.time.update_seconds_median
        if (noisy := m.time.noise_warning()) is not None:
            m.warnings.append(noisy)


def _reader(opts: MeasureOptions, device: torch.device, compiled: bool, tracked_budget: int | None) -> MemoryReader:
    if compiled and device.type != "cuda":  # inductor's buffers: the allocator's events
        return MemoryReader.ALLOCATOR
    # the memory update's tracker records the timeline too (the timeline's recorder listens to it,
    # measure/timeline_tracker.py), so its figures are the memory probe's; not on CUDA (allocator history) nor
    # under a budget (its tracker enforces it)
    if opts.timeline and opts.memory and device.type != "cuda" and tracked_budget is None:
        return MemoryReader.TIMELINE
    return MemoryReader.TRACKER


class _CompileHooks(LoopHooks):
    """A compiled run's compile line, read at the loop's stage boundaries."""

    def __init__(self, m: Draft, watch):
        self.m, self.watch, self.settled_at, self.first_own = m, watch, 0, 0.0

    def first_update(self, wall_seconds: float) -> None:  # its wall-clock, compilation included
        self.m.environment["compile"] = {"first_update_wall_seconds": wall_seconds}
        # its own time: the compilations so far are its own (later updates' recompilations are not)
        self.first_own = max(wall_seconds - self.watch.seconds, 0.0)

    def settled(self) -> None:
        self.settled_at = self.watch.compiles

    def warmed(self) -> None:
        _compiled_warmup(self.m, self.watch, self.settled_at, self.first_own)

    def timed(self) -> None:
        _compiled_timed(self.m, self.watch)


def _compiled_warmup(m: Draft, watch, settled: int, first_own: float) -> None:
    """The compile line's figures: compilation seconds and the first update's own (wall-clock, untimed)."""
    info = m.environment["compile"]
    info.update(mode=watch.mode, backend=watch.backend, compile_seconds=watch.seconds, compilations=watch.compiles,
                first_update_seconds=first_own,
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
