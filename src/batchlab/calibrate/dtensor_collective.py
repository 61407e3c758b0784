"""DTensor's host work per collective, measured on this machine between two forked processes.

A tensor-parallel plan's collectives are DTensor redistributions (a row-parallel output's ``Partial`` made
``Replicate``, a column-parallel input's gradient, sequence parallelism's gathers and scatters): each runs
DTensor's redistribute planning, a functional collective (the input cloned, the output wrapped for autograd, an
explicit ``wait_tensor``) and the unwrapping, in Python on the rank's main thread, before and after gloo moves a
byte.  The 1-rank mesh of ``calibrate/dtensor.py`` skips them (nothing to send) and the link calibration times a
plain ``dist.all_reduce`` (``calibrate/link.py``), so neither sees this work.  Here two ranks alternate, sample by
sample, a ``Partial`` -> ``Replicate`` redistribute of a small DTensor and a plain all-reduce of the same tensor,
each after the same few matmuls, and time the main thread's CPU in each call; the figure is the difference of the
medians (the two ranks' mean): the host work a DTensor collective adds to what the link prices.  CPU time, not
wall: a wait for the peer costs no CPU, and the link's latency prices the wait already.  Torch is imported inside
the functions.
"""
from __future__ import annotations

import statistics
import time

from batchlab.calibrate.link import join, two_ranks

NBYTES = 2**14  # small: the fixed host work, not the copy of the buffer
SAMPLES = 100  # alternated pairs of calls per rank
WARMUP = 5
TIMEOUT_S = 60
BURST = 8  # 64x64 matmuls before each call: the rank comes from compute, as a layer's collective does


def _rank(rank: int, port: int, samples: int, results) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    from batchlab.trace.sharded import _forget_meshes as forget_meshes

    join(rank, port, TIMEOUT_S)
    try:
        mesh = init_device_mesh("cpu", (2,))
        x, a = torch.ones(NBYTES // 4), torch.randn(64, 64)

        def dtensor() -> None:
            DTensor.from_local(x, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()

        def plain() -> None:
            dist.all_reduce(x)

        spent: dict[str, list[float]] = {"dtensor": [], "plain": []}
        for i in range(WARMUP + samples):
            for name, call in ((("dtensor", dtensor), ("plain", plain)) if i % 2 == 0
                               else (("plain", plain), ("dtensor", dtensor))):
                for _ in range(BURST):
                    a @ a
                t = time.thread_time()
                call()
                if i >= WARMUP:
                    spent[name].append(time.thread_time() - t)
        results.put((rank, statistics.median(spent["dtensor"]) - statistics.median(spent["plain"])))
    finally:
        dist.destroy_process_group()
        forget_meshes()


def measure(samples: int = SAMPLES) -> float:
    """Seconds of main-thread CPU a DTensor collective adds over a plain gloo all-reduce of the same tensor (the
    mean of the two ranks' differences of medians); RuntimeError where two ranks cannot run here."""
    return statistics.fmean(two_ranks(_rank, samples, "DTensor collective timing", TIMEOUT_S))
