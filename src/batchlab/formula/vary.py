"""One-variable tables: the estimate for each value of one field, directions versus the first value."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchlab.config import Keep, RunConfig, apply_change, parse_field_value
from batchlab.formula import Calibrations, Estimate, estimate

# relative change under which the calculator calls two figures equal
SAME = 0.005

# (label, getter) for the outputs a --vary table compares
OUTPUTS = (
    ("peak memory", lambda e: e.memory.peak_bytes),
    ("activations", lambda e: e.memory.activations_bytes),
    ("update time", lambda e: e.time.update_seconds),
    ("tokens/s", lambda e: e.time.tokens_per_second),
    ("hardware FLOPs/update", lambda e: e.flops.hardware_flops_per_update),
)


@dataclass(frozen=True)
class VaryRow:
    value: Any
    config: RunConfig
    estimate: Estimate
    directions: dict[str, str]  # output label -> "up" | "down" | "same" versus the first row


def direction(a: float, b: float, same: float = SAME) -> str:
    if a == b or (a and abs(b / a - 1) < same):
        return "same"
    return "up" if b > a else "down"


def vary(cfg: RunConfig, name: str, values: list[str], keep: Keep = Keep.GLOBAL_BATCH,
         calibrations: Calibrations | None = None) -> list[VaryRow]:
    """One row per value; ``calibrations`` as for ``estimate``."""
    rows: list[VaryRow] = []
    for text in values:
        c = apply_change(cfg, name, parse_field_value(name, text), keep)
        e = estimate(c, calibrations)
        first = rows[0].estimate if rows else e
        rows.append(VaryRow(text, c, e, {label: direction(get(first), get(e)) for label, get in OUTPUTS}))
    return rows
