"""Gloo's all-reduce between two local processes: what a DP rank on this CPU host waits for per gradient
bucket, timed on a real process group (torch.distributed over loopback), not a socket echo.  Gloo's ring also
copies and sums the buffers.  The median of the samples: a step's all-reduces meet the same scheduling and
loopback delays (the tiny GPT's 1 MiB and 2.4 MiB buckets took 8.7-12 ms each inside its DDP update here, its
whole 3.4 MiB 4.1-5.0 ms alone at the median and 2.1-3.0 ms at the lower quartile, which priced it before).
Torch is imported inside the functions."""
from __future__ import annotations

import multiprocessing
import queue
import statistics
import time
import warnings

from batchlab.host import free_port

SIZES = (2**14, 2**20, 4 * 2**20)  # bytes all-reduced: a message's fixed cost, up to about a small model's bucket
WARMUP = 3  # all-reduces per size before timing (the ring's connections are made on first use)
MAX_SAMPLES = 200
TIMEOUT_S = 30


def _rank(rank: int, port: int, sizes: tuple[int, ...], seconds: float, results) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        out = {}
        for nbytes in sizes:
            x = torch.ones(nbytes // 4)
            t = time.perf_counter()
            for _ in range(WARMUP):
                dist.all_reduce(x)
            # both ranks run the same number of collectives: the count each could afford, the smaller agreed
            each = (time.perf_counter() - t) / WARMUP
            count = torch.tensor([min(MAX_SAMPLES, max(5, int(seconds / len(sizes) / max(2 * each, 1e-6))))])
            dist.all_reduce(count, op=dist.ReduceOp.MIN)
            samples: list[float] = []
            for _ in range(int(count)):
                dist.barrier()  # both ranks start the all-reduce together: its own time, not the other's lateness
                t = time.perf_counter()
                dist.all_reduce(x)
                samples.append(time.perf_counter() - t)
            # the median: a step's all-reduce meets the same scheduling and loopback delays (not a quartile: the
            # lower one priced the tiny GPT's in-step all-reduces at under half their time here)
            out[nbytes] = statistics.median(samples)
        if rank == 0:
            results.put(out)
    finally:
        dist.destroy_process_group()


def allreduce_seconds(sizes: tuple[int, ...], seconds: float) -> dict[int, float]:
    """Per size (bytes), the time of one all-reduce between two processes forked here, over gloo (the lower
    of its samples).  Wall clock: a rank waits on its peer, which is the cost.  Raises RuntimeError where they cannot run it."""
    # fork: no interpreter start-up per rank; a parent's OpenMP pool is no hazard, as the ranks run no parallel
    # region (one thread each: gloo and a fill; checked with the parent at 2 threads)
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    ctx = multiprocessing.get_context(method)
    port = free_port()
    results = ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(r, port, sizes, seconds, results), daemon=True) for r in range(2)]
    for p in ranks:
        p.start()
    try:
        return results.get(timeout=TIMEOUT_S + 10 * seconds)
    except queue.Empty:
        codes = [p.exitcode for p in ranks]
        raise RuntimeError(f"gloo's all-reduce between two local processes gave no result (exit codes {codes})") \
            from None
    finally:
        for p in ranks:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


def allreduce_times(seconds: float) -> dict[int, float]:
    """``allreduce_seconds`` at ``SIZES``; {} with a warning where they cannot be timed here (local ranks are
    then priced over the device entry's link)."""
    try:
        return allreduce_seconds(SIZES, seconds)
    except RuntimeError as e:
        warnings.warn(f"calibrate: {e}; DP on this CPU is priced over the device entry's link", stacklevel=2)
        return {}


def ring_fit(times: dict[int, float]) -> tuple[float, float]:
    """(bytes/s, seconds per message) that the ring model (formula.sharding: 2(n-1)/n of the buffer over the
    link, plus 2(n-1) messages) turns back into all-reduce ``times`` (bytes -> s): for 2 ranks
    t(B) = B / bandwidth + 2 latency, fitted by least squares; (0, 0) with fewer than two sizes."""
    if len(times) < 2:
        return 0.0, 0.0
    xs, ys = list(times), list(times.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    bandwidth = 1.0 / max(slope, 1e-15)
    return bandwidth, max(0.0, (my - mx * slope) / 2)


def allreduce_link(seconds: float) -> tuple[float, float]:
    """The ring model's link fitted to all-reduces timed now (``ring_fit`` of ``allreduce_times``)."""
    return ring_fit(allreduce_times(seconds))
