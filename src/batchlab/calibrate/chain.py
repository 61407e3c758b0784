"""Gloo's all-reduce between two local processes as a tensor-parallel micro-batch meets it: one in a chain of
many, each a short compute gap after the last, priced by the chain's mean.

The link calibration (link.py) takes the median of single all-reduces, each after a barrier and a step's compute:
right for a data-parallel update's few gradient all-reduces, but a TP micro-batch runs a collective every layer
or two, and its wall pays the mean of them.  Gloo's per-call time between local processes has a heavy tail (a
thread wake-up that misses its core, the peer's), so the mean is well above the median (docs/cpu.md, "Figures
behind the code's choices").  Here two ranks with a core each run, per gap, chains of all-reduces of
``CHAIN_BYTES`` with ``gap`` seconds of matmuls before each; a chain's figure is the mean call time (its tail
included), the two ranks' mean; per gap the median over the chains of a few pairs forked in turn (a chain that
other processes' load stretched whole, or a pair the OS placed badly, does not move it).  Cached with the CPU's
calibration (``Calibration.link_chain_seconds``) the first time measure or compare meets a tensor-parallel CPU
layout; formula/links.py ``Link.in_chain`` prices each TP collective from it at the micro-batch's gap.  Torch is
imported inside the functions.
"""
from __future__ import annotations

import statistics
import time

from batchlab.cache.calibrations import default_threads, load_cached, save
from batchlab.calibrate.link import BURST_S, burst, join, two_ranks
from batchlab.calibrate.oneoff import two_rank_figure
from batchlab.formula.links import CHAIN_BYTES
from batchlab.formula.plausible import link_chain_problems

GAPS = (0.0, 0.5e-3, 2e-3, 8e-3)  # seconds of compute before each all-reduce: back to back up to a wide layer
CALLS = 30  # all-reduces per chain: enough for the tail to show in its mean
CHAINS = 4  # per gap and pair of ranks
LAUNCHES = 4  # pairs forked in turn: how the OS places a pair and its gloo threads holds for its life
WARMUP = 5
TIMEOUT_S = 90


def _rank(rank: int, port: int, arg: tuple[tuple[float, ...], int], results) -> None:
    gaps, chains = arg
    import torch
    import torch.distributed as dist

    join(rank, port, TIMEOUT_S)
    try:
        a, per_burst = burst()  # matmuls of the link calibration's step: both ranks run the same count
        x = torch.ones(CHAIN_BYTES // 4)
        for _ in range(WARMUP):
            dist.all_reduce(x)
        out: dict[float, list[float]] = {}
        for gap in gaps:
            matmuls = int(per_burst * gap / BURST_S)
            for _ in range(chains):
                dist.barrier()
                spent = 0.0
                for _ in range(CALLS):
                    for _ in range(matmuls):
                        a @ a
                    t = time.perf_counter()
                    dist.all_reduce(x)
                    spent += time.perf_counter() - t
                out.setdefault(gap, []).append(spent / CALLS)
        results.put((rank, out))
    finally:
        dist.destroy_process_group()


def measure(gaps: tuple[float, ...] = GAPS, chains: int = CHAINS, launches: int = LAUNCHES) -> dict[float, float]:
    """{gap seconds: seconds of one all-reduce of ``CHAIN_BYTES`` between two local ranks, as a chain of them
    ``gap`` apart pays it}; RuntimeError where two ranks cannot run here."""
    means: dict[float, list[float]] = {g: [] for g in gaps}
    for _ in range(launches):
        got = two_ranks(_rank, (gaps, chains), "chained all-reduce timing", TIMEOUT_S)
        for g in gaps:
            means[g] += [(x + y) / 2 for x, y in zip(got[0][g], got[1][g])]
    return {g: statistics.median(v) for g, v in means.items()}


def wanted(cfgs: tuple) -> bool:
    return any(c.device == "cpu" and c.parallel.tp > 1 for c in cfgs)


KEY = "link_chain"  # its ``Calibration.untimed`` entry where the measurement failed or gave nonsense


def ensure(cfgs: tuple, threads: int | None = None) -> str | None:
    """Where ``cfgs`` run tensor parallelism on local CPU ranks and this CPU's calibration (at ``threads``) lacks
    the chained all-reduce's figures: measure them (a few seconds) and cache them with the calibration, or, where
    they cannot be measured or are implausible, remember that until the next calibration.  The line to show, or
    None."""
    if not wanted(cfgs):
        return None
    cal = load_cached("cpu", default_threads() if threads is None else threads)
    if cal is None or cal.link_chain_seconds or KEY in cal.untimed or not cal.loopback_bytes_per_s:
        return None
    curve, bad = two_rank_figure(cal, KEY, lambda: {f"{g:g}": s for g, s in measure().items()},
                                 lambda c: link_chain_problems(c, cal.loopback_warm_latency_s))
    if bad:
        return (f"time model: gloo's chained all-reduce {bad}; TP collectives priced from the link's medians until "
                "the next `batchlab calibrate`")
    if curve is None:
        return ("time model: gloo's chained all-reduce timed while other processes kept the cores busy: not cached, "
                "timed again next time; TP collectives priced from the link's medians meanwhile")
    cal.link_chain_seconds = curve
    save(cal)
    return ("time model: measured once gloo's all-reduce as a chain of them pays it (the mean, its tail included: "
            f"{text(curve)}); tensor-parallel collectives are priced from it; cached with the calibration")


def text(curve: dict[str, float]) -> str:
    """The chained all-reduce's figures, gap by gap ("" where none)."""
    return ", ".join(f"{s * 1e3:.2f} ms after {float(g) * 1e3:g} ms" for g, s in curve.items())
