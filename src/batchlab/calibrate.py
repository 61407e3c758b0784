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
import os
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from batchlab.config import ConfigError, Precision
from batchlab.formula.opcost import DISPATCH_KIND, OpCosts, Phase
from batchlab.host import cpu_hardware

@dataclass
class Calibration:
    device: str  # batchlab device name the figures stand for ("cpu", "h200", ... or the backend)
    hardware: str  # what was measured: CPU model and threads, or the GPU's name
    torch_device: str  # cpu | cuda:0 | mps
    matmul_flops_fp32: float  # FLOP/s, the best shape class (what a large matmul reaches)
    matmul_flops_bf16: float | None  # None where bf16 matmuls are not supported
    memory_bytes_per_s: float  # element-wise bandwidth at the largest size: bytes read + written per second
    matmul_size: dict[str, int] = field(default_factory=dict)  # dtype -> FLOPs per call of the best class
    copy_bytes: int = 0  # bytes one call of the largest bandwidth size moves
    threads: int = 0  # torch intra-op threads (CPU rates scale with them)
    measured_at: str = ""  # ISO 8601, UTC
    torch_version: str = ""
    seconds: float = 0.0  # how long calibrating took
    # the per-op time model's parameters (formula/opcost.py OpCosts)
    matmul_curve: dict[str, list[list[float]]] = field(default_factory=dict)  # dtype -> [[FLOPs/call, FLOP/s]]
    memory_curve: list[list[float]] = field(default_factory=list)  # [[bytes/call, bytes/s]], fp32 add
    memory_curve_bf16: list[list[float]] = field(default_factory=list)  # the same add in bf16
    strided_bytes_per_s: float = 0.0  # a transposed view copied contiguous, read + write
    element_seconds: dict[str, float] = field(default_factory=dict)  # "activation:fp32" -> s per element
    dispatch_seconds: dict[str, float] = field(default_factory=dict)  # forward | backward | plain -> s per op
    provenance: str = "calibrated"

    @property
    def source(self) -> str:
        """How the numbers were obtained, for every time prediction that uses them."""
        return (f"calibrated on {self.hardware} ({self.torch_device}), torch {self.torch_version}, "
                f"{self.threads} thread(s), at {self.measured_at}, {self.seconds:.1f} s")

    def matmul_flops(self, precision: Precision | str) -> float:
        """The matmul ceiling for a precision: fp32, or bf16 for every 16-bit compute precision (fp16 is not
        measured separately; where bf16 is unsupported, the fp32 figure)."""
        p = Precision.parse("precision", precision)
        if p is Precision.FP32 or self.matmul_flops_bf16 is None:
            return self.matmul_flops_fp32
        return self.matmul_flops_bf16

    def op_costs(self) -> OpCosts | None:
        """The per-op model's parameters, or None for a cache written before the per-op model existed."""
        if not (self.matmul_curve and self.memory_curve and self.dispatch_seconds and self.strided_bytes_per_s):
            return None
        return OpCosts(matmul={k: tuple(map(tuple, v)) for k, v in self.matmul_curve.items()},
                       memory=tuple(map(tuple, self.memory_curve)), strided_bytes_per_s=self.strided_bytes_per_s,
                       memory_low=tuple(map(tuple, self.memory_curve_bf16)) or None,
                       element_seconds=dict(self.element_seconds),
                       dispatch=dict(self.dispatch_seconds), asynchronous=not self.torch_device.startswith("cpu"),
                       source=self.source)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["source"] = self.source
        return out


# ------------------------------------------------------------------------------------------ cache

def cache_dir() -> Path:
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("batchlab")) / "calibration"


def default_threads() -> int:
    """The intra-op threads a torch process here starts with (OMP_NUM_THREADS, else the CPU count)."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "")))
    except ValueError:
        return os.cpu_count() or 1


def _cache_path(device: str, torch_version: str, threads: int) -> Path:
    name = f"{device}-torch{torch_version}-{threads}threads"
    return cache_dir() / (re.sub(r"[^A-Za-z0-9_.-]+", "_", name) + ".json")


def save(cal: Calibration) -> Path:
    path = _cache_path(cal.device, cal.torch_version, cal.threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cal.to_dict(), indent=2))
    tmp.replace(path)  # atomic: a reader never sees half a file
    return path


def load_cached(device_name: str, threads: int | None = None) -> Calibration | None:
    """The cached calibration for a batchlab device name (``RunConfig.device``) at ``threads`` (default: what
    a process here starts with), or None.  CPU rates depend on the thread count, so only an entry measured
    with the same count serves; a CPU entry measured on other hardware (a shared home directory) is ignored.
    """
    return load_all(threads).get(device_name)


def load_all(threads: int | None = None) -> dict[str, Calibration]:
    """Every usable cached calibration, by batchlab device name: what ``formula.estimate`` is given.
    Where one device has several (torch versions), the newest measurement wins."""
    want = default_threads() if threads is None else threads
    found = [cal for cal in (_read(p) for p in sorted(cache_dir().glob("*.json"))) if cal is not None]
    usable = [c for c in found if not c.torch_device.startswith("cpu") or c.threads == want]
    return {cal.device: cal for cal in sorted(usable, key=lambda c: c.measured_at)}


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

    Each sample times enough calls to last ~20 ms (less when ``seconds`` is short), so launch and clock
    overheads stay small on a GPU.
    """
    t0 = clock()
    fn()
    sync()
    once = max(clock() - t0, 1e-9)
    calls = max(1, int(min(0.02, seconds / 5) / once))
    rates: list[float] = []
    end = clock() + seconds
    while clock() < end or len(rates) < min_samples:
        t = clock()
        for _ in range(calls):
            fn()
        sync()
        rates.append(work * calls / max(clock() - t, 1e-12))
    return rates


# Shape classes for the matmul curve, (m, k, n): from a few heads' attention blocks to large projections;
# the time model interpolates between their FLOPs per call.
MATMUL_SHAPES = ((32, 32, 32), (128, 64, 64), (256, 128, 128), (512, 128, 384), (1024, 256, 256),
                 (1024, 512, 1024), (2048, 1024, 1024))
GPU_MATMUL_SHAPES = ((128, 128, 128), (512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048),
                     (4096, 4096, 4096), (8192, 8192, 8192))
# element-wise bandwidth at these operand sizes (elements): in cache, last-level cache, memory
MEMORY_SIZES = (16 * 2**10, 256 * 2**10, 4 * 2**20)
ELEMENTS = 256 * 2**10  # size of the per-element kernels' calls (rows of 128)


COLD_BYTES = 32 * 2**20  # operands cycled through per kernel: beyond a core's L2, as in a training step


def _copies(make, nbytes: int) -> list:
    """Enough independent operand sets that cycling through them keeps each call's operands out of cache."""
    return [make() for _ in range(max(1, min(16, COLD_BYTES // max(nbytes, 1))))]


def _cycling(fn, sets: list):
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(sets)
        return fn(*sets[state["i"]])

    return call


def _curve_point(device, dtype, shape, seconds: float, sync) -> tuple[float, float] | None:
    """(FLOPs per matmul, FLOP/s) of one linear layer's three matmuls at (m, k, n): the forward x @ w^T,
    the input gradient g @ w and the weight gradient g^T @ x, on operands cycled out of cache."""
    import torch

    m, k, n = shape
    try:
        def make():
            return (torch.randn(m, k, device=device).to(dtype), torch.randn(n, k, device=device).to(dtype),
                    torch.randn(m, n, device=device).to(dtype))

        def linear_layer(x, w, g):
            torch.mm(x, w.t())
            torch.mm(g, w)
            torch.mm(g.t(), x)

        elem = torch.empty((), dtype=dtype).element_size()
        call = _cycling(linear_layer, _copies(make, (m * k + n * k + m * n) * elem))
        fl = 2 * m * k * n
        return float(fl), statistics.median(timed_rates(call, 3 * fl, seconds, sync, min_samples=2))
    except (RuntimeError, TypeError):  # dtype not supported by this device's matmul
        return None


def _matmul_curve(device, dtype, shapes, seconds: float, sync) -> list[list[float]]:
    """(FLOPs per call, median FLOP/s) per shape class, ascending; stops where a call would overrun."""
    out: list[list[float]] = []
    for shape in shapes:
        point = _curve_point(device, dtype, shape, seconds / len(shapes), sync)
        if point is None:
            break
        out.append(list(point))
        if 3 * point[0] / point[1] > seconds / len(shapes) / 4:
            break
    return sorted(out)


# attention's batched matmuls (batch entries, s, d): q k^T and p v per (batch, head), and their gradients
BMM_SHAPES = ((16, 32, 32), (32, 64, 32), (32, 128, 32), (32, 256, 64), (16, 512, 64))


def _bmm_curve(device, dtype, seconds: float, sync) -> list[list[float]]:
    """(FLOPs per batch entry, FLOP/s) of attention's six batched matmuls (two forward, four backward, in
    the layouts autograd gives them), per shape class."""
    import torch

    out = []
    for batch, s, d in BMM_SHAPES:
        try:
            q, k = torch.randn(batch, s, d, device=device).to(dtype), torch.randn(batch, s, d, device=device).to(dtype)
            p = torch.randn(batch, s, s, device=device).to(dtype)
        except (RuntimeError, TypeError):
            return out

        def attention():
            torch.bmm(q, k.transpose(1, 2))  # scores
            torch.bmm(p, k)  # p v
            torch.bmm(p.transpose(1, 2), q)  # grad v = p^T grad_y
            torch.bmm(q, k.transpose(1, 2))  # grad p = grad_y v^T
            torch.bmm(p, k)  # grad q = grad_s k
            torch.bmm(p.transpose(1, 2), q)  # grad k = grad_s^T q

        fl = 2 * s * s * d
        out.append([float(fl), statistics.median(timed_rates(attention, 6 * fl * batch, seconds / len(BMM_SHAPES),
                                                             sync, min_samples=2))])
    return sorted(out)


# fused attention (batch x heads, s, d), causal, forward and backward together
SDPA_SHAPES = ((8, 64, 32), (8, 128, 32), (8, 256, 64), (4, 512, 64))


def _sdpa_curve(device, dtype, seconds: float, sync) -> list[list[float]]:
    """(forward FLOPs per (batch, head), FLOP/s) of scaled_dot_product_attention's forward + backward, as
    FlopCounterMode counts them (4 s^2 d + 10 s^2 d per head, no causal halving)."""
    import torch
    import torch.nn.functional as F

    out = []
    for heads, s, d in SDPA_SHAPES:
        try:
            q, k, v = (torch.randn(1, heads, s, d, device=device).to(dtype).requires_grad_() for _ in range(3))
            g = torch.randn(1, heads, s, d, device=device).to(dtype)
        except (RuntimeError, TypeError):
            return out

        def step():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)

        out.append([float(4 * s * s * d), statistics.median(
            timed_rates(step, 14 * s * s * d * heads, seconds / len(SDPA_SHAPES), sync, min_samples=2))])
    return sorted(out)


def _memory_curve(device, seconds: float, sync) -> tuple[list[list[float]], list[list[float]], float]:
    """Bandwidth of an out-of-place fp32 add (two reads, one write) at each size (the small ones stay in
    cache, as a previous op's output does); and of a strided copy, a (b, s, a, d) activation's transpose
    made contiguous as attention code does."""
    import torch

    curves: dict[torch.dtype, list[list[float]]] = {torch.float32: [], torch.bfloat16: []}
    share = seconds / (2 * len(MEMORY_SIZES) + 1)
    for dtype, out in curves.items():
        for n in MEMORY_SIZES:
            x, y = torch.ones(n, device=device, dtype=dtype), torch.ones(n, device=device, dtype=dtype)
            moved = 3 * x.element_size() * n
            out.append([float(moved), statistics.median(timed_rates(lambda: torch.add(x, y), moved, share, sync))])
    n = MEMORY_SIZES[1]
    x = torch.ones(n // (128 * 4 * 32), 128, 4, 32, device=device).transpose(1, 2)
    strided = statistics.median(timed_rates(lambda: x.contiguous(), 2 * 4 * x.numel(), share, sync))
    return curves[torch.float32], curves[torch.bfloat16], strided


def _element_seconds(device, seconds: float, sync) -> dict[str, float]:
    """Seconds per output element of each class's representative kernel, fp32 and bf16: tanh-GELU and its
    gradient, softmax and layer norm over rows of 128, the dropout RNG (bernoulli_).  The operand stays
    in cache, as the previous op's output mostly is."""
    import torch
    import torch.nn.functional as F

    gelu_grad = torch.ops.aten.gelu_backward
    kernels = {"activation": lambda x: F.gelu(x, approximate="tanh"),
               "activation-grad": lambda x: gelu_grad(x, x, approximate="tanh"), "softmax": lambda x: x.softmax(-1),
               "norm": lambda x: F.layer_norm(x, (128,)), "random": lambda x: x.bernoulli_(0.9)}
    out = {}
    for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        x = torch.rand(ELEMENTS // 128, 128, device=device).to(dtype)
        for klass, fn in kernels.items():
            rate = statistics.median(timed_rates(lambda: fn(x), ELEMENTS, seconds / 2 / len(kernels), sync))
            out[f"{klass}:{tag}"] = 1.0 / rate
    return out


def _dispatch_seconds(device, seconds: float, sync) -> dict[str, float]:
    """Seconds per op by who dispatches it, from updates of a GPT so small that every op is dispatch-bound:
    each phase's wall time over its op count (trace/ops.py counts them on this same update)."""
    from batchlab.config import RunConfig, preset
    from batchlab.measure.clock import PhaseClock
    from batchlab.measure.harness import Trainer
    from batchlab.trace.ops import record_update

    cfg = RunConfig(model=preset("tiny", layers=2, hidden=16, heads=2, vocab=32, max_positions=8), seq=8,
                    micro_batch=1)
    trainer = Trainer(cfg, device)
    trainer.update()
    ops = record_update(trainer)
    calls: dict[str, int] = {}
    for op in ops:
        kind = DISPATCH_KIND[op.phase]
        calls[kind] = calls.get(kind, 0) + op.count
    clock = PhaseClock(sync)
    per_kind: dict[str, list[float]] = {k: [] for k in calls}
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(per_kind["forward"]) < 5:
        clock.start()
        trainer.update(probe=clock)
        clock.mark("end")
        spent: dict[str, float] = {}
        for phase, secs in clock.seconds.items():
            kind = DISPATCH_KIND[Phase(phase)]
            spent[kind] = spent.get(kind, 0.0) + secs
        for kind in calls:
            per_kind[kind].append(spent.get(kind, 0.0) / calls[kind])
    return {k: statistics.median(v) for k, v in per_kind.items()}


def _hardware(device) -> str:
    import torch

    if device.type == "cpu":
        return f"{cpu_hardware()}, {torch.get_num_threads()} threads"
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def measure(torch_device: str = "cpu", seconds: float = 10.0, shapes: tuple[tuple[int, int, int], ...] | None = None,
            threads: int | None = None) -> Calibration:
    """Measure what the per-op time model needs in about ``seconds``: the matmul curves in fp32 and bf16
    (34% linear layers, 8% attention's batched matmuls, 8% fused attention), element-wise bandwidth (10%), per-element kernels
    (15%), per-op dispatch (25%).  ``threads``: the
    intra-op thread count to measure at (CPU; restored afterwards)."""
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
    shapes = shapes or (MATMUL_SHAPES if device.type == "cpu" else GPU_MATMUL_SHAPES)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        sync = synchronizer(device)
        start = time.perf_counter()
        fp32 = _matmul_curve(device, torch.float32, shapes, 0.17 * seconds, sync)
        bf16 = _matmul_curve(device, torch.bfloat16, shapes, 0.17 * seconds, sync)
        bmm = {"bmm-fp32": _bmm_curve(device, torch.float32, 0.04 * seconds, sync),
               "bmm-bf16": _bmm_curve(device, torch.bfloat16, 0.04 * seconds, sync),
               "sdpa-fp32": _sdpa_curve(device, torch.float32, 0.04 * seconds, sync),
               "sdpa-bf16": _sdpa_curve(device, torch.bfloat16, 0.04 * seconds, sync)}
        mem, mem16, strided = _memory_curve(device, 0.1 * seconds, sync)
        elements = _element_seconds(device, 0.15 * seconds, sync)
        dispatch = _dispatch_seconds(device, 0.25 * seconds, sync)
        assert fp32, "fp32 matmul failed"
        best32, best16 = max(fp32, key=lambda p: p[1]), max(bf16, key=lambda p: p[1]) if bf16 else None
        return Calibration(
            device=catalogue_name(device), hardware=_hardware(device), torch_device=str(device),
            matmul_flops_fp32=best32[1], matmul_flops_bf16=best16[1] if best16 else None,
            memory_bytes_per_s=mem[-1][1], matmul_size={"fp32": int(best32[0]), **({"bf16": int(best16[0])} if best16 else {})},
            copy_bytes=int(mem[-1][0]), threads=torch.get_num_threads(),
            measured_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            torch_version=torch.__version__, seconds=time.perf_counter() - start,
            matmul_curve={"fp32": fp32, **({"bf16": bf16} if bf16 else {}), **{k: v for k, v in bmm.items() if v}},
            memory_curve=mem, memory_curve_bf16=mem16,
            strided_bytes_per_s=strided, element_seconds=elements, dispatch_seconds=dispatch)
    finally:
        torch.set_num_threads(before)


def ensure(torch_device: str = "cpu", threads: int | None = None, seconds: float = 10.0
           ) -> tuple[Calibration, bool]:
    """The cached calibration of a local device at ``threads``, measured and cached first when there is none
    (or only one from before the per-op model): (calibration, whether it was measured now)."""
    from batchlab.measure.device import catalogue_name, usable

    want = default_threads() if threads is None else threads
    cached = load_cached(catalogue_name(usable(torch_device)), want)
    if cached is not None and cached.op_costs() is not None:
        return cached, False
    cal = measure(torch_device, seconds=seconds, threads=want)
    save(cal)
    return cal, True


def auto(device_name: str, threads: int | None, enabled: bool = True) -> str | None:
    """``measure`` / ``compare`` on this CPU: calibrate once (cached) so their time predictions use measured
    rates.  Returns the line to show the user (None when a cached calibration served, nothing to say)."""
    if device_name != "cpu":
        return None  # GPUs: `batchlab calibrate --torch-device cuda`; the catalogue's figures otherwise
    want = default_threads() if threads is None else threads
    if not enabled:
        cached = load_cached("cpu", want)
        return None if cached is not None else (
            f"time model: not calibrated (--no-calibrate): nominal CPU rates at {want} thread(s)")
    cal, fresh = ensure("cpu", threads=want)
    if not fresh:
        return None
    return (f"time model: calibrated this CPU once at {cal.threads} thread(s) in {cal.seconds:.1f} s and cached it "
            f"({_cache_path(cal.device, cal.torch_version, cal.threads)}); --no-calibrate skips this")
