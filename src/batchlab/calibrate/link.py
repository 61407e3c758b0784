"""Gloo's all-reduce between two local processes, as a DP rank on this CPU host meets it in a step: timed on a
real process group (torch.distributed over loopback), each sample right after both ranks ran the same 15 ms
of matmuls, so gloo's threads wake from a computing process and the ranks arrive apart, as they do at a
gradient bucket.  A figure is the mean of the two ranks' medians: the later rank's is the all-reduce, the
earlier one's adds its wait for the later, and a DP update pays the mean of the two beyond its ranks' mean
compute.  Idle all-reduces started together after a barrier price a DP update's gradients well under what they
cost inside the update (docs/cpu.md, "Figures behind the code's choices").  Torch is imported inside the
functions."""
from __future__ import annotations

import multiprocessing
import queue
import statistics
import time
import warnings

from batchlab.formula.links import COLD_GAP_S
from batchlab.formula.opcost import UNRESOLVED
from batchlab.host import free_port

SIZES = (2**14, 2**20, 4 * 2**20)  # bytes all-reduced: a message's fixed cost, up to about a small model's bucket
WARMUP = 3  # all-reduces per size before timing (the ring's connections are made on first use)
MAX_SAMPLES = 200
MIN_SAMPLES = 25  # per size: a median of fewer wanders by half between calibrations of a quiet VM (wake-ups, steal)
TIMEOUT_S = 30
BURST_S = COLD_GAP_S  # seconds of matmuls each rank runs before each timed all-reduce (a step's compute)


def join(rank: int, port: int, timeout_s: float) -> None:
    """Join a gloo group of 2 ranks on this host, at one intra-op thread."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=timeout_s))


def burst(burst_s: float = BURST_S, clock=time.perf_counter):
    """(a 128 x 128 matrix, how many of its matmuls take ``burst_s`` on ``clock``): both ranks of the group then
    compute the same number between all-reduces, the smaller count agreed."""
    import torch
    import torch.distributed as dist

    a = torch.randn(128, 128)
    t = clock()
    for _ in range(20):
        a @ a
    matmuls = torch.tensor([int(burst_s / max((clock() - t) / 20, 1e-7))])
    dist.all_reduce(matmuls, op=dist.ReduceOp.MIN)
    return a, int(matmuls)


def _rank(rank: int, port: int, arg: tuple[tuple[int, ...], float], results, burst_s: float = BURST_S) -> None:
    sizes, seconds = arg
    import torch
    import torch.distributed as dist

    join(rank, port, TIMEOUT_S)
    try:
        a, matmuls = burst(burst_s)
        out, bursts = {}, []
        for nbytes in sizes:
            x = torch.ones(nbytes // 4)
            t = time.perf_counter()
            for _ in range(WARMUP):
                dist.all_reduce(x)
            each = (time.perf_counter() - t) / WARMUP + burst_s
            count = torch.tensor([min(MAX_SAMPLES, max(MIN_SAMPLES, int(seconds / len(sizes) / max(2 * each, 1e-6))))])
            dist.all_reduce(count, op=dist.ReduceOp.MIN)
            samples: list[float] = []
            for _ in range(int(count)):
                dist.barrier()
                t = time.perf_counter()
                for _ in range(int(matmuls)):  # a step's compute before its all-reduce: the ranks arrive apart
                    a @ a
                bursts.append(time.perf_counter() - t)
                t = time.perf_counter()
                dist.all_reduce(x)
                samples.append(time.perf_counter() - t)
            out[nbytes] = statistics.median(samples)
        # the smallest size again, back to back: gloo's and the peer's threads awake, as between collectives a
        # few small ops apart (formula/links.py ``after_gap``)
        x, warm = torch.ones(sizes[0] // 4), []
        dist.barrier()
        for _ in range(MIN_SAMPLES):
            t = time.perf_counter()
            dist.all_reduce(x)
            warm.append(time.perf_counter() - t)
        out["warm"] = statistics.median(warm)
        results.put((rank, (out, bursts)))
    finally:
        dist.destroy_process_group()


def allreduce_timed(sizes: tuple[int, ...], seconds: float) -> dict:
    """``{"seconds": {bytes: s}, "skew": s}``: per size, the time of one all-reduce between two processes forked
    here, over gloo, right after ``BURST_S`` of compute on both (the mean of the ranks' medians; wall clock: a
    rank waits on its peer, which is the cost; RuntimeError where they cannot run it); skew, the median over
    the samples of how much longer the slower rank took over the same matmuls than the two ranks' mean
    (0.035: 3.5%), which a DP update waits for between its all-reduces."""
    # each rank's median: the later rank's is the all-reduce alone, the earlier one's adds the wait for it
    (first, b0), (second, b1) = two_ranks(_rank, (sizes, seconds), "result of gloo's all-reduce",
                                          TIMEOUT_S + 10 * seconds)
    skew = [max(x, y) / ((x + y) / 2) - 1 for x, y in zip(b0, b1) if x + y > 0]
    return {"seconds": {n: (first[n] + second[n]) / 2 for n in first if n != "warm"},
            "skew": statistics.median(skew) if skew else 0.0, "warm": (first["warm"] + second["warm"]) / 2}


def two_ranks(target, arg, what: str, timeout_s: float) -> list:
    """What two forked local ranks of ``target(rank, port, arg, results)`` put on their queue, rank order unknown;
    RuntimeError naming ``what`` where they give nothing in ``timeout_s`` (none is left running)."""
    # fork: no interpreter start-up per rank; a parent's OpenMP pool is no hazard, as the ranks run no parallel
    # region (one intra-op thread each: gloo, a fill and the matmuls; checked with the parent at 2 threads)
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    ctx = multiprocessing.get_context(method)
    port, results = free_port(), ctx.Queue()
    ranks = [ctx.Process(target=target, args=(r, port, arg, results), daemon=True) for r in range(2)]
    for p in ranks:
        p.start()
    try:
        return [got for _, got in (results.get(timeout=timeout_s) for _ in ranks)]
    except queue.Empty:
        codes = [p.exitcode for p in ranks]
        raise RuntimeError(f"two local ranks gave no {what} (exit codes {codes})") from None
    finally:
        for p in ranks:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


LAUNCHES = 5  # pairs of ranks forked in turn: how the OS places a pair and its gloo threads holds for the pair's life


def allreduce_times(seconds: float, launches: int = LAUNCHES) -> dict:
    """``allreduce_timed`` at ``SIZES`` over ``launches`` pairs of ranks, per size the median of the pairs' figures
    (on a quiet 2-core VM one pair's median of a 16 KiB all-reduce ranged 0.5-2.6 ms from one pair to the next,
    each steady within its life); {} with a warning where they cannot be timed here (local ranks are then priced
    over the device entry's link)."""
    try:
        runs = [allreduce_timed(SIZES, seconds / launches) for _ in range(launches)]
    except RuntimeError as e:
        warnings.warn(f"calibrate: {e}; DP on this CPU is priced over the device entry's link", stacklevel=2)
        return {}
    return {"seconds": {n: statistics.median(r["seconds"][n] for r in runs) for n in SIZES},
            "skew": statistics.median(r["skew"] for r in runs), "warm": statistics.median(r["warm"] for r in runs)}


def warm_latency(warm_seconds: float | None, bytes_per_s: float) -> float:
    """Seconds per message of a back-to-back all-reduce of ``SIZES[0]`` bytes between 2 ranks (2 messages), its
    bytes over the fitted bandwidth taken off; 0 where unmeasured."""
    if not warm_seconds or not bytes_per_s:
        return 0.0
    return max(0.0, (warm_seconds - SIZES[0] / bytes_per_s) / 2)


def ring_fit(times: dict[int, float]) -> tuple[float, float]:
    """(bytes/s, seconds per message) that the ring model (formula.sharding: 2(n-1)/n of the buffer over the
    link, plus 2(n-1) messages) turns back into all-reduce ``times`` (bytes -> s): for 2 ranks
    t(B) = B / bandwidth + 2 latency, fitted by least squares; (0, 0) with fewer than two sizes."""
    if len(times) < 2:
        return 0.0, 0.0
    xs, ys = list(times), list(times.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    bandwidth = 1.0 / max(slope, 1 / UNRESOLVED)
    return bandwidth, max(0.0, (my - mx * slope) / 2)

