"""The time model's assumptions in one line (formula/opcost.py's rates, where they come from, what they made of an
update), shown by the estimate and the trace alike."""
from __future__ import annotations

from batchlab.formula.opcost import OpCosts, TimeBreakdown
from batchlab.util.units import fmt_count


def _rates(points, unit: str) -> str:
    """The range of a rate curve ('2 GFLOP/s-29.1 TFLOP/s', one figure when flat)."""
    lo, hi = (fmt_count(f(r for _, r in points), unit) for f in (min, max))
    return lo if lo == hi else f"{lo}-{hi}"


def describe(costs: OpCosts, t: TimeBreakdown) -> str:
    """The time model's assumptions in one line: which rates, from where, and what they made of this update."""
    mm = "; ".join(f"{k} {_rates(pts, 'FLOP/s')}" for k, pts in costs.matmul.items())
    bw = "at " + _rates(costs.memory, "B/s")
    if costs.memory_inplace:
        bw += f" into fresh outputs, {_rates(costs.memory_inplace, 'B/s')} in place"
    disp = "/".join(f"{costs.dispatch[k] * 1e6:.1f}" for k in ("forward", "backward", "plain"))
    if costs.matmul_intensity:
        mm += f", a linear layer's bytes beyond its calibrated shape's at {fmt_count(costs.memory[-1][1], 'B/s')}"
    own = ", ".join(f"{k} " + (f"not timed: {costs.untimed[k]}" if k in costs.untimed else "not in the calibration")
                    for k in t.unpriced)
    return (f"time model: per-op sum over {t.ops:,} ops per update ({fmt_count(t.flops, 'FLOP')} in matmuls at "
            f"{mm} by call size; {fmt_count(t.bytes, 'B')} moved by memory-bound ops {bw}; dispatch {disp} µs per "
            f"forward/backward/plain op, {t.dispatch_share:.0%} of the ops' time"
            f"{'; launches overlap kernels' if costs.asynchronous else ''}); source: {costs.source}"
            + (f"; priced at 0: a compiled graph's or checkpoint region's own call ({own})" if own else ""))
