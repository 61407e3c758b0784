"""What this machine is, asked without torch: the NVIDIA GPUs' names (nvidia-smi) and the CPU's model; and a
free loopback port for process groups started on it.

Imports nothing from batchlab, so the config (``--device local``), the calibration cache and the
measurement environment all read the host the same way.
"""
from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess


def gpu_names() -> list[str]:
    """Names of the local NVIDIA GPUs as the driver reports them (``NVIDIA H100 80GB HBM3``), or []."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else what ``platform`` knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def memory_bytes() -> int | None:
    """This machine's memory (``MemTotal`` of ``/proc/meminfo``), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024  # the file's unit is KiB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        return None


def cpu_hardware() -> str:
    """CPU model and core count: what a CPU calibration stands for."""
    return f"{cpu_name()}, {os.cpu_count()} cores"


def _cpu_flags_and_mhz() -> tuple[set[str], float | None]:
    flags: set[str] = set()
    mhz = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
                elif line.startswith("cpu MHz") and mhz is None:
                    mhz = float(line.split(":", 1)[1])
    except (OSError, ValueError):
        pass
    return flags, mhz


def cpu_vector_flops_per_cycle() -> int:
    """fp32 FLOPs one core issues per cycle: two FMA ports x SIMD lanes x 2 (multiply + add)."""
    flags, _ = _cpu_flags_and_mhz()
    lanes = 16 if "avx512f" in flags else 8 if "avx2" in flags else 4
    return 2 * lanes * (2 if "fma" in flags or "avx512f" in flags else 1)


def cpu_peak_flops() -> tuple[float, str]:
    """This machine's nominal fp32 peak, cores x clock x vector FLOPs per cycle, and how it was read."""
    _, mhz = _cpu_flags_and_mhz()
    ghz = (mhz or 2000.0) / 1000
    cores = os.cpu_count() or 1
    per_cycle = cpu_vector_flops_per_cycle()
    how = (f"{cores} cores x {ghz:.2f} GHz{'' if mhz else ' (assumed)'} x {per_cycle} fp32 FLOP/cycle "
           "(/proc/cpuinfo)")
    return cores * ghz * 1e9 * per_cycle, how


def free_port() -> int:
    """A TCP port free on the loopback now, for a process group started without torchrun."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
