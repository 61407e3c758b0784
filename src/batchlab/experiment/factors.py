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
            values.append(int(open(path).read()) / 1000)
        except (OSError, ValueError):
            pass
    if not values:
        try:
            with open("/proc/cpuinfo") as f:
                values = [float(line.split(":", 1)[1]) for line in f if line.startswith("cpu MHz")]
        except (OSError, ValueError):
            values = []
    return round(sum(values) / len(values), 1) if values else None


def cpu_times() -> dict[int, tuple[str, float]]:
    """pid -> (command name, user+system CPU seconds) for every readable process."""
    out = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            text = open(stat).read()
        except OSError:
            continue
        name = text[text.find("(") + 1:text.rfind(")")]
        rest = text[text.rfind(")") + 2:].split()
        try:  # fields 14 and 15 of /proc/PID/stat (utime, stime), counted after the name
            out[int(stat.split("/")[2])] = (name, (int(rest[11]) + int(rest[12])) / CLOCK_TICKS)
        except (IndexError, ValueError):
            continue
    return out


@dataclass
class Snapshot:
    wall: float = field(default_factory=time.monotonic)
    load: list[float] | None = field(default_factory=load_average)
    mhz: float | None = field(default_factory=cpu_mhz)
    cpu: dict[int, tuple[str, float]] = field(default_factory=cpu_times)


def busy_processes(before: Snapshot, after: Snapshot) -> list[dict[str, Any]]:
    """Other processes alive over the whole run that used more than BUSY_SHARE of a core."""
    elapsed = max(after.wall - before.wall, 1e-9)
    mine = {os.getpid(), os.getppid()}
    busy = []
    for pid, (name, end) in after.cpu.items():
        if pid in mine or pid not in before.cpu:
            continue
        share = (end - before.cpu[pid][1]) / elapsed
        if share > BUSY_SHARE:
            busy.append({"pid": pid, "name": name, "cpu_share": round(share, 2)})
    return sorted(busy, key=lambda d: -d["cpu_share"])


def uncontrolled(before: Snapshot, after: Snapshot, timing_noise: dict[str, Any], note: str | None) -> dict[str, Any]:
    busy = busy_processes(before, after)
    return {"load_average": {"before": before.load, "after": after.load},
            "busy_processes": {"count": len(busy), "top": busy[:5],
                               "rule": f"other processes using > {BUSY_SHARE:.0%} of a core during the run"},
            "cpu_mhz": {"before": before.mhz, "after": after.mhz},
            "cpu_count": os.cpu_count(),
            "timing_noise": timing_noise,
            "note": note or ""}
