"""Whether a calibration's measured rates can be trusted: each against its device's nominal figures and against
its own curve.  A calibration measured under load, cut short by its budget or hand-edited can say a CPU does
4 MFLOP/s; priced with it, every time prediction is off by 10^4 and nothing looks wrong.  Torch-free: the
cache reader (``cache.calibrations._read``) and the measuring side (``calibrate.run``) ask the same question.

The bounds are wide on purpose -- they catch a broken measurement, not a slow machine: a real kernel on a real
device runs between ``SLOW`` below and ``FAST`` above its nominal figure whatever the host, load or shape.
"""
from __future__ import annotations

import math

from batchlab.formula.inkernel import IN_KERNEL, rate_keys

# Measured over nominal: a matmul on a loaded host with wall-clock timing reaches a few % of the nominal peak at
# worst (small shapes, 2 threads sharing a core: 1/50 seen on 2-core VMs); 1/500 is no real device.  Above:
# the CPU's nominal per-cycle figure is read from its flags (AMX, VNNI and SME units it cannot see run faster).
SLOW = 1 / 500
FAST = 16.0
OUTLIER = 8.0  # an interior point of a curve this far below both neighbours is a stall, not the kernel
MIN_POINTS = 2  # a curve of one point is one call size: it says nothing of the sizes a model's ops have
# Per-op fixed cost (s): torch's dispatcher alone takes ~1 µs; 10 ms per op is a stalled process, not a CPU.
DISPATCH = (1e-7, 1e-2)
# Element-wise bandwidth (bytes/s) where the device has no nominal figure of its own: 20 MB/s .. 20 TB/s.
BANDWIDTH = (2e7, 2e13)
# A model's own dispatch per op over batchlab's GPT's (calibrate/family.py): HF code measured 0.8-6x here.
FAMILY_RATIO = (0.05, 50.0)
# A compiled kernel's in-kernel draw or mask store per element over ATen's bulk bernoulli_ (``random/<op>:<dtype>``
# over ``random:<dtype>``, calibrate/compiled_rng.py): a Philox engine per element, 1.4-2.3x measured here.
IN_KERNEL_RATIO = (0.1, 100.0)
# Inductor's in-kernel arithmetic (``<class>/inductor_<op>:<dtype>``) over ATen's kernel of the same op: vectorised
# inside the fused loop with no launch of its own it can run far below it; a hundredfold either way is a broken timing.
IN_KERNEL_ARITHMETIC_RATIO = (0.01, 100.0)


def problems(cal, peak_flops: float | None = None, bytes_per_s: float | None = None) -> list[str]:
    """What is implausible in ``cal`` (a formula.calibration.Calibration); [] when every rate passes.
    ``peak_flops`` / ``bytes_per_s``: the device's nominal fp32 peak for the threads measured and its memory
    bandwidth (None: unknown, only the device-free bounds apply)."""
    out: list[str] = [f"{name} {v!r} is not a number" for name, v in (
        ("threads", cal.threads), ("cores", cal.cores), ("other_cores", cal.other_cores)) if not _finite(v)]
    out += [f"{name} {v!r} is not a table of names" for name, v in (
        ("untimed", cal.untimed), ("link_cpu_seconds", cal.link_cpu_seconds),
        ("link_chain_seconds", cal.link_chain_seconds), ("dtensor_seconds", cal.dtensor_seconds),
        ("dispatch_seconds", cal.dispatch_seconds), ("element_seconds", cal.element_seconds))
        if not (isinstance(v, dict) and all(isinstance(k, str) for k in v))]
    if out:  # the checks below read these fields
        return out
    curves = dict(cal.matmul_curve)
    for key, curve in curves.items():  # the linear layers' curves price most of a step: they need their sizes
        out += _curve(f"matmul curve {key}", curve, "FLOP/s", rising=True,
                      points=MIN_POINTS if key in ("fp32", "bf16") else 1)
    for name, curve in (("bandwidth curve fp32", cal.memory_curve), ("bandwidth curve bf16", cal.memory_curve_bf16),
                        ("in-place bandwidth curve", cal.memory_curve_inplace)):
        if curve:  # bandwidth falls from cache to memory: no order asked
            out += _curve(name, curve, "B/s", rising=False, points=MIN_POINTS if name.endswith("fp32") else 1)
    if not (_finite(cal.matmul_flops_fp32) and cal.matmul_flops_fp32 > 0):
        out.append(f"fp32 matmul {cal.matmul_flops_fp32!r} FLOP/s is not a positive number")
    if peak_flops:  # the curve's best where there is one (a cache from before the per-op model has the ceiling)
        best = _best(curves["fp32"]) if "fp32" in curves else cal.matmul_flops_fp32
        if best is not None and not SLOW * peak_flops <= best <= FAST * peak_flops:
            out.append(f"fp32 matmul {best:.3g} FLOP/s is {best / peak_flops:.2g}x the nominal peak "
                       f"{peak_flops:.3g} FLOP/s (plausible: {SLOW:g}x to {FAST:g}x)")
    low, high = (SLOW * bytes_per_s, FAST * bytes_per_s) if bytes_per_s else BANDWIDTH
    # the strided copy is 0 in a cache from before it was measured (the time model then uses the bandwidth)
    for name, rate in (("bandwidth", cal.memory_bytes_per_s), ("strided copy", cal.strided_bytes_per_s or None)):
        if rate is not None and not (_finite(rate) and low <= rate <= high):
            out.append(f"{name} {rate!r} B/s outside {low:.3g}..{high:.3g} B/s")
    for what, table in (("dispatch", cal.dispatch_seconds), ("dispatch under autocast", cal.dispatch_seconds_autocast)):
        out += dispatch_problems(what, table)
    out += [f"per-element {k} {s!r} s is not a positive number" for k, s in cal.element_seconds.items()
            if not (_finite(s) and s > 0)]
    out += in_kernel_problems(cal.element_seconds)
    for family, ratios in cal.family_dispatch.items():
        out += family_problems(family, ratios)
    out += link_cpu_problems(cal.link_cpu_seconds, cal.loopback_latency_s, cal.loopback_bytes_per_s)
    out += link_chain_problems(cal.link_chain_seconds, cal.loopback_warm_latency_s)
    warm, cold = cal.loopback_warm_latency_s, cal.loopback_latency_s  # back to back: no more than after compute
    if warm and not (_finite(warm) and _finite(cold) and 0 <= warm <= cold):
        out.append(f"link back-to-back latency {warm!r} s is not a number from 0 to the after-compute one "
                   f"({cal.loopback_latency_s!r} s)")
    return out + dtensor_problems(cal.dtensor_seconds)


LINK_CPU_OVER = 1.5  # the link's CPU part (calibrate/shared_link.py) is timed in another run than the link itself


def dispatch_problems(what: str, table: dict) -> list[str]:
    """Per kind, a cost per call that is not a number in ``DISPATCH``'s range (an op's dispatch, or a compiled
    graph's or checkpoint region's own call, calibrate/calls.py)."""
    return [f"{what} {kind} {s!r} s per call outside {DISPATCH[0]:g}..{DISPATCH[1]:g} s" for kind, s in table.items()
            if not (_finite(s) and DISPATCH[0] <= s <= DISPATCH[1])]


CHAIN_SECONDS = 20e-3  # a chained all-reduce's mean beyond this is a stall, not the link


def link_chain_problems(chain: dict, warm_latency_s: float) -> list[str]:
    """The chained all-reduce's figures (calibrate/chain.py): gaps that are numbers from 0, each figure a positive
    number up to ``CHAIN_SECONDS`` and, a mean over a tail, no less than half the link's back-to-back median of 2
    messages (timed in another run)."""
    out = []
    for g, s in chain.items():
        try:
            gap = float(g)
        except ValueError:
            gap = float("nan")
        if not (_finite(gap) and gap >= 0):
            out.append(f"chained all-reduce gap {g!r} is not a number of seconds from 0")
        elif not (_finite(s) and (warm_latency_s or 0.0) <= s <= CHAIN_SECONDS and s > 0):
            out.append(f"chained all-reduce {s!r} s after {g} s outside {warm_latency_s or 0.0:g}.."
                       f"{CHAIN_SECONDS:g} s")
    return out


def link_cpu_problems(cpu: dict, latency_s: float, bytes_per_s: float) -> list[str]:
    """gloo's link CPU part per message and per byte (calibrate/shared_link.py): a number from 0 to the link's own
    figure (its whole per-message cost, its seconds per byte), give or take ``LINK_CPU_OVER`` between two runs."""
    out = []
    for k, whole in (("message", latency_s), ("byte", 1 / bytes_per_s if _finite(bytes_per_s) and bytes_per_s
                                                 else None)):
        if k not in cpu:
            continue
        v = cpu[k]
        if not (_finite(v) and v >= 0):
            out.append(f"link CPU part per {k} {v!r} s is not a number from 0")
        elif _finite(whole) and whole and v > LINK_CPU_OVER * whole:
            out.append(f"link CPU part per {k} {v:.3g} s is x{v / whole:.3g} the link's own {whole:.3g} s "
                       f"(plausible: up to x{LINK_CPU_OVER:g})")
    return out


def in_kernel_problems(element_seconds: dict) -> list[str]:
    """Each ``random/<op>:<dtype>`` rate against ATen's ``random:<dtype>`` outside ``IN_KERNEL_RATIO``, and each
    other in-kernel rate against ATen's rate of the same op (formula/inkernel.py's fallback) outside
    ``IN_KERNEL_ARITHMETIC_RATIO``."""
    out = []
    for k, s in element_seconds.items():
        op, _, tag = k.rpartition(":")
        cls, _, name = op.partition("/")
        if k.startswith("random/"):
            ref, band, what = "random:" + tag, IN_KERNEL_RATIO, "ATen's bernoulli_"
        elif name.startswith(IN_KERNEL):
            ref = next((x for x in rate_keys(cls, name, tag) if x.split(":")[0] != op and x in element_seconds), None)
            band, what = IN_KERNEL_ARITHMETIC_RATIO, f"ATen's {ref}"
        else:
            continue
        eager = element_seconds.get(ref)
        if eager and _finite(s) and _finite(eager) and eager > 0 and not band[0] <= s / eager <= band[1]:
            out.append(f"per-element {k} x{s / eager:.3g} {what} outside x{band[0]:g}..x{band[1]:g}")
    return out


# FSDP2's host work per collective (calibrate/fsdp_host.py: its hooks' copy-in, copy-out and bookkeeping, tens of
# ops a collective): at least 100 ops of DISPATCH's floor, at most a tenth of a second
FSDP_HOST = (1e-5, 0.1)


def dtensor_problems(seconds: dict) -> list[str]:
    """DTensor's host cost per op (calibrate/dtensor.py): a positive per-op time in dispatch's range, per kind;
    FSDP2's per collective ("fsdp-*" keys) in ``FSDP_HOST``."""
    out = []
    for k, s in seconds.items():
        low, high = FSDP_HOST if k.startswith("fsdp") else DISPATCH
        if not (_finite(s) and low <= s <= high):
            out.append(f"DTensor {k} {s!r} s per {'collective' if k.startswith('fsdp') else 'op'} outside "
                       f"{low:g}..{high:g} s")
    return out


def family_problems(family: str, ratios: dict) -> list[str]:
    """A model's own dispatch per op over batchlab's GPT's (calibrate/family.py) outside ``FAMILY_RATIO``."""
    return [f"{family}'s own dispatch {k} x{r!r} outside x{FAMILY_RATIO[0]:g}..x{FAMILY_RATIO[1]:g}"
            for k, r in ratios.items() if not (_finite(r) and FAMILY_RATIO[0] <= r <= FAMILY_RATIO[1])]


def _curve(name: str, curve, unit: str, rising: bool, points: int) -> list[str]:
    """A (size, rate) curve: ``points`` at least, every figure a positive number, sizes ascending; ``rising``: no
    rate falling with the call size (matmuls: the measurement fits a non-decreasing curve, a fall is a file it
    did not write)."""
    pts = [p for p in curve if len(p) == 2]
    if len(pts) != len(curve) or not all(_finite(x) and x > 0 and _finite(y) and y > 0 for x, y in pts):
        return [f"{name}: every point must be a positive (size, {unit}) pair"]
    if len(pts) < points:
        return [f"{name}: {len(pts)} point(s), at least {points} call sizes needed"]
    if any(b[0] <= a[0] for a, b in zip(pts, pts[1:])):
        return [f"{name}: call sizes not ascending"]
    if rising and any(b[1] < a[1] * (1 - 1e-9) for a, b in zip(pts, pts[1:])):
        return [f"{name}: the rate falls as the calls grow (a measured curve is fitted non-decreasing)"]
    dips = [x for (_, r0), (x, r), (_, r1) in zip(pts, pts[1:], pts[2:]) if r * OUTLIER < min(r0, r1)]
    if dips:  # a size between two others runs at their rate or between them, never 8x below both
        return [f"{name}: the rate at {dips[0]:.3g} is over {OUTLIER:g}x below both neighbouring sizes' (a stall)"]
    return []


def _best(curve) -> float | None:
    rates = [p[1] for p in curve if len(p) == 2 and _finite(p[1])]
    return max(rates) if rates else None


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def ratio_text(predicted: float, measured: float) -> str | None:
    """The line that says the time model, not the run, is broken where a prediction and a measurement of the
    same run differ by more than ``BROKEN`` either way (None otherwise)."""
    if not (predicted > 0 and measured > 0):
        return None
    r = predicted / measured
    if 1 / BROKEN <= r <= BROKEN:
        return None
    return (f"the time model is broken here, not the run: it predicted {r:.3g}x the measured update time; check "
            "the calibration (`batchlab calibrate` measures it again) before reading any predicted time")


BROKEN = 10.0  # prediction / measurement beyond this either way: no real run is that far off a sound model
