"""What the measured update-time differences between tensor / pipeline layouts are made of, on forked gloo ranks.

The time ratios of ``parallel_accuracy.py`` put whole updates side by side; this script takes them apart, each
comparison in processes that hold both layouts at once and alternate their updates (A B, B A, ...: a slow spell of
the shared machine falls on both sides of a pair):

1. DTensor's host work, without any message: the built-in GPT plain, under the tensor-parallel plan and under the
   sequence-parallel plan (distributed/tensor_parallel.py) on a 1-rank mesh, where DTensor skips every collective
   but runs every op through its own dispatch.  One process, one thread, forward + backward of 4 micro-batches.
2. The messages: TP2 and TP2 + SP on 2 ranks, every c10d collective of one update counted by kind (calls, bytes)
   beside the formula's catalogue (``formula.pipeline.tp_collectives``), and the paired update times.
3. The schedules: GPipe, 1F1B and interleaved 1F1B (2 chunks) on 2 ranks, each rank's update split into the
   stages' forward / backward chunks (compute), issuing the point-to-point ops, waiting for them, and the rest,
   with the p2p ops counted beside the formula's sends (``formula.pipeline.pp_sends``).

    python benchmarks/parallel_time_parts.py          # writes docs/accuracy/parallel-time-parts.md
"""
from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from page import publish  # noqa: E402

BASE = ["estimate", "--seq", "64", "--micro-batch", "4", "--accum", "4"]
PAIRS = 8  # alternated updates per layout
MS = 1e3


def _config(flags: str):
    from batchlab.cli.common import config_from_command

    return config_from_command(BASE + flags.split())


# -- 1. DTensor's host work on a 1-rank mesh


def host_work(queue) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.utils._python_dispatch import TorchDispatchMode

    from batchlab.distributed import tensor_parallel as tp
    from batchlab.models import build_workload

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    cfg = _config("")

    def make(sp):
        torch.manual_seed(0)
        w = build_workload(cfg)
        if sp is not None:
            for block in w.model.blocks:
                tp.shard_block(block, cfg.model, mesh, sp)
            tp.shard_boundaries(w.model, cfg.model, sp, mesh)
        return w

    models = {"plain": make(None), "TP plan": make(False), "SP plan": make(True)}
    gen = torch.Generator().manual_seed(0)
    batches = [models["plain"].make_batch(gen, cfg.micro_batch, cfg.seq, torch.device("cpu")) for _ in range(cfg.accum)]

    def update(name):
        w = models[name]
        for x, y in batches:
            with loss_parallel() if name != "plain" else contextlib.nullcontext():
                w.loss_sum(w.model, x, y).backward()

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.dtensor = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            flat = list(args) + list((kwargs or {}).values())
            self.dtensor += any(type(t).__name__ == "DTensor" for t in flat)
            return func(*args, **(kwargs or {}))

    counts = {}
    for name in models:
        update(name)
        with Ops() as ops:
            update(name)
        counts[name] = ops.dtensor
    times = {n: [] for n in models}
    for k in range(PAIRS):
        for n in (list(models) if k % 2 == 0 else list(models)[::-1]):
            t = time.perf_counter()
            update(n)
            times[n].append(time.perf_counter() - t)
    queue.put((times, counts))
    dist.destroy_process_group()


# -- 2. and 3. two ranks holding several layouts


def _ranks(target, layouts: dict[str, str], port: int) -> list:
    import torch.multiprocessing as mp

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, layouts, q, port)) for r in range(2)]
    for p in procs:
        p.start()
    out = sorted(q.get(timeout=1200) for _ in procs)
    for p in procs:
        p.join()
    return out


def _init(rank: int, port: int):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")


def _alternate(trainers: dict, before=lambda name: None) -> dict[str, list[float]]:
    import torch.distributed as dist

    walls = defaultdict(list)
    names = list(trainers)
    for k in range(PAIRS):
        for n in (names if k % 2 == 0 else names[::-1]):
            before(n)
            dist.barrier()
            t = time.perf_counter()
            trainers[n].update()
            walls[n].append(time.perf_counter() - t)
    return dict(walls)


def messages_rank(rank: int, layouts: dict[str, str], queue, port: int) -> None:
    import math

    import torch
    import torch.distributed as dist
    from torch.profiler import profile

    from batchlab.distributed import layouts as built

    _init(rank, port)
    kinds = {"_c10d_functional::all_reduce": "all_reduce", "_c10d_functional::all_gather_into_tensor": "all_gather",
             "_c10d_functional::reduce_scatter_tensor": "reduce_scatter"}

    def collectives(trainer) -> dict[str, tuple[int, int]]:
        """Every functional collective of one update, by kind (calls, bytes), as the profiler records them at the
        dispatcher: those DTensor issues inside its own dispatch (loss_parallel's) included, which a dispatch mode
        does not see (its handler runs with the mode off)."""
        with profile(record_shapes=True) as prof:
            trainer.update()
        seen = defaultdict(lambda: [0, 0])
        for e in prof.events():
            if (kind := kinds.get(e.name)) and e.input_shapes:
                nbytes = math.prod(e.input_shapes[0]) * 4  # fp32 throughout
                # as nccl-tests size them: the gathered output of an all-gather, the input otherwise
                seen[kind][0] += 1
                seen[kind][1] += nbytes * (2 if kind == "all_gather" else 1)
        return {k: tuple(v) for k, v in seen.items()}

    trainers = {n: built.build(_config(f), torch.device("cpu"), rank)[0] for n, f in layouts.items()}
    counted = {}
    for n, tr in trainers.items():
        tr.update()
        tr.update()
        counted[n] = collectives(tr)
    queue.put((rank, _alternate(trainers), counted))
    dist.destroy_process_group()


def schedule_rank(rank: int, layouts: dict[str, str], queue, port: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining.schedules as schedules

    from batchlab.distributed import layouts as built

    _init(rank, port)
    spent = defaultdict(float)
    p2p = defaultdict(int)
    current = {"name": ""}

    def timed(fn, part):
        def wrapped(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[(current["name"], part)] += time.perf_counter() - t
        return wrapped

    trainers = {}
    for name, flags in layouts.items():
        tr = built.build(_config(flags), torch.device("cpu"), rank)[0]
        for st in tr.stages:
            st.forward_one_chunk = timed(st.forward_one_chunk, "compute")
            st.backward_one_chunk = timed(st.backward_one_chunk, "compute")
        trainers[name] = tr
    issue, wait = schedules._batch_p2p, schedules._wait_batch_p2p

    def counted_issue(ops, *args, **kwargs):
        p2p[current["name"]] += len(ops)
        return issue(ops, *args, **kwargs)

    schedules._batch_p2p = timed(counted_issue, "issuing p2p ops")
    schedules._wait_batch_p2p = timed(wait, "waiting for p2p ops")
    for name, tr in trainers.items():
        current["name"] = name
        tr.update()
        tr.update()
    spent.clear()
    p2p.clear()
    walls = _alternate(trainers, lambda n: current.update(name=n))
    queue.put((rank, walls, {f"{n}|{part}": s / PAIRS for (n, part), s in spent.items()},
               {n: c / PAIRS for n, c in p2p.items()}))
    dist.destroy_process_group()


def _paired(a: list[float], b: list[float]) -> float:
    return statistics.median(y / x for x, y in zip(a, b))


def _slowest(ranks: list, name: str) -> list[float]:
    return [max(xs) for xs in zip(*(r[1][name] for r in ranks))]


def main() -> int:
    import torch.multiprocessing as mp

    from batchlab.formula.pipeline import pp_sends, tp_collectives
    from batchlab.formula.ranks import shares

    load0 = os.getloadavg()[0]
    print("The built-in tiny GPT (4 layers, hidden 128, 4 heads, vocabulary 512), micro-batch 4 x sequence 64, "
          f"4 micro-batches per update, fp32; every comparison alternates its layouts' updates in processes that "
          f"hold them all ({PAIRS} updates each after 2 warmup updates), one thread per process. Load average "
          f"{load0:.1f} at the start ({os.cpu_count()} cores).\n")

    print("## 1. DTensor's host work, no messages (1-rank mesh, one process)\n")
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=host_work, args=(q,))
    p.start()
    times, counts = q.get(timeout=1200)
    p.join()
    print("| model | update (ms, median) | ops on DTensors per update | paired ratio |")
    print("|---|---|---|---|")
    prev = None
    for n, ts in times.items():
        ratio = f"x{_paired(times[prev], ts):.2f} over {prev}" if prev else ""
        print(f"| {n} | {statistics.median(ts) * MS:.0f} | {counts[n]} | {ratio} |")
        prev = n
    print("\nOn one rank DTensor skips every collective: the difference is DTensor's own dispatch (sharding "
          "propagation, wrapping and unwrapping, redistributions that move nothing) and the plan's autograd "
          "functions. The formula prices it per op on a DTensor (formula/dtensor.py: a rank's DTensor ops counted by "
          "mechanism, at the host cost per op the calibration measures on a 1-rank mesh, calibrate/dtensor.py).\n")

    print("## 2. Tensor-parallel messages (2 ranks)\n")
    layouts = {"TP2": "--tp 2", "TP2 + SP": "--tp 2 --sequence-parallel"}
    ranks = _ranks(messages_rank, layouts, 29611)
    print("| layout | collective | counted calls / update | counted MiB / update | formula calls | formula MiB |")
    print("|---|---|---|---|---|---|")
    for n, flags in layouts.items():
        cfg = _config(flags)
        formula = defaultdict(lambda: [0, 0])
        for (kind, _), (calls, nbytes) in tp_collectives(cfg, shares(cfg)[0]).items():
            formula[kind][0] += calls * cfg.accum
            formula[kind][1] += nbytes * cfg.accum
        seen = ranks[0][2][n]
        for kind in sorted(set(seen) | set(formula)):
            c, b = seen.get(kind, (0, 0))
            print(f"| {n} | {kind} | {c} | {b / 2**20:.2f} | {formula[kind][0]} | {formula[kind][1] / 2**20:.2f} |")
    a, b = _slowest(ranks, "TP2"), _slowest(ranks, "TP2 + SP")
    print(f"\nUpdate (slowest rank, median): TP2 {statistics.median(a) * MS:.0f} ms, TP2 + SP "
          f"{statistics.median(b) * MS:.0f} ms; paired ratio {_paired(a, b):.2f}.\n")

    print("## 3. Pipeline schedules (2 ranks)\n")
    layouts = {"GPipe": "--pp 2 --pp-schedule gpipe", "1F1B": "--pp 2 --pp-schedule 1f1b",
               "interleaved (2 chunks)": "--pp 2 --pp-schedule interleaved-1f1b --pp-virtual 2"}
    ranks = _ranks(schedule_rank, layouts, 29621)
    parts = ("compute", "issuing p2p ops", "waiting for p2p ops")
    print("| schedule | rank | update (ms) | " + " | ".join(f"{x} (ms)" for x in parts)
          + " | rest (ms) | p2p ops / update | formula sends + receives |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, flags in layouts.items():
        cfg = _config(flags)
        sends = [pp_sends(cfg, r) * 2 * cfg.accum for r in shares(cfg)]
        for rank, walls, spent, ops in ranks:
            wall = statistics.median(walls[n])
            got = [spent.get(f"{n}|{x}", 0.0) for x in parts]
            print(f"| {n} | {rank} | {wall * MS:.0f} | " + " | ".join(f"{g * MS:.0f}" for g in got)
                  + f" | {(wall - sum(got)) * MS:.0f} | {ops.get(n, 0):.0f} | {sends[rank]} |")
    g, o, i = (_slowest(ranks, n) for n in layouts)
    print(f"\nPaired ratios (slowest rank): 1F1B / GPipe {_paired(g, o):.2f}, interleaved / 1F1B {_paired(o, i):.2f}. "
          "Compute: the stages' forward_one_chunk / backward_one_chunk; the rest: the schedule's own host work, "
          "the loss, the data and the optimizer step.\n")
    print(f"Load average at the end: {os.getloadavg()[0]:.1f} ({os.cpu_count()} cores).\n")
    return 0


if __name__ == "__main__":
    publish(main, "parallel-time-parts", "What tensor- and pipeline-parallel update times are made of, measured")
