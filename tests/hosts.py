"""Other hosts' calibrations, for running tests as on CPUs the project was not developed on (test support).

A profile turns a real calibration of this CPU into what another CPU measures: faster matmuls and slower memory
(a wide-vector server), a slower everything with dearer dispatch (an old laptop), a dispatch cheaper than the
cost model's work prices (the AMD EPYC that crashed the family ratio), and degenerate caches a loaded or broken
run leaves behind (one point of the curve at 4.1 MFLOP/s; zero rates), which must be caught, not priced.

``pytest --host-profile NAME`` seeds the run's calibration cache with a profile for the whole suite
(tests/conftest.py); tests/calibrate/test_other_hosts.py runs the README's commands under each in every run.
"""
from __future__ import annotations

import dataclasses
from typing import Callable


def _scaled(cal, matmul: float = 1.0, memory: float = 1.0, dispatch: float = 1.0, elements: float = 1.0):
    rates = lambda curve, f: [[x, y * f] for x, y in curve]  # noqa: E731
    return dataclasses.replace(
        cal, matmul_flops_fp32=cal.matmul_flops_fp32 * matmul,
        matmul_flops_bf16=cal.matmul_flops_bf16 * matmul if cal.matmul_flops_bf16 else None,
        matmul_curve={k: rates(v, matmul) for k, v in cal.matmul_curve.items()},
        matmul_start={k: [[x, s / matmul] for x, s in v] for k, v in cal.matmul_start.items()},
        memory_bytes_per_s=cal.memory_bytes_per_s * memory, memory_curve=rates(cal.memory_curve, memory),
        memory_curve_bf16=rates(cal.memory_curve_bf16, memory),
        memory_curve_inplace=rates(cal.memory_curve_inplace, memory),
        strided_bytes_per_s=cal.strided_bytes_per_s * memory,
        element_seconds={k: s * elements for k, s in cal.element_seconds.items()},
        dispatch_seconds={k: s * dispatch for k, s in cal.dispatch_seconds.items()},
        dispatch_seconds_autocast={k: s * dispatch for k, s in cal.dispatch_seconds_autocast.items()})


def _poisoned(cal):
    return dataclasses.replace(cal, matmul_curve={**cal.matmul_curve, "fp32": [[65536.0, 4.1e6]]},
                               matmul_flops_fp32=4.1e6)


def _zeros(cal):
    return dataclasses.replace(cal, memory_bytes_per_s=0.0, dispatch_seconds=dict.fromkeys(cal.dispatch_seconds, 0.0))


PROFILES: dict[str, Callable] = {
    "wide-server": lambda c: _scaled(c, matmul=4.0, memory=0.5),
    "old-laptop": lambda c: _scaled(c, matmul=0.5, memory=0.7, dispatch=3.0, elements=2.0),
    "cheap-dispatch": lambda c: _scaled(c, dispatch=0.1),
    "poisoned": _poisoned,  # degenerate: must be ignored and measured again
    "zeros": _zeros,  # degenerate
}
DEGENERATE = ("poisoned", "zeros")


def seed(name: str) -> None:
    """Measure this CPU briefly at one thread (the suite's threads) and cache profile ``name`` of it."""
    from batchlab.calibrate import measure, save

    save(PROFILES[name](measure("cpu", seconds=1.0, threads=1, rounds=1)))


def stub_calibration(**extra):
    """A cached CPU calibration of this host with round figures, for tests of what is measured once and cached
    beside it."""
    import torch
    from batchlab.calibrate import Calibration
    from batchlab.host import cpu_hardware
    return Calibration(device="cpu", hardware=f"{cpu_hardware()}, 1 threads", torch_device="cpu",
                       matmul_flops_fp32=1e10, matmul_flops_bf16=None, memory_bytes_per_s=1e9, matmul_size={},
                       copy_bytes=1, threads=1, measured_at="2026-01-01T00:00:00+00:00",
                       torch_version=torch.__version__, seconds=1.0, **extra)
