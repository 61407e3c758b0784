"""How fast this host runs now against while it was calibrated: a ~6 ms bundle of the calibrated kernel
classes (a matmul, an add into fresh outputs, the dropout RNG, tiny dispatch-bound ops), timed by the
calibration with each of its dispatch slices and by a measuring process before each timed update.  On a
shared VM the same isolated kernels can switch between speeds within seconds, so an absolute update time
measured a minute after the calibration can sit far off a prediction that holds at the calibration's speed.
The probe says which speed an update ran at; compare prints the prediction at that speed beside the one at the
calibration's: a bound on how far the host moved, not a correction (docs/cpu.md, "The host speed probe").
Torch is imported inside the functions."""
from __future__ import annotations

import itertools
import statistics
import time
from typing import Callable

ELEMENTS = 256 * 2**10  # floats per element-wise operand: 1 MiB, past the L2 cache
OUTPUTS = 8  # the add cycles through this many 1 MiB outputs: its writes miss the cache, as a forward's do
# what the bundle is: a calibration whose reference timed another bundle is measured again (calibrate._current)
BUNDLE = "2 x (mm 512x128x384, add of 1 MiB into 1 of 8 outputs, bernoulli_ of 1 MiB, 50 tiny add_)"
TINY = 50  # in-place adds on 8 floats per half bundle: the per-op dispatch cost, 10-20% of a small model's step
READS = 3  # bundle reads per probe figure, their median: before each timed update and with each calibration slice


class SpeedProbe:
    """The bundle, built once (~12 MiB of operands and outputs; it allocates nothing afterwards, so a measuring
    process's heap, which its timed updates reuse without page faults, is left as it was); ``read()`` times it
    on ``clock``: the thread's CPU time at one intra-op thread (other processes' load is not in it, as in the
    calibration), else wall clock."""

    def __init__(self, clock: Callable[[], float] | None = None):
        import torch

        self.clock = clock or (time.thread_time if torch.get_num_threads() == 1 else time.perf_counter)
        self.x, self.a, self.b = torch.rand(ELEMENTS), torch.randn(512, 128), torch.randn(128, 384)
        self.c, self.u, self.v = torch.empty(512, 384), torch.ones(ELEMENTS), torch.ones(ELEMENTS)
        self.tiny, self.one = torch.zeros(8), torch.ones(8)  # a tensor operand: a Python scalar allocates one
        self.outputs = itertools.cycle([torch.empty(ELEMENTS) for _ in range(OUTPUTS)])
        for _ in range(OUTPUTS // 2):  # every output written once: no read faults a page in
            self.once()

    def once(self) -> float:
        import torch

        c = self.clock()
        for _ in range(2):
            torch.mm(self.a, self.b, out=self.c)
            torch.add(self.u, self.v, out=next(self.outputs))
            self.x.bernoulli_(0.9)
            for _ in range(TINY):
                self.tiny.add_(self.one)
        return self.clock() - c

    def read(self, n: int = READS) -> float:
        """The median of ``n`` bundle times (seconds), after one untimed: right after a training update the
        first bundle finds its operands out of cache (here 5.1-8.6 ms against 4.3-6.8 for the next ones)."""
        self.once()
        return statistics.median(self.once() for _ in range(n))


def host_speed(reads: list[float], reference: float | None) -> float | None:
    """The median probe read over the calibration's: 1 at its speed, 1.3 when the host runs 30% slower; None
    where either is missing."""
    if not reads or not reference or reference <= 0:
        return None
    return statistics.median(reads) / reference
