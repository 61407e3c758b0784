"""The calibration record and its pure checks.  Torch-free, and no file is read here: the cache (one JSON file per
device, torch version and thread count) is read and written by batchlab.cache.calibrations, and the formula's
callers pass what it holds in."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from batchlab.config import Precision
from batchlab.formula import plausible
from batchlab.formula.opcost import OpCosts


# Parts of a calibration beyond the fp32 kernels and dispatch every time prediction uses: 16-bit kernels and
# autocast's dispatch ("bf16": any 16-bit precision), dispatch under selective checkpointing's dispatch mode
# ("sac"), and on CPU the local ranks' contention and gloo link ("ranks": more than one rank).
SCOPES = ("bf16", "sac", "ranks")


def needs(cfg) -> set[str]:
    """The ``SCOPES`` a prediction for ``cfg`` (a RunConfig) prices its ops with."""
    # any layer under the selective dispatch mode (a plan's too: priced apart from its preset, a plan of all
    # selective-op layers lost the mode's dispatch and undercut the preset it equals)
    sac = any(m.dispatch_mode for m in cfg.ac.layer_modes(cfg.model.layers))
    return ({"bf16"} if cfg.precision is not Precision.FP32 else set()) | ({"sac"} if sac else set()) | (
        {"ranks"} if cfg.parallel.world_size > 1 else set())


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
    matmul_shapes: list[list[int]] = field(default_factory=list)  # the (m, k, n) the linear-layer curve was timed on
    # fused kernels' seconds per call beyond their entries' work: kind-dtype -> [[FLOPs per entry, seconds]]
    matmul_start: dict[str, list[list[float]]] = field(default_factory=dict)
    memory_curve: list[list[float]] = field(default_factory=list)  # [[bytes/call, bytes/s]], fp32 add
    memory_curve_bf16: list[list[float]] = field(default_factory=list)  # the same add in bf16
    memory_curve_inplace: list[list[float]] = field(default_factory=list)  # fp32 add_ (no fresh output)
    strided_bytes_per_s: float = 0.0  # a transposed view copied contiguous, read + write
    element_seconds: dict[str, float] = field(default_factory=dict)  # "activation:fp32" -> s per element
    dispatch_seconds: dict[str, float] = field(default_factory=dict)  # forward | backward | plain -> s per op
    # the same under autocast (bf16-mixed); {}: unmeasured
    dispatch_seconds_autocast: dict[str, float] = field(default_factory=dict)
    # CPU: the link between local ranks in the ring model's terms (bytes/s, seconds per message), from gloo's
    # all-reduce between two local processes (calibrate/link.py); 0: unmeasured
    loopback_bytes_per_s: float = 0.0
    loopback_latency_s: float = 0.0
    link: str = ""  # what those figures were measured on ("": a TCP echo over loopback, before gloo's all-reduce)
    loopback_warm_latency_s: float = 0.0  # the same per message back to back, both ranks' threads awake; 0: unmeasured
    # CPU: how much longer the slower of two local ranks computes than their mean between all-reduces (0.035:
    # 3.5%; calibrate/link.py); 0: unmeasured
    rank_skew: float = 0.0
    # CPU: the ranks' own CPU seconds in that link, per message ("message") and per byte ("byte"): the part that
    # stretches where local ranks time-share the cores (calibrate/shared_link.py); {}: not measured
    link_cpu_seconds: dict[str, float] = field(default_factory=dict)
    # CPU: one all-reduce's seconds as a chain of them pays it, by the compute gap before each ({"0.002": s};
    # calibrate/chain.py); {}: not measured
    link_chain_seconds: dict[str, float] = field(default_factory=dict)
    cores: int = 0  # CPU cores of the machine measured (local ranks x threads beyond it share them)
    # CPU: a process's slowdown while ``contention_processes`` run the same kernels at once, by kind
    # (compute | memory | dispatch; calibrate/concurrency.py); 0 processes: not measured (an older cache)
    contention: dict[str, float] = field(default_factory=dict)
    contention_processes: int = 0
    allocator: str = ""  # CPU: the host allocator regime the kernels were timed in (batchlab.host.state)
    probe_seconds: float = 0.0  # CPU: the host speed probe's bundle (host/speed.py), median of the rounds; 0: none
    probe: str = ""  # which bundle that is (host.PROBE_BUNDLE)
    # a Hugging Face model's own dispatch per op over batchlab's GPT's, by kind (forward, backward), keyed by
    # formula.timing.dispatch_family; measured once per model code the first time measure / compare meets it
    # (calibrate/family.py)
    family_dispatch: dict[str, dict[str, float]] = field(default_factory=dict)
    # the host time each op on a DTensor adds (sharding propagation, wrapping), by dispatch kind; measured once the
    # first time measure / compare meets a tensor-parallel config (calibrate/dtensor.py); {}: not measured
    dtensor_seconds: dict[str, float] = field(default_factory=dict)
    # rates measured lazily (calibrate/compiled_rng.py) whose timing failed or gave nonsense here, key -> why: not
    # timed again until the next full calibration, the fallback rate serves meanwhile
    untimed: dict[str, str] = field(default_factory=dict)
    provenance: str = "calibrated"
    # CPU: cores other processes kept busy on average while it was measured (/proc/stat less this process tree's
    # CPU time); -1: not read.  A wall-clock calibration (threads > 1) under such load prices that load into
    # every rate (``loaded``)
    other_cores: float = -1.0
    # what was measured beyond fp32 kernels and dispatch (``SCOPES``); compare and measure calibrate only what
    # their configs need (``needs``); a cache written before scopes has them all
    scope: list[str] = field(default_factory=lambda: list(SCOPES))

    @property
    def source(self) -> str:
        """How the numbers were obtained, for every time prediction that uses them."""
        return (f"calibrated on {self.hardware} ({self.torch_device}), torch {self.torch_version}, "
                f"{self.threads} thread(s), at {self.measured_at}, {self.seconds:.1f} s"
                + (f", {self.allocator}" if self.allocator else "")
                + (f", parts measured: fp32{''.join(' + ' + k for k in self.scope)}" if set(self.scope) != set(SCOPES)
                   else "")
                + (f", measured while other processes kept {self.other_cores:.1f} core(s) busy" if loaded(self)
                   else ""))

    def covers(self, cfg) -> bool:
        """Whether it measured every part a prediction for ``cfg`` needs (``needs``)."""
        return needs(cfg) <= set(self.scope)

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
                       matmul_start={k: tuple(map(tuple, v)) for k, v in self.matmul_start.items()},
                       memory=tuple(map(tuple, self.memory_curve)), strided_bytes_per_s=self.strided_bytes_per_s,
                       memory_low=tuple(map(tuple, self.memory_curve_bf16)) or None,
                       memory_inplace=tuple(map(tuple, self.memory_curve_inplace)) or None,
                       element_seconds=dict(self.element_seconds),
                       dispatch=dict(self.dispatch_seconds),
                       dispatch_autocast=dict(self.dispatch_seconds_autocast),
                       asynchronous=not self.torch_device.startswith("cpu"),
                       link_bytes_per_s=self.loopback_bytes_per_s or None, link_latency_s=self.loopback_latency_s,
                       link_warm_latency_s=self.loopback_warm_latency_s,
                       threads=self.threads, cores=self.cores, contention=dict(self.contention),
                       contention_processes=self.contention_processes, rank_skew=self.rank_skew,
                       link_cpu_seconds=dict(self.link_cpu_seconds), link_chain_seconds=dict(self.link_chain_seconds),
                       family_dispatch={k: dict(v) for k, v in self.family_dispatch.items()},
                       dtensor_seconds=dict(self.dtensor_seconds), untimed=dict(self.untimed),
                       matmul_intensity=tuple(sorted((2 * m * k * n, 2 * m * k * n / (4 * (m * k + k * n + m * n)))
                                                     for m, k, n in self.matmul_shapes)),
                       source=self.source)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["source"] = self.source
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Calibration":
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in raw.items() if k in names})


SPARE = 0.25  # cores of others' load beyond the spare cores before a wall-clock calibration counts as loaded


def loaded(cal: Calibration) -> bool:
    """Whether ``cal`` timed wall-clock on a CPU (more than one thread: one thread times its own CPU seconds,
    which others' load does not stretch) while other processes took cores its threads needed."""
    return cal.torch_device.startswith("cpu") and loaded_by(cal.other_cores, cal.cores, cal.threads)


def loaded_by(other_cores: float | None, cores: int, threads: int) -> bool:
    """Whether a wall-clock timing at ``threads`` of ``cores`` was stretched by ``other_cores`` of others' load
    (one thread times its own CPU seconds: never)."""
    if threads <= 1 or other_cores is None or other_cores < 0:
        return False
    return other_cores > max((cores or threads) - threads, 0) + SPARE


def check(cal: Calibration) -> list[str]:
    """What is implausible in ``cal`` against its device's nominal figures and its own curves (formula/plausible.py);
    [] for a calibration the time model may price with."""
    from batchlab.config.devices import DEVICES

    try:
        return plausible.problems(cal, *nominal(cal, DEVICES.get(cal.device)))
    except (TypeError, AttributeError, ValueError) as e:  # a field of the wrong type in a hand-edited file
        return [f"malformed: {e}"]


def drop_implausible_parts(cal: Calibration) -> list[str]:
    """Clear from ``cal`` the parts measured on first use (calibrate/chain.py, shared_link.py, dtensor.py,
    family.py) whose figures are implausible, and say which: the rest of the calibration still prices, and the next
    measure or compare meets those parts missing and measures them again.  A malformed table is left for ``check``
    to name."""
    out: list[str] = []
    try:
        if bad := plausible.link_chain_problems(cal.link_chain_seconds, cal.loopback_warm_latency_s):
            cal.link_chain_seconds, out = {}, out + bad
        if bad := plausible.link_cpu_problems(cal.link_cpu_seconds, cal.loopback_latency_s, cal.loopback_bytes_per_s):
            cal.link_cpu_seconds, out = {}, out + bad
        for k in [k for k in cal.dtensor_seconds if plausible.dtensor_problems({k: cal.dtensor_seconds[k]})]:
            out += plausible.dtensor_problems({k: cal.dtensor_seconds.pop(k)})
        for f in [f for f in cal.family_dispatch if plausible.family_problems(f, cal.family_dispatch[f])]:
            out += plausible.family_problems(f, cal.family_dispatch.pop(f))
    except (TypeError, AttributeError, ValueError):
        return out
    return out


def nominal(cal: Calibration, spec) -> tuple[float | None, float | None]:
    """(fp32 peak for the threads measured, memory bytes/s) of ``cal``'s device from its catalogue ``spec``;
    None where unknown.  A CPU's peak is all its cores' (host.cpu_peak_flops): ``threads`` of ``cores`` of it;
    its bandwidth is a nominal guess, not the host's, so only the device-free bounds apply to it."""
    if spec is None:
        return None, None
    if cal.torch_device.startswith("cpu"):
        cores = cal.cores or os.cpu_count() or 1
        return spec.peak_flops_fp32 * min(max(cal.threads, 1), cores) / cores, None
    return spec.peak_flops_fp32, spec.hbm_bytes_per_s
