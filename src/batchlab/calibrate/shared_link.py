"""How much of gloo's link is the ranks' own CPU work, measured on this machine: what stretches when local ranks
time-share the cores.

The link calibration (link.py) times an all-reduce between two ranks with a core each, right after a step's compute.
A layout whose ranks outnumber the cores (4 ranks of one thread on 2 cores) meets that link differently: the
rank's own part of a message (gloo's wake-ups, syscalls, copies and sums, on its main and its gloo threads) runs at
its share of a core, but while it waits for its peer -- to arrive from its compute, to send -- the other ranks use
the core, so the per-message cost does not stretch by the whole time-sharing factor.  Here two ranks with a core
each time the link calibration's all-reduce (``link.BURST_S`` of CPU work on each, then the all-reduce) of a small
and a large message, in wall-clock and in the process's CPU time (every thread of it); the figures, the two ranks'
mean: the CPU seconds of one message (the small all-reduce's less its bytes', over its 2 messages) and of one byte
(the large one's beyond the small one's).  CPU time is what other processes' load does not stretch.  Cached with
the CPU's calibration (``Calibration.link_cpu_seconds``) the first time measure or compare meets a layout whose
local ranks time-share the cores; formula/links.py stretches only that part of the link by the sharing.  Torch is imported inside the
functions.
"""
from __future__ import annotations

import statistics
import time

from batchlab.cache.calibrations import default_threads, load_cached, save
from batchlab.calibrate.link import burst, join, two_ranks
from batchlab.calibrate.oneoff import two_rank_figure
from batchlab.formula.plausible import link_cpu_problems

SIZES = (2**14, 4 * 2**20)  # bytes all-reduced: the per-message cost, and one with the bytes dominant
SAMPLES = 25  # timed all-reduces per size and rank
WARMUP = 3
TIMEOUT_S = 60


def _rank(rank: int, port: int, samples: int, results) -> None:
    import torch
    import torch.distributed as dist

    join(rank, port, TIMEOUT_S)
    try:
        a, matmuls = burst(clock=time.thread_time)  # the link calibration's step of compute
        out = {}
        for n in SIZES:
            x, wall, cpu = torch.ones(n // 4), [], []
            for _ in range(WARMUP):
                dist.all_reduce(x)
            for _ in range(samples):
                dist.barrier()
                for _ in range(int(matmuls)):
                    a @ a
                t, c = time.perf_counter(), time.process_time()  # process time: gloo's threads too
                dist.all_reduce(x)
                cpu.append(time.process_time() - c)
                wall.append(time.perf_counter() - t)
            out[n] = (statistics.median(wall), statistics.median(cpu))
        results.put((rank, out))
    finally:
        dist.destroy_process_group()


def measure(samples: int = SAMPLES) -> dict[str, float]:
    """{"message": s, "byte": s}: the CPU seconds (every thread of a rank's process) of one message of gloo's ring
    and of one byte on it, from an all-reduce between two local ranks with a core each (2 messages, the buffer's
    bytes each way; the two ranks' mean), and {"message_wall": s, "byte_wall": s}, the same in wall-clock as
    timed beside them; RuntimeError where two ranks cannot run here."""
    got = two_ranks(_rank, samples, "link CPU timing", TIMEOUT_S)
    small, big = SIZES
    out = {}
    for i, key in ((1, ""), (0, "_wall")):
        spent = {n: statistics.fmean(g[n][i] for g in got) for n in SIZES}
        per_byte = max(0.0, (spent[big] - spent[small]) / (big - small))
        out["message" + key], out["byte" + key] = max(0.0, spent[small] - small * per_byte) / 2, per_byte
    return out


def wanted(cfgs: tuple, cores: int, threads: int) -> bool:
    """Whether a config among ``cfgs`` runs local CPU ranks whose threads outnumber the ``cores`` (unknown cores:
    formula/timing.py ``sharing`` stretches nothing, so nothing is wanted)."""
    return bool(cores) and any(c.device == "cpu" and c.parallel.world_size > 1
                               and c.parallel.world_size * threads > cores for c in cfgs)


KEY = "link_cpu"  # its ``Calibration.untimed`` entry where the measurement failed or gave nonsense


def ensure(cfgs: tuple, threads: int | None = None) -> str | None:
    """Where ``cfgs`` run local ranks time-sharing this CPU's cores and its calibration (at ``threads``) lacks the
    link's CPU share: measure it (a few seconds) and cache it with the calibration, or, where it cannot be measured
    or is implausible, remember that until the next calibration.  The line to show, or None."""
    cal = load_cached("cpu", default_threads() if threads is None else threads)
    if (cal is None or cal.link_cpu_seconds or KEY in cal.untimed or not cal.loopback_bytes_per_s
            or not wanted(cfgs, cal.cores, cal.threads)):
        return None
    cpu, bad = two_rank_figure(cal, KEY, lambda: {k: v for k, v in measure().items() if k in ("message", "byte")},
                               lambda c: link_cpu_problems(c, cal.loopback_latency_s, cal.loopback_bytes_per_s),
                               wall_clock=False)
    if bad:
        return (f"time model: gloo's link CPU part {bad}; every message stretched by the sharing until the next "
                "`batchlab calibrate`")
    cal.link_cpu_seconds = cpu
    save(cal)
    return (f"time model: measured once how much of gloo's link is the ranks' own CPU work "
            f"({cpu['message'] * 1e6:.0f} us a message, {cpu['byte'] * 1e9:.2f} ns a byte): only that "
            "stretches where ranks time-share the cores; cached with the calibration")
