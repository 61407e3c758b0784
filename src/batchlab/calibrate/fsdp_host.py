"""FSDP2's host work per collective, measured on this machine between two forked processes.

Around each all-gather and reduce-scatter FSDP2 runs Python on the rank's main thread: its pre-/post-forward and
pre-/post-backward hooks, the all-gather's copy-in and copy-out into the unsharded parameters, the reduce-scatter's
copy-in and the division of the gradient shard, the swap between sharded and unsharded DTensor parameters (on a 2-D
mesh beside tensor parallelism, parameters sharded on both).  The link (calibrate/link.py) prices the message, not
this.  Here two ranks alternate updates of the calibration's dispatch-bound GPT without FSDP2 and with it
(``fully_shard`` per block and on the root, resharded after forward, over the two ranks), each beside the plain
model and beside the tensor-parallel plan on a size-1 TP dimension of a (2, 1) mesh; the figure is the main thread's
extra CPU time over the FSDP2 collectives the update issued (counted), the optimizer's step left out: its ops on the
DTensor parameters are priced per op (formula/dtensor.py), and counted here too they were paid twice.  CPU time:
waiting for the peer costs none.
Torch is imported inside the functions.
"""
from __future__ import annotations

import statistics
import time

from batchlab.calibrate.link import join, two_ranks

UPDATES = 20  # alternated updates of each of the four trainers per rank
WARMUP = 3
TIMEOUT_S = 90
KEYS = {"fsdp-hooks": ("plain", "fsdp"), "fsdp-tp-hooks": ("tp", "tp+fsdp")}  # figure -> (without FSDP2, with it)


def _trainers(mesh):
    import torch

    from batchlab.calibrate.dispatch import DISPATCH_GPT
    from batchlab.distributed import tensor_parallel as tp
    from batchlab.distributed.engines import fsdp_units
    from batchlab.measure.harness import Trainer
    from batchlab.models import build_workload

    cfg = DISPATCH_GPT

    class Sharded(Trainer):
        def clip_gradients(self, max_norm: float):  # on the local shards, as the layouts do (distributed/layouts.py)
            return tp.clip_grad_norm(self.raw_model.parameters(), max_norm)

    def make(plan: bool, fsdp: bool):
        torch.manual_seed(cfg.seed)
        wl = build_workload(cfg)
        if plan:
            for block in wl.model.blocks:
                tp.shard_block(block, cfg.model, mesh["tp"], False)
        wrap = (lambda m: (fsdp_units(cfg, mesh["dp"], [*m.blocks, m], True), m)[1]) if fsdp else None
        return (Sharded if plan or fsdp else Trainer)(cfg, torch.device("cpu"), workload=wl, wrap=wrap)

    return {"plain": make(False, False), "fsdp": make(False, True), "tp": make(True, False),
            "tp+fsdp": make(True, True)}


def _collectives(trainer) -> int:
    """FSDP2's all-gathers and reduce-scatters in one update (c10d ops it issues outside DTensor's dispatch)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._opname
            if func.namespace == "c10d" and ("allgather" in name or "reduce_scatter" in name):
                self.n += 1
            return func(*args, **(kwargs or {}))

    with Counting() as c:
        trainer.update()
    return c.n


def _timed_step(trainer) -> list[float]:
    """A one-item list that sums the main thread's CPU seconds in ``trainer``'s optimizer steps from now on."""
    spent, step = [0.0], trainer.optimizer.step

    def timed(*args, **kwargs):
        t = time.thread_time()
        try:
            return step(*args, **kwargs)
        finally:
            spent[0] += time.thread_time() - t

    trainer.optimizer.step = timed
    return spent


def _rank(rank: int, port: int, updates: int, results) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from batchlab.trace.sharded import _forget_meshes as forget_meshes

    join(rank, port, TIMEOUT_S)
    try:
        trainers = _trainers(init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp")))
        counts = {name: _collectives(tr) for name, tr in trainers.items()}
        stepping = {name: _timed_step(tr) for name, tr in trainers.items()}
        spent: dict[str, list[float]] = {name: [] for name in trainers}
        names = list(trainers)
        for i in range(WARMUP + updates):
            for name in (names if i % 2 == 0 else names[::-1]):
                t, stepped = time.thread_time(), stepping[name][0]
                trainers[name].update()
                if i >= WARMUP:  # the optimizer's step left out: its DTensor ops are priced per op (formula/dtensor.py)
                    spent[name].append(time.thread_time() - t - (stepping[name][0] - stepped))
        med = {name: statistics.median(v) for name, v in spent.items()}
        results.put((rank, {key: (med[b] - med[a]) / counts[b] for key, (a, b) in KEYS.items() if counts[b]}))
    finally:
        dist.destroy_process_group()
        forget_meshes()


def measure(updates: int = UPDATES) -> dict[str, float]:
    """{"fsdp-hooks": s, "fsdp-tp-hooks": s}: main-thread CPU seconds per FSDP2 collective, on a 1-D data-parallel
    mesh and on a 2-D one beside the tensor-parallel plan (the two ranks' mean), the optimizer's step left out;
    RuntimeError where two ranks cannot run here."""
    got = two_ranks(_rank, updates, "FSDP2 host-work timing", TIMEOUT_S)
    return {key: statistics.fmean(g[key] for g in got) for key in got[0] if all(key in g for g in got)}
