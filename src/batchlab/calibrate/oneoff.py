"""How a figure timed once per CPU outside ``batchlab calibrate`` is taken (calibrate/family.py, dtensor.py,
compiled_rng.py, calls.py): at the calibration's intra-op threads, on this thread's CPU clock where one thread
runs (other processes' load does not enter a sample), and a failure kept as one line in ``Calibration.untimed``
so it is not tried again until the next calibration."""
from __future__ import annotations

import contextlib
import time

from batchlab.calibrate.kernels import CLOCK


@contextlib.contextmanager
def thread_clock():
    """``CLOCK`` within: this thread's CPU seconds at one intra-op thread, wall seconds at several (a multi-thread
    kernel's other threads' work is not this thread's)."""
    import torch

    token = CLOCK.set(time.thread_time if torch.get_num_threads() == 1 else time.perf_counter)
    try:
        yield
    finally:
        CLOCK.reset(token)


@contextlib.contextmanager
def at_threads(threads: int):
    """torch's intra-op threads set to the calibration's ``threads`` within, restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def why(e: BaseException) -> str:
    """A failed timing as one line for ``Calibration.untimed`` (inductor's C++ compiler missing, ...)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:160]


def two_rank_figure(cal, key: str, measure, problems, wall_clock: bool = True) -> tuple[object | None, str]:
    """A figure two local ranks time over gloo (calibrate/shared_link.py, chain.py), taken once
    for ``cal``: (figure, "") to cache; (None, why) where it failed or ``problems(figure)`` found it implausible,
    kept in ``cal.untimed[key]`` (saved) so it is not tried again until the next calibration; (None, "") where a
    ``wall_clock`` figure was timed while other processes kept the cores busy (two ranks' wall time stretched: not
    cached, timed again next time; a CPU-time figure is not stretched by them)."""
    from batchlab import host
    from batchlab.cache.calibrations import save
    from batchlab.formula.calibration import loaded_by

    load = host.LoadSampler(thread=False).start()
    try:
        figure = measure()
    except RuntimeError as e:
        load.stop()
        bad = f"not measured ({e})"
    else:
        if wall_clock and loaded_by(load.stop()["other_cores"], cal.cores, 2):
            return None, ""
        bad = "; ".join(problems(figure))
        if not bad:
            return figure, ""
    cal.untimed[key] = bad
    save(cal)
    return None, bad
