"""A multiple-choice knapsack with prefix constraints, solved exactly by dynamic programming.

Each layer i (bottom first) takes one option j: cost ``seconds[i][j]``, bytes ``held[i][j]``.  Constraints
model activation checkpointing's memory walk: at layer i's backward the layers below it still hold what they
kept, so ``sum(held[l] for l < i) <= caps[i]`` for every i, and at the end of the forward every layer's
``sum(held) <= total_cap``.  Minimise the total cost.  Bytes are discretised in ``step``-byte units, held
rounded up and caps down, so a solution always satisfies the exact constraints (it is optimal over the
discretised ones; ``step=1``: exactly optimal).

Three exact solvers, by the instance's shape:
- many identical layers (more than ``DP_LAYERS``): a plan as counts per option, in exact bytes, in time
  linear in the layers (advise/layercounts.py);
- identical layers (the formula's model): any order of a multiset of options can be replaced by the
  ascending-held one, whose every prefix sum is the least (the k smallest of a multiset sum to at most any k
  of them), with the same totals and cost.  So the option holding most sits on top, c times, above a plan
  of the others: one pass of the prefix DP over the others, every c read off it.  This also takes the second
  total, where only that option keeps beyond what it holds for the walk (autocast's weight copies, kept by
  the layers that recompute nothing).
- one total: the prefix DP over dense arrays of the held sum (numpy);
- otherwise: states of (held, kept) sums with dominated pairs pruned (pure Python).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from batchlab.advise import layercounts

UNITS = 1 << 16  # budget resolution: the largest cap in units
DP_LAYERS = 512  # identical layers beyond this are solved as counts (the program is layers x UNITS)
_TIE = 1e-15  # costs closer than this are equal (the first option in menu order wins)


def step_for(caps: Sequence[int], total_cap: int, units: int = UNITS) -> int:
    return max(1, math.ceil(max([total_cap, *caps, 1]) / units))


def solve(seconds: Sequence[Sequence[float]], held: Sequence[Sequence[int]], caps: Sequence[int], total_cap: int,
          step: int | None = None, kept: Sequence[Sequence[int]] | None = None,
          kept_cap: int | None = None) -> tuple[int, ...] | None:
    """The option index per layer with the least total cost that meets every constraint; None: none does.
    ``kept``/``kept_cap``: a second total, ``sum(kept) <= kept_cap``."""
    if by_counts(seconds, held, kept):
        return layercounts.solve(seconds[0], held[0], kept[0] if kept is not None else None, caps, total_cap,
                                 kept_cap)
    step = step or step_for(caps, total_cap)
    up = [[math.ceil(b / step) for b in row] for row in held]
    cap_units = [math.floor(c / step) for c in caps]
    total_units = math.floor(total_cap / step)
    second = [[math.ceil(b / step) for b in row] for row in kept] if kept is not None else None
    second_cap = math.floor(kept_cap / step) if kept_cap is not None else None
    if total_units < 0 or (second_cap is not None and second_cap < 0):
        return None  # every option holds >= 0 bytes
    if len(set(map(tuple, seconds))) == 1 and len(set(map(tuple, up))) == 1 and (
            second is None or len(set(map(tuple, second))) == 1):
        top = _top_option(up[0], second[0] if second else None)
        if top is not None:
            return _stacked(list(seconds[0]), up[0], second[0] if second else None, top, cap_units, total_units,
                            second_cap, len(seconds))
    if second is None:
        return _dense(seconds, up, cap_units, total_units)
    return _sparse(seconds, up, second, cap_units + [total_units], second_cap)


def by_counts(seconds: Sequence[Sequence[float]], held: Sequence[Sequence[int]],
              kept: Sequence[Sequence[int]] | None = None) -> bool:
    """Whether ``solve`` takes the instance as counts per option (exact bytes: no rounding to a grid)."""
    rows = (seconds, held) if kept is None else (seconds, held, kept)
    return len(seconds) > DP_LAYERS and all(len(set(map(tuple, r))) == 1 for r in rows)


def _top_option(w: Sequence[int], k: Sequence[int] | None) -> int | None:
    """The option that holds most, where it is the only one whose second-total bytes differ from its held."""
    z = max(range(len(w)), key=lambda j: (w[j], j))
    if k is not None and any(k[j] != w[j] for j in range(len(w)) if j != z):
        return None
    return z


def _prefix_pass(seconds: Sequence[Sequence[float]], up: Sequence[Sequence[int]], cap_units: Sequence[int],
                 total: int, options: Sequence[int], visit=None) -> tuple[list[np.ndarray], np.ndarray] | None:
    """The prefix DP over dense held-sum arrays: per layer, the option taken into each state (-1: none), and
    the least cost of each held sum over all layers.  ``visit(i, best)`` sees it over the first i (0..n)."""
    best = np.full(total + 1, np.inf)
    best[0] = 0.0
    came = []
    for i in range(len(seconds)):
        if visit is not None:
            visit(i, best)
        if cap_units[i] < 0:
            return None
        best[cap_units[i] + 1:] = np.inf  # layer i's backward sees the prefix below
        nxt = np.full(total + 1, np.inf)
        arg = np.full(total + 1, -1, dtype=np.int16)
        for j in options:
            w = up[i][j] if j < len(up[i]) else total + 1
            if w > total:
                continue
            cand = best[:total + 1 - w] + seconds[i][j]
            better = cand < nxt[w:] - _TIE
            nxt[w:][better], arg[w:][better] = cand[better], j
        best = nxt
        came.append(arg)
    if visit is not None:
        visit(len(seconds), best)
    return came, best


def _walk_back(came: Sequence[np.ndarray], up: Sequence[Sequence[int]], state: int) -> list[int]:
    out = []
    for i in reversed(range(len(came))):
        j = int(came[i][state])
        out.append(j)
        state -= up[i][j]
    return out[::-1]


def _dense(seconds, up, cap_units, total) -> tuple[int, ...] | None:
    if total < 0:
        return None
    done = _prefix_pass(seconds, up, cap_units, total, range(max(map(len, seconds))))
    if done is None or not np.isfinite(done[1]).any():
        return None
    came, best = done
    return tuple(_walk_back(came, up, int(np.argmin(best))))


def _stacked(cost: list[float], w: list[int], k: list[int] | None, z: int, cap_units: list[int], total: int,
             kept_cap: int | None, n: int) -> tuple[int, ...] | None:
    """Identical layers: the least cost over c = n - m layers of option z on top of a plan of m below it."""
    others = [j for j in range(len(w)) if j != z]
    found: list[tuple[float, int, int]] = []  # (cost, m, held sum of the m below)

    def visit(m: int, best: np.ndarray) -> None:
        c = n - m
        cap = total - c * w[z]  # the total; then every walk point among the c on top
        if k is not None and kept_cap is not None:
            cap = min(cap, kept_cap - c * k[z])
        for p in range(m, n):
            cap = min(cap, cap_units[p] - (p - m) * w[z])
        if cap < 0:
            return
        head = best[:cap + 1]
        s = int(np.argmin(head))
        if np.isfinite(head[s]):
            found.append((float(head[s]) + c * cost[z], m, s))

    done = _prefix_pass([cost] * n, [w] * n, cap_units, total, others, visit)
    if done is None or not found:
        return None
    came = done[0]
    least = min(f[0] for f in found)
    # at equal cost: the fewest on top, then the least held below
    _, m, s = min((f for f in found if f[0] <= least + _TIE * n), key=lambda f: (-f[1], f[2]))
    below = sorted(_walk_back(came[:m], [w] * m, s), key=lambda j: (w[j], j))  # ascending: least prefix sums
    return tuple(below) + (z,) * (n - m)


def _sparse(seconds, up, second, cap_units, second_cap) -> tuple[int, ...] | None:
    n = len(seconds)
    second_cap = math.inf if second_cap is None else second_cap
    best: dict[tuple[int, int], float] = {(0, 0): 0.0}  # (prefix held, prefix kept) in units -> least cost
    back: list[dict[tuple[int, int], tuple[tuple[int, int], int]]] = []  # per layer: state -> (previous, option)
    for i in range(n):
        best = {s: c for s, c in best.items() if s[0] <= cap_units[i]}  # layer i's backward sees the prefix below
        if not best:
            return None
        nxt: dict[tuple[int, int], float] = {}
        came: dict[tuple[int, int], tuple[tuple[int, int], int]] = {}
        for s, c in best.items():
            for j, (cost, w, k) in enumerate(zip(seconds[i], up[i], second[i])):
                t, total = (s[0] + w, s[1] + k), c + cost
                if t[0] <= cap_units[n] and t[1] <= second_cap and (t not in nxt or total < nxt[t] - _TIE):
                    nxt[t], came[t] = total, (s, j)
        best = _pareto(nxt)
        back.append(came)
    if not best:
        return None
    state = min(best, key=lambda s: (best[s], s))
    out = []
    for i in reversed(range(n)):
        state, j = back[i][state]
        out.append(j)
    return tuple(reversed(out))


def _pareto(states: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """Of the states with the same first sum, those no other beats on both the second sum and the cost."""
    out: dict[tuple[int, int], float] = {}
    last: dict[int, float] = {}
    for s in sorted(states):
        if states[s] < last.get(s[0], math.inf) - _TIE:
            out[s], last[s[0]] = states[s], states[s]
    return out


def feasible(choice: Sequence[int], held: Sequence[Sequence[int]], caps: Sequence[int], total_cap: int,
             kept: Sequence[Sequence[int]] | None = None, kept_cap: int | None = None) -> bool:
    """The exact constraints, in bytes."""
    prefix = 0
    for i, j in enumerate(choice):
        if prefix > caps[i]:
            return False
        prefix += held[i][j]
    second = sum(kept[i][j] for i, j in enumerate(choice)) if kept is not None else 0
    return prefix <= total_cap and (kept_cap is None or second <= kept_cap)
