"""The planner's counts solver for many identical layers (advise/layercounts.py) against brute force over
every per-layer assignment, and its linear time at 20,000 layers (counted: the checks it makes, not seconds)."""
from __future__ import annotations

import itertools
import random

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


def _instance(n: int):
    cost, held = [0.0, 0.04, 0.045, 0.047, 0.02], [1984512, 524288, 655360, 327680, 65536]
    return [cost] * n, [held] * n, [n * 900_000 - 10 * i for i in range(n)], n * 1_000_000


def test_twenty_thousand_identical_layers_take_the_counts_solver_whose_checks_do_not_grow_with_the_layers(monkeypatch):
    """Linear time, counted rather than timed: the per-layer program over a budget grid (layers x grid: minutes
    here) is never entered, and the walk checks the counts solver makes grow with the log of the layer count
    (bisection over one option's count), not with the count itself."""
    for name in ("_dense", "_sparse", "_stacked", "_prefix_pass"):
        monkeypatch.setattr(knapsack, name, lambda *a, _n=name, **k: pytest.fail(f"the per-layer program ran ({_n})"))
    checks = []
    fits = layercounts._fits
    monkeypatch.setattr(layercounts, "_fits", lambda *a: checks.append(1) or fits(*a))
    seen = {}
    for n in (10_000, 20_000):
        checks.clear()
        seconds, held, caps, total = _instance(n)
        got = knapsack.solve(seconds, held, caps, total)
        assert got is not None and knapsack.feasible(got, held, caps, total)
        seen[n] = len(checks)
    # by hand: each pair bisects over at most n counts, log2(20,000) - log2(10,000) = 1 more check per search
    assert seen[20_000] <= seen[10_000] * 1.25, seen
