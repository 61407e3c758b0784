"""Measured ceilings of the local device: achievable matmul FLOP/s (fp32, bf16) and memory bandwidth.

``batchlab calibrate`` runs a few seconds of large matmuls and copies, and caches the result per device
under platformdirs' user cache dir; the formula's time model then uses it for the local device instead of
a datasheet figure, and says so (``Calibration.source``).

    from batchlab.calibrate import load_cached
    cal = load_cached("cpu")          # a batchlab device name (RunConfig.device), or None if never run here
    cal.matmul_flops("bf16-mixed")    # FLOP/s; cal.memory_bytes_per_s; cal.source says where they came from
    estimate(cfg, load_all())         # the caller reads the cache; formula.estimate stays a pure function

Importing this module does not import torch (callers of the formula read the cache); measuring does.
"""
from __future__ import annotations

import datetime as _dt
import json
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from batchlab.config import ConfigError, Precision
from batchlab.host import cpu_hardware

@dataclass
class Calibration:
    device: str  # batchlab device name the figures stand for ("cpu", "h200", ... or the backend)
    hardware: str  # what was measured: CPU model and threads, or the GPU's name
    torch_device: str  # cpu | cuda:0 | mps
    matmul_flops_fp32: float  # FLOP/s, median over repeats of the best square size
    matmul_flops_bf16: float | None  # None where bf16 matmuls are not supported
    memory_bytes_per_s: float  # copy bandwidth: bytes read + written per second
    matmul_size: dict[str, int] = field(default_factory=dict)  # dtype -> n of the n x n matmul used
    copy_bytes: int = 0  # size of the copied buffer
    threads: int = 0  # torch intra-op threads (CPU rates scale with them)
    measured_at: str = ""  # ISO 8601, UTC
    torch_version: str = ""
    seconds: float = 0.0  # how long calibrating took
    provenance: str = "calibrated"

    @property
    def source(self) -> str:
        """How the numbers were obtained, for every time prediction that uses them."""
        return f"calibrated on {self.hardware} ({self.torch_device}) at {self.measured_at}"

    def matmul_flops(self, precision: Precision | str) -> float:
        """The matmul ceiling for a precision: fp32, or bf16 for every 16-bit compute precision (fp16 is not
        measured separately; where bf16 is unsupported, the fp32 figure)."""
        p = Precision.parse("precision", precision)
        if p is Precision.FP32 or self.matmul_flops_bf16 is None:
            return self.matmul_flops_fp32
        return self.matmul_flops_bf16

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["source"] = self.source
        return out


# ------------------------------------------------------------------------------------------ cache

def cache_dir() -> Path:
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("batchlab")) / "calibration"


def _cache_path(device: str) -> Path:
    return cache_dir() / (re.sub(r"[^A-Za-z0-9_.-]+", "_", device) + ".json")


def save(cal: Calibration) -> Path:
    path = _cache_path(cal.device)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cal.to_dict(), indent=2))
    tmp.replace(path)  # atomic: a reader never sees half a file
    return path


def load_cached(device_name: str) -> Calibration | None:
    """The cached calibration for a batchlab device name (``RunConfig.device``), or None.

    A CPU entry measured on other hardware (a home directory shared between machines) is ignored.
    """
    return _read(_cache_path(device_name))


def load_all() -> dict[str, Calibration]:
    """Every usable cached calibration, by batchlab device name: what ``formula.estimate`` is given."""
    found = (_read(p) for p in sorted(cache_dir().glob("*.json")))
    return {cal.device: cal for cal in found if cal is not None}


def _read(path: Path) -> Calibration | None:
    try:
        raw = json.loads(path.read_text())
        names = {f for f in Calibration.__dataclass_fields__}
        cal = Calibration(**{k: v for k, v in raw.items() if k in names})
    except (OSError, ValueError, TypeError):
        return None
    if cal.torch_device == "cpu" and not cal.hardware.startswith(cpu_hardware()):
        return None
    return cal


# ------------------------------------------------------------------------------------------ measuring

def timed_rates(fn: Callable[[], Any], work: float, seconds: float, sync: Callable[[], None],
                clock: Callable[[], float] = time.perf_counter, min_samples: int = 3) -> list[float]:
    """Rates (work per second) of repeated ``fn()`` calls for about ``seconds``, one warm-up call first.

    Each sample times enough calls to last ~20 ms, so launch and clock overheads stay small on a GPU.
    """
    t0 = clock()
    fn()
    sync()
    once = max(clock() - t0, 1e-9)
    calls = max(1, int(0.02 / once))
    rates: list[float] = []
    end = clock() + seconds
    while clock() < end or len(rates) < min_samples:
        t = clock()
        for _ in range(calls):
            fn()
        sync()
        rates.append(work * calls / max(clock() - t, 1e-12))
    return rates


def _matmul_rate(device, dtype, sizes, seconds: float, sync) -> tuple[float, int] | None:
    """Best median matmul FLOP/s over square sizes (2 n^3 FLOPs per n x n @ n x n), and that n."""
    import torch

    best: tuple[float, int] | None = None
    per_size = seconds / len(sizes)
    for n in sizes:
        try:
            a = torch.randn(n, n, device=device).to(dtype)
            b = torch.randn(n, n, device=device).to(dtype)
            rate = statistics.median(timed_rates(lambda: torch.mm(a, b), 2 * n**3, per_size, sync, min_samples=2))
        except (RuntimeError, TypeError):  # dtype not supported by this device's matmul
            return best
        if best is None or rate > best[0]:
            best = (rate, n)
        if 2 * n**3 / rate > per_size / 4:  # larger sizes would overrun the time asked for
            break
    return best


def _copy_rate(device, nbytes: int, seconds: float, sync) -> float:
    """Bytes read + written per second by a device-local copy much larger than the caches."""
    import torch

    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return statistics.median(timed_rates(lambda: dst.copy_(src), 2 * src.nbytes, seconds, sync))


def _hardware(device) -> str:
    import torch

    if device.type == "cpu":
        return f"{cpu_hardware()}, {torch.get_num_threads()} threads"
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def _defaults(device) -> tuple[tuple[int, ...], int]:
    # sizes large enough to reach the ceiling, small enough for a few seconds on a 2-core CPU
    if device.type == "cpu":
        return (512, 1024, 2048), 256 * 2**20
    copy = 2 * 2**30
    if device.type == "cuda":
        import torch

        copy = min(copy, torch.cuda.mem_get_info(device)[0] // 4)  # source + destination, room to spare
    return (2048, 4096, 8192), copy


def measure(torch_device: str = "cpu", seconds: float = 3.0, sizes: tuple[int, ...] | None = None,
            copy_bytes: int | None = None) -> Calibration:
    """Measure this device's ceilings in about ``seconds`` (40% fp32 matmul, 40% bf16, 20% copy)."""
    import torch

    from batchlab.measure.clock import synchronizer
    from batchlab.measure.device import catalogue_name, usable

    if seconds <= 0:
        raise ConfigError("seconds", f"must be > 0, got {seconds}")
    device = usable(torch_device)
    try:
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as e:
        raise ConfigError("torch_device", f"{torch_device!r} is not usable here: {e}") from None
    default_sizes, default_copy = _defaults(device)
    sizes, copy_bytes = sizes or default_sizes, copy_bytes or default_copy
    sync = synchronizer(device)
    start = time.perf_counter()
    fp32 = _matmul_rate(device, torch.float32, sizes, 0.4 * seconds, sync)
    bf16 = _matmul_rate(device, torch.bfloat16, sizes, 0.4 * seconds, sync)
    copy = _copy_rate(device, copy_bytes, 0.2 * seconds, sync)
    assert fp32 is not None, "fp32 matmul failed"
    return Calibration(
        device=catalogue_name(device), hardware=_hardware(device), torch_device=str(device),
        matmul_flops_fp32=fp32[0], matmul_flops_bf16=bf16[0] if bf16 else None, memory_bytes_per_s=copy,
        matmul_size={"fp32": fp32[1], **({"bf16": bf16[1]} if bf16 else {})}, copy_bytes=copy_bytes,
        threads=torch.get_num_threads(), measured_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        torch_version=torch.__version__, seconds=time.perf_counter() - start)
