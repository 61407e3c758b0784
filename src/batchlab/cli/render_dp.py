"""Plain-text lines for a DP measurement: memory per rank and the gradient all-reduce.  Torch-free."""
from __future__ import annotations

from batchlab.measure.result import Measurement
from batchlab.units import fmt_bytes, fmt_seconds


def memory_lines(m: Measurement) -> list[str]:
    mem = m.memory
    if mem is None or not mem.per_rank_peak_bytes:
        return []
    ranks = ", ".join(f"rank {k} {fmt_bytes(b)}" for k, b in enumerate(mem.per_rank_peak_bytes))
    return [f"peak memory per rank ({mem.provenance}): {ranks}; max {fmt_bytes(mem.peak_bytes)}, "
            f"spread {fmt_bytes(mem.rank_spread_bytes)}",
            "DDP gradient_as_bucket_view is on: gradients are views into the all-reduce buckets "
            "(one gradient copy less than .grad + bucket)"]


def comm_lines(m: Measurement) -> list[str]:
    c = m.comm
    if c is None:
        return []
    rounds = "once" if c.rounds_per_update == 1 else f"{c.rounds_per_update} times"
    out = [f"gradient all-reduce ({c.backend}, {c.world_size} ranks): {rounds} per optimizer update, "
           f"{c.calls_per_update} bucket(s), {fmt_bytes(c.bytes_per_update)} per update (counted by a DDP comm hook)"]
    if c.seconds:
        predicted = f"; {c.predicted_provenance}"
        if c.predicted_seconds is not None:
            predicted += f": {fmt_seconds(c.predicted_seconds)}"
            if c.predicted_bytes is not None and c.predicted_bandwidth_bytes_per_s:
                predicted += (f" (ring 2(n-1)/n x {fmt_bytes(c.predicted_bytes)} over "
                              f"{c.predicted_bandwidth_bytes_per_s / 1e9:.3g} GB/s)")
        out.append(f"all-reduce time per update (median, wall-clock via comm hook, approximate): "
                   f"{fmt_seconds(c.seconds_median)}{predicted}; compute (update minus all-reduce): "
                   f"{fmt_seconds(c.compute_seconds_median)}")
    if c.scope:
        out.append(f"scope: {c.scope}")
    return out


def lines(m: Measurement) -> list[str]:
    """Everything DP-specific a report prints; empty for a one-process measurement."""
    return memory_lines(m) + comm_lines(m)
