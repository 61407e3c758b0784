"""What this machine is, asked without torch: the NVIDIA GPUs' names (nvidia-smi) and the CPU's model.

Imports nothing from batchlab, so the config (``--device local``), the calibration cache and the
measurement environment all read the host the same way.
"""
from __future__ import annotations

import os
import platform
import shutil
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
