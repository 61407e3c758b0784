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
under ``MASK_KEY`` (formula/inkernel.py ``MASK_STORE``).

The other per-element work a generated kernel does is timed alike, for any compiled model on this CPU: a
transcendental op (tanh, exp, erf, sigmoid, log; a softmax's passes over a row) is at::vec's vectorised function
inside the fused loop, not ATen's kernel of that op (whose CPU path can be another library's, at another cost
per element), and a bool tensor a kernel reads (a mask the forward saved for backward) is widened into a vector
mask element by element (``VecMask<float,1>::from(bool*)``, a scalar loop whose branches follow the mask's values:
a causal mask's runs along each row are predicted, a dropout mask's draws are not, about twice the time per
element where both were first timed).
Each is a compiled ``op(x)`` (``where(m, x, 0)``) less a compiled ``x * 2`` that moves the same bytes, timed in
turns with ``bernoulli_`` and cached under ``activation/inductor_<op>`` (``softmax/inductor_softmax``,
``masked/inductor_mask_load``, a random mask's ``masked/inductor_mask_load_random``); where not timed, ATen's
kernel of the op serves (formula/inkernel.py).
"""
from __future__ import annotations

import math

from batchlab.cache.calibrations import default_threads, load_cached, save
from batchlab.calibrate.oneoff import at_threads, thread_clock, why
from batchlab.config import CompileMode, RunConfig
from batchlab.formula.inkernel import MASK_LOAD, MASK_LOAD_RANDOM, MASK_STORE, RNG, in_kernel
from batchlab.formula.plausible import IN_KERNEL_RATIO, in_kernel_problems

NAME, MASK = RNG, MASK_STORE  # as the op lists name them (formula/inkernel.py)
KEY = f"random/{NAME}:fp32"  # its element_seconds entry (formula/opcost.py element_rate_seconds's key)
MASK_KEY = f"random/{MASK}:fp32"
MASK_LOAD_KEY = f"masked/{MASK_LOAD}:fp32"
MASK_LOAD_RANDOM_KEY = f"masked/{MASK_LOAD_RANDOM}:fp32"
# transcendental ops inductor computes inside its kernels (formula/opcost.py _ACTIVATION's, as ATen names them)
ARITHMETIC = ("tanh", "exp", "erf", "sigmoid", "log")
ARITHMETIC_KEYS = {f"activation/{in_kernel(op)}:fp32": op for op in ARITHMETIC}
# a softmax inside a kernel: its passes over each row (max, exp and sum, divide) fused with what feeds it
SOFTMAX_KEY = f"softmax/{in_kernel('softmax')}:fp32"
SECONDS = 1.0


def wanted(cfg: RunConfig) -> bool:
    """``cfg`` runs dropout inside inductor's CPU kernels."""
    return compiled_on_cpu(cfg) and cfg.model.dropout > 0


def compiled_on_cpu(cfg: RunConfig) -> bool:
    """``cfg`` runs inductor's CPU kernels."""
    return cfg.compile is not CompileMode.NONE and cfg.device == "cpu"


def measure(seconds: float = SECONDS) -> float:
    """Inductor's in-kernel RNG over ATen's ``bernoulli_`` per element (``_timed``)."""
    import torch

    return _timed(NAME, torch.rand_like, seconds)


def measure_mask(seconds: float = SECONDS) -> float:
    """A compiled kernel's bool store over ATen's ``bernoulli_`` per element: ``x > 0.5`` into a bool buffer, the
    comparison itself far cheaper than the store (``_timed``)."""
    return _timed(MASK, lambda x: x > 0.5, seconds)


def measure_in_kernel(seconds: float = SECONDS) -> dict[str, float]:
    """Per ``ARITHMETIC_KEYS`` / ``SOFTMAX_KEY`` / ``MASK_LOAD_KEY`` / ``MASK_LOAD_RANDOM_KEY`` key, that work inside a compiled kernel over ATen's
    ``bernoulli_`` per element: each compiled op's time less a compiled ``x * 2``'s (the same bytes moved, no
    arithmetic to speak of), all timed in one set of turns."""
    import torch

    from batchlab.calibrate.kernels import ELEMENTS

    x = torch.rand(ELEMENTS // 128, 128)
    # a causal mask's pattern (runs of one value along each row): the widening is a scalar loop per element whose
    # branches a random mask mispredicts, several times slower per element (not priced here)
    mask = torch.ones(128, 128, dtype=torch.bool).triu(1).repeat(ELEMENTS // 128 // 128, 1)
    # a dropout's mask: one draw per element, kept with dropout's usual probability
    drawn = torch.rand(ELEMENTS // 128, 128) > 0.1
    fns = {"copy": lambda t: t * 2.0, **{k: getattr(torch, op) for k, op in ARITHMETIC_KEYS.items()},
           SOFTMAX_KEY: lambda t: torch.softmax(t, -1), MASK_LOAD_KEY: lambda t: torch.where(mask, t, 0.0),
           MASK_LOAD_RANDOM_KEY: lambda t: torch.where(drawn, t, 0.0)}
    rates = _rates(x, fns, seconds)
    base = rates["bernoulli_"] / rates["copy"]
    # an op no slower than the copy within the timing's spread (exp, vectorised, often is) keeps a floor of 1% of
    # the copy's time: a calibrated rate is positive
    return {k: max(rates["bernoulli_"] / rates[k] - base, base / 100) for k in fns if k != "copy"}


def _bernoulli(x):
    """The calibration's ``bernoulli_`` turn over ``x``'s size, drawn into a buffer of its own: drawn into ``x`` it
    would leave the compiled ops timed after it only zeros and ones (log of 0 in a tenth of them)."""
    from batchlab.calibrate.kernels import ELEMENTS

    into = x.new_empty(x.shape)
    return (lambda: into.bernoulli_(0.9)), ELEMENTS


def _timed(name: str, fn, seconds: float) -> float:
    """Compiled ``fn`` over ATen's ``bernoulli_`` per element, on this CPU at the current intra-op threads (``_rates``):
    the compiled kernel moves at most 8 bytes per element, far below what its per-element work costs."""
    import torch

    from batchlab.calibrate.kernels import ELEMENTS

    rates = _rates(torch.rand(ELEMENTS // 128, 128), {name: fn}, seconds)
    return rates["bernoulli_"] / rates[name]


def _rates(x, fns: dict, seconds: float) -> dict[str, float]:
    """Each of ``fns`` compiled by inductor over ``x`` (the per-element kernels' operand, calibrate/kernels.py
    ``ELEMENTS``) and the calibration's own ``bernoulli_`` kernel, timed in turns so the host's speed of the moment
    falls on all (elements per second, by name; the compiles outside the timed turns)."""
    import torch

    from batchlab.calibrate.kernels import ELEMENTS, alternated, keeping

    kernels = {}
    for k, fn in fns.items():
        run = torch.compile(fn, backend="inductor", dynamic=False, fullgraph=True)
        run(x)  # the compile
        kernels[k] = (keeping(lambda run=run: run(x)), ELEMENTS)
    with thread_clock():
        return alternated({**kernels, "bernoulli_": _bernoulli(x)}, seconds, lambda: None)


def ensure(cfg: RunConfig, threads: int | None = None) -> str | None:
    """For a compiled model on this CPU whose calibration (at ``threads``) lacks the in-kernel rates it runs at
    (``KEY`` and ``MASK_KEY`` with dropout; ``ARITHMETIC_KEYS``, ``SOFTMAX_KEY``, ``MASK_LOAD_KEY``,
    ``MASK_LOAD_RANDOM_KEY`` for any):
    measure them and cache them with the calibration.  Returns the line to show the user (None: nothing to say)."""
    cal = load_cached("cpu", default_threads() if threads is None else threads) if compiled_on_cpu(cfg) else None
    eager = cal.element_seconds.get("random:fp32") if cal is not None else None
    timers = {KEY: ("inductor's in-kernel RNG", measure), MASK_KEY: ("inductor's bool mask store", measure_mask)} \
        if wanted(cfg) else {}
    lines = _ensure_in_kernel(cal, eager)
    missing = [k for k in timers if cal is not None and k not in cal.element_seconds and k not in cal.untimed]
    if cal is None or not missing or not eager:
        return "\n".join(lines) or None
    with at_threads(cal.threads):
        for k in missing:
            what, timer = timers[k]
            try:
                ratio = timer()
            except Exception as e:  # noqa: BLE001 - inductor or its C++ compiler unusable here: the eager rate serves
                first = why(e)
                cal.untimed[k] = first
                lines.append(f"time model: {what} not timed ({first}); ATen's bernoulli_ rate serves until the "
                             "next `batchlab calibrate`")
                continue
            low, high = IN_KERNEL_RATIO
            if not (math.isfinite(ratio) and low <= ratio <= high):
                cal.untimed[k] = f"timed at {ratio:.3g} x ATen's bernoulli_ per element"
                lines.append(f"time model: {what} timed at {ratio:.3g} x ATen's bernoulli_ per element (plausible: "
                             f"x{low:g}..x{high:g}); not cached, ATen's rate serves until the next `batchlab "
                             "calibrate`")
                continue
            cal.element_seconds[k] = ratio * eager  # the calibration's bernoulli_ rate, scaled by the paired ratio
            lines.append(f"time model: timed {what} once against ATen's bernoulli_ (x{ratio:.2f} per element, "
                         f"{ratio * eager * 1e9:.1f} ns) and cached it with the calibration")
    save(cal)  # the rates timed, and the failures, so neither is timed again
    return "\n".join(lines)


def _ensure_in_kernel(cal, eager: float | None) -> list[str]:
    """``measure_in_kernel``'s rates cached with ``cal`` where it lacks any of them; the lines saying so."""
    keys = (*ARITHMETIC_KEYS, SOFTMAX_KEY, MASK_LOAD_KEY, MASK_LOAD_RANDOM_KEY)
    if cal is None or not eager or all(k in cal.element_seconds or k in cal.untimed for k in keys):
        return []
    try:
        with at_threads(cal.threads):
            ratios = measure_in_kernel()
    except Exception as e:  # noqa: BLE001 - inductor or its C++ compiler unusable here: ATen's rates serve
        first = why(e)
        cal.untimed.update({k: first for k in keys if k not in cal.element_seconds})
        save(cal)
        return [f"time model: inductor's in-kernel arithmetic not timed ({first}); ATen's kernels' rates serve "
                "until the next `batchlab calibrate`"]
    # each kept where plausible against ATen's rate of the same op (formula/plausible.py): a broken timing serves
    # nothing, ATen's rate prices the op instead
    # the rates cached already stay (other figures were priced with them): the missing ones are added
    ratios = {k: r for k, r in ratios.items() if k not in cal.element_seconds}
    kept = {k: r * eager for k, r in ratios.items() if math.isfinite(r) and r > 0
            and not in_kernel_problems({**cal.element_seconds, k: r * eager})}
    cal.element_seconds.update(kept)
    cal.untimed.update({k: "implausible against ATen's rate of the op" for k in ratios if k not in kept})
    save(cal)
    return ["time model: timed inductor's in-kernel arithmetic once against ATen's bernoulli_ and cached it with "
            "the calibration (" + ", ".join(f"{k.split('/')[1].split(':')[0].removeprefix('inductor_')} "
                                            f"{v * 1e9:.2f} ns" for k, v in kept.items()) + " per element)"]
