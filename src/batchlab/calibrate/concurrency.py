"""How much slower one process's kernels run while other processes on this host run the same kernels: the
cost of data-parallel ranks sharing one machine beyond its core count (memory bandwidth, shared caches, a
virtual CPU's hidden sibling).  Measured as each process's CPU seconds per call, N processes at once over one
alone, so time-sharing by other load (wall clock) does not enter it; ``formula.timing`` multiplies a local
rank's op costs by it.  Torch is imported inside the functions."""
from __future__ import annotations

import multiprocessing
import os
import statistics
import time

from batchlab.calibrate.kernels import COLD_BYTES, MEMORY_SIZES, _copies, _cycling, keeping, steady, timed_rates

# what each kind stands for in the op classes (formula/timing.py CONTENDED): a matmul (compute-bound), an
# out-of-cache add into fresh outputs (memory-bound), a tiny add (dispatch-bound: Python and the dispatcher)
KINDS = ("compute", "memory", "dispatch")


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


def _worker(threads: int, seconds: float, barrier, commands, results) -> None:
    """Build every kind's kernel once, then time one kind per command: (kind, processes running it)."""
    import torch

    torch.set_num_threads(threads)
    kernels = {kind: _kernel(kind) for kind in KINDS}
    # the memory kind until its kept 4 MiB sums reach their budget (10 calls), so no timed window pays the first
    # touch of its pages
    warm = {"memory": 2 + COLD_BYTES // (4 * MEMORY_SIZES[-1])}
    for kind, (call, _) in kernels.items():
        for _ in range(warm.get(kind, 2)):
            call()
    clock = time.thread_time if threads == 1 else time.process_time
    while (command := commands.get()) is not None:
        kind, processes = command
        call, work = kernels[kind]
        if processes > 1:
            barrier.wait()  # all start together and run for the same wall-clock budget
        results.put(steady(timed_rates(call, work, seconds, lambda: None, clock=clock), cpu_clock=True))


class Contention:
    """``processes`` forked workers kept for a calibration round, timed in alternations of one alone and all at
    once (``alternate``) that the round spreads through itself, as it does the dispatch slices: two vCPUs can
    share one core for seconds at a time, so a few contiguous windows can all read that state, where windows
    spread over the calibration read it once (docs/cpu.md, "Figures behind the code's choices").
    ``factors()``: per kind, the median of the alternations' ratios.
    Inert (no workers, empty factors) where the processes' threads do not fit on the cores (then they
    time-share, which ``formula.timing.sharing`` already counts) or for fewer than 2 processes."""

    def __init__(self, processes: int, threads: int, window: float):
        cores = os.cpu_count() or 1
        self.samples: dict[str, list[float]] = {kind: [] for kind in KINDS}
        self.workers: list = []
        if processes < 2 or processes * threads > cores:
            return
        # fork: no interpreter start-up per worker; at one thread the parent never started an OpenMP pool
        method = "fork" if threads == 1 and "fork" in multiprocessing.get_all_start_methods() else "spawn"
        ctx = multiprocessing.get_context(method)
        self.processes, self.barrier, self.results = processes, ctx.Barrier(processes), ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(processes)]
        self.workers = [ctx.Process(target=_worker, args=(threads, window, self.barrier, q, self.results),
                                    daemon=True) for q in self.commands]
        for w in self.workers:
            w.start()

    def _rate(self, kind: str, n: int) -> float:
        for q in self.commands[:n]:
            q.put((kind, n))
        return sum(self.results.get(timeout=120) for _ in range(n)) / n

    def alternate(self) -> None:
        """Per kind, one window alone then one with every process at once (a change of the machine's load
        falls on both sides of each ratio)."""
        for kind in KINDS if self.workers else ():
            self.samples[kind].append(self._rate(kind, 1) / self._rate(kind, self.processes))

    def factors(self) -> dict[str, float]:
        return {kind: statistics.median(v) for kind, v in self.samples.items() if v}

    def close(self) -> None:
        for q in getattr(self, "commands", ()):
            q.put(None)
        for w in self.workers:
            w.join(timeout=30)

