"""What the per-op time model attributes a predicted update-time change to: which op classes and phases grow,
by how much, and how much of each step is fixed per-op cost.  Torch-free; compare's diagnosis shows it.

    attribute(est_a.time, est_b.time).text
    # "the time model predicts B/A = 1.53: recompute adds 31% matmul FLOPs but 36% memory-bound bytes; of the
    #  +65 ms: random 53%, matmul 21%, ...; dispatch is 5% of A's step and 4% of B's"
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from batchlab.formula.opcost import TimeBreakdown
from batchlab.formula.timing import TimeEstimate


@dataclass(frozen=True)
class Part:
    name: str  # op class, "dispatch" or "communication"
    seconds_a: float
    seconds_b: float

    @property
    def delta(self) -> float:
        return self.seconds_b - self.seconds_a


@dataclass(frozen=True)
class Attribution:
    ratio: float  # predicted update time B / A
    flops_ratio: float  # matmul FLOPs per update, B / A
    bytes_ratio: float  # bytes moved by memory-bound ops, B / A
    ops_ratio: float  # ops dispatched, B / A
    recompute_flops_share: float  # FLOPs recompute adds in B, as a share of A's (0 without checkpointing)
    recompute_bytes_share: float  # memory-bound bytes recompute adds in B, as a share of A's
    dispatch_share_a: float  # fixed per-op cost as a share of the ops' time
    dispatch_share_b: float
    parts: tuple[Part, ...]  # sorted by |delta|, largest first; deltas add up to B - A
    text: str
    provenance: str = "formula"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["parts"] = [dict(asdict(p), delta=p.delta) for p in self.parts]
        return out


def _ratio(b: float, a: float) -> float:
    return b / a if a else float("nan")


def _parts(a: TimeBreakdown, b: TimeBreakdown, comm_a: float, comm_b: float) -> tuple[Part, ...]:
    names = sorted(set(a.by_class) | set(b.by_class))
    parts = [Part(name=n, seconds_a=a.by_class.get(n, 0.0), seconds_b=b.by_class.get(n, 0.0)) for n in names]
    parts.append(Part(name="communication", seconds_a=comm_a, seconds_b=comm_b))
    return tuple(sorted((p for p in parts if p.seconds_a or p.seconds_b), key=lambda p: -abs(p.delta)))


def attribute(a: TimeEstimate, b: TimeEstimate) -> Attribution | None:
    """The model's account of B against A (None where either side has no per-op breakdown)."""
    if a.ops is None or b.ops is None:
        return None
    oa, ob = a.ops, b.ops
    rf = (ob.flops_by_phase.get("recompute", 0) - oa.flops_by_phase.get("recompute", 0)) / oa.flops if oa.flops else 0.0
    rb = (ob.bytes_by_phase.get("recompute", 0) - oa.bytes_by_phase.get("recompute", 0)) / oa.bytes if oa.bytes else 0.0
    parts = _parts(oa, ob, a.exposed_comm_seconds, b.exposed_comm_seconds)
    att = Attribution(ratio=_ratio(b.update_seconds, a.update_seconds), flops_ratio=_ratio(ob.flops, oa.flops),
                      bytes_ratio=_ratio(ob.bytes, oa.bytes), ops_ratio=_ratio(ob.ops, oa.ops),
                      recompute_flops_share=rf, recompute_bytes_share=rb, dispatch_share_a=oa.dispatch_share,
                      dispatch_share_b=ob.dispatch_share, parts=parts, text="")
    return Attribution(**{**asdict(att), "parts": parts, "text": _text(att, a, b)})


def _ms(s: float) -> str:
    return f"{s * 1e3:+.3g} ms"


def _text(att: Attribution, a: TimeEstimate, b: TimeEstimate) -> str:
    head = f"the time model predicts B/A = {att.ratio:.2f}"
    if att.recompute_flops_share or att.recompute_bytes_share:
        head += (f": recompute adds {att.recompute_flops_share:.0%} matmul FLOPs but "
                 f"{att.recompute_bytes_share:.0%} memory-bound bytes")
    else:
        head += (f": matmul FLOPs x{att.flops_ratio:.2f}, memory-bound bytes x{att.bytes_ratio:.2f}, ops "
                 f"x{att.ops_ratio:.2f}")
    change = b.update_seconds - a.update_seconds
    if change:
        top = [p for p in att.parts if abs(p.delta) >= 0.05 * abs(change)][:4]
        head += f"; of the {_ms(change)}: " + ", ".join(f"{p.name} {p.delta / change:.0%}" for p in top)
    return head + f"; dispatch is {att.dispatch_share_a:.0%} of A's step and {att.dispatch_share_b:.0%} of B's"
