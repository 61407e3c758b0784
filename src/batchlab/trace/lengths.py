"""A tracked update's live bytes event by event, and the same update at other sequence lengths derived from three.

At one micro-batch the model's code runs the same ops at every sequence length of one code path (below or
at the sliding window), and each storage it makes holds b·s·width, b·heads·s², s² (a mask) or a constant
bytes: so the live bytes after the k-th storage is created are a parabola in s, the same for every k up to
its coefficients.  Three traced lengths give every parabola; a fourth checks them, op by op and byte by
byte, and only then are the other lengths derived (else traced).  A derived phase high point is the
maximum over the same events the tracker's own maximum runs over, so it equals the traced one (the
profiles of falcon, bloom, mistral below and at its window, mixtral and gemma2 were compared byte for byte
with tracing every length).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import lcm, prod
from typing import NamedTuple

from batchlab.config.phase import Phase

_PHASES = (Phase.FORWARD, Phase.BACKWARD)


class EventLog:
    """A StorageListener noting, for the forward's and backward's storages, the live bytes once each is added
    (the tracker's ``_note_peak`` sees the same), and the ops run: the update's shape-free signature."""

    def __init__(self, tracker):
        self.tracker, self.ops, self.phases, self.live = tracker, [], [], []

    def added(self, key: int, nbytes: int, category: str) -> None:
        if self.tracker.phase in _PHASES:
            self.phases.append(self.tracker.phase)
            self.live.append(self.tracker._current)

    def freed(self, key: int) -> None:
        pass

    def relabelled(self, key: int, category: str) -> None:
        pass

    def op_done(self, func, args) -> None:
        if self.tracker.phase in _PHASES:
            self.ops.append(func)


class Figures(NamedTuple):
    """What trace/profile.py fits from one update (bytes)."""

    kept: int  # left by the forward for backward
    forward: int  # the forward's high point above what is live as backward starts
    backward: int  # the backward's, likewise
    optimizer: int  # the optimizer step's temporaries (0 where the step was left out)
    copies: int  # autocast's weight copies kept


@dataclass(frozen=True)
class Run:
    """One tracked update at one length: the figures the profile keeps and the events they are maxima of."""

    signature: tuple  # ops and the phase of each storage event
    scalars: tuple[int, ...]  # kept for backward, live as backward starts, autocast copies kept
    live: tuple[int, ...]  # live bytes after each storage event, in order
    optimizer: int = 0  # the optimizer step's temporaries (0 where the step was left out)

    @classmethod
    def of(cls, log: EventLog, kept: int, at_backward: int, copies: int, optimizer: int = 0) -> "Run":
        return cls((tuple(log.ops), tuple(log.phases)), (kept, at_backward, copies), tuple(log.live), optimizer)

    def figures(self) -> Figures:
        kept, at_backward, copies = self.scalars
        phases = self.signature[1]
        top = {p: max((v for q, v in zip(phases, self.live) if q is p), default=0) for p in _PHASES}
        return Figures(kept, top[Phase.FORWARD] - at_backward, top[Phase.BACKWARD] - at_backward, self.optimizer,
                       copies)


def _through(points: dict[int, tuple[int, ...]], x: int) -> tuple[int, ...] | None:
    """Each component of the parabolas through three (s, vector) at x (Lagrange, in integers); None where one
    is not a whole number of bytes (then the events are not parabolas in s)."""
    xs = sorted(points)
    nums = [prod(x - m for m in xs if m != k) for k in xs]
    dens = [prod(k - m for m in xs if m != k) for k in xs]
    scale = lcm(*dens)
    weights = [n * (scale // d) for n, d in zip(nums, dens)]
    out = []
    for ys in zip(*(points[k] for k in xs)):
        v, r = divmod(sum(w * y for w, y in zip(weights, ys)), scale)
        if r:
            return None
        out.append(v)
    return tuple(out)


def _derived(runs: dict[int, Run], x: int) -> Run | None:
    """The run at length x from three runs of one micro-batch, or None (their ops differ, or a parabola does
    not give whole bytes there)."""
    if len({r.signature for r in runs.values()}) != 1:
        return None
    vec = _through({s: r.scalars + r.live for s, r in runs.items()}, x)
    return None if vec is None else Run(next(iter(runs.values())).signature, vec[:3], vec[3:])


def _same(a: Run | None, b: Run) -> bool:
    return a is not None and (a.signature, a.scalars, a.live) == (b.signature, b.scalars, b.live)


# the micro-batch whose check vouches for each: b = 1 has a code path of its own (broadcasting leaves some
# tensors unmaterialised), b = 3 runs b = 2's ops on tensors b/2 times as large (the parabolas' coefficients
# grow, their form does not)
_VOUCHED_BY = {1: 1, 2: 2, 3: 2}


def at_shapes(trace, shapes: list[tuple[int, int]]) -> dict[tuple[int, int], Run]:
    """(b, s) -> Run for every shape, ``trace(b, s)`` called at three lengths per micro-batch (the shortest, a
    middle one, the longest) and a check at b = 1 and b = 2 at the second shortest (where a short-sequence
    code path would show).  Where a check differs by one byte or one op, or there are under five lengths,
    every shape it vouches for is traced."""
    lengths = sorted({s for _, s in shapes})
    batches = sorted({b for b, _ in shapes})
    if len(lengths) < 5 or batches != sorted(_VOUCHED_BY) or len(shapes) != len(batches) * len(lengths):
        return {shape: trace(*shape) for shape in shapes}
    nodes, check = [lengths[0], lengths[len(lengths) // 2], lengths[-1]], lengths[1]
    out = {(b, s): trace(b, s) for b in batches for s in nodes}
    at = lambda b: {s: out[(b, s)] for s in nodes}  # noqa: E731
    ok = {}
    for b in sorted(set(_VOUCHED_BY.values())):
        out[(b, check)] = trace(b, check)
        ok[b] = _same(_derived(at(b), check), out[(b, check)])
    for b in batches:
        for s in lengths:
            if (b, s) not in out:
                out[(b, s)] = (_derived(at(b), s) if ok[_VOUCHED_BY[b]] else None) or trace(b, s)
    return out
