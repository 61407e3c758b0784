"""Paired, alternated updates of a one-process trainer (A) and a data-parallel group (B) that are alive at once.

On this shared VM the host's speed switches within seconds (a step timed 131 ms, then 188 ms 20 s later in
the same script), so timing A and B in separate runs, one after the other, puts the host's change into the
ratio.  Here the 1 + n processes all live for the whole measurement and take turns at a barrier: A runs one
update while the ranks wait, then the n ranks run one update together (DDP over gloo, batchlab's engine of
ZeRO stage 0) while A waits, and so on, in the order A B, B A, A B, ... (as the in-process pairs).  A pair's
two updates are a few hundred milliseconds apart, so a speed switch falls on both sides of most pairs.

Each slot: every process waits at the barrier, then the side whose turn it is times one update (wall clock;
the CPU time of the whole process, gloo's threads included, and the minor page faults) while the other
side blocks at the next barrier.  B's time is its slowest rank's (the all-reduce waits for it).
"""
from __future__ import annotations

import multiprocessing
import os
import statistics
import time


def _timed(trainer, probe) -> tuple[float, float, float, float]:
    from batchlab.host import regime

    speed = probe.read()  # the host speed probe (batchlab.host.speed), read as compare reads it
    f, c, t = regime.minor_faults(), time.process_time(), time.perf_counter()
    trainer.update()
    return time.perf_counter() - t, time.process_time() - c, regime.minor_faults() - f, speed


def _side(cfg, rank: int, world: int, port: int, barrier, results, pairs: int, warmup: int, is_b: bool) -> None:
    import torch

    torch.set_num_threads(1)
    if is_b:
        import torch.distributed as dist

        from batchlab.distributed.equivalence import rank_env

        os.environ.update(rank_env(rank, world, port))
        dist.init_process_group("gloo")
        from batchlab.distributed.engines import build

        trainer, _ = build(cfg, torch.device("cpu"), rank, world)
    else:
        from batchlab.measure.harness import Trainer

        trainer = Trainer(cfg, "cpu")
    from batchlab.host.speed import SpeedProbe

    probe = SpeedProbe()
    barrier.wait()
    for _ in range(warmup):  # each side warms up alone, in turn
        barrier.wait()
        if not is_b:
            trainer.update()
        barrier.wait()
        if is_b:
            trainer.update()
    from batchlab.host import regime

    regime.pretouch()  # as a measuring process does after warmup
    out = []
    for i in range(pairs):
        for turn_b in ((False, True) if i % 2 == 0 else (True, False)):
            barrier.wait()
            if turn_b == is_b:
                out.append(_timed(trainer, probe))
    barrier.wait()
    results.put((is_b, rank, out))
    if is_b:
        del trainer
        dist.destroy_process_group()


def paired_dp(a, b, pairs: int, warmup: int = 3, reference: float = float("nan")):
    """(per-pair wall ratios t(B)/t(A), A's and B's (wall, CPU, faults, host speed) per update): ``a`` one
    process, ``b`` ``b.dp`` local ranks; every process at 1 intra-op thread.  Host speed: the speed probe read
    before the update over ``reference`` (the calibration's read), B's the mean over its ranks."""
    assert a.dp == 1 and b.dp > 1 and b.zero == 0, (a.dp, b.dp, b.zero)
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(1 + b.dp), ctx.Queue()
    from batchlab.host import free_port

    port = free_port()
    procs = [ctx.Process(target=_side, args=(a, 0, 1, port, barrier, results, pairs, warmup, False), daemon=True)]
    procs += [ctx.Process(target=_side, args=(b, r, b.dp, port, barrier, results, pairs, warmup, True), daemon=True)
              for r in range(b.dp)]
    for p in procs:
        p.start()
    try:
        got = [results.get(timeout=600) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    sa = next(out for is_b, _, out in got if not is_b)
    ranks = [out for is_b, _, out in got if is_b]
    # B's update: the slowest rank's wall and CPU time, the worst rank's faults, the ranks' mean probe
    sb = [(*(max(r[i][k] for r in ranks) for k in range(3)), statistics.fmean(r[i][3] for r in ranks))
          for i in range(pairs)]
    speed = lambda side: [(*x[:3], x[3] / reference) for x in side]  # noqa: E731
    return [y[0] / x[0] for x, y in zip(sa, sb)], speed(sa), speed(sb)


if __name__ == "__main__":  # a quick look: python benchmarks/dp_pairs.py
    from batchlab.config import RunConfig, preset

    base = RunConfig(model=preset("tiny"), model_source="builtin").replace(seq=128, micro_batch=8)
    r, sa, sb = paired_dp(base, base.replace(dp=2), 8)
    print(f"ratio {statistics.median(r):.2f}; A {statistics.median(x[0] for x in sa) * 1e3:.0f} ms, "
          f"B {statistics.median(y[0] for y in sb) * 1e3:.0f} ms")
