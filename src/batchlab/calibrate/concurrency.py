"""How much slower one process's kernels run while other processes on this host run the same kernels: the
cost of data-parallel ranks sharing one machine beyond its core count (memory bandwidth, shared caches, a
virtual CPU's hidden sibling).  Measured as each process's CPU seconds per call, N processes at once over one
alone, so time-sharing by other load (wall clock) does not enter it; ``formula.timing`` multiplies a local
rank's op costs by it.  Torch is imported inside the functions."""
from __future__ import annotations

import multiprocessing
import os
import time

from batchlab.calibrate.kernels import COLD_BYTES, MEMORY_SIZES, _copies, _cycling, keeping, steady, timed_rates

# what each kind stands for in the op classes (formula/timing.py CONTENDED): a matmul (compute-bound), an
# out-of-cache add into fresh outputs (memory-bound), a tiny add (dispatch-bound: Python and the dispatcher)
KINDS = ("compute", "memory", "dispatch")
ROUNDS = 2  # alternations of 1 and N processes; the faster of each (other load only slows a sample down)


def _kernel(kind: str):
    """(call, work per call) of one kind's kernel on this process's CPU."""
    import torch

    if kind == "compute":
        a, b = torch.randn(256, 256), torch.randn(256, 256)
        return (lambda: torch.mm(a, b)), 2 * 256**3
    if kind == "memory":
        n = MEMORY_SIZES[-1]
        sets = _copies(lambda: (torch.ones(n), torch.ones(n)), 8 * n)
        return keeping(_cycling(torch.add, sets), COLD_BYTES), 12 * n
    x = torch.ones(8)
    return (lambda: x.add(1)), 1


def _worker(kind: str, threads: int, seconds: float, barrier, results) -> None:
    import torch

    torch.set_num_threads(threads)
    call, work = _kernel(kind)
    call()
    barrier.wait()  # all N start together, and all run for the same wall-clock budget
    clock = time.thread_time if threads == 1 else time.process_time
    results.put(steady(timed_rates(call, work, seconds, lambda: None, clock=clock)))


def _rate(ctx, kind: str, processes: int, threads: int, seconds: float) -> float:
    """The per-process rate of ``kind`` with ``processes`` running it at once (their mean)."""
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(kind, threads, seconds, barrier, results), daemon=True)
               for _ in range(processes)]
    for w in workers:
        w.start()
    rates = [results.get(timeout=60 + 10 * seconds) for _ in workers]
    for w in workers:
        w.join()
    return sum(rates) / len(rates)


def slowdown(processes: int, threads: int, seconds: float) -> dict[str, float]:
    """Per kind, a process's time per call with ``processes`` running at once over one alone (>= 1 is not
    enforced: a factor below 1 is noise, clipped by the caller).  Empty where the processes' threads do not
    fit on the cores (then they time-share, which ``formula.timing.sharing`` already counts)."""
    cores = os.cpu_count() or 1
    if processes < 2 or processes * threads > cores:
        return {}
    # fork: no interpreter start-up per worker; at one thread the parent never started an OpenMP pool
    method = "fork" if threads == 1 and "fork" in multiprocessing.get_all_start_methods() else "spawn"
    ctx = multiprocessing.get_context(method)
    share = seconds / (len(KINDS) * 2 * ROUNDS)
    out = {}
    for kind in KINDS:
        rates: dict[int, list[float]] = {1: [], processes: []}
        for _ in range(ROUNDS):  # alternated, so a change of the machine's load falls on both
            for n in rates:
                rates[n].append(_rate(ctx, kind, n, threads, share))
        out[kind] = max(rates[1]) / max(rates[processes])
    return out
