"""Uncontrolled factors: what else the machine was doing while the experiment ran (Linux /proc and /sys;
each figure is absent where it cannot be read).  Torch-free."""
from __future__ import annotations

import glob
import os
import time
from dataclasses import dataclass, field
from typing import Any

BUSY_SHARE = 0.10  # another process that used this share of one core during the run counts as busy
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _read(path: str) -> str:
    with open(path) as f:  # closed at once: /proc is read hundreds of times a run (an unclosed file warns at GC)
        return f.read()


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def cpu_mhz() -> float | None:
    """Mean current CPU frequency: cpufreq in /sys (kHz), else /proc/cpuinfo's 'cpu MHz'."""
    values = []
    for path in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/cpufreq/scaling_cur_freq"):
        try:
            values.append(int(_read(path)) / 1000)
        except (OSError, ValueError):
            pass
    if not values:
        try:
            with open("/proc/cpuinfo") as f:
                values = [float(line.split(":", 1)[1]) for line in f if line.startswith("cpu MHz")]
        except (OSError, ValueError):
            values = []
    return round(sum(values) / len(values), 1) if values else None


@dataclass(frozen=True)
class Proc:
    name: str
    ppid: int
    cpu_seconds: float  # user + system since the process started
    start_seconds: float  # since boot
    reaped_seconds: float = 0.0  # user + system of its children it has waited for (theirs recursively)


def cpu_times() -> dict[int, Proc]:
    """pid -> Proc for every readable process (/proc/PID/stat: fields 4 ppid, 14-15 utime/stime, 16-17
    cutime/cstime, 22 start)."""
    out = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            text = _read(stat)
        except OSError:
            continue
        name = text[text.find("(") + 1:text.rfind(")")]
        rest = text[text.rfind(")") + 2:].split()  # rest[0] is field 3
        try:
            own, reaped = int(rest[11]) + int(rest[12]), int(rest[13]) + int(rest[14])
            out[int(stat.split("/")[2])] = Proc(name, int(rest[1]), own / CLOCK_TICKS, int(rest[19]) / CLOCK_TICKS,
                                                reaped / CLOCK_TICKS)
        except (IndexError, ValueError):
            continue
    return out


def uptime() -> float | None:
    try:
        return float(_read("/proc/uptime").split()[0])
    except (OSError, ValueError, IndexError):
        return None


def busy_cpu_seconds() -> float | None:
    """CPU seconds all CPUs spent not idle since boot (/proc/stat's first line: all but idle and iowait)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return (sum(fields) - fields[3] - fields[4]) / CLOCK_TICKS


def tree_cpu_seconds(root: int, procs: dict[int, Proc]) -> float:
    """CPU seconds of ``root``'s tree: each live process's own and its waited-for children's.  The measuring
    processes are forks of the pre-imported process (host/warm.py), which waits for them, not this one: in
    ``os.times()``'s children they are missing until that process ends."""
    return sum(procs[pid].cpu_seconds + procs[pid].reaped_seconds for pid in descendants(root, procs) if pid in procs)


def descendants(root: int, procs: dict[int, Proc]) -> set[int]:
    """root and every process below it (the measured subprocesses are ours, not competitors)."""
    children: dict[int, list[int]] = {}
    for pid, p in procs.items():
        children.setdefault(p.ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo += children.get(pid, [])
    return out


class Usage:
    """CPU seconds each other process used across successive /proc samples, kept incrementally (a long
    observed training run is sampled for hours).  A process seen in any sample counts: one born after
    ``run_start`` (seconds since boot) from its start, one gone before the end up to its last sighting."""

    def __init__(self, run_start: float, mine: int):
        self.run_start, self.mine = run_start, mine
        self.used: dict[int, tuple[str, float]] = {}
        self.last: dict[int, Proc] = {}
        self.ours: set[int] = set()

    def add(self, procs: dict[int, Proc]) -> None:
        first = not self.last
        self.ours |= descendants(self.mine, procs)
        for pid, p in procs.items():
            prev = self.last.get(pid)
            if prev is not None and prev.start_seconds == p.start_seconds:
                delta = p.cpu_seconds - prev.cpu_seconds
            else:  # first sighting (or a reused pid): all of it if it began during the run
                delta = p.cpu_seconds if not first and p.start_seconds >= self.run_start else 0.0
            self.used[pid] = (p.name, self.used.get(pid, (p.name, 0.0))[1] + max(delta, 0.0))
        self.last = {**self.last, **procs}

    def others(self) -> dict[int, tuple[str, float]]:
        return {pid: u for pid, u in self.used.items() if pid not in self.ours and pid != os.getppid()}


class LoadSampler:
    """What competed for the CPU while the experiment ran: /proc sampled from start() to stop(), and
    /proc/stat's machine-wide busy time from start to stop (which also catches processes too short-lived for
    any sample).  ``mine``: the process whose tree is ours.

    ``thread=True``: sampled every ``interval`` seconds on a daemon thread (the experiment runs in subprocesses).
    ``thread=False``: sampled only when the caller calls ``poll()`` (an observed run calls it after each update,
    outside the timed window), at most every ``interval`` seconds and spaced so that sampling takes at most
    ``max_share`` of the wall time: a thread reading /proc while the user's update runs would take CPU and the
    GIL from it (milliseconds a sample, growing with the process count: docs/cpu.md).
    """

    def __init__(self, interval: float = 0.5, mine: int | None = None, thread: bool = True,
                 max_share: float = 0.005):
        import threading

        self.interval, self.mine, self.threaded = interval, os.getpid() if mine is None else mine, thread
        self.max_share = max_share
        self.samples = 0
        self.sample_seconds = 0.0  # wall time spent reading /proc for the samples
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="batchlab-factors", daemon=True) if thread else None
        self._next = 0.0  # polled: monotonic time before which poll() does not sample
        self.result: dict[str, Any] | None = None

    @property
    def rule(self) -> str:
        if self.threaded:
            return f"/proc sampled every {self.interval:g} s"
        return (f"/proc sampled between updates (outside the timed window), at most every {self.interval:g} s "
                f"and at most {self.max_share:.1%} of the wall time")

    def start(self) -> "LoadSampler":
        self.before = Snapshot()
        up = uptime()
        self._busy0, self._own0 = busy_cpu_seconds(), tree_cpu_seconds(self.mine, self.before.cpu)
        self.usage = Usage(up if up is not None else float("inf"), self.mine)
        self._add(self.before.cpu)
        self._next = time.monotonic() + self.interval
        if self._thread is not None:
            self._thread.start()
        return self

    def _add(self, procs: dict[int, Proc]) -> None:
        self.usage.add(procs)
        self.samples += 1

    def _sample(self) -> float:
        t0 = time.monotonic()
        self._add(cpu_times())
        t1 = time.monotonic()
        self.sample_seconds += t1 - t0
        return t1 - t0

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def poll(self) -> None:
        """Sample now if the polled spacing has passed (a no-op with ``thread=True`` or after stop())."""
        if self._thread is not None or self.result is not None or time.monotonic() < self._next:
            return
        cost = self._sample()
        self._next = time.monotonic() + max(self.interval, cost / self.max_share)

    def stop(self) -> dict[str, Any]:
        """The usage over the run (idempotent: a second call returns the first one's)."""
        if self.result is None:
            self._stop.set()
            if self._thread is not None:
                self._thread.join()
            after = Snapshot()
            self._add(after.cpu)
            elapsed = max(after.wall - self.before.wall, 1e-9)
            busy = sorted(({"pid": pid, "name": name, "cpu_share": round(sec / elapsed, 2)}
                           for pid, (name, sec) in self.usage.others().items() if sec / elapsed > BUSY_SHARE),
                          key=lambda d: -d["cpu_share"])
            busy1, others = busy_cpu_seconds(), None
            if self._busy0 is not None and busy1 is not None:
                own = tree_cpu_seconds(self.mine, after.cpu) - self._own0
                others = max(0.0, (busy1 - self._busy0) - own) / elapsed
            self.result = {"before": self.before, "after": after, "busy": busy, "other_cores": others,
                           "samples": self.samples}
        return self.result


@dataclass
class Snapshot:
    wall: float = field(default_factory=time.monotonic)
    load: list[float] | None = field(default_factory=load_average)
    mhz: float | None = field(default_factory=cpu_mhz)
    cpu: dict[int, Proc] = field(default_factory=cpu_times)


def uncontrolled(sampler: LoadSampler, timing_noise: dict[str, Any], note: str | None) -> dict[str, Any]:
    """The record's ``factors``: load, what else used the CPU during the run (sampled), clock, timing noise."""
    u = sampler.stop()
    before, after, busy = u["before"], u["after"], u["busy"]
    cores = u["other_cores"]
    return {"load_average": {"before": before.load, "after": after.load},
            "busy_processes": {"count": len(busy), "top": busy[:5], "samples": u["samples"],
                               "sample_seconds": round(sampler.sample_seconds, 4),
                               "rule": f"other processes (not this one or its subprocesses) using > {BUSY_SHARE:.0%} "
                                       f"of a core during the run, {sampler.rule}"},
            "other_cpu": {"cores": round(cores, 2) if cores is not None else None,
                          "rule": "machine-wide busy CPU time (/proc/stat) minus this process tree's, over the "
                                  "run's wall time: includes processes too short-lived to be sampled"},
            "cpu_mhz": {"before": before.mhz, "after": after.mhz},
            "cpu_count": os.cpu_count(),
            "timing_noise": timing_noise,
            "note": note or ""}
