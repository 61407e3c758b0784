"""The planner's counts solver for many identical layers (advise/layercounts.py) against brute force over
every per-layer assignment, and its linear time at 20,000 layers."""
from __future__ import annotations

import itertools
import random
import time

import pytest

from batchlab.advise import knapsack, layercounts


def _brute(cost, held, kept, caps, total, kept_cap):
    best = None
    for choice in itertools.product(range(len(cost)), repeat=len(caps)):
        prefix = [sum(held[j] for j in choice[:i]) for i in range(len(caps) + 1)]
        ok = all(p <= c for p, c in zip(prefix, caps)) and prefix[-1] <= total
        ok = ok and (kept_cap is None or sum(kept[j] for j in choice) <= kept_cap)
        if ok:
            c = sum(cost[j] for j in choice)
            best = c if best is None else min(best, c)
    return best


def test_counts_match_brute_force_on_small_instances():
    rng = random.Random(3)
    for _ in range(400):
        n, m = rng.randint(1, 6), rng.randint(1, 4)
        cost = [rng.choice([0.0, 0.5, 1.0, 1.5, 2.0, 3.0]) for _ in range(m)]
        held = [rng.randint(0, 9) for _ in range(m)]
        kept = [rng.randint(0, 9) for _ in range(m)] if rng.random() < 0.5 else None
        caps = [rng.randint(0, 30) for _ in range(n)]
        total, kept_cap = rng.randint(0, 35), (rng.randint(0, 30) if kept else None)
        want = _brute(cost, held, kept or held, caps, total, kept_cap)
        got = layercounts.solve(cost, held, kept, caps, total, kept_cap)
        if want is None:
            assert got is None
            continue
        assert got is not None and sum(cost[j] for j in got) == pytest.approx(want)
        rows = [held] * n
        assert knapsack.feasible(got, rows, caps, total, [kept] * n if kept else None, kept_cap)


def test_two_options_are_exact_at_any_layer_count():
    """none (holds H, free) and full (holds h, costs 1): the fewest full layers whose ascending layout meets
    a walk that tightens towards the top, computed by hand."""
    n, big, small = 5000, 100, 7
    caps = [big * n - 40 * i for i in range(n)]
    total = 60 * n
    got = layercounts.solve([0.0, 1.0], [big, small], None, caps, total, None)
    fulls = got.count(1)
    # ascending: fulls at the bottom; every walk point and the total hold, and one full fewer breaks one
    layout = lambda f: [small] * f + [big] * (n - f)  # noqa: E731
    def ok(f):
        lay, prefix = layout(f), 0
        for i in range(n):
            if prefix > caps[i]:
                return False
            prefix += lay[i]
        return prefix <= total
    assert list(got) == [1] * fulls + [0] * (n - fulls)
    assert ok(fulls) and not ok(fulls - 1)


def test_twenty_thousand_identical_layers_in_seconds():
    n = 20_000
    cost, held = [0.0, 0.04, 0.045, 0.047, 0.02], [1984512, 524288, 655360, 327680, 65536]
    caps = [n * 900_000 - 10 * i for i in range(n)]
    t = time.perf_counter()
    got = knapsack.solve([cost] * n, [held] * n, caps, n * 1_000_000)
    assert time.perf_counter() - t < 5.0  # the per-layer program took minutes here
    assert got is not None and knapsack.feasible(got, [held] * n, caps, n * 1_000_000)
