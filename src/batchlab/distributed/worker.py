"""One rank of a data-parallel measurement: the harness Trainer inside DistributedDataParallel.

Runs under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT in the environment).  The Trainer
already runs all but the last micro-batch under ``no_sync()`` and divides the loss by the global
useful-token count; this module adds DDP (``gradient_as_bucket_view=True``: gradients are views into
DDP's all-reduce buckets, one gradient copy less) and the communication hook, runs the measured update loop
(measure/loop.py, the one a one-process measurement runs) with the rank's seams and plan, and returns one
JSON-able dict per rank.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from batchlab.config import ConfigError, RunConfig, config_from_dict, to_jsonable
from batchlab.distributed import comm, engines, layouts
from batchlab.distributed.mesh import coordinates
from batchlab.distributed.traffic import TrafficCounter
from batchlab.measure.clock import Listeners
from batchlab.measure.device import torch_device
from batchlab.measure.harness import Trainer
from batchlab.measure.loop import LoopPlan, Seams, TimedUpdates, UpdateLoop
from batchlab.measure.memory import tracker_for
from batchlab.measure.options import MeasureOptions
from batchlab.measure.result import MeasuredMemory
from batchlab.measure.session import environment

# Test-only fault injection: "RANK:UPDATE:KIND" makes that rank fail just before that update (counting
# warmup updates from 0).  KIND: kill (SIGKILL itself, as the kernel's OOM killer does), raise, oom,
# hang (sleeps; its peers block in their next collective).
FAULT_ENV = "BATCHLAB_DDP_FAULT"
# DDP rebuilds its buckets (in gradient-ready order) in the second update: steady state starts after it
MIN_WARMUP = 2


@dataclass
class RankSpec:
    """What every rank needs; the launcher writes it as JSON, ``torchrun -m batchlab measure`` builds it."""

    config: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)  # MeasureOptions.to_dict()
    collective_timeout_s: float = 120.0  # a collective waiting longer than this raises instead of hanging


def env_ranks() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment."""
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))


def init(cfg: RunConfig, opts: MeasureOptions, collective_timeout_s: float) -> tuple[torch.device, str]:
    """Join torchrun's process group: gloo on CPU, nccl on CUDA (one GPU per local rank)."""
    _, _, local = env_ranks()
    device = torch_device(cfg, opts.torch_device)
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=collective_timeout_s))
    return device, backend


build = engines.build  # the engine of cfg.zero: DDP, DDP + ZeroRedundancyOptimizer, FSDP2


def _maybe_fail(rank: int, update: int) -> None:
    text = os.environ.get(FAULT_ENV)
    if not text:
        return
    r, u, kind = text.split(":")
    if int(r) != rank or int(u) != update:
        return
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "oom":
        raise torch.OutOfMemoryError("injected: out of memory")
    if kind == "hang":
        time.sleep(3600)
    raise RuntimeError(f"injected failure in rank {rank} at update {update}")


BUCKET_VIEW_NOTE = "DDP gradient_as_bucket_view=True: gradients are views into the all-reduce buckets"


class RankSeams(Seams):
    """A rank's seams in the update loop (measure/loop.py): the test-only fault injection before each update, the
    DDP communication monitor listening to every update, the traffic counter to the memory update's, and the
    engine's storages told to the tracker (distributed/engines.py)."""

    def __init__(self, monitor: comm.CommMonitor | None, traffic: TrafficCounter | None = None):
        self.monitor, self.traffic, self._counting = monitor, traffic, None

    def update(self, trainer: Trainer, listener) -> Any:
        _maybe_fail(trainer.rank, trainer.updates_done)
        return trainer.update(listener=listener)

    def listening(self, listener):
        listeners = [p for p in (listener, self.monitor, self._counting) if p is not None]
        if len(listeners) > 1:
            return Listeners(*listeners)
        return listeners[0] if listeners else None

    def tracker(self, trainer: Trainer, budget: int | None):
        tracker = tracker_for(trainer, budget)  # with a budget: a CPU stand-in for a smaller device
        engines.register_storages(tracker, trainer, self.monitor)
        tracker.reset()
        return tracker

    @contextlib.contextmanager
    def counting(self):
        if self.traffic is None:
            yield
            return
        with self.traffic:
            self._counting = self.traffic
            try:
                yield
            finally:
                self._counting = None


def rank_plan(cfg: RunConfig, opts: MeasureOptions, device: torch.device) -> LoopPlan:
    """A rank's plan: at least ``MIN_WARMUP`` updates, all before the memory update; a CPU budget enforced in the
    memory update only; no phase split on an asynchronous device yet (merge.py pairs each timed update's phases
    with its time, as on CPU)."""
    warmup = max(MIN_WARMUP, opts.warmup)
    return LoopPlan(warmup=warmup, settle=warmup, memory=opts.memory, steps=opts.steps if opts.timing else 0,
                    tracked_budget=cfg.memory_budget if device.type == "cpu" else None, budget_in_warmup=False)


def measure_memory(trainer: Trainer, monitor: comm.CommMonitor | None, budget: int | None = None,
                   traffic: TrafficCounter | None = None) -> MeasuredMemory:
    """Peak memory of one steady-state update on this rank (allocator stats on CUDA, storage tracker on CPU);
    ``traffic`` counts the same update's collectives."""
    plan = LoopPlan(warmup=0, settle=0, tracked_budget=budget, budget_in_warmup=False)
    mem = UpdateLoop(trainer, plan, RankSeams(monitor, traffic)).memory_update()
    return _noted(mem, monitor)


def _noted(mem: MeasuredMemory, monitor: comm.CommMonitor | None) -> MeasuredMemory:
    return mem if monitor is None else replace(mem, method=f"{mem.method}; {BUCKET_VIEW_NOTE}")


def _timed(t: TimedUpdates, monitor: comm.CommMonitor | None, accum: int) -> dict[str, Any]:
    out = dict(samples=t.samples, cpu_seconds=t.cpu_seconds, useful_tokens=t.useful_tokens,
               phase_seconds=t.phase_seconds, page_faults_per_update=t.page_faults_per_update,
               probe_seconds=t.probe_seconds)
    if monitor is None:  # FSDP2: collectives counted (traffic), not timed
        return out
    seen = monitor.updates[t.first_update:t.first_update + len(t.samples)]  # the monitor saw every update
    last = accum - 1
    return dict(out, comm=dict(calls=[u.calls for u in seen], rounds=[u.rounds for u in seen],
                          bytes=[u.bytes for u in seen], seconds=[u.seconds() for u in seen],
                          last_micro_batch_only=all(u.micro_batches == {last} for u in seen)))


def _describe(trainer: Trainer, backend: str, warmup: int) -> dict[str, Any]:
    rank, world, local = env_ranks()
    model = trainer.raw_model
    env = dict(environment(trainer.device), model=trainer.workload.description,
               parameters=sum(p.numel() for p in model.parameters()), ac_wrapped_layers=list(trainer.wrapped_layers))
    return dict(rank=rank, world=world, local_rank=local, host=socket.gethostname(), pid=os.getpid(),
                parameter_shard_bytes=engines.shard_bytes(model),
                environment=env, backend=backend, device=str(trainer.device), torch=torch.__version__,
                threads=torch.get_num_threads(), warmup=warmup,
                parameter_bytes=sum(p.numel() * p.element_size() for p in model.parameters()))


def run_rank(spec: RankSpec) -> dict[str, Any]:
    """Warm up, measure memory on one update, time ``steps`` more; the per-rank result as plain JSON."""
    cfg, opts = config_from_dict(spec.config), MeasureOptions.from_dict(spec.options)
    rank, world, _ = env_ranks()
    layout = cfg.parallel
    if layout.world_size != world:
        raise ConfigError("dp", f"the layout's {layout.text()} does not match the torchrun world size {world}")
    device, backend = init(cfg, opts, spec.collective_timeout_s)
    if layouts.applies(cfg):
        trainer, monitor = layouts.build(cfg, device, rank)
    else:
        trainer, monitor = build(cfg, device, rank, world, sync_every_micro_batch=opts.fsdp_sync_every_micro_batch)
    plan = rank_plan(cfg, opts, device)
    traffic = TrafficCounter() if opts.memory else None
    done = UpdateLoop(trainer, plan, RankSeams(monitor, traffic)).run()
    out = _describe(trainer, backend, plan.warmup)
    out["engine"] = (layouts.describe(cfg) if layouts.applies(cfg)
                     else engines.describe(cfg, opts.fsdp_sync_every_micro_batch))
    out["coordinates"] = coordinates(layout, rank)
    if done.memory is not None:
        out["memory"] = to_jsonable(_noted(done.memory, monitor))
        out["traffic"] = traffic.summary(cfg.accum)
    if done.time is not None:
        out.update(_timed(done.time, monitor, cfg.accum))
    return out


def gather(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's result, in rank order, on every rank."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    return everyone
