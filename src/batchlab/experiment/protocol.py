"""Both sides measured interleaved, A B A B ..., each measurement in a process of its own (on CPU a fork of
a pre-imported one: host/warm.py), warmup excluded.

Interleaving puts the two sides of one round next to each other in time, so slow drifts of the machine
(other load, frequency, thermal) hit both alike and cancel in the round's paired ratio B/A.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from batchlab.config import ConfigError, Counted, RunConfig
from batchlab.measure.options import MeasureOptions
from batchlab.measure.result import Measurement, Outcome

MIN_ROUNDS = 3  # fewer paired ratios give no spread worth the name
MeasureFn = Callable[[RunConfig, MeasureOptions], Measurement]
# progress(done, total, label) with done/total counted in measurements (2 per round)
Progress = Callable[[int, int, str], None]


def check_rounds(rounds: int) -> int:
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < MIN_ROUNDS:
        raise ConfigError("rounds", f"must be a whole number >= {MIN_ROUNDS} (paired ratios need a spread), "
                                    f"got {rounds!r}")
    return rounds


@dataclass
class Rounds:
    """Measurements per side, index = round.  None: not measured (the side ran out of memory or failed
    earlier; an OOM or a crash repeats, so it is not run again)."""

    a: list[Measurement | None] = field(default_factory=list)
    b: list[Measurement | None] = field(default_factory=list)
    seconds: list[tuple[float, float]] = field(default_factory=list)  # wall seconds of each subprocess
    skipped: list[str] = field(default_factory=list)

    def side(self, name: str) -> list[Measurement | None]:
        return self.a if name == "a" else self.b

    def counted(self) -> Counted:
        """What the measured model counts (tokens, or samples for a per-sample model): known once built."""
        return next((m.counted for m in self.a + self.b if m is not None), Counted.TOKENS)


def default_measure(cfg: RunConfig, options: MeasureOptions) -> Measurement:
    from batchlab.run import measure

    return measure(cfg, options)


@contextlib.contextmanager
def threads_env(threads: int | None):
    """Pin the intra-op threads of the measured subprocesses (torch reads OMP_NUM_THREADS at start-up).
    On a shared machine more threads than free cores make OpenMP workers wait on each other, and the
    update time then measures the contention more than the change."""
    if threads is None:
        yield
        return
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old


def prestart(cfg: RunConfig, options: MeasureOptions) -> None:
    """Start the isolated CPU measurements' pre-imported process (host/warm.py) on a thread, so that its
    imports overlap what this process does before the first measurement, which then
    waits for it.  Call it in the measurements' environment (``threads_env``): a process started in another
    would not serve them."""
    from batchlab.host import warm
    from batchlab.measure import runner

    if options.isolate and runner.backend(cfg, options) == "cpu":
        threading.Thread(target=warm.pre_imported, args=(runner.child_env(),), daemon=True).start()


def interleave(a: RunConfig, b: RunConfig, rounds: int, options: MeasureOptions,
               measure: MeasureFn | None = None, progress: Progress | None = None) -> Rounds:
    """A B A B ... for ``rounds`` rounds; ``measure`` defaults to batchlab.run.measure (isolated)."""
    check_rounds(rounds)
    measure = measure or default_measure
    progress = progress or (lambda done, total, label: None)
    out = Rounds()
    stopped: dict[str, str] = {}
    total = 2 * rounds
    for r in range(rounds):
        times = []
        for name, cfg in (("a", a), ("b", b)):
            label = f"round {r + 1}/{rounds}: side {name.upper()}"
            progress(2 * r + len(times), total, label)
            if name in stopped:
                out.side(name).append(None)
                times.append(0.0)
                continue
            t0 = time.perf_counter()
            m = measure(cfg, options)
            times.append(time.perf_counter() - t0)
            out.side(name).append(m)
            if m.outcome is not Outcome.OK:
                stopped[name] = m.outcome.value
                if r + 1 < rounds:
                    out.skipped.append(f"side {name.upper()}: {m.outcome.value} in round {r + 1} "
                                       f"({m.outcome_detail or 'no detail'}); not run again")
        out.seconds.append((times[0], times[1]))
        progress(2 * r + 2, total, f"round {r + 1}/{rounds} done")
    return out
