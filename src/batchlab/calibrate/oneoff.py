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


def timed_once(cal, keys: tuple[str, ...], measure, problems, threads: int | None,
               errors: tuple[type[BaseException], ...] = (RuntimeError,), failed: str = "{}") -> tuple:
    """A figure timed once for ``cal`` outside ``batchlab calibrate`` (calls.py, chain.py, shared_link.py):
    (figure, "", others) to cache; (None, why, others) where ``measure`` raised one of ``errors`` (said as
    ``failed`` formats it) or ``problems(figure)`` found it implausible, kept in ``cal.untimed`` under each of
    ``keys`` (the caller saves) so it is not tried again until the next calibration; (None, "", others) where a
    wall-clock figure at ``threads`` threads was stretched by other processes' load (``formula.calibration.
    loaded_by``: not cached, timed again next time; None: a CPU-time figure, which their load does not stretch).
    ``others``: the cores other processes kept busy meanwhile."""
    from batchlab import host
    from batchlab.formula.calibration import loaded_by

    load = host.LoadSampler(thread=False).start()
    try:
        figure = measure()
    except errors as e:
        others, bad = load.stop()["other_cores"], failed.format(why(e))
    else:
        others = load.stop()["other_cores"]
        if threads and loaded_by(others, cal.cores, threads):
            return None, "", others
        bad = "; ".join(problems(figure))
        if not bad:
            return figure, "", others
    cal.untimed.update(dict.fromkeys(keys, bad))
    return None, bad, others


def two_rank_figure(cal, key: str, measure, problems, wall_clock: bool = True) -> tuple[object | None, str]:
    """``timed_once`` of a figure two local ranks time over gloo (calibrate/shared_link.py, chain.py), its wall
    clock two processes' (``wall_clock``; else CPU time); a failure or an implausible figure saved at once."""
    from batchlab.cache.calibrations import save

    figure, bad, _ = timed_once(cal, (key,), measure, problems, 2 if wall_clock else None,
                                failed="not measured ({})")
    if bad:
        save(cal)
    return figure, bad
