"""What this machine is, and how batchlab's CPU measuring processes are started and kept steady.

The rest of batchlab asks the host through these names only (a GPU measurement needs the first group alone):

    what the machine is     cpu_name(), cpu_hardware(), gpu_names(), memory_bytes(), cpu_peak_flops(), free_port()
    starting a measuring    measuring_env(env): the environment a measuring process starts with (the allocator
    process                 regime); needs_own_process(): this process lacks the regime (a calibration moves to a
                            child); the module host.warm: the pre-imported process CPU measurements are
                            forked from
    around timed updates    TimedUpdates: heap pre-touch, speed probe reads, page faults per update;
                            SpeedProbe (the calibration reads it too, for the reference)
    the state beside a      state(env): the allocator regime in one line; warning(): where it cannot be set;
    result                  LoadSampler / uncontrolled: what else used the CPU during a run
    adjusting a CPU time    speed_factor(reads, reference): how much slower the host ran than while calibrated;
                            PROBE_BUNDLE names what the probe times

Modules: machine (facts), regime (allocator), warm + preload (pre-imported worker), speed (probe), load (/proc
sampling), timed (the timed-update helper).  Importing this package imports no torch.
"""
from __future__ import annotations

from batchlab.host import regime
from batchlab.host.machine import (cpu_hardware, cpu_name, cpu_peak_flops, cpu_vector_flops_per_cycle, free_port,
                                   gpu_names, memory_bytes)
from batchlab.host.speed import BUNDLE as PROBE_BUNDLE
from batchlab.host.speed import SpeedProbe
from batchlab.host.speed import host_speed as speed_factor
from batchlab.host.timed import TimedUpdates


def measuring_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a process batchlab starts to measure in: the allocator regime's variables added."""
    return regime.steady_env(env)


def needs_own_process() -> bool:
    """This process runs glibc without the regime: a CPU calibration must run in a child started in it."""
    return regime.missing()


def state(env: dict[str, str] | None = None) -> str:
    """The allocator regime of a process started with ``env`` (default: this one), as a report states it."""
    return regime.describe(env)


def warning() -> str | None:
    """What to tell the user where batchlab cannot set the regime (an allocator other than glibc)."""
    return regime.warning()


def __getattr__(name: str):
    # the /proc sampler and the pre-imported worker load on first use: `import batchlab.host` stays small
    if name in ("LoadSampler", "uncontrolled"):
        from batchlab.host import load

        return getattr(load, name)
    raise AttributeError(f"module 'batchlab.host' has no attribute {name!r}")


__all__ = ["PROBE_BUNDLE", "LoadSampler", "SpeedProbe", "TimedUpdates", "cpu_hardware", "cpu_name", "cpu_peak_flops",
           "cpu_vector_flops_per_cycle", "free_port", "gpu_names", "measuring_env", "memory_bytes",
           "needs_own_process", "speed_factor", "state", "uncontrolled", "warning"]
