"""Many identical layers: a plan as a count of layers per option, solved in exact bytes in time linear in the
layer count (the knapsack's dynamic program over per-layer choices and a budget grid is layers x grid).

Every layer has the same options (cost, held bytes, kept bytes).  Any order of a multiset of options can be
replaced by the ascending-held one, whose every prefix sum is the least, so a plan is its counts, laid out
ascending from the bottom.  An option another beats on cost, held and kept bytes at once is never needed (swap
it, re-sort: no prefix sum grows).  Of the rest, the search takes every pair of options in any counts, with up
to ``EXTRA`` layers of a third: exact where two options remain (the usual menu: no recompute and the full
block), and otherwise the best plan of that shape.  For a pair the count of the less-holding option is the
least that meets the walk (more of it lowers every prefix sum), found by bisection, or the most the kept
total allows where it is the cheaper (cost and the kept total are linear in the count); each
check reads range minima of ``cap_i - held * i`` from a sparse table, a few steps per run of one option.
"""
from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

EXTRA = 8  # layers of a third option tried beside a pair
_TIE = 1e-15


class _Walk:
    """Range minima of ``caps[i] - w * i`` over layer indices, one sparse table per option's held ``w``."""

    def __init__(self, caps: Sequence[int], held: Sequence[int]):
        idx = np.arange(len(caps), dtype=np.int64)
        self.tables = [self._table(np.asarray(caps, dtype=np.int64) - w * idx) for w in held]

    @staticmethod
    def _table(a: np.ndarray) -> list[np.ndarray]:
        levels = [a]  # levels[k][i]: min of a[i : i + 2**k]
        while (1 << len(levels)) <= len(a):
            half = 1 << (len(levels) - 1)
            levels.append(np.minimum(levels[-1][:-half], levels[-1][half:]))
        return levels

    def least(self, j: int, lo: int, hi: int) -> int:
        """min over i in [lo, hi] (inclusive, lo <= hi) of caps[i] - held_j * i."""
        levels = self.tables[j]
        k = (hi - lo + 1).bit_length() - 1
        return int(min(levels[k][lo], levels[k][hi - (1 << k) + 1]))


def solve(cost: Sequence[float], held: Sequence[int], kept: Sequence[int] | None, caps: Sequence[int],
          total_cap: int, kept_cap: int | None) -> tuple[int, ...] | None:
    """The option per layer, bottom first (ascending held); None: no plan of the searched shape fits."""
    n = len(caps)
    kept = list(held) if kept is None else list(kept)
    if n == 0 or caps[0] < 0:
        return None
    live = _undominated(cost, held, kept)
    walk = _Walk(caps, held)
    best: tuple[float, tuple[int, ...]] | None = None
    pairs = list(itertools.combinations(live, 2)) or [(live[0], live[0])]
    for a, b in pairs:
        if held[a] < held[b]:
            a, b = b, a  # a: holds more
        for t, extra in [(None, 0)] + [(t, e) for t in live if t not in (a, b) for e in range(1, EXTRA + 1)]:
            counts = _pair(a, b, t, extra, n, cost, held, kept, walk, total_cap, kept_cap)
            if counts is not None:
                c = sum(cost[j] * k for j, k in counts.items())
                if best is None or c < best[0] - _TIE * n:
                    best = (c, _layout(counts, held))
    return None if best is None else best[1]


def _undominated(cost, held, kept) -> list[int]:
    def beats(x: int, y: int) -> bool:
        no_worse = cost[x] <= cost[y] and held[x] <= held[y] and kept[x] <= kept[y]
        same = cost[x] == cost[y] and held[x] == held[y] and kept[x] == kept[y]
        return no_worse and (not same or x < y)

    return [y for y in range(len(cost)) if not any(beats(x, y) for x in range(len(cost)) if x != y)]


def _pair(a, b, t, extra, n, cost, held, kept, walk, total_cap, kept_cap) -> dict[int, int] | None:
    """The cheapest counts {option: layers} with ``extra`` layers of t and the rest split between a and b."""
    m = n - extra
    if m < 0:
        return None

    def counts(cb: int) -> dict[int, int]:
        out: dict[int, int] = {}
        for j, k in ((a, m - cb), (b, cb), (t, extra)):
            if j is not None and k:
                out[j] = out.get(j, 0) + k
        return out

    def fits(cb: int) -> bool:
        return _fits(counts(cb), held, walk, n, total_cap)

    top = m if a != b else 0
    if not fits(top):
        return None
    lo, hi = 0, top
    while lo < hi:  # the least count of b that fits the walk: more of b lowers every prefix sum
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    hi = top
    if kept_cap is not None:  # the kept total is linear in b's count: a bound on one side
        room = kept_cap - sum(kept[j] * k for j, k in counts(0).items())
        slope = kept[b] - kept[a]
        if slope > 0:
            hi = min(hi, room // slope)
        elif slope < 0:
            lo = max(lo, -(room // -slope))
        elif room < 0:
            return None
    if lo > hi:
        return None
    return counts(lo if cost[b] >= cost[a] else hi)  # cost is linear in b's count too


def _fits(counts: dict[int, int], held, walk: _Walk, n: int, total_cap: int) -> bool:
    """The ascending layout of ``counts`` meets every walk point and the total."""
    below = 0  # the prefix sum at the first layer of the run
    start = 0
    for j in sorted(counts, key=lambda j: (held[j], j)):
        c = counts[j]
        hi = min(start + c, n - 1)  # walk points i in (start, start + c] see this run's layers below them
        if start + 1 <= hi and walk.least(j, start + 1, hi) < below - held[j] * start:
            return False
        below += held[j] * c
        start += c
    return below <= total_cap


def _layout(counts: dict[int, int], held) -> tuple[int, ...]:
    out: list[int] = []
    for j in sorted(counts, key=lambda j: (held[j], j)):
        out += [j] * counts[j]
    return tuple(out)
