"""The kernels ``batchlab calibrate`` times: matmul curves (linear layers, attention's batched matmuls, fused
attention), element-wise bandwidth, per-element kernels (per-op dispatch: dispatch.py).  Torch is imported inside the
functions, so importing this module stays cheap."""
from __future__ import annotations

import contextvars
import itertools
import statistics
import time
from typing import Any, Callable



# The clock the kernels are timed with.  On a CPU at one intra-op thread, the calling thread's CPU time
# (``use_cpu_time``): on a shared machine a wall clock also counts the time other processes hold the core,
# which is the load of the moment, not this kernel's cost; the model predicts an otherwise idle machine.
CLOCK: contextvars.ContextVar[Callable[[], float]] = contextvars.ContextVar("calibration_clock",
                                                                            default=time.perf_counter)


def steady(rates: list[float], cpu_clock: bool | None = None) -> float:
    """The rate a kernel runs at, from repeated samples.  Timed in CPU seconds (``cpu_clock``; default: whether
    ``CLOCK`` is a CPU-time clock), other processes' load does not enter a sample: what spreads them is the
    host's own speed (a shared VM can switch between speeds within seconds), which the predicted steps meet
    alike, so the median, the statistic their measurement takes (the upper quartile priced the grids of
    benchmarks/time_accuracy.py too fast: docs/cpu.md).  Timed by a wall clock, other work only
    ever slows a sample down: the upper quartile, the kernel's own rate."""
    if len(rates) < 2:
        return rates[0]
    if cpu_clock is None:
        cpu_clock = CLOCK.get() is not time.perf_counter
    if cpu_clock:
        return statistics.median(rates)
    return statistics.quantiles(rates, n=4, method="inclusive")[2]


def monotone(curve: list[list[float]]) -> list[list[float]]:
    """The least-squares non-decreasing fit of a (size, rate) curve (pool adjacent violators): a larger call
    of the same kernel does not run at a lower rate, so a dip is sampling noise, averaged with its neighbours."""
    blocks: list[list[float]] = []  # [sum of rates, count]
    for _, rate in curve:
        blocks.append([rate, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            r, n = blocks.pop()
            blocks[-1][0] += r
            blocks[-1][1] += n
    rates = [r / n for r, n in blocks for _ in range(int(n))]
    return [[size, rate] for (size, _), rate in zip(curve, rates)]


def timed_rates(fn: Callable[[], Any], work: float, seconds: float, sync: Callable[[], None],
                clock: Callable[[], float] | None = None, min_samples: int = 3) -> list[float]:
    """Rates (work per second) of repeated ``fn()`` calls for about ``seconds``, one warm-up call first.

    Each sample times enough calls to last ~20 ms (less when ``seconds`` is short), so launch and clock
    overheads stay small on a GPU.  ``clock`` times the calls (default: ``CLOCK``'s, with ``seconds`` a
    wall-clock budget, so a loaded machine does not stretch the calibration).
    """
    budget = clock or time.perf_counter
    clock = clock or CLOCK.get()
    t0 = clock()
    fn()
    sync()
    calls = max(1, int(min(0.02, seconds / 5) / max(clock() - t0, 1e-9)))
    return _samples(fn, work, seconds, sync, clock, calls, min_samples, budget)


def _samples(fn, work: float, seconds: float, sync, clock, calls: int, min_samples: int,
             budget=None) -> list[float]:
    """Rates of ``calls`` calls a sample for ``seconds`` on the ``budget`` clock (default: wall clock), at
    least ``min_samples``."""
    budget = budget or time.perf_counter
    rates: list[float] = []
    end = budget() + seconds
    while budget() < end or len(rates) < min_samples:
        t = clock()
        for _ in range(calls):
            fn()
        sync()
        rates.append(work * calls / max(clock() - t, 1e-12))
    return rates


TURNS = 4  # turns each kernel of an alternated group is timed in (``alternated``)


def alternated(kernels: dict, seconds: float, sync, turns: int = TURNS, at_least: int = 1) -> dict:
    """Per key, the steady rate of ``kernels[key] = (call, work per call)``: the keys timed in turn, ``turns``
    times each, ``seconds`` in all.  Why: a shared host's speed moves within a second (docs/cpu.md), and a
    prediction compares the figures of one kernel's variants (fp32 against bf16); timed in turns, they meet the
    same speeds.  A turn starts only
    within ``seconds`` of wall clock (a call longer than its share gets fewer turns); past that, turns of one
    sample a key go on while a key has fewer than ``at_least`` (a kernel whose speed swings needs several)."""
    clock = CLOCK.get()
    samples: dict = {key: [] for key in kernels}
    calls: dict = {}
    share = seconds / (turns * max(len(kernels), 1))
    end = time.perf_counter() + seconds
    for turn in itertools.count():
        budgeted = turn < turns and time.perf_counter() + share * len(kernels) / 2 <= end
        if turn and not budgeted and min(map(len, samples.values())) >= at_least:
            break
        for key, (fn, work) in kernels.items():
            if turn == 0:  # the warm-up call once, which also sizes the samples
                samples[key] = timed_rates(fn, work, share, sync, min_samples=1)
                calls[key] = max(1, int(min(0.02, share / 5) * samples[key][0] / work))
            else:
                samples[key] += _samples(fn, work, share if budgeted else 0.0, sync, clock, calls[key], 1)
    return {key: steady(v) for key, v in samples.items()}


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


def _linear_layer(device, dtype, shape):
    """(call, FLOPs of the call) of one linear layer's three matmuls at (m, k, n), outputs into fresh memory
    (a reused buffer runs well above a step's rate: docs/cpu.md): the forward x @ w^T, the input gradient
    g @ w and the weight gradient g^T @ x, on operands cycled out of cache."""
    import torch

    m, k, n = shape

    def make():
        return (torch.randn(m, k, device=device).to(dtype), torch.randn(n, k, device=device).to(dtype),
                torch.randn(m, n, device=device).to(dtype))

    def linear_layer(x, w, g):  # outputs kept (``keeping``): a step writes each into fresh memory
        return torch.mm(x, w.t()), torch.mm(g, w), torch.mm(g.t(), x)

    elem = torch.empty((), dtype=dtype).element_size()
    return keeping(_cycling(linear_layer, _copies(make, (m * k + n * k + m * n) * elem))), 3 * 2 * m * k * n


def _runs_matmul(device, dtype) -> bool:
    """Whether this device's matmul takes ``dtype`` (a 2 x 2 call, not a shape's warm-up twice)."""
    import torch

    try:
        torch.mm(torch.ones(2, 2, device=device, dtype=dtype), torch.ones(2, 2, device=device, dtype=dtype))
        return True
    except (RuntimeError, TypeError):
        return False


def _matmul_curves(device, dtypes: dict, shapes, seconds: float, sync) -> dict[str, list[list[float]]]:
    """Per name in ``dtypes`` ({"fp32": torch.float32, ...}), (FLOPs per matmul, FLOP/s) per shape class,
    ascending, the dtypes of a shape timed in turns (``alternated``); a dtype stops where a call would overrun
    its share; one the device's matmul lacks has no curve."""
    out: dict[str, list[list[float]]] = {name: [] for name in dtypes}
    live = {name: dtype for name, dtype in dtypes.items() if _runs_matmul(device, dtype)}
    share = seconds / len(shapes)
    for shape in shapes:
        if not live:
            break
        layers = {name: _linear_layer(device, dtype, shape) for name, dtype in live.items()}
        rates = alternated(layers, share * len(layers) / len(dtypes), sync)
        for name, rate in rates.items():
            work = layers[name][1]
            out[name].append([work / 3, rate])
            if work / rate > share / len(dtypes) / 4:  # the next shape's call would overrun its share
                live.pop(name)
    return {name: monotone(sorted(curve)) for name, curve in out.items()}


# attention's batched matmuls (batch entries, s, d): q k^T and p v per (batch, head), and their gradients
BMM_SHAPES = ((16, 32, 32), (32, 64, 32), (32, 128, 32), (32, 256, 64), (16, 512, 64))


def _attention_bmms(device, dtype, batch: int, s: int, d: int):
    """(call, FLOPs of the call) of attention's six batched matmuls at (batch, s, d); None without the dtype."""
    import torch

    try:
        q, k = torch.randn(batch, s, d, device=device).to(dtype), torch.randn(batch, s, d, device=device).to(dtype)
        p = torch.randn(batch, s, s, device=device).to(dtype)
    except (RuntimeError, TypeError):
        return None

    def attention():  # outputs kept, as in a step
        return (torch.bmm(q, k.transpose(1, 2)),  # scores
                torch.bmm(p, k),  # p v
                torch.bmm(p.transpose(1, 2), q),  # grad v = p^T grad_y
                torch.bmm(q, k.transpose(1, 2)),  # grad p = grad_y v^T
                torch.bmm(p, k),  # grad q = grad_s k
                torch.bmm(p.transpose(1, 2), q))  # grad k = grad_s^T q

    return keeping(attention), 6 * 2 * s * s * d * batch


def _bmm_curves(device, dtypes: dict, seconds: float, sync) -> dict[str, list[list[float]]]:
    """Per name in ``dtypes``, (FLOPs per batch entry, FLOP/s) of attention's six batched matmuls (two
    forward, four backward, in the layouts autograd gives them) per shape class, the dtypes timed in turns."""
    out: dict[str, list[list[float]]] = {name: [] for name in dtypes}
    for batch, s, d in BMM_SHAPES:
        calls = {name: c for name, dtype in dtypes.items() if (c := _attention_bmms(device, dtype, batch, s, d))}
        for name, rate in alternated(calls, seconds * len(calls) / len(dtypes) / len(BMM_SHAPES), sync).items():
            out[name].append([float(2 * s * s * d), rate])
    return {name: monotone(sorted(curve)) for name, curve in out.items()}


# fused attention, causal: (s, d) each at two (batch x heads) entry counts (fewer at s 512: 0.2 s a call pair)
SDPA_SHAPES = ((64, 32, 2, 16), (128, 32, 2, 16), (256, 64, 2, 16), (512, 64, 1, 8))


# samples each fused-attention call gets at least: bf16's backward on CPU swings from call to call where fp32's
# and the forwards hold steady, and a round's 1-3 samples moved a model's priced attention backward from one
# calibration to the next (docs/cpu.md)
SWINGING = 5


def _sdpa_calls(device, dtype, heads: int, s: int, d: int) -> dict | None:
    """{"fwd"/"bwd": (call, 1)}: one forward and one backward call of scaled_dot_product_attention over
    ``heads`` (batch x heads) entries, the backward on one retained graph.  None without the dtype."""
    import torch
    import torch.nn.functional as F

    try:
        q, k, v = (torch.randn(1, heads, s, d, device=device).to(dtype).requires_grad_() for _ in range(3))
        g = torch.randn(1, heads, s, d, device=device).to(dtype)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except (RuntimeError, TypeError):
        return None
    return {"fwd": (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), 1.0),
            "bwd": (lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True), 1.0)}


def _sdpa_curves(device, dtypes: dict, seconds: float, sync
                 ) -> tuple[dict[str, list[list[float]]], dict[str, list[list[float]]]]:
    """Fused attention's costs per direction and dtype name (``sdpa-fp32``, ``sdpa-backward-bf16``): (rate
    curves: forward FLOPs per (batch, head) entry, FLOP/s of each further entry, FLOPs as FlopCounterMode
    counts them, 4 s^2 d forward and 10 s^2 d backward per entry, no causal halving; start curves: the same x,
    seconds of a call beyond its entries' work), from each shape timed at two entry counts, t(H) = start + H w,
    every dtype's calls of a shape timed in turns (``alternated``).
    Why: on a CPU in bf16 the backward can have a large cost per call and run far below fp32's speed while the
    forward runs faster than fp32's; one rate for both, at one entry count, mispriced a bf16 step's attention
    several-fold (docs/cpu.md)."""
    rates: dict[str, list[list[float]]] = {}
    starts: dict[str, list[list[float]]] = {}
    live = dict(dtypes)
    for s, d, h1, h2 in SDPA_SHAPES:
        calls = {}
        for name, dtype in list(live.items()):
            made = [_sdpa_calls(device, dtype, h, s, d) for h in (h1, h2)]
            if None in made:
                live.pop(name)
                continue
            calls.update({(name, i, kind): call for i, m in enumerate(made) for kind, call in m.items()})
        if not calls:
            break
        share = seconds * len(live) / len(dtypes) / len(SDPA_SHAPES)
        per_call = {key: 1 / rate for key, rate in alternated(calls, share, sync, at_least=SWINGING).items()}
        per_entry = 4 * s * s * d  # FLOPs per (batch, head): OpCount.flops_per_matmul of fused attention
        for name in live:
            for kind, direction, flops in (("sdpa", "fwd", per_entry), ("sdpa-backward", "bwd", 2.5 * per_entry)):
                t1, t2 = per_call[(name, 0, direction)], per_call[(name, 1, direction)]
                w = max((t2 - t1) / (h2 - h1), t2 / h2 / 4)  # per entry; a noisy difference kept plausible
                rates.setdefault(f"{kind}-{name}", []).append([float(per_entry), flops / w])
                starts.setdefault(f"{kind}-{name}", []).append([float(per_entry), max(0.0, t2 - h2 * w)])
    return {k: monotone(v) for k, v in rates.items()}, starts


def keeping(fn, budget: int = COLD_BYTES):
    """``fn`` whose outputs (a tensor or a tuple of them) stay alive until they total ``budget`` bytes, then are
    all freed: a training step's forward writes each activation into fresh memory (kept for backward), not
    into the buffer the previous call just freed, so its writes miss the cache.  Timing a kernel whose output
    is freed and reused at once measures the warm-buffer rate, well above a step's.  Calibration runs in the steady allocator regime
    (batchlab.host.regime), as the measured processes do, so the freed budget is reused without page faults and
    what remains is the cache miss (docs/cpu.md, "Figures behind the code's choices")."""
    kept: list = []
    state = {"bytes": 0}

    def call():
        out = fn()
        if state["bytes"] >= budget:
            kept.clear()
            state["bytes"] = 0
        kept.append(out)
        outs = out if isinstance(out, tuple) else (out,) if out is not None else ()
        state["bytes"] += sum(t.numel() * t.element_size() for t in outs) if outs else budget
        return out

    return call


def _memory_curve(device, seconds: float, sync, low: bool = True
                  ) -> tuple[list[list[float]], list[list[float]], list[list[float]], float]:
    """Bandwidth (bytes read + written per second) at each size, inputs cycled through more than a core's L2
    as in a step: of an out-of-place add into kept outputs (``keeping``) in fp32 and bf16, of an in-place
    ``add_`` (fp32), and of a strided copy, a (b, s, a, d) activation's transpose made contiguous as attention
    code does.  ``low`` False: no bf16 curve (empty), each other kernel timed as long as with it."""
    import torch

    def add_(x, y):
        return x.add_(y)

    curves = {(torch.float32, torch.add): [], (torch.bfloat16, torch.add): [], (torch.float32, add_): []}
    share = seconds / (len(curves) * len(MEMORY_SIZES) + 1)
    if not low:
        del curves[(torch.bfloat16, torch.add)]

    def kernel(dtype, fn, n):
        elem = torch.empty((), dtype=dtype).element_size()
        sets = _copies(lambda: (torch.ones(n, device=device, dtype=dtype),
                                torch.ones(n, device=device, dtype=dtype)), 2 * n * elem)
        return (_cycling(fn, sets) if fn is add_ else keeping(_cycling(fn, sets))), 3 * elem * n

    for n in MEMORY_SIZES:  # the variants of a size in turns (``alternated``)
        kernels = {variant: kernel(*variant, n) for variant in curves}
        for variant, rate in alternated(kernels, share * len(kernels), sync).items():
            curves[variant].append([float(kernels[variant][1]), rate])
    n = MEMORY_SIZES[1]
    sets = _copies(lambda: (torch.ones(n // (128 * 4 * 32), 128, 4, 32, device=device).transpose(1, 2),), 4 * n)
    strided = steady(timed_rates(keeping(_cycling(lambda x: x.contiguous(), sets)), 2 * 4 * n, share, sync))
    return (curves[(torch.float32, torch.add)], curves.get((torch.bfloat16, torch.add), []),
            curves[(torch.float32, add_)], strided)


def _element_seconds(device, seconds: float, sync, low: bool = True) -> dict[str, float]:
    """Seconds per output element of each class's representative kernel, fp32 and bf16: tanh-GELU and its
    gradient, softmax and layer norm over rows of 128, log-softmax over rows of 1024, a causal masked_fill
    of 128 x 128 blocks, the dropout RNG (bernoulli_); and of each transcendental kernel an op list names
    (``activation/silu:fp32``): their costs differ by more than the class allows (docs/cpu.md).  The operand stays
    in cache, as the previous op's output mostly is; outputs are kept, as a step's are (``keeping``).
    ``low`` False: fp32 only, each kernel timed as long as with bf16 beside it."""
    import torch
    import torch.nn.functional as F

    aten = torch.ops.aten
    causal = torch.ones(128, 128, dtype=torch.bool, device=device).triu(1)  # broadcast over the rows' blocks
    kernels = {"activation": lambda x: F.gelu(x, approximate="tanh"),
               "activation-grad": lambda x: aten.gelu_backward(x, x, approximate="tanh"),
               "softmax": lambda x: x.softmax(-1),
               "loss": lambda x: x.view(-1, 1024).log_softmax(-1),  # over a vocabulary-like row
               "masked": lambda x: x.view(-1, 128, 128).masked_fill(causal, float("-inf")),
               "norm": lambda x: F.layer_norm(x, (128,)), "random": lambda x: x.bernoulli_(0.9)}
    kernels.update({f"activation/{name}": getattr(aten, name) for name in NAMED_ACTIVATIONS})
    kernels.update({f"activation-grad/{name}": (lambda op: lambda x: op(x, x))(getattr(aten, name))
                    for name in NAMED_ACTIVATION_GRADS})
    dtypes = ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))[:2 if low else 1]
    xs = {tag: torch.rand(ELEMENTS // 128, 128, device=device).to(dtype) for dtype, tag in dtypes}
    out = {}
    for cost_class, fn in kernels.items():  # a kernel's precisions in turns (``alternated``)
        calls = {f"{cost_class}:{tag}": ((lambda f=fn, x=x: f(x)) if cost_class == "random"  # bernoulli_ is in place
                                    else keeping(lambda f=fn, x=x: f(x)), ELEMENTS) for tag, x in xs.items()}
        share = seconds / len(kernels) * len(xs) / 2
        out.update({key: 1.0 / rate for key, rate in alternated(calls, share, sync).items()})
    return out


# transcendental kernels timed by name (formula/opcost.py: an op of these names is priced at its own rate;
# gelu is not: its aten name does not say which approximation runs, so it keeps its class's tanh-GELU rate)
NAMED_ACTIVATIONS = ("silu", "tanh", "exp", "log", "sigmoid", "erf", "sin", "cos")
NAMED_ACTIVATION_GRADS = ("silu_backward", "tanh_backward", "sigmoid_backward")
