"""Gloo's all-reduce between two local processes: what a DP rank on this CPU host waits for per gradient
bucket, timed on a real process group (torch.distributed over loopback), not a socket echo.  Gloo's ring also
copies and sums the buffers: 3.4 MiB (the built-in tiny GPT's gradients) all-reduced in 4.1-5.0 ms here, where a
TCP echo's bandwidth and latency priced 1.5-2.1 ms.  Torch is imported inside the functions."""
from __future__ import annotations

import multiprocessing
import socket
import statistics
import time

SIZES = (2**14, 4 * 2**20)  # bytes all-reduced: a message's fixed cost, and about a small model's bucket
WARMUP = 3  # all-reduces per size before timing (the ring's connections are made on first use)


def _rank(rank: int, port: int, sizes: tuple[int, ...], seconds: float, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        out = {}
        for nbytes in sizes:
            x = torch.ones(nbytes // 4)
            for _ in range(WARMUP):
                dist.all_reduce(x)
            samples: list[float] = []
            end = time.perf_counter() + seconds / len(sizes)
            while len(samples) < 5 or time.perf_counter() < end:
                dist.barrier()  # both ranks start the all-reduce together: its own time, not the other's lateness
                t = time.perf_counter()
                dist.all_reduce(x)
                samples.append(time.perf_counter() - t)
            out[nbytes] = statistics.median(samples)
        if rank == 0:
            results.put(out)
    finally:
        dist.destroy_process_group()


def allreduce_seconds(sizes: tuple[int, ...], seconds: float) -> dict[int, float]:
    """Per size (bytes), the median time of one all-reduce between two processes forked here, over gloo.  Wall
    clock: a rank waits on its peer, which is the cost."""
    # fork: no interpreter start-up per rank (the caller measures at one thread: no OpenMP pool to inherit)
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    ctx = multiprocessing.get_context(method)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(r, port, sizes, seconds, results), daemon=True) for r in range(2)]
    for p in ranks:
        p.start()
    try:
        return results.get(timeout=60)
    finally:
        for p in ranks:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def allreduce_link(seconds: float) -> tuple[float, float]:
    """(bytes/s, seconds per message) that the ring model (formula.sharding: 2(n-1)/n of the buffer over the
    link, plus 2(n-1) messages) turns back into gloo's all-reduce times at ``SIZES``: for 2 ranks
    t(B) = B / bandwidth + 2 latency."""
    (b1, t1), (b2, t2) = sorted(allreduce_seconds(SIZES, seconds).items())
    bandwidth = (b2 - b1) / max(t2 - t1, 1e-9)
    return bandwidth, max(0.0, (t1 - b1 / bandwidth) / 2)
