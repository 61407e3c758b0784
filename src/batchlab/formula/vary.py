"""One-variable tables: the estimate for each value of one field, directions versus the first value."""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from batchlab.config import BATCH_FIELDS, ConfigError, Keep, RunConfig, apply_change, parse_field_value
from batchlab.formula import Calibrations, Estimate, estimate
from batchlab.util.units import SAME_TOLERANCE

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
    """One value of the table; an impossible one has no config or estimate, only ``why`` and ``fix``."""
    value: Any
    config: RunConfig | None
    estimate: Estimate | None
    directions: dict[str, str]  # output label -> "up" | "down" | "same" versus the first possible row
    why: str = ""  # why this value is not possible for the config
    fix: str = ""  # what would make it possible

    @property
    def possible(self) -> bool:
        return self.estimate is not None

    def to_dict(self) -> dict[str, Any]:
        if not self.possible:
            return {"value": self.value, "possible": False, "why": self.why, "fix": self.fix}
        return {"value": self.value, "possible": True, "directions": self.directions, **self.estimate.to_dict()}


def direction(a: float, b: float, same: float = SAME_TOLERANCE) -> str:
    if a == b or (a and abs(b / a - 1) < same):
        return "same"
    return "up" if b > a else "down"


def _per_step(cfg: RunConfig, name: str) -> int:
    """What the global batch must be a multiple of when ``name`` changes at a kept global batch."""
    return cfg.accum * cfg.dp if name == "accum" else cfg.micro_batch * cfg.dp


def _why(cfg: RunConfig, name: str, free: RunConfig) -> str:
    per = "accum × DP" if name == "accum" else "micro-batch × DP"
    return (f"the global batch {cfg.global_batch} = {cfg.micro_batch} × {cfg.accum} × {cfg.dp} is kept "
            f"(--keep global-batch, the default) and is not a multiple of {per} = {_per_step(free, name)}")


def _fix(cfg: RunConfig, loose: RunConfig, unit: int) -> str:
    """--keep accum (the global batch it would give) and the smallest --global-batch every row divides
    (``unit``: the least common multiple of what each row's global batch must be a multiple of)."""
    g = -(-cfg.global_batch // unit) * unit
    if g > MAX_SUGGESTED:  # e.g. micro_batch=1..1000: the lcm of 1..1000 has 433 digits
        return f"--keep accum (global batch {loose.global_batch}); no global batch up to {MAX_SUGGESTED:.0e} " \
               "makes every row possible"
    return f"--keep accum (global batch {loose.global_batch}), or --global-batch {g} (every row possible)"


MAX_SUGGESTED = 10**9  # samples per update: beyond it a suggested --global-batch helps nobody


def _loose(cfg: RunConfig, name: str, text: str) -> RunConfig | None:
    """cfg with the value and accum kept (the global batch free), or None when the value itself is invalid."""
    try:
        return apply_change(cfg, name, parse_field_value(name, text), Keep.ACCUM)
    except ConfigError:
        return None


def varied(cfg: RunConfig, name: str, values: list[str]) -> Iterator[RunConfig]:
    """The configs a --vary table derives from cfg (accum kept; invalid values left out), for the CLI to have
    the model's layer profile cover them all before the table is computed."""
    return (c for c in (_loose(cfg, name, text) for text in values) if c is not None)


MAX_ROWS = 100_000  # a range longer than this is a typo, not a table


def split_values(text: str) -> list[str]:
    """``--vary``'s values: separated by ``;`` anywhere and by ``,`` outside a plan; a ``plan:`` value keeps
    its commas and runs to the next ``;``, the next item starting ``plan:`` or the end
    (``ac=none,plan:full*2,none*2`` is two values; ``ac=plan:full*4;none`` too)."""
    out: list[str] = []
    for chunk in text.split(";"):
        plan: list[str] | None = None
        for part in chunk.split(","):
            if part.strip().lower().startswith("plan:"):
                if plan is not None:
                    out.append(",".join(plan))
                plan = [part]
            elif plan is not None:
                plan.append(part)
            else:
                out.append(part)
        if plan is not None:
            out.append(",".join(plan))
    return out


def values_of(text: str) -> list[str]:
    """The values of ``--vary FIELD=TEXT`` (``split_values``), a part ``a..b`` standing for the whole numbers
    a, a+1, ..., b (``accum=1..1000``; ``micro_batch=1,2,4..6``)."""
    out: list[str] = []
    for part in split_values(text):
        lo, dots, hi = part.partition("..")
        if not dots:
            out.append(part)
            continue
        if not (lo.strip().isdigit() and hi.strip().isdigit()) or int(lo) > int(hi):
            raise ConfigError("vary", f"a range is a..b with whole numbers a <= b (e.g. accum=1..64), got {part!r}")
        if int(hi) - int(lo) + 1 + len(out) > MAX_ROWS:
            raise ConfigError("vary", f"{part!r} gives more than {MAX_ROWS:,} rows")
        out += [str(v) for v in range(int(lo), int(hi) + 1)]
    return out


def vary(cfg: RunConfig, name: str, values: list[str], keep: Keep = Keep.GLOBAL_BATCH,
         calibrations: Calibrations | None = None) -> list[VaryRow]:
    """One row per value, impossible ones included (with why and what would make them possible);
    raises ConfigError only when no value is possible.  ``calibrations`` as for ``estimate``."""
    loose = [_loose(cfg, name, text) for text in values]
    unit = math.lcm(*(_per_step(c, name) for c in loose if c is not None))  # once: it is the same for every row
    rows: list[VaryRow] = []
    for text, free in zip(values, loose):
        try:
            c = apply_change(cfg, name, parse_field_value(name, text), keep)
        except ConfigError as e:
            if free is None or name not in BATCH_FIELDS:  # the value itself is invalid for this config
                rows.append(VaryRow(value=text, config=None, estimate=None, directions={}, why=str(e)))
                continue
            rows.append(VaryRow(value=text, config=None, estimate=None, directions={}, why=_why(cfg, name, free),
                                fix=_fix(cfg, free, unit)))
            continue
        e = estimate(c, calibrations)
        first = next((r.estimate for r in rows if r.possible), e)
        rows.append(VaryRow(value=text, config=c, estimate=e,
                            directions={label: direction(get(first), get(e)) for label, get in OUTPUTS}))
    if not any(r.possible for r in rows):
        first = rows[0]
        raise ConfigError(name, f"no value is possible: {first.why}" + (f"; {first.fix}" if first.fix else ""))
    return rows
