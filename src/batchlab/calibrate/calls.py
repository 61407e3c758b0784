"""The own cost of a call that wraps a region of ops, beyond the ops it runs: a compiled graph's and a
non-reentrant checkpoint's.  Timed once on this CPU and cached with the calibration as dispatch kinds.

A block compiled by torch.compile runs, each forward, dynamo's guards on its inputs (the cache lookup), the
compiled region's frame and AOTAutograd's runtime wrapper, which makes one autograd node for the whole graph
(``CompiledFunction``); each backward, the engine calls that node, whose wrapper prepares the saved tensors and runs
the backward graph (``CompiledFunctionBackward``).  None of it is an ATen call, so the dispatch figures, timed on
eager ops, do not cover it.  Timed on the smallest graph with a backward, ``x * 2`` over a few elements, compiled
against the same function in eager, forward alone and forward with backward, in turns (calibrate/kernels.py
``alternated``); each side's time less what the time model prices its ops at (eager: one forward and one backward
op's dispatch; compiled: one kernel each, a no-grad call's) is the graph's own call:

    graph-forward  = t(compiled forward) − t(eager forward) + dispatch(forward) − dispatch(plain)
    graph-backward = Δt(compiled backward) − Δt(eager backward) + dispatch(backward) − dispatch(plain)

An eager block under ``torch.utils.checkpoint(use_reentrant=False, preserve_rng_state=True)`` pays, per region, in
forward the checkpoint's Python entry (its frame, the RNG state stashed, the saved-tensor hooks installed) and,
at the first unpack in backward, the recompute's entry (the RNG state restored, a fresh graph under the hooks'
context); per saved tensor it runs a pack and an unpack hook, which the op lists already count as the detach and
alias they issue.  Timed on chains of k sigmoids (each saves its output) checkpointed against eager, k = 1 and 4:
the extra time is linear in k, and its value at k = 0 is the region's own cost, forward (``checkpoint-forward``)
and recompute (``checkpoint-recompute``).  A selective policy's dispatch mode is timed with it in its per-op
dispatch (calibrate/dispatch.py), and a checkpoint inside a compiled graph is part of the graph: neither pays these.
Each figure is the median of ``ROUNDS`` such timings, taken as calibrate/oneoff.py says.  Each ``Launch.GRAPH`` /
``Launch.CHECKPOINT`` op is priced at its kind (formula/opcost.py; 0 where untimed, and the estimate says so).
"""
from __future__ import annotations

import statistics

from batchlab.cache.calibrations import default_threads, load_cached, save
from batchlab.calibrate.oneoff import at_threads, thread_clock, timed_once
from batchlab.config import RunConfig
from batchlab.config.phase import Launch, Phase, own_kind
from batchlab.formula.oplist import update_ops
from batchlab.formula.plausible import dispatch_problems

GRAPH = (own_kind(Launch.GRAPH, Phase.FORWARD), own_kind(Launch.GRAPH, Phase.BACKWARD))
CHECKPOINT = (own_kind(Launch.CHECKPOINT, Phase.FORWARD), own_kind(Launch.CHECKPOINT, Phase.RECOMPUTE))
SECONDS = 1.0
ROUNDS = 3  # each figure the median of this many timings, a burst of the host's load in one not taken
CHAINS = (1, 4)  # saved tensors of the two checkpointed chains


def _times(turns: dict, seconds: float) -> dict[str, float]:
    """Seconds per call of each of ``turns`` (name -> function), timed in turns on this thread's clock."""
    from batchlab.calibrate.kernels import alternated

    with thread_clock():
        return {k: 1.0 / rate for k, rate in alternated({k: (fn, 1) for k, fn in turns.items()}, seconds,
                                                         lambda: None).items()}


def _median(timer, rounds: int = ROUNDS) -> dict[str, float]:
    """Each figure of ``timer()`` as the median of ``rounds`` timings (a repeated compile is inductor's cache hit)."""
    runs = [timer() for _ in range(rounds)]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def measure_graph(dispatch: dict[str, float], seconds: float = SECONDS) -> dict[str, float]:
    """``GRAPH``'s seconds per graph call on this CPU at the current intra-op threads, the eager ops' priced
    dispatch (``dispatch``: the calibration's forward, backward, plain) taken off (the module's docstring)."""
    import torch

    x, grad = torch.randn(4, 8, requires_grad=True), torch.ones(4, 8)

    def double(t):
        return t * 2

    compiled = torch.compile(double, backend="inductor", dynamic=False, fullgraph=True)
    compiled(x).backward(grad)  # the compiles, forward and backward, outside the timed turns
    t = _times({"eager forward": lambda: double(x), "compiled forward": lambda: compiled(x),
                "eager update": lambda: double(x).backward(grad),
                "compiled update": lambda: compiled(x).backward(grad)}, seconds)
    forward = t["compiled forward"] - t["eager forward"] + dispatch["forward"] - dispatch["plain"]
    backward = ((t["compiled update"] - t["compiled forward"]) - (t["eager update"] - t["eager forward"])
                + dispatch["backward"] - dispatch["plain"])
    return {"graph-forward": forward, "graph-backward": backward}


def measure_checkpoint(seconds: float = SECONDS) -> dict[str, float]:
    """``CHECKPOINT``'s seconds per region on this CPU at the current intra-op threads (the module's docstring)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    x, grad = torch.randn(4, 8, requires_grad=True), torch.ones(4, 8)

    def chain(k):
        def run(t):
            for _ in range(k):
                t = t.sigmoid()
            return t
        return run

    turns = {}
    for k in CHAINS:
        f = chain(k)
        turns |= {(k, "eager", "forward"): lambda f=f: f(x), (k, "eager", "update"): lambda f=f: f(x).backward(grad),
                  (k, "checkpointed", "forward"): lambda f=f: checkpoint(f, x, use_reentrant=False),
                  (k, "checkpointed", "update"):
                      lambda f=f: checkpoint(f, x, use_reentrant=False).backward(grad)}
    t = _times(turns, seconds)
    extra = {k: (t[k, "checkpointed", "forward"] - t[k, "eager", "forward"],
                 (t[k, "checkpointed", "update"] - t[k, "checkpointed", "forward"])
                 - (t[k, "eager", "update"] - t[k, "eager", "forward"])) for k in CHAINS}
    (a, b) = CHAINS
    # each part's line through the two chains, read at no saved tensor
    at_zero = [extra[a][i] - a * (extra[b][i] - extra[a][i]) / (b - a) for i in (0, 1)]
    return dict(zip(CHECKPOINT, at_zero))


def problems(timed: dict[str, float]) -> list[str]:
    """What makes ``timed`` unusable: a cost per call outside dispatch's plausible range (formula/plausible.py)."""
    return dispatch_problems("own call", timed)


def wanted(cfg: RunConfig) -> tuple[str, ...]:
    """The kinds ``cfg`` pays on this CPU, as the formula's op list prices them: its graph's and region's own
    calls (``Launch.GRAPH``, ``Launch.CHECKPOINT``; formula/oplist.py decides who runs which)."""
    if cfg.device != "cpu":
        return ()  # a GPU's: `batchlab calibrate --torch-device cuda` (the estimate says what is priced at 0)
    paid = {own_kind(op.launch, op.phase) for op in update_ops(cfg)
            if op.launch in (Launch.GRAPH, Launch.CHECKPOINT)}
    return tuple(k for k in (*GRAPH, *CHECKPOINT) if k in paid)


def ensure(cfg: RunConfig, threads: int | None = None) -> str | None:
    """For a model on this CPU whose calibration (at ``threads``) lacks the region costs it runs (``wanted``),
    time them once and cache them with the calibration (or why not, in ``untimed``, so it is not tried again).
    Returns the line to show the user (None: nothing to say)."""
    kinds = wanted(cfg)
    cal = load_cached("cpu", default_threads() if threads is None else threads) if kinds else None
    if cal is None:
        return None
    # a graph's own call is what it adds to the eager ops' dispatch: timed only beside the calibrated dispatch
    dispatched = all(k in cal.dispatch_seconds for k in ("forward", "backward", "plain"))
    timers = {GRAPH: ("a compiled graph's own call", lambda: measure_graph(cal.dispatch_seconds)),
              CHECKPOINT: ("a checkpoint region's own call", measure_checkpoint)}
    lines = []
    with at_threads(cal.threads):
        for group, (what, timer) in timers.items():
            if (not set(group) & set(kinds) or all(k in cal.dispatch_seconds or k in cal.untimed for k in group)
                    or (group is GRAPH and not dispatched)):
                continue
            # inductor or its C++ compiler unusable here: not priced; a wall-clock timing (several threads)
            # stretched by others' load stays out of the cache, as calibrate's, and is not marked untimed either
            timed, wrong, others = timed_once(cal, group, lambda: _median(timer), problems, cal.threads,
                                              errors=(Exception,))
            busy = f", while other processes kept {others:.1f} core(s) busy" if others else ""
            if wrong:
                lines.append(f"time model: {what} not timed ({wrong}); not priced until the next "
                             "`batchlab calibrate`")
                continue
            if timed is None:
                lines.append(f"time model: {what} timed{busy}: not cached, timed again next time")
                continue
            cal.dispatch_seconds.update(timed)
            lines.append(f"time model: timed {what} once and cached it with the calibration ("
                         + ", ".join(f"{k.split('-')[1]} {s * 1e6:.0f} µs" for k, s in timed.items())
                         + f"; median of {ROUNDS}{busy})")
    if lines:
        save(cal)
    return "\n".join(lines) or None
