"""The timeline record: samples of live tensor bytes by category, phases, the peak and what is live there.

Torch-free, so reports and notebooks load it anywhere.  Samples are columnar (one list per field) and kept
only where the live total changes, so a 7B model's update stays a few MB of JSON; the sample at the peak
is always kept, so ``max(totals) == peak_bytes`` to the byte.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

# The formula's at_peak vocabulary (formula/memory.py), plus logits/loss split out of activations.
# The live-storage tracker's categories are coarser: FOLD maps each timeline category to the tracker's.
CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "logits", "recompute", "temporaries", "data")
FOLD = {"logits": "activations", "recompute": "temporaries"}
LABELS = {"parameters": "parameters", "gradients": "gradients", "optimizer": "optimizer state",
          "activations": "activations kept for backward", "logits": "logits / loss",
          "recompute": "recompute working set", "temporaries": "temporaries", "data": "data (token ids)"}


def fold(parts: dict[str, int]) -> dict[str, int]:
    """Timeline categories summed into the tracker's (logits -> activations, recompute -> temporaries)."""
    out: dict[str, int] = {}
    for k, v in parts.items():
        out[FOLD.get(k, k)] = out.get(FOLD.get(k, k), 0) + v
    return out


@dataclass(frozen=True)
class PhaseSpan:
    label: str  # "data", "forward 1", "backward 1", ..., "all-reduce", "optimizer"
    phase: str  # the harness phase: data | forward | backward | allreduce | optimizer
    first_op: int
    last_op: int


@dataclass(frozen=True)
class Timeline:
    provenance: str  # trace | allocator (the tracker on CPU counts every tensor storage: "allocator")
    method: str  # how the bytes were counted, in words
    title: str  # model, config and global batch, for the figure
    ops: tuple[int, ...]  # op index of each sample (ops dispatched since the update began)
    phase_of: tuple[int, ...]  # index into ``phases`` of each sample
    phases: tuple[PhaseSpan, ...]
    parts: dict[str, tuple[int, ...]]  # category -> bytes at each sample
    op_names: tuple[str, ...]  # the aten op of each sample ("" where unknown)
    peak_bytes: int  # the update's peak tensor bytes, as the tracker / allocator reported it
    peak_sample: int  # index of the sample at the peak
    at_peak_by_module: dict[str, dict[str, int]] = field(default_factory=dict)  # module -> category -> bytes
    capacity_bytes: int = 0  # the device's memory (0: unknown)
    formula_phase_peaks: dict[str, int] = field(default_factory=dict)  # phase -> formula tensor bytes
    notes: tuple[str, ...] = ()
    # communication drawn over the phase it overlaps, e.g. {"gradient all-reduce": "backward 4"} (DP > 1)
    overlaps: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        n = len(self.ops)
        assert len(self.phase_of) == n and len(self.op_names) == n
        assert all(len(v) == n for v in self.parts.values())

    @property
    def totals(self) -> list[int]:
        cols = list(self.parts.values())
        return [sum(c[i] for c in cols) for i in range(len(self.ops))]

    @property
    def at_peak(self) -> dict[str, int]:
        return {k: v[self.peak_sample] for k, v in self.parts.items()}

    @property
    def peak_op(self) -> int:
        return self.ops[self.peak_sample]

    @property
    def peak_phase(self) -> PhaseSpan:
        return self.phases[self.phase_of[self.peak_sample]]

    def to_dict(self) -> dict[str, Any]:
        totals = self.totals
        return {
            "provenance": self.provenance, "method": self.method, "title": self.title,
            "peak_bytes": self.peak_bytes, "peak_sample": self.peak_sample, "peak_op": self.peak_op,
            "peak_phase": self.peak_phase.label, "at_peak": self.at_peak,
            "at_peak_by_module": self.at_peak_by_module, "capacity_bytes": self.capacity_bytes,
            "formula_phase_peaks": self.formula_phase_peaks, "notes": list(self.notes), "overlaps": self.overlaps,
            "phases": [vars(p) for p in self.phases],
            "samples": {"op": list(self.ops), "phase": list(self.phase_of), "op_name": list(self.op_names),
                        "bytes": {k: list(v) for k, v in self.parts.items()}, "total": totals},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Timeline":
        s = d["samples"]
        return cls(provenance=d["provenance"], method=d["method"], title=d["title"], ops=tuple(s["op"]),
                   phase_of=tuple(s["phase"]), phases=tuple(PhaseSpan(**p) for p in d["phases"]),
                   parts={k: tuple(v) for k, v in s["bytes"].items()}, op_names=tuple(s["op_name"]),
                   peak_bytes=d["peak_bytes"], peak_sample=d["peak_sample"],
                   at_peak_by_module={k: dict(v) for k, v in d["at_peak_by_module"].items()},
                   capacity_bytes=d["capacity_bytes"], formula_phase_peaks=dict(d["formula_phase_peaks"]),
                   notes=tuple(d["notes"]), overlaps=dict(d.get("overlaps", {})))


def downsample(t: Timeline, width: int) -> list[int]:
    """Sample indices to draw at ``width`` points: per bucket the highest and lowest total, phase
    boundaries and the peak always kept (a renderer needs no more than a few per pixel)."""
    n = len(t.ops)
    if n <= 2 * width:
        return list(range(n))
    totals = t.totals
    keep = {0, n - 1, t.peak_sample}
    keep.update(i for i in range(1, n) if t.phase_of[i] != t.phase_of[i - 1])
    step = n / width
    for b in range(width):
        lo, hi = int(b * step), min(int((b + 1) * step), n)
        if lo < hi:
            chunk = range(lo, hi)
            keep.add(max(chunk, key=totals.__getitem__))
            keep.add(min(chunk, key=totals.__getitem__))
    return sorted(keep)


# buckets kept when a record stores a timeline: <= 2 samples a bucket + phase edges, ~30 kB of JSON a side
STORED_WIDTH = 150


def compact(t: Timeline, width: int = STORED_WIDTH) -> Timeline:
    """``t`` at the samples ``downsample`` keeps (each bucket's highest and lowest total, phase boundaries,
    the first, last and peak samples), for storing in a record: a few hundred samples instead of one per
    op, while the peak sample, ``peak_bytes`` and ``at_peak`` stay exact (max(totals) is unchanged)."""
    keep = downsample(t, width)
    if len(keep) == len(t.ops):
        return t
    pick = lambda col: tuple(col[i] for i in keep)  # noqa: E731
    return replace(t, ops=pick(t.ops), phase_of=pick(t.phase_of), op_names=pick(t.op_names),
                   parts={k: pick(v) for k, v in t.parts.items()}, peak_sample=keep.index(t.peak_sample))


def aligned(a: Timeline, b: Timeline) -> list[tuple[int, int, int]]:
    """(op in ``a``, a's total, b's total at the matching sample) for every sample of ``a``.

    Samples are matched by (phase, op name) with difflib, so ops only one side ran do not shift the rest:
    transformers' packed-sequence check runs in a real forward and not in the trace (it is patched out
    there), and clip_grad_norm_ takes the foreach path on real tensors only.  A sample of ``a`` with no
    counterpart is compared with ``b``'s state just before the point where it would be."""
    import difflib

    key = lambda t: [(t.phases[p].label, name) for p, name in zip(t.phase_of, t.op_names)]  # noqa: E731
    ta, tb = a.totals, b.totals
    match: dict[int, int] = {}
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, key(a), key(b), autojunk=False).get_opcodes():
        for i in range(i1, i2):
            match[i] = j1 + (i - i1) if tag == "equal" else (j1 + min(i - i1, j2 - j1 - 1) if j2 > j1 else j1 - 1)
    return [(a.ops[i], ta[i], tb[max(match[i], 0)]) for i in range(len(a.ops))]
