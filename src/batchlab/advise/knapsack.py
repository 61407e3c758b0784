"""A multiple-choice knapsack with prefix constraints, solved exactly by dynamic programming.

Each layer i (bottom first) takes one option j: cost ``seconds[i][j]``, bytes ``held[i][j]``.  Constraints
model activation checkpointing's memory walk: at layer i's backward the layers below it still hold what they
kept, so ``sum(held[l] for l < i) <= caps[i]`` for every i, and at the end of the forward every layer's
``sum(held) <= total_cap``.  Minimise the total cost.  Bytes are discretised in ``step``-byte units, held
rounded up and caps down, so a solution always satisfies the exact constraints (it is optimal over the
discretised ones; ``step=1``: exactly optimal).  Pure Python.
"""
from __future__ import annotations

import math
from typing import Sequence

UNITS = 4096  # budget resolution: the largest cap in units


def step_for(caps: Sequence[int], total_cap: int, units: int = UNITS) -> int:
    return max(1, math.ceil(max([total_cap, *caps, 1]) / units))


def solve(seconds: Sequence[Sequence[float]], held: Sequence[Sequence[int]], caps: Sequence[int], total_cap: int,
          step: int | None = None) -> tuple[int, ...] | None:
    """The option index per layer with the least total cost that meets every constraint; None: none does."""
    n = len(seconds)
    step = step or step_for(caps, total_cap)
    up = [[math.ceil(b / step) for b in row] for row in held]
    cap_units = [math.floor(c / step) for c in caps] + [math.floor(total_cap / step)]
    best: dict[int, float] = {0: 0.0}  # prefix held (units) -> least cost so far
    back: list[dict[int, tuple[int, int]]] = []  # per layer: state -> (previous state, option)
    for i in range(n):
        best = {s: c for s, c in best.items() if s <= cap_units[i]}  # layer i's backward sees the prefix below
        if not best:
            return None
        nxt: dict[int, float] = {}
        came: dict[int, tuple[int, int]] = {}
        for s, c in best.items():
            for j, (cost, w) in enumerate(zip(seconds[i], up[i])):
                t, total = s + w, c + cost
                if t <= cap_units[n] and (t not in nxt or total < nxt[t] - 1e-15):
                    nxt[t], came[t] = total, (s, j)
        best = nxt
        back.append(came)
    if not best:
        return None
    state = min(best, key=lambda s: (best[s], s))
    out = []
    for i in reversed(range(n)):
        state, j = back[i][state]
        out.append(j)
    return tuple(reversed(out))


def feasible(choice: Sequence[int], held: Sequence[Sequence[int]], caps: Sequence[int], total_cap: int) -> bool:
    """The exact constraints, in bytes."""
    prefix = 0
    for i, j in enumerate(choice):
        if prefix > caps[i]:
            return False
        prefix += held[i][j]
    return prefix <= total_cap
