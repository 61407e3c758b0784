"""The random numbers a compiled dropout draws inside inductor's CPU kernels, priced per element.

Eager dropout draws its mask with ATen's ``bernoulli_`` (the calibration's "random" kernel), in bulk.  Under
torch.compile, inductor lowers every random op to ``prims.inductor_random`` and generates each number inside the
fused kernel that consumes it: the C++ backend calls ``normalized_rand_cpu(seed, offset)`` once per element, which
builds a Philox4x32-10 engine at that offset and keeps one of its four words (torch/csrc/inductor/cpp_prefix.h;
Salmon et al. 2011 for Philox), a scalar loop even inside a vectorised kernel (codegen/cpp.py ``codegen_rand``).
Its cost per element is that of no ATen kernel, so the first time measure or compare meets a compiled model with
dropout on this CPU, a compiled ``rand_like`` of the per-element kernels' size is timed (one small inductor compile,
then ~1 s in turns with ``bernoulli_``) and its cost per element over ``bernoulli_``'s, times the calibration's
``bernoulli_`` rate, cached with the CPU's calibration under ``KEY``; the time model prices each
``inductor_random`` element at it (formula/opcost.py ``element_rate_seconds``), and at the "random" class's rate
(ATen's ``bernoulli_``) where it is not measured yet.

A compiled forward that keeps a dropout mask for backward stores it as bool from the kernel's vector mask
(``VecMask<float,1>::store`` into a ``bool*``), which costs per element about what the draw does and no ATen kernel
resembles it: a compiled ``x > c`` with a bool output is timed the same way, in turns with ``bernoulli_``, and cached
under ``MASK_KEY`` (formula/fusion.py ``MASK``).
"""
from __future__ import annotations

import math
import time

from batchlab.cache.calibrations import default_threads, load_cached, save
from batchlab.config import CompileMode, RunConfig
from batchlab.formula.plausible import IN_KERNEL_RATIO

NAME = "inductor_random"  # the prim inductor lowers random ops to, as the op lists name it
KEY = f"random/{NAME}:fp32"  # its element_seconds entry (formula/opcost.py element_rate_seconds's key)
MASK = "inductor_mask_store"  # a kept mask's bool store inside a compiled kernel (formula/fusion.py MASK)
MASK_KEY = f"random/{MASK}:fp32"
SECONDS = 1.0


def wanted(cfg: RunConfig) -> bool:
    """``cfg`` runs dropout inside inductor's CPU kernels."""
    return cfg.compile is not CompileMode.NONE and cfg.model.dropout > 0 and cfg.device == "cpu"


def measure(seconds: float = SECONDS) -> float:
    """Inductor's in-kernel RNG over ATen's ``bernoulli_`` per element (``_timed``)."""
    import torch

    return _timed(NAME, torch.rand_like, seconds)


def measure_mask(seconds: float = SECONDS) -> float:
    """A compiled kernel's bool store over ATen's ``bernoulli_`` per element: ``x > 0.5`` into a bool buffer, the
    comparison itself far cheaper than the store (``_timed``)."""
    return _timed(MASK, lambda x: x > 0.5, seconds)


def _timed(name: str, fn, seconds: float) -> float:
    """Compiled ``fn`` over ATen's ``bernoulli_`` per element, on this CPU at the current intra-op threads: ``fn``
    compiled by inductor and the calibration's own ``bernoulli_`` kernel over the per-element kernels' operand
    (calibrate/kernels.py ``ELEMENTS``), timed in turns so the host's speed of the moment falls on both; the
    compiled kernel moves at most 8 bytes per element, far below what its per-element work costs."""
    import torch

    from batchlab.calibrate.kernels import CLOCK, ELEMENTS, alternated, keeping

    x = torch.rand(ELEMENTS // 128, 128)
    draw = torch.compile(fn, backend="inductor", dynamic=False, fullgraph=True)
    draw(x)  # the compile, outside the timed turns
    token = CLOCK.set(time.thread_time if torch.get_num_threads() == 1 else time.perf_counter)
    try:
        rates = alternated({name: (keeping(lambda: draw(x)), ELEMENTS),
                            "bernoulli_": (lambda: x.bernoulli_(0.9), ELEMENTS)}, seconds, lambda: None)
    finally:
        CLOCK.reset(token)
    return rates["bernoulli_"] / rates[name]


def ensure(cfg: RunConfig, threads: int | None = None) -> str | None:
    """For a compiled model with dropout on this CPU whose calibration (at ``threads``) lacks ``KEY`` or
    ``MASK_KEY``: measure them and cache them with the calibration.  Returns the line to show the user (None:
    nothing to say)."""
    cal = load_cached("cpu", default_threads() if threads is None else threads) if wanted(cfg) else None
    eager = cal.element_seconds.get("random:fp32") if cal is not None else None
    timers = {KEY: ("inductor's in-kernel RNG", measure), MASK_KEY: ("inductor's bool mask store", measure_mask)}
    missing = [k for k in timers if cal is not None and k not in cal.element_seconds]
    if cal is None or not missing or not eager:
        return None
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(cal.threads)
    lines = []
    try:
        for k in missing:
            what, timer = timers[k]
            try:
                ratio = timer()
            except Exception as e:  # noqa: BLE001 - inductor or its C++ compiler unusable here: the eager rate serves
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
                lines.append(f"time model: {what} not timed ({first}); ATen's bernoulli_ rate serves")
                continue
            low, high = IN_KERNEL_RATIO
            if not (math.isfinite(ratio) and low <= ratio <= high):
                lines.append(f"time model: {what} timed at {ratio:.3g} x ATen's bernoulli_ per element (plausible: "
                             f"x{low:g}..x{high:g}); not cached, ATen's rate serves")
                continue
            cal.element_seconds[k] = ratio * eager  # the calibration's bernoulli_ rate, scaled by the paired ratio
            lines.append(f"time model: timed {what} once against ATen's bernoulli_ (x{ratio:.2f} per element, "
                         f"{ratio * eager * 1e9:.1f} ns) and cached it with the calibration")
    finally:
        torch.set_num_threads(before)
    if any(k in cal.element_seconds for k in missing):
        save(cal)
    return "\n".join(lines)
