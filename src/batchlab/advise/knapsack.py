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

UNITS = 1 << 16  # budget resolution: the largest cap in units


def step_for(caps: Sequence[int], total_cap: int, units: int = UNITS) -> int:
    return max(1, math.ceil(max([total_cap, *caps, 1]) / units))


def solve(seconds: Sequence[Sequence[float]], held: Sequence[Sequence[int]], caps: Sequence[int], total_cap: int,
          step: int | None = None, kept: Sequence[Sequence[int]] | None = None,
          kept_cap: int | None = None) -> tuple[int, ...] | None:
    """The option index per layer with the least total cost that meets every constraint; None: none does.
    ``kept``/``kept_cap``: a second total, ``sum(kept) <= kept_cap`` (a state is then a pair of sums, with the
    pairs one dominates pruned)."""
    n = len(seconds)
    step = step or step_for(caps, total_cap)
    up = [[math.ceil(b / step) for b in row] for row in held]
    cap_units = [math.floor(c / step) for c in caps] + [math.floor(total_cap / step)]
    second = [[math.ceil(b / step) for b in row] for row in kept] if kept is not None else [[0] * len(r) for r in up]
    second_cap = math.floor(kept_cap / step) if kept_cap is not None else math.inf
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
                if t[0] <= cap_units[n] and t[1] <= second_cap and (t not in nxt or total < nxt[t] - 1e-15):
                    nxt[t], came[t] = total, (s, j)
        best = _pareto(nxt) if kept is not None else nxt
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
        if states[s] < last.get(s[0], math.inf) - 1e-15:
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
