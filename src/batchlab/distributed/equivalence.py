"""Semantics check for a change of ZeRO stage: after a few updates every engine's parameters equal DDP's.

    from batchlab.distributed.equivalence import same_parameters_as_ddp
    check = same_parameters_as_ddp(cfg_a, cfg_b)   # cfg_a/cfg_b differ in zero (and nothing that matters)
    check.equal, check.max_abs_difference, check.text

Both engines run in one job of ``cfg.dp`` ranks (gloo on CPU; forks of the pre-imported process, as a DP
measurement's ranks are, or ``torch.multiprocessing`` where there is none), one after the other (the same job
also tracks each one's memory and counts its collectives), from the same seed: same initial weights, same data
on each rank, same dropout masks.  Full
parameters are gathered (``DTensor.full_tensor()`` under FSDP2) and compared elementwise in fp32.  Sums
over ranks and the gradient norm are computed in a different order by each engine, so equality is up to
``ATOL`` (absolute, after two AdamW updates at lr 1e-4).
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from batchlab.config import ConfigError, Precision, RunConfig
from batchlab.distributed.forked import rank_env
from batchlab.host import free_port

ATOL = 1e-6  # fp32; engines differ by reduction order only, orders of magnitude below this (docs/cpu.md)


@dataclass(frozen=True)
class EquivalenceCheck:
    stages: tuple[int, ...]  # the stages compared with ZeRO-0 (DDP)
    updates: int
    max_abs_difference: dict[int, float]  # stage -> largest |parameter - DDP's parameter|
    tolerance: float = ATOL
    traffic: dict[int, dict] = field(default_factory=dict)  # stage -> one steady update's collectives
    memory: dict[int, dict] = field(default_factory=dict)  # stage -> that update's peak (tracker), phase, parts

    @property
    def equal(self) -> bool:
        return all(d <= self.tolerance for d in self.max_abs_difference.values())

    @property
    def text(self) -> str:
        diffs = ", ".join(f"ZeRO-{z} {d:.1e}" for z, d in self.max_abs_difference.items())
        verdict = "equal to DDP's" if self.equal else "DIFFERENT from DDP's"
        return (f"parameters after {self.updates} updates {verdict} (max |difference|: {diffs}; "
                f"tolerance {self.tolerance:g}, fp32)")


TIMEOUT_S = 600.0


def _rank(rank: int, world: int, port: int, cfgs: list[dict], updates: int, out: str) -> None:
    """A ``torch.multiprocessing`` rank (where no fork of the pre-imported process can be had)."""
    os.environ.update(rank_env(rank, world, port))
    _stages(cfgs, updates, out)


def forked_rank(folder: Path, request: dict, parent: int) -> int:
    """A rank forked from the pre-imported process (distributed/forked.py); it dies with that process."""
    _stages(request["cfgs"], request["updates"], request["out"])
    return 0


def _stages(cfgs: list[dict], updates: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from batchlab.config import config_from_dict
    from batchlab.distributed import engines
    from batchlab.distributed.traffic import TrafficCounter
    from batchlab.distributed.worker import init, measure_memory
    from batchlab.measure.options import MeasureOptions

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results = []
    for d in cfgs:
        cfg = config_from_dict(d)
        device, _ = init(cfg, MeasureOptions(), 120.0)
        trainer, monitor = engines.build(cfg, device, rank, world)
        for _ in range(updates):
            trainer.update(listener=monitor)
        full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu().clone()
                for n, p in trainer.raw_model.named_parameters()}
        # one more update, steady (DDP broadcasts its rebuilt bucket order once, in the second): its memory
        # as the measurement tracks it, and its collectives per micro-batch
        counter = TrafficCounter()
        mem = measure_memory(trainer, monitor, None, counter)
        peaks: list = [None] * world
        dist.all_gather_object(peaks, (mem.peak_bytes, mem.peak_phase.value, mem.breakdown))  # plain types for torch.load
        top = max(peaks, key=lambda p: p[0])
        results.append(dict(parameters=full, traffic=counter.summary(cfg.accum),
                            memory=dict(peak_bytes=top[0], peak_phase=top[1], breakdown=top[2],
                                        per_rank_peak_bytes=[p[0] for p in peaks])))
        dist.barrier()
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


def run_stages(cfgs: list[RunConfig], updates: int = 2) -> list[dict]:
    """Per config (same DP), in one job: ``parameters`` (full, by name) after ``updates`` updates; then one
    update more: its ``memory`` (live-storage tracker, the highest rank's peak) and ``traffic``
    (TrafficCounter.summary)."""
    import torch
    import torch.multiprocessing as mp

    from batchlab.distributed import forked
    from batchlab.measure.runner import child_env

    world, dicts = cfgs[0].dp, [c.to_dict() for c in cfgs]
    with tempfile.TemporaryDirectory(prefix="batchlab-equiv-") as tmp:
        out = str(Path(tmp) / "params.pt")
        ranks = forked.run(world, f"{__name__}:forked_rank", dict(cfgs=dicts, updates=updates, out=out), Path(tmp),
                           child_env(), TIMEOUT_S)
        if ranks is None:
            mp.start_processes(_rank, args=(world, free_port(), dicts, updates, out), nprocs=world,
                               start_method="spawn")
        elif ranks.timed_out or any(code != 0 for code in ranks.codes.values()):
            why = "timed out" if ranks.timed_out else f"exit statuses {ranks.codes}"
            raise RuntimeError(f"the ZeRO check's ranks failed ({why}): {ranks.log[-1500:]}")
        return torch.load(out)


def check_stages(base: RunConfig, stages: tuple[int, ...], updates: int = 2) -> EquivalenceCheck:
    """Each stage's parameters against ZeRO-0's (DDP) for ``base``'s shape, in one job."""
    return check_shapes((base,), stages, updates)[0]


def check_shapes(bases: tuple[RunConfig, ...], stages: tuple[int, ...], updates: int = 2
                 ) -> tuple[EquivalenceCheck, ...]:
    """check_stages for several shapes of the same DP, all in one job (one process start for all)."""
    for base in bases:
        if base.dp < 2:
            raise ConfigError("dp", "the ZeRO semantics check needs dp >= 2 (one rank has nothing to shard)")
        if base.precision is not Precision.FP32:
            raise ConfigError("precision", "the ZeRO semantics check compares fp32 runs")
        if base.dp != bases[0].dp:
            raise ConfigError("dp", "the shapes checked in one job share one DP size")
    every = (0, *stages)
    results = run_stages([base.replace(zero=z) for base in bases for z in every], updates)
    out = []
    for i in range(len(bases)):
        runs = dict(zip(every, results[i * len(every):(i + 1) * len(every)]))
        ref = runs[0]["parameters"]
        diffs = {z: max(float((runs[z]["parameters"][n] - ref[n]).abs().max()) for n in ref) for z in stages}
        out.append(EquivalenceCheck(tuple(stages), updates, diffs, traffic={z: runs[z]["traffic"] for z in every},
                                    memory={z: runs[z]["memory"] for z in every}))
    return tuple(out)


def same_parameters_as_ddp(cfg_a: RunConfig, cfg_b: RunConfig, updates: int = 2) -> EquivalenceCheck:
    """compare's semantics hook when a change moves the ZeRO stage: both sides' stages against DDP, in fp32."""
    other = cfg_a.diff(cfg_b)
    other.pop("zero", None)
    if other:
        raise ConfigError(next(iter(other)), "the ZeRO semantics check compares configs that differ only in zero")
    stages = tuple(sorted({cfg_a.zero, cfg_b.zero} - {0})) or (0,)
    return check_stages(cfg_a.replace(precision=Precision.FP32), stages, updates)
